"""File bytes become 8-bit frames for the model's preprocessing: the first step of every image path
(the service's uploads, in-process folder scoring and the training folder dataset alike).

`decode_image` accepts DICOM (with or without the 128-byte preamble), PNG and JPEG, sniffed by
their magic bytes, never by a file name or a client's Content-Type. Every failure a client can
cause is a `tafl.errors.ServiceError` with a 4xx status and a one-sentence message that says
what to send instead; no other exception escapes. Sizes are checked from the headers before any
pixel is decoded (decompression bombs, 60000x60000 DICOM headers, thousands of frames).

DICOM pixels go through the standard display pipeline: modality LUT / rescale, then the first
VOI LUT or window in the file (min-max over the frame when it has none), a min-max stretch to
0..255 and, for MONOCHROME1, inversion. YBR colour is converted to RGB (pydicom 3 already does
so while decoding and reports it), palette colour is expanded through its LUT, and deeper than
8-bit colour is scaled by its bit depth. Privacy: neither `DecodedImage.info` nor any message
holds a tag value that could identify a patient, only technical facts (modality, photometric
interpretation, bits, transfer syntax, frames, SOP class name). pydicom's own warnings, which
may quote tag values, are silenced while a file is read.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
from PIL import Image, ImageOps
from pydicom.pixels import (apply_color_lut, apply_modality_lut, apply_voi_lut, as_pixel_options,
                            convert_color_space, get_decoder)
from pydicom.uid import UID, ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

from tafl.errors import BadRequest, DataError, PayloadTooLarge, ServiceError, UnprocessableImage, UnsupportedMedia
from tafl.imaging.pixels import minmax_u8, pil_to_uint8

log = logging.getLogger(__name__)

MIN_SIDE = 8
ACCEPTED = "send a DICOM, PNG or JPEG file instead"
PNG_MAGIC, JPEG_MAGIC = b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"
PIXEL_KEYWORDS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
PHOTOMETRICS = {"MONOCHROME1", "MONOCHROME2", "PALETTE COLOR", "RGB", "YBR_FULL", "YBR_FULL_422",
                "YBR_PARTIAL_420", "YBR_ICT", "YBR_RCT", "HSV", "ARGB", "CMYK"}
# What other common uploads are, for a 415 message that names what was received.
OTHER_MAGIC = ((b"GIF8", "a GIF image"), (b"BM", "a BMP image"), (b"II*\x00", "a TIFF image"),
               (b"MM\x00*", "a TIFF image"), (b"%PDF", "a PDF document"), (b"PK\x03\x04", "a ZIP archive"),
               (b"\x1f\x8b", "a gzip archive"), (b"\x00\x00\x00\x0cjP  ", "a JPEG 2000 image"),
               (b"\xffO\xffQ", "a JPEG 2000 codestream"), (b"8BPS", "a Photoshop file"))


@dataclass
class DecodedImage:
    frames: list[np.ndarray]  # each uint8, (H, W) grey or (H, W, 3) RGB
    kind: str  # "png" | "jpeg" | "dicom"
    info: dict[str, Any] = field(default_factory=dict)  # technical, non-identifying facts only


# The raster formats a training folder may also hold (the service takes DICOM, PNG and JPEG only).
FOLDER_RASTERS = {"bmp": (b"BM",), "tiff": (b"II*\x00", b"MM\x00*")}


def decode_image(data: bytes, *, max_bytes: int = 50 * 2**20, max_pixels: int = 50_000_000,
                 max_frames: int = 64, extra_rasters: tuple[str, ...] = ()) -> DecodedImage:
    """Decode a DICOM, PNG or JPEG file (and any of `extra_rasters`, names of FOLDER_RASTERS) into uint8
    frames, or raise a 4xx ServiceError."""
    if not data:
        raise BadRequest("the uploaded file is empty: choose a DICOM, PNG or JPEG image and send it again")
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"the file is {len(data) / 2**20:.1f} MiB, over the {max_bytes / 2**20:.1f} MiB "
                              "limit: send a single image or a shorter series")
    if data.startswith(PNG_MAGIC):
        return _decode_raster(data, "png", max_pixels)
    if data.startswith(JPEG_MAGIC):
        return _decode_raster(data, "jpeg", max_pixels)
    if data[128:132] == b"DICM" or _looks_like_bare_dataset(data):
        return _decode_dicom(data, max_pixels, max_frames)
    for kind in extra_rasters:
        if data.startswith(FOLDER_RASTERS[kind]):
            return _decode_raster(data, kind, max_pixels)
    raise UnsupportedMedia(f"the upload is {_describe(data)}, which this service cannot read: {ACCEPTED}")


def decode_file(path: str | Path, *, max_bytes: int = 512 * 2**20, max_pixels: int = 200_000_000,
                max_frames: int = 4096, frames: str = "each") -> DecodedImage:
    """A training image file (DICOM, PNG, JPEG, BMP or TIFF) through the same decoder as an upload.

    `frames`: "each" keeps every frame of a multi-frame file (one sample per frame), "refuse" makes a
    multi-frame file an error. Any failure is a DataError that names the file and says why."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:  # before reading: a huge file must not be loaded to be refused
            raise DataError(f"cannot read image {path}: the file is {size / 2**20:.1f} MiB, over the "
                            f"{max_bytes / 2**20:.0f} MiB limit for one training image")
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read image {path}: {exc.strerror or exc}") from exc
    try:
        decoded = decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels, max_frames=max_frames,
                               extra_rasters=tuple(FOLDER_RASTERS))
    except ServiceError as exc:
        raise DataError(f"cannot read image {path}: {exc}") from exc
    if frames == "refuse" and len(decoded.frames) > 1:
        raise DataError(f"{path} is a multi-frame image ({len(decoded.frames)} frames) and frames='refuse': "
                        "export one frame per file, or set frames: each to train on every frame")
    return decoded


# --------------------------------------------------------------------------- sniffing


def _looks_like_bare_dataset(data: bytes) -> bool:
    """A DICOM data set written without preamble and 'DICM': starts with a group 0002/0008 tag."""
    if len(data) < 8:
        return False
    for order in ("little", "big"):
        group = int.from_bytes(data[0:2], order)
        if group in (0x0002, 0x0008):
            explicit_vr = data[4:6].isalpha() and data[4:6].isupper()
            implicit_len = int.from_bytes(data[4:8], order)
            if explicit_vr or implicit_len < len(data):
                return True
    return False


def _describe(data: bytes) -> str:
    """Name what a rejected upload is, for the 415 message."""
    for magic, name in OTHER_MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "a WebP image"
    if data[4:8] == b"ftyp":
        return "a HEIC image" if data[8:12] in (b"heic", b"heix", b"mif1") else "an MP4/QuickTime file"
    head = data[:512].lstrip().lower()
    if head.startswith((b"<?xml", b"<svg", b"<!doctype", b"<html")):
        return "an XML, SVG or HTML file"
    text = data[:4096].decode("utf-8", "replace")[: -3 if len(data) > 4096 else None]  # cut may split a char
    if "\ufffd" not in text and all(c.isprintable() or c in "\r\n\t" for c in text):
        return "a text file"
    return "a file of an unrecognised type"


# --------------------------------------------------------------------------- PNG / JPEG


def _decode_raster(data: bytes, kind: str, max_pixels: int) -> DecodedImage:
    name = {"tiff": "TIFF", "bmp": "BMP"}.get(kind, kind.upper())
    corrupt = UnprocessableImage(f"the {name} file is truncated or corrupt: save or export it again and resend it")
    try:
        im = Image.open(BytesIO(data), formats=[name])  # lazy: reads the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _too_many_pixels(None, None, max_pixels) from None
    except Exception:
        raise corrupt from None
    w, h = im.size
    if w * h > max_pixels:  # decompression-bomb guard, before a single pixel is decoded
        raise _too_many_pixels(w, h, max_pixels)
    _check_side(w, h)
    try:
        im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _too_many_pixels(w, h, max_pixels) from None
    except Exception:
        raise corrupt from None
    try:  # EXIF orientation (camera and phone photos); a malformed EXIF block is ignored
        orientation = int(im.getexif().get(0x0112, 1) or 1)
        im = ImageOps.exif_transpose(im) or im
    except Exception:
        orientation = 1
    try:
        frame = pil_to_uint8(im)
    except Exception:
        raise corrupt from None
    info = {"mode": im.mode, "width": frame.shape[1], "height": frame.shape[0], "frames": 1}
    if orientation != 1:
        info["exif_orientation"] = orientation
    return DecodedImage(frames=[frame], kind=kind, info=info)


# --------------------------------------------------------------------------- DICOM


def _decode_dicom(data: bytes, max_pixels: int, max_frames: int) -> DecodedImage:
    """Read and render a DICOM file; anything unforeseen becomes a generic 422 (never a raw error)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pydicom's warnings may quote tag values
            return _render_dicom(data, max_pixels, max_frames)
    except ServiceError:
        raise
    except Exception as exc:  # only the type is logged: messages may quote tag values
        log.debug("DICOM decoding failed with %s", type(exc).__name__)
        raise UnprocessableImage("the DICOM file could not be turned into an image: check that it is a "
                                 "complete image object, export it again and resend it") from None


def _render_dicom(data: bytes, max_pixels: int, max_frames: int) -> DecodedImage:
    try:
        ds = pydicom.dcmread(BytesIO(data), force=data[128:132] != b"DICM")
    except Exception:
        raise UnprocessableImage("the DICOM file is truncated or corrupt and could not be read: "
                                 "export it again from the PACS or modality and resend it") from None
    if not any(k in ds for k in PIXEL_KEYWORDS):
        if "Rows" in ds:
            raise UnprocessableImage("the DICOM file declares an image but its pixel data is missing, so it is "
                                     "probably truncated: export it again and resend it")
        sop = _sop_class_name(ds)
        raise UnprocessableImage(f"the DICOM file holds no image{f' ({sop})' if sop else ''}: send an image "
                                 "object such as CT, MR, X-ray, ultrasound or a secondary capture")
    if "Rows" not in ds or "Columns" not in ds:
        raise UnprocessableImage("the DICOM file has pixel data but no image size (Rows/Columns): "
                                 "export it again from the PACS or modality and resend it")
    rows, cols = int(ds.Rows), int(ds.Columns)
    n_frames, spp = int(ds.get("NumberOfFrames") or 1), int(ds.get("SamplesPerPixel") or 1)
    if n_frames > max_frames:
        raise PayloadTooLarge(f"the DICOM file holds {n_frames} frames, more than the {max_frames} this "
                              "service accepts: send a single frame or a shorter series")
    if rows * cols * n_frames > max_pixels:
        raise PayloadTooLarge(f"the DICOM file declares {n_frames} frame(s) of {cols}×{rows} pixels, over the "
                              f"{max_pixels:,}-pixel limit: send a smaller image or fewer frames")
    _check_side(cols, rows)
    if n_frames < 1 or spp not in (1, 3):
        raise UnprocessableImage(f"the DICOM image has {n_frames} frames of {spp} samples per pixel, which is "
                                 "not a grey or RGB image: export it as a standard grey or RGB image")

    if not ds.file_meta.get("TransferSyntaxUID"):  # bare data set: use the encoding it was read with
        implicit, little = ds.original_encoding
        ds.file_meta.TransferSyntaxUID = (ImplicitVRLittleEndian if implicit else
                                          ExplicitVRLittleEndian if little else ExplicitVRBigEndian)
    tsyntax = UID(ds.file_meta.TransferSyntaxUID)
    ts_name = _uid_name(tsyntax) or "unrecognised"
    try:
        decoder = get_decoder(tsyntax)
        available = decoder.is_available
    except NotImplementedError:
        available = False
    if not available:
        raise UnsupportedMedia(f"the DICOM transfer syntax '{ts_name}' is not supported here: export the image "
                               "uncompressed or as JPEG, JPEG-LS, JPEG 2000 or RLE and resend it")
    try:
        arr, meta = decoder.as_array(ds, validate=True, raw=False, **as_pixel_options(ds))
    except Exception:
        raise UnprocessableImage(f"the DICOM pixel data ({ts_name}) could not be decoded, it is truncated, "
                                 "corrupt or in an unsupported variant: export it again uncompressed and "
                                 "resend it") from None

    # One layout for everything: (F, H, W) or (F, H, W, 3), from the header, not from ndim alone.
    arr = arr[np.newaxis] if n_frames == 1 else arr
    if arr.shape[:3] != (n_frames, rows, cols) or arr.ndim != (4 if spp == 3 else 3):
        raise UnprocessableImage("the DICOM pixel data does not match its declared size: "
                                 "export it again from the PACS or modality and resend it")
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2")).strip().upper()
    decoded_as = str(meta.get("photometric_interpretation") or photometric).strip().upper()
    info: dict[str, Any] = {"modality": _safe_code(ds.get("Modality")),
                            "photometric": photometric if photometric in PHOTOMETRICS else "other",
                            "bits_allocated": _safe_int(ds.get("BitsAllocated")),
                            "bits_stored": _safe_int(ds.get("BitsStored")),
                            "transfer_syntax": ts_name, "frames": n_frames, "sop_class": _sop_class_name(ds)}

    if spp == 3:
        if decoded_as in ("YBR_FULL", "YBR_FULL_422") and arr.dtype == np.uint8:
            arr = convert_color_space(arr, decoded_as, "RGB", per_frame=True)
        out = _scale_colour(arr, _safe_int(ds.get("BitsStored")) or arr.dtype.itemsize * 8)
    elif photometric == "PALETTE COLOR":
        rgb = _palette_to_rgb(arr, ds, little_endian=tsyntax.is_little_endian)
        out = _scale_colour(rgb, rgb.dtype.itemsize * 8)
    else:
        out, info["windowing"] = _render_grey(arr, ds, invert=photometric == "MONOCHROME1")
    frames = [np.ascontiguousarray(f, dtype=np.uint8) for f in out]
    return DecodedImage(frames=frames, kind="dicom", info={k: v for k, v in info.items() if v is not None})


def _render_grey(arr: np.ndarray, ds: pydicom.Dataset, *, invert: bool) -> tuple[np.ndarray, str]:
    """Modality LUT, first VOI LUT or window, per-frame min-max to uint8, MONOCHROME1 inversion."""
    values = apply_modality_lut(arr, ds)
    windowing = "min-max"
    if ds.get("VOILUTSequence") or ("WindowCenter" in ds and "WindowWidth" in ds):
        try:
            values = apply_voi_lut(values, ds, index=0, prefer_lut=True)
            windowing = "VOI LUT" if ds.get("VOILUTSequence") else "window centre/width"
        except Exception:  # a broken window should not reject the image: fall back to min-max
            log.debug("VOI LUT / window unusable, using min-max")
    out = np.stack([minmax_u8(np.asarray(f, dtype=np.float32)) for f in values])
    return (255 - out if invert else out), windowing


def _palette_to_rgb(arr: np.ndarray, ds: pydicom.Dataset, *, little_endian: bool) -> np.ndarray:
    """Expand PALETTE COLOR through its LUTs (RGB, alpha dropped).

    pydicom 3.0 reads plain (non-segmented) 16-bit LUT data in the machine's byte order, so a
    big-endian file's palette comes out byte-swapped; hand it native-order bytes instead.
    """
    if not little_endian and "RedPaletteColorLookupTableData" in ds:
        n_entries = int(ds.RedPaletteColorLookupTableDescriptor[0]) or 65536
        for keyword in (f"{c}PaletteColorLookupTableData" for c in ("Red", "Green", "Blue", "Alpha")):
            if keyword in ds and len(ds[keyword].value) == 2 * n_entries:
                ds[keyword].value = np.frombuffer(ds[keyword].value, ">u2").astype("=u2").tobytes()
    return apply_color_lut(arr, ds)[..., :3]


def _scale_colour(arr: np.ndarray, bits: int) -> np.ndarray:
    """Colour deeper than 8 bits to uint8 by its bit depth (global min-max when values disagree)."""
    if arr.dtype == np.uint8:
        return arr
    values = np.nan_to_num(arr.astype(np.float32))  # float32 is plenty for an 8-bit result
    top = float(2 ** max(1, min(bits, 32)) - 1)
    if values.min() < 0 or values.max() > top:
        return minmax_u8(values)
    return np.clip(np.rint(values * (255.0 / top)), 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------- helpers


def _check_side(width: int, height: int) -> None:
    if min(width, height) < MIN_SIDE:
        raise UnprocessableImage(f"the image is {width}×{height} pixels, too small to classify: send an "
                                 f"image of at least {MIN_SIDE}×{MIN_SIDE} pixels")


def _too_many_pixels(width: int | None, height: int | None, limit: int) -> PayloadTooLarge:
    size = f"{width}×{height} pixels" if width else "too many pixels"
    return PayloadTooLarge(f"the image declares {size}, over the {limit:,}-pixel limit: "
                           "downscale it before sending")


def _uid_name(uid: Any) -> str | None:
    """A UID's registered name, or the bare UID when it is well formed but unknown (never free text)."""
    text = str(uid or "").strip("\x00 ")
    if not re.fullmatch(r"[0-9.]{1,64}", text):
        return None
    name = UID(text).name
    return name if re.fullmatch(r"[\w .,()\[\]'/&+-]{1,120}", name) else text


def _sop_class_name(ds: pydicom.Dataset) -> str | None:
    """The SOP class's registered name (e.g. 'RT Plan Storage'); None when absent or unknown."""
    uid = ds.get("SOPClassUID") or ds.file_meta.get("MediaStorageSOPClassUID")
    name = _uid_name(uid)
    return name if name and name != str(uid).strip("\x00 ") else None


def _safe_code(value: Any) -> str | None:
    """A short code string such as a Modality ('CT'), or None when it is anything else."""
    text = str(value or "").strip()
    return text if re.fullmatch(r"[A-Z0-9_]{1,16}", text) else None


def _safe_int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None
