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
interpretation, bits, transfer syntax, frames, SOP class name). pydicom's own warnings and log
records, which may quote tag values, never reach a handler: a filter installed once at import drops
them (thread-safe, unlike `warnings.catch_warnings`) and counts them per thread.

Hostile inputs (see tests/hostile_corpus.py): every decode is bounded before it allocates. A
deflated data set is inflated by this module with a cap on its output, a cheap walk over the data
set's elements bounds their count and sequence depth before pydicom parses it, encapsulated frames
are checked against the header (frame count, and the size each JPEG / JPEG-LS / JPEG 2000 frame
header declares) before they are decoded, RLE segments are decoded with a cap on their output,
12-bit JPEG Extended frames (which Pillow cannot read) go to libjpeg only when whole (their end-of-image
marker present: libjpeg fills a cut frame with grey without an error),
segmented palette tables are expanded with a cap on their length, and the grey pipeline works in
bounded float chunks. `decoded_nbytes` reads headers only and tells a caller how much a decode
will allocate, to choose between the event loop and a worker thread.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
import warnings
import zlib
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
from PIL import Image, ImageOps
from pydicom.pixels import (
    apply_color_lut,
    apply_modality_lut,
    apply_voi_lut,
    as_pixel_options,
    convert_color_space,
    get_decoder,
)
from pydicom.uid import (
    UID,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEGExtended12Bit,
    RLELossless,
)

from tafl.errors import (
    BadRequest,
    DataError,
    PayloadTooLarge,
    ServiceError,
    UnprocessableImage,
    UnsupportedMedia,
)
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


# An 8-bit PNG cannot exceed about 1032 pixels per byte (deflate's limit); only 1/2/4-bit images go
# beyond, and those large and that compressible are blank: cheap to send, costly to decode.
_RATIO_MIN_PIXELS, _MAX_PIXELS_PER_BYTE = 1 << 22, 1100

# The raster formats a training folder may also hold (the service takes DICOM, PNG and JPEG only).
FOLDER_RASTERS = {"bmp": (b"BM",), "tiff": (b"II*\x00", b"MM\x00*")}


# the upload decoder's limits unless a caller sets its own (the service's TAFL_MAX_* settings)
DEFAULT_MAX_PIXELS, DEFAULT_MAX_FRAMES = 50_000_000, 64


def decode_image(data: bytes, *, max_bytes: int = 50 * 2**20, max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_frames: int = DEFAULT_MAX_FRAMES, extra_rasters: tuple[str, ...] = ()) -> DecodedImage:
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
        return _decode_dicom(data, max_bytes, max_pixels, max_frames)
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


NATIVE_SYNTAXES = frozenset({"1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.2"})


def dicom_transfer_syntax(data: bytes) -> str | None:
    """The transfer syntax UID in a Part 10 file's meta group (a few hundred bytes read, never raises); None
    for a bare data set (which is in a native encoding) or a meta group it cannot read."""
    try:
        if data[128:132] != b"DICM":
            return None
        pos, end = 132, min(len(data), 132 + 64 * 1024)
        while pos + 8 <= end:
            group, elem = struct.unpack_from("<HH", data, pos)
            if group != 2:
                return None
            if data[pos + 4:pos + 6] in _LONG_VRS:
                length, head = struct.unpack_from("<I", data, pos + 8)[0], 12
            else:
                length, head = struct.unpack_from("<H", data, pos + 6)[0], 8
            if elem == 0x0010:
                uid = data[pos + head:pos + head + min(length, 64)].decode("ascii", "replace").strip("\0 ")
                return uid if re.fullmatch(r"[0-9.]{1,64}", uid) else None
            pos += head + length
    except Exception:  # noqa: BLE001 - a probe never fails
        return None
    return None


def is_dicom(data: bytes) -> bool:
    """Whether `decode_image` would read `data` as DICOM (Part 10 with 'DICM', or a bare data set)."""
    return data[128:132] == b"DICM" or _looks_like_bare_dataset(data)


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
    if w * h > _RATIO_MIN_PIXELS and w * h > _MAX_PIXELS_PER_BYTE * len(data):
        raise PayloadTooLarge(f"the {name} file is {len(data) / 1024:.0f} KB but declares {w}×{h} pixels, more "
                              f"than {_MAX_PIXELS_PER_BYTE} pixels per byte, which only a blank image of "
                              "under 8 bits per sample reaches: send the image as an 8-bit greyscale or colour file")
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


def _decode_dicom(data: bytes, max_bytes: int, max_pixels: int, max_frames: int) -> DecodedImage:
    """Read and render a DICOM file; anything unforeseen becomes a generic 422 (never a raw error).
    pydicom's warnings and log records are dropped by the filters `_silence_pydicom` installed."""
    _ensure_silenced()
    try:
        return _render_dicom(data, max_bytes, max_pixels, max_frames)
    except ServiceError:
        raise
    except Exception as exc:  # only the type is logged: messages may quote tag values
        log.debug("DICOM decoding failed with %s", type(exc).__name__)
        raise UnprocessableImage("the DICOM file could not be turned into an image: check that it is a "
                                 "complete image object, export it again and resend it") from None


def _render_dicom(data: bytes, max_bytes: int, max_pixels: int, max_frames: int) -> DecodedImage:
    max_elements = max(10_000, 100 * max_frames)  # real files: under 1 500 (an ECG waveform); pydicom ~30 µs each
    scan = _prescan(data, max_elements)
    deflated = scan.deflated
    if deflated:  # inflated here, with a cap, rather than by pydicom (which inflates it whole)
        data = _inflate(data, scan, max_bytes)
        scan = _prescan(data, max_elements)
    cut = truncation(scan, len(data), 132 if data[128:132] == b"DICM" else 0)
    if cut:  # said before pydicom, which reads a cut file as far as it goes ("holds no image", a decode error)
        raise UnprocessableImage(f"the DICOM file is truncated: {cut}; send the complete file (export it again "
                                 "and resend it)")
    try:
        ds = pydicom.dcmread(BytesIO(data), force=data[128:132] != b"DICM")
    except Exception:
        if scan.cut_at is not None:  # cut inside an element after the pixel data (trailing padding, say)
            raise UnprocessableImage(f"the DICOM file is truncated: it ends inside a data element ({len(data):,} "
                                     "bytes in all); send the complete file (export it again and resend it)") from None
        raise UnprocessableImage("the DICOM file is truncated or corrupt and could not be read: "
                                 "export it again from the PACS or modality and resend it") from None
    if not any(k in ds for k in PIXEL_KEYWORDS):
        sop = _sop_class_name(ds)
        if "Rows" in ds or (sop and "Image Storage" in sop):  # an image object cut before its pixels
            raise UnprocessableImage(f"the DICOM file is truncated: {f'a {sop} object' if sop else 'an image'} "
                                     f"that ends after {len(data):,} bytes, before its pixel data; send the "
                                     "complete file (export it again and resend it)")
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
    ts_name = (_uid_name(DeflatedExplicitVRLittleEndian) if deflated else _uid_name(tsyntax)) or "unrecognised"
    try:
        decoder = get_decoder(tsyntax)
        available = decoder.is_available
    except NotImplementedError:
        available = False
    if not available:
        raise UnsupportedMedia(f"the DICOM transfer syntax '{ts_name}' is not supported here: export the image "
                               "uncompressed or as JPEG, JPEG-LS, JPEG 2000 or RLE and resend it")
    pixel_keyword = next(k for k in PIXEL_KEYWORDS if k in ds)
    if tsyntax.is_encapsulated and pixel_keyword == "PixelData":
        _check_encapsulated(ds.PixelData, tsyntax, n_frames, rows, cols, spp, max_fragments=max(4096, 64 * max_frames))
    plugin = {"decoding_plugin": "tafl"} if tsyntax == RLELossless or _is_jpeg12(tsyntax, ds) else {}
    if plugin and "tafl" not in decoder.available_plugins:  # 12-bit JPEG without pylibjpeg-libjpeg installed
        raise UnsupportedMedia(f"the DICOM transfer syntax '{ts_name}' with 12-bit samples is not "
                               "supported here: export the image uncompressed or as JPEG-LS, JPEG 2000 or RLE and "
                               "resend it")
    _rle_state.too_long = _jpeg12_state.cut = False
    try:
        arr, meta = decoder.as_array(ds, validate=True, raw=False, **plugin, **as_pixel_options(ds))
    except Exception:
        if tsyntax == RLELossless and getattr(_rle_state, "too_long", False):
            raise UnprocessableImage("the DICOM file's RLE pixel data decodes to more than its declared image "
                                     "size: export it again from the PACS or modality and resend it") from None
        if getattr(_jpeg12_state, "cut", False):
            raise UnprocessableImage("the DICOM file's JPEG pixel data is truncated: a frame ends before its "
                                     "end-of-image marker; send the complete file (export it again and resend "
                                     "it)") from None
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


_CHUNK_PIXELS = 1 << 20  # the grey pipeline's float64 temporaries are bounded to this many pixels at a time


def _render_grey(arr: np.ndarray, ds: pydicom.Dataset, *, invert: bool) -> tuple[np.ndarray, str]:
    """Modality LUT, first VOI LUT or window, per-frame min-max to uint8, MONOCHROME1 inversion.

    pydicom's LUT functions return float64; they are elementwise, so they run on blocks of at most
    _CHUNK_PIXELS (several small frames, or rows of a large one) kept as float32 (what the min-max
    stretch used anyway): temporaries of about 12 bytes × _CHUNK_PIXELS plus 4 bytes per pixel of
    one frame, instead of 16 bytes per pixel of the whole series."""
    want_voi = bool(ds.get("VOILUTSequence") or ("WindowCenter" in ds and "WindowWidth" in ds))
    state = {"voi": want_voi, "windowing": "min-max", "used": False}

    def luts(block: np.ndarray) -> np.ndarray:
        values = apply_modality_lut(block, ds)
        if state["voi"]:
            try:
                values = apply_voi_lut(values, ds, index=0, prefer_lut=True)
                state["windowing"] = "VOI LUT" if ds.get("VOILUTSequence") else "window centre/width"
            except Exception:  # a broken window should not reject the image: fall back to min-max
                log.debug("VOI LUT / window unusable, using min-max")
                if state["used"]:  # some blocks were windowed already: start again, min-max throughout
                    raise _RestartMinMax from None
                state["voi"] = False
        state["used"] = True
        return values

    n, h, w = arr.shape[:3]
    out = np.empty((n, h, w), dtype=np.uint8)
    try:
        if h * w <= _CHUNK_PIXELS:  # whole frames, several at a time
            k = max(1, _CHUNK_PIXELS // max(1, h * w))
            for g in range(0, n, k):
                block = np.asarray(luts(arr[g:g + k]), dtype=np.float32)
                for j in range(block.shape[0]):
                    out[g + j] = minmax_u8(block[j], overwrite=True)
        else:  # one frame at a time, in blocks of rows
            step = max(1, _CHUNK_PIXELS // max(1, w))
            frame = np.empty((h, w), dtype=np.float32)
            for i in range(n):
                for r in range(0, h, step):
                    frame[r:r + step] = luts(arr[i, r:r + step])
                out[i] = minmax_u8(frame, overwrite=True)
    except _RestartMinMax:
        return _render_grey(arr, _without_voi(ds), invert=invert)
    if invert:
        np.subtract(255, out, out=out)
    return out, state["windowing"]


class _RestartMinMax(Exception):
    pass


def _without_voi(ds: pydicom.Dataset) -> pydicom.Dataset:
    copy = pydicom.Dataset(ds)
    for keyword in ("VOILUTSequence", "WindowCenter", "WindowWidth"):
        if keyword in copy:
            del copy[keyword]
    return copy


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
    _expand_segmented_palettes(ds, little_endian)
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


# --------------------------------------------------------------------------- pydicom's warnings and logs


class _Quiet(threading.local):
    records = 0  # pydicom log records dropped in this thread (each of its warnings is also logged)


_quiet = _Quiet()


class _DropPydicom(logging.Filter):
    """On the 'pydicom' logger: counts each record per thread and lets none through (never formatted)."""

    def filter(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        _quiet.records += 1
        return False


class _DropHandler(logging.Handler):
    """The 'pydicom' logger's only handler: records of its child loggers arrive here, counted, dropped."""

    def handle(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        _quiet.records += 1
        return False

    def emit(self, record: logging.LogRecord) -> None:
        pass


def _silence_pydicom() -> None:
    """Once, at import: no pydicom warning or log record (they may quote tag values) reaches a handler.

    The 'pydicom' logger drops its records and stops propagation; its child loggers
    ('pydicom.pixels...') propagate only to its own (dropping) handler. Warnings raised in pydicom's
    modules, or attributed to this module's calls into pydicom, are ignored by a process-wide filter,
    which, unlike `warnings.catch_warnings`, never swaps global state under another thread."""
    logger = logging.getLogger("pydicom")
    if not any(isinstance(f, _DropPydicom) for f in logger.filters):
        logger.addFilter(_DropPydicom())
        logger.addHandler(_DropHandler())
    logger.propagate = False
    warnings.filterwarnings("ignore", module=re.escape(__name__) + "$")
    warnings.filterwarnings("ignore", module=r"pydicom(\.|$)")


_silence_pydicom()
_OUR_FILTERS = tuple(warnings.filters[:2])


def _ensure_silenced() -> None:
    """Each DICOM decode: put the filters back in front if the application has since added its own
    (e.g. `warnings.simplefilter('always')`); a cheap check, and no swap of global state."""
    if tuple(warnings.filters[:2]) != _OUR_FILTERS or logging.getLogger("pydicom").propagate:
        _silence_pydicom()


def pydicom_records_dropped() -> int:
    """How many pydicom log records this thread has dropped so far (for tests and diagnostics)."""
    return _quiet.records


# --------------------------------------------------------------------------- decoded size, cheaply

UNKNOWN_NBYTES = 1 << 40  # what decoded_nbytes answers when it cannot tell: large, so the work goes off-loop
_PROBE_ELEMENTS = 1000  # a probe walks at most this many elements (image headers have a few hundred)


def decoded_nbytes(data: bytes) -> int:
    """Bytes a `decode_image` of `data` will allocate for its pixels (decoded samples plus the uint8
    frames), from the headers only; UNKNOWN_NBYTES when it cannot tell. Never raises; reads a
    few hundred bytes of a PNG or JPEG and only the element headers of a DICOM (microseconds to
    about a millisecond). A deflated DICOM, a data set with thousands of elements and anything
    unrecognised answer UNKNOWN_NBYTES, so that a caller runs their decode off the event loop."""
    try:
        if data.startswith(PNG_MAGIC):
            if data[12:16] != b"IHDR":
                return UNKNOWN_NBYTES
            w, h, depth, colour = struct.unpack(">IIBB", data[16:26])
            channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(colour, 4)
            out = 1 if colour in (0, 4) and depth <= 8 else 3
            return w * h * (max(1, channels * depth // 8) + 4 * channels + out)  # + an RGBA/uint16 temporary
        if data.startswith(JPEG_MAGIC):
            sof = _jpeg_sof(data, 0, min(len(data), 1 << 20))
            if sof is None:
                return UNKNOWN_NBYTES
            h, w, comps = sof
            return w * max(h, 1) * comps * 2
        if data[128:132] == b"DICM" or _looks_like_bare_dataset(data):
            scan = _scan_dicom(data, max_elements=_PROBE_ELEMENTS, max_depth=_MAX_DEPTH, probe=True)
            if scan.deflated or scan.rows is None or scan.cols is None:
                return UNKNOWN_NBYTES
            px = scan.rows * scan.cols * max(1, scan.frames) * max(1, scan.spp)
            per_sample = max(1, -(-(scan.bits or 16) // 8))
            return px * (per_sample + 1 + 8) if scan.spp == 1 else px * (per_sample + 1)  # grey: + float temps
        return len(data)  # anything else is refused from its magic bytes, cheaply
    except Exception:  # noqa: BLE001 - a probe never fails: in doubt, off the loop
        return UNKNOWN_NBYTES


# --------------------------------------------------------------------------- DICOM pre-scan

_MAX_DEPTH = 16  # sequences nested deeper than this are refused (functional groups nest 3–4 deep)
_LONG_VRS = {b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV"}
_ALL_VRS = _LONG_VRS | {b"AE", b"AS", b"AT", b"CS", b"DA", b"DS", b"DT", b"FD", b"FL", b"IS", b"LO", b"LT",
                        b"PN", b"SH", b"SL", b"SS", b"ST", b"TM", b"UI", b"UL", b"US"}
_UNDEFINED = 0xFFFFFFFF
_ITEM, _ITEM_END, _SEQ_END = 0xFFFEE000, 0xFFFEE00D, 0xFFFEE0DD
_HEADER_TAGS = {0x00280010: "rows", 0x00280011: "cols", 0x00280008: "frames", 0x00280002: "spp",
                0x00280100: "bits"}


class _Limit(Exception):
    """The pre-scan hit a bound: `what` is 'elements' or 'depth'."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@dataclass
class _Scan:
    ts: str | None = None
    deflated: bool = False
    body: int = 0  # offset of the data set after the file meta
    ts_value: tuple[int, int] | None = None  # (offset, length) of the transfer syntax UID's value
    group_length: int | None = None  # offset of the (0002,0000) value
    rows: int | None = None
    cols: int | None = None
    frames: int = 1
    spp: int = 1
    bits: int | None = None
    elements: int = 0
    depth: int = 0
    confused: bool = False  # the walk met bytes it could not parse and stopped (pydicom may still read them)
    pixels: tuple[int, int] | None = None  # native pixel data: (bytes in the file, bytes its length declares)
    pixels_cut: bool = False  # encapsulated pixel data that ends before its sequence delimiter
    cut_at: int | None = None  # offset of a top-level element whose header or value runs past the end of the file


def _scan_dicom(data: bytes, *, max_elements: int, max_depth: int, probe: bool = False) -> _Scan:
    """Walk the element headers of a DICOM file without decoding any value: the transfer syntax and
    image size, and the number of elements and depth of sequences, raising _Limit past a bound."""
    st = _Scan()
    pos = 132 if data[128:132] == b"DICM" else 0
    end = len(data)
    # File meta (group 0002): always explicit VR little endian.
    while pos + 8 <= end and data[pos:pos + 2] == b"\x02\x00":
        elem = int.from_bytes(data[pos + 2:pos + 4], "little")
        vr = data[pos + 4:pos + 6]
        if vr in _LONG_VRS:
            length, hdr = int.from_bytes(data[pos + 8:pos + 12], "little"), 12
        elif vr in _ALL_VRS:
            length, hdr = int.from_bytes(data[pos + 6:pos + 8], "little"), 8
        else:
            break  # implicit VR meta (non-conformant): leave it to pydicom
        if length == _UNDEFINED or pos + hdr + length > end:
            break
        if elem == 0x0000 and length == 4:
            st.group_length = pos + hdr
        elif elem == 0x0010:
            st.ts_value = (pos + hdr, length)
            st.ts = data[pos + hdr:pos + hdr + length].decode("ascii", "replace").strip("\x00 ")
        pos += hdr + length
        st.elements += 1
    st.body = pos
    if st.group_length is not None and not probe and pos < st.group_length + 4 + int.from_bytes(
            data[st.group_length:st.group_length + 4], "little") and pos + 8 > end:
        st.cut_at = pos  # the file ends inside its file meta group, whose length it declares
    if st.ts == DeflatedExplicitVRLittleEndian:
        st.deflated = True
        return st
    little = st.ts != ExplicitVRBigEndian
    explicit = _explicit_here(data, pos, st.ts != ImplicitVRLittleEndian if st.ts else True)
    try:
        stop = _walk(data, pos, end, explicit, little, 0, st, max_elements, max_depth, probe)
        if st.cut_at is None and not st.confused and not probe and 0 < end - stop < 8:
            st.cut_at = stop  # the file ends inside an element's header
    except (IndexError, struct.error):  # a header read past the end of the data: the file is cut short
        st.confused = True
        if st.cut_at is None and not probe:
            st.cut_at = end
    except ValueError:
        st.confused = True
    return st


def truncation(st: _Scan, size: int, header: int) -> str | None:
    """What a walk found cut short, as the 422's reason: the pixel data, or (when the walk met no pixel data
    at all) an element before it. None for a complete file, or one cut only after its pixel data (trailing
    padding), which still holds its whole image."""
    if st.pixels is not None and st.pixels[0] < st.pixels[1]:
        return f"its pixel data holds {st.pixels[0]:,} of {st.pixels[1]:,} bytes"
    if st.pixels_cut:
        return "its compressed pixel data ends inside a fragment, before the end of its fragment sequence"
    if st.pixels is None and st.cut_at is not None:
        return f"it ends inside a data element ({size:,} bytes in all), before any pixel data"
    if st.pixels is None and st.elements == 0 and not st.confused and size <= header + 8:
        return f"it ends after {size:,} bytes, before its first data element"
    return None


# (uint16, uint32) unpackers per byte order, built once: the walk recurses per sequence item
_STRUCTS = {o: (struct.Struct(o + "H"), struct.Struct(o + "I")) for o in "<>"}


def _walk(data: bytes, pos: int, end: int, explicit: bool, little: bool, depth: int, st: _Scan,
          max_elements: int, max_depth: int, probe: bool, open_item: bool = False) -> int:
    """Walk elements from `pos` up to `end` or an item delimiter; returns the offset after them. `open_item`:
    the elements of an undefined-length item, which must end with its delimiter (else the file is cut)."""
    order = "<" if little else ">"
    u16, u32 = _STRUCTS[order]
    while pos + 8 <= end:
        group, elem = u16.unpack_from(data, pos)[0], u16.unpack_from(data, pos + 2)[0]
        tag = group << 16 | elem
        if tag == _ITEM_END:
            return pos + 8
        if tag in (_ITEM, _SEQ_END):  # stray delimiters: pydicom stops here too
            st.confused = True
            return end
        st.elements += 1
        if st.elements > max_elements:
            raise _Limit("elements")
        implicit_here = not explicit
        if explicit:
            vr = data[pos + 4:pos + 6]
            if vr in _LONG_VRS:
                length, pos = u32.unpack_from(data, pos + 8)[0], pos + 12
            elif vr in _ALL_VRS:
                length, pos = u16.unpack_from(data, pos + 6)[0], pos + 8
            else:
                st.confused = True
                return end
            is_sq = vr == b"SQ" or (vr == b"UN" and length == _UNDEFINED)
            implicit_here = vr == b"UN"  # an undefined-length UN holds an implicit VR LE sequence
        else:
            length, pos = u32.unpack_from(data, pos + 4)[0], pos + 8
            is_sq = length == _UNDEFINED or _dictionary_vr(tag) == "SQ"
        if depth == 0 and tag in _HEADER_TAGS and length != _UNDEFINED and length <= 16:
            _record(st, tag, data[pos:pos + length], explicit and not implicit_here, order)
        if tag == 0x7FE00010 and depth == 0:
            if probe:
                return end
            if length == _UNDEFINED:  # encapsulated: skip its items (checked after pydicom reads them)
                pos, complete = _skip_items(data, pos, end, u32, u16)
                st.pixels_cut = st.pixels_cut or not complete
                st.pixels = st.pixels or (0, 0)
                continue
            st.pixels = (max(0, min(length, end - pos)), length)
            is_sq = False
        if st.cut_at is None and length != _UNDEFINED and pos + length > len(data):
            st.cut_at = pos  # the file ends inside this element's value
        if is_sq and tag != 0x7FE00010:
            if depth + 1 > max_depth:
                raise _Limit("depth")
            st.depth = max(st.depth, depth + 1)
            stop = end if length == _UNDEFINED else min(end, pos + length)
            sub_explicit = explicit and not implicit_here
            sub_little = little and not implicit_here or implicit_here
            pos = _walk_items(data, pos, stop, sub_explicit, sub_little, depth + 1, st, max_elements,
                              max_depth, probe, open_seq=length == _UNDEFINED)
            continue
        if length == _UNDEFINED:
            st.confused = True
            return end
        pos += length
    if open_item and end >= len(data) and st.cut_at is None and not probe:
        st.cut_at = pos  # the file ends before the item's delimiter
    return pos


def _walk_items(data: bytes, pos: int, stop: int, explicit: bool, little: bool, depth: int, st: _Scan,
                max_elements: int, max_depth: int, probe: bool, open_seq: bool = False) -> int:
    """Walk a sequence's items up to `stop` or its delimiter; `open_seq`: an undefined-length sequence, which
    must end with its delimiter (else the file is cut)."""
    order = "<" if little else ">"
    u16, u32 = _STRUCTS[order]
    while pos + 8 <= stop:
        tag = u16.unpack_from(data, pos)[0] << 16 | u16.unpack_from(data, pos + 2)[0]
        length = u32.unpack_from(data, pos + 4)[0]
        pos += 8
        if tag == _SEQ_END:
            return pos
        if tag != _ITEM:
            st.confused = True
            return len(data)
        st.elements += 1
        if st.elements > max_elements:
            raise _Limit("elements")
        item_explicit = _explicit_here(data, pos, explicit)
        if length == _UNDEFINED:
            pos = _walk(data, pos, len(data), item_explicit, little, depth, st, max_elements, max_depth, probe,
                        open_item=True)
        else:
            if st.cut_at is None and pos + length > len(data):
                st.cut_at = pos  # the file ends inside this item
            _walk(data, pos, min(stop, pos + length), item_explicit, little, depth, st, max_elements, max_depth,
                  probe)
            pos += length
    if open_seq and stop >= len(data) and st.cut_at is None and not probe:
        st.cut_at = pos  # the file ends before the sequence's delimiter
    return pos


def _explicit_here(data: bytes, pos: int, default: bool) -> bool:
    """Whether the data set at `pos` is explicit VR, from its first element, as pydicom decides (it
    reads a file whose transfer syntax says one and whose bytes say the other by its bytes)."""
    if pos + 6 > len(data) or data[pos:pos + 4] in (b"\xfe\xff\x0d\xe0", b"\xff\xfe\xe0\x0d"):
        return default
    return data[pos + 4:pos + 6] in _ALL_VRS


def _skip_items(data: bytes, pos: int, end: int, u32: struct.Struct, u16: struct.Struct) -> tuple[int, bool]:
    """The offset after an encapsulated pixel data's items, and False when the file ends before their
    sequence delimiter (inside a fragment, or between them: a truncated file)."""
    while pos + 8 <= end:
        tag = u16.unpack_from(data, pos)[0] << 16 | u16.unpack_from(data, pos + 2)[0]
        length = u32.unpack_from(data, pos + 4)[0]
        if tag == _SEQ_END:
            return pos + 8, True
        if tag != _ITEM or length == _UNDEFINED:
            return end, True  # not items: left to pydicom and the fragment checks
        pos += 8 + length
    return end, False


def _record(st: _Scan, tag: int, raw: bytes, explicit: bool, order: str) -> None:
    name = _HEADER_TAGS[tag]
    try:
        if tag == 0x00280008:  # IS: a decimal string
            st.frames = int(raw.decode("ascii").strip("\x00 ") or 1)
        elif len(raw) >= 2:
            setattr(st, name, struct.unpack_from(order + "H", raw)[0])
    except (ValueError, UnicodeDecodeError, struct.error):
        pass


_VR_CACHE: dict[int, str | None] = {}


def _dictionary_vr(tag: int) -> str | None:
    if tag not in _VR_CACHE:
        try:
            _VR_CACHE[tag] = pydicom.datadict.dictionary_VR(tag)
        except KeyError:
            _VR_CACHE[tag] = None
    return _VR_CACHE[tag]


def _prescan(data: bytes, max_elements: int) -> _Scan:
    """The bounded walk before pydicom parses anything: too many elements is 413, too deep 422."""
    try:
        return _scan_dicom(data, max_elements=max_elements, max_depth=_MAX_DEPTH)
    except _Limit as exc:
        if exc.what == "depth":
            raise UnprocessableImage(f"the DICOM file nests sequences more than {_MAX_DEPTH} deep, which no image "
                                     "object needs: export it again from the PACS or modality and resend it") from None
        raise PayloadTooLarge(f"the DICOM file holds more than {max_elements:,} data elements: send a single "
                              "image object without large attached sequences") from None


def _inflate(data: bytes, scan: _Scan, limit: int) -> bytes:
    """A deflated file as the same file in Explicit VR Little Endian, inflated with a cap on its output."""
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    body, tail = bytearray(), memoryview(data)[scan.body:]
    try:  # 1 MiB at a time: zlib's own output buffer for one big call peaks at twice its output
        while not inflater.eof and len(body) <= limit:
            chunk = inflater.decompress(tail, 1 << 20)
            tail = memoryview(inflater.unconsumed_tail)
            if not chunk and not tail:
                break
            body += chunk
    except zlib.error:
        raise UnprocessableImage("the deflated DICOM file is truncated or corrupt: export it again, "
                                 "preferably uncompressed, and resend it") from None
    if len(body) > limit:
        raise PayloadTooLarge(f"the deflated DICOM file expands to more than {limit / 2**20:.0f} MiB: send it "
                              "uncompressed or with an image compression such as JPEG 2000")
    if scan.ts_value is None:
        raise UnprocessableImage("the DICOM file's header is corrupt: export it again and resend it")
    start, length = scan.ts_value
    new_ts = str(ExplicitVRLittleEndian).encode() + b"\x00"  # 20 bytes, even
    head = bytearray(data[:start - 2] + len(new_ts).to_bytes(2, "little") + new_ts + data[start + length:scan.body])
    if scan.group_length is not None:
        old = int.from_bytes(head[scan.group_length:scan.group_length + 4], "little")
        head[scan.group_length:scan.group_length + 4] = (old + len(new_ts) - length).to_bytes(4, "little")
    return bytes(head) + body


# --------------------------------------------------------------------------- encapsulated frames

_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xF7}


def _jpeg_sof(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int, int] | None:
    """(height, width, components) from the SOF (or JPEG-LS SOF55) segment of a JPEG starting at `pos`."""
    pos += 2  # SOI
    while pos + 4 <= end:
        if buf[pos] != 0xFF:
            return None
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01,) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        length = buf[pos + 2] << 8 | buf[pos + 3]
        if marker in _SOF_MARKERS and pos + 10 <= end:
            h = buf[pos + 5] << 8 | buf[pos + 6]
            w = buf[pos + 7] << 8 | buf[pos + 8]
            return h, w, buf[pos + 9]
        if marker == 0xDA or length < 2:  # start of scan before any SOF
            return None
        pos += 2 + length
    return None


def _j2k_siz(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int, int] | None:
    """(height, width, components) from the SIZ segment of a JPEG 2000 codestream or JP2 file."""
    if bytes(buf[pos:pos + 12]) == b"\x00\x00\x00\x0cjP  \r\n\x87\n":  # JP2: find the codestream box
        i = bytes(buf[pos:min(end, pos + 4096)]).find(b"jp2c")
        if i < 0:
            return None
        pos += i + 4
    if bytes(buf[pos:pos + 4]) != b"\xff\x4f\xff\x51" or pos + 42 > end:
        return None
    xs, ys, xo, yo = struct.unpack_from(">IIII", buf, pos + 8)
    comps = struct.unpack_from(">H", buf, pos + 40)[0]
    return ys - yo, xs - xo, comps


def _check_encapsulated(pixel_data: bytes, tsyntax: UID, n_frames: int, rows: int, cols: int, spp: int,
                        max_fragments: int) -> None:
    """Before any frame is decoded: as many frames as the header declares, none larger than its size."""
    buf = memoryview(pixel_data)
    end, pos = len(buf), 0
    fragments: list[tuple[int, int]] = []
    first = True
    while pos + 8 <= end:
        tag, length = struct.unpack_from("<HH", buf, pos), struct.unpack_from("<I", buf, pos + 4)[0]
        if tag == (0xFFFE, 0xE0DD):
            break
        if tag != (0xFFFE, 0xE000) or length == _UNDEFINED:
            return  # malformed: pydicom's own parser refuses it
        if not first:  # the first item is the basic offset table
            fragments.append((pos + 8, min(end, pos + 8 + length)))
            if len(fragments) > max_fragments:
                raise UnprocessableImage(f"the DICOM pixel data is split into more than {max_fragments:,} "
                                         "fragments: export it again from the PACS or modality and resend it")
        first = False
        pos += 8 + length
    mismatch = UnprocessableImage("the DICOM file's encoded frames do not agree with its header (frame count "
                                  "or image size): export it again from the PACS or modality and resend it")
    if tsyntax == RLELossless:
        if len(fragments) > n_frames:  # RLE: exactly one fragment per frame
            raise mismatch
        return
    starts = 0
    for a, b in fragments:
        head = bytes(buf[a:a + 4])
        if head[:2] == b"\xff\xd8":
            size = _jpeg_sof(buf, a, b)
        elif head == b"\xff\x4f\xff\x51" or head == b"\x00\x00\x00\x0c":
            size = _j2k_siz(buf, a, b)
        else:
            continue  # a later fragment of a frame split across fragments
        starts += 1
        if starts > n_frames:
            raise mismatch
        if size is not None:
            h, w, comps = size
            if h > rows or w > cols or h < 0 or w < 0 or comps > max(spp, 1) + 1:
                raise mismatch


# --------------------------------------------------------------------------- RLE, bounded

# This module is also a pydicom decoding plugin: bounded RLE, and 12-bit JPEG Extended through pylibjpeg-libjpeg.
DECODER_DEPENDENCIES = {RLELossless: (), JPEGExtended12Bit: ("pylibjpeg>=2.0", "pylibjpeg-libjpeg>=2.1")}


def is_available(uid: str) -> bool:
    if uid == JPEGExtended12Bit:
        from pydicom.pixels.decoders import pylibjpeg

        return pylibjpeg.is_available(uid)
    return uid == RLELossless


_rle_state = threading.local()  # too_long: this thread's last RLE decode stopped at the frame's size


def _rle_segment(src: bytes, limit: int) -> bytearray:
    """One RLE segment, decoding at most `limit` + 1 bytes (PackBits; a trailing pad byte is allowed)."""
    out = bytearray()
    extend, pos, n = out.extend, 0, len(src)
    while pos < n:
        header = src[pos] + 1
        pos += 1
        if header > 129:
            extend(src[pos:pos + 1] * (258 - header))
            pos += 1
        elif header < 129:
            extend(src[pos:pos + header])
            pos += header
        if len(out) > limit + 1:
            _rle_state.too_long = True
            raise ValueError("RLE segment longer than the frame")
    return out


def _rle_decode_frame(src: bytes, runner: Any) -> bytearray:
    """pydicom decoding plugin: its RLE decoder with each segment's output capped at rows × columns."""
    rows, cols, spp, bits = runner.rows, runner.columns, runner.samples_per_pixel, runner.bits_allocated
    order = runner.get_option("rle_segment_order", ">")
    if bits % 8:
        raise NotImplementedError("RLE with bits allocated not a multiple of 8")
    n_seg, bps = struct.unpack_from("<I", src, 0)[0], bits // 8
    offsets = list(struct.unpack_from("<15I", src, 4))[:n_seg]
    if n_seg != spp * bps:
        raise ValueError("wrong number of RLE segments")
    offsets.append(len(src))
    plane = rows * cols
    decoded = bytearray(plane * spp * bps)
    stride = bps * plane
    for sample in range(spp):
        for byte in (range(bps) if order == "<" else reversed(range(bps))):
            ii = sample * bps + byte
            segment = _rle_segment(src[offsets[ii]:offsets[ii + 1]], plane)
            if len(segment) < plane:
                raise ValueError("RLE segment shorter than the frame")
            if order == ">":
                byte = bps - byte - 1
            start = byte + sample * stride
            decoded[start:start + stride:bps] = segment[:plane]
    runner.set_option("planar_configuration", 1)
    return decoded


# --------------------------------------------------------------------------- 12-bit JPEG Extended

_jpeg12_state = threading.local()  # cut: this thread's last 12-bit JPEG frame ended before its EOI marker
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # after entropy-coded data: not stuffing, RSTn or fill
_SEQUENTIAL_DCT = (0xC0, 0xC1)  # SOF0/SOF1: baseline and extended sequential, Huffman (what 1.2.4.50/51 allow)


def _is_jpeg12(tsyntax: UID, ds: pydicom.Dataset) -> bool:
    """A JPEG Extended file with 12-bit samples: Pillow refuses those, pylibjpeg-libjpeg reads them through the
    plugin below (8-bit ones keep Pillow, as JPEG Baseline does)."""
    return tsyntax == JPEGExtended12Bit and (_safe_int(ds.get("BitsStored")) or 8) > 8


def _sequential_scan_fixes(src: bytes | bytearray) -> list[int]:
    """Offsets of the Se bytes to set to 63 in `src`, a JPEG frame: the scan headers of a sequential DCT frame
    whose Ss, Se and Ah/Al are all zero. Old encoders wrote that (pydicom's JPEG-lossy.dcm is one); IJG's code
    (dcmtk's, and libjpeg-turbo's under Pillow) decodes all 64 coefficients of a sequential scan whatever its
    header says (jdhuff.c: "some baseline files out there with all zeroes in these bytes"), with a warning, but
    libjpeg refuses the frame. A walk over the marker segments, at most 4 scans (one per component) and 1000
    segments."""
    fixes: list[int] = []
    pos, end, sequential, scans, segments = 2, len(src), False, 0, 0
    while pos + 5 <= end and scans < 4 and segments < 1000:
        if src[pos] != 0xFF:
            return fixes  # not a marker where one must be: libjpeg says what is wrong
        marker = src[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xD9:  # EOI
            break
        segments += 1
        length = src[pos + 2] << 8 | src[pos + 3]
        if marker in _SEQUENTIAL_DCT:
            sequential = True
        elif marker == 0xDA:
            scans += 1
            params = pos + 5 + 2 * src[pos + 4]  # after Ns and its component selectors
            if sequential and length == params - pos + 1 and src[params:params + 3] == b"\x00\x00\x00":
                fixes.append(params + 1)
            found = _JPEG_MARKER.search(src, pos + 2 + length)  # the marker after this scan's entropy-coded data
            if found is None:
                break
            pos = found.start()
            continue
        pos += 2 + length
    return fixes


def _jpeg12_decode_frame(src: bytes, runner: Any) -> bytes | bytearray:
    """pydicom decoding plugin for 12-bit JPEG Extended: pydicom's pylibjpeg-libjpeg plugin, given only whole
    frames, with an all-zero sequential scan header read as IJG reads it."""
    from pydicom.pixels.decoders.pylibjpeg import _decode_frame

    tail = bytes(src[-64:])
    eoi = tail.rfind(b"\xff\xd9")
    if eoi < 0 or tail[eoi + 2:].strip(b"\x00\xff"):  # a frame is padded to an even length (JPEG-lossy.dcm: 0xFF)
        _jpeg12_state.cut = True
        raise ValueError("JPEG frame without its end-of-image marker")
    fixes = _sequential_scan_fixes(src)
    if fixes:  # one copy of the compressed frame (libjpeg takes bytes only)
        view, parts, last = memoryview(src), [], 0
        for at in fixes:
            parts += [view[last:at], b"\x3f"]
            last = at + 1
        src = b"".join([*parts, view[last:]])
    return _decode_frame(src, runner)


# --------------------------------------------------------------------------- segmented palettes


def _expand_segmented(words: tuple[int, ...], limit: int, *, nr_segments: int | None = None,
                      last: int | None = None, depth: int = 0, budget: list[int] | None = None) -> list[int]:
    """pydicom's segmented LUT expansion (PS3.3 C.7.9.2) with its output capped at `limit` entries,
    indirect segments nested at most two deep and at most 200 000 segments read in all (indirect
    ones re-read earlier segments); ValueError past any of them."""
    budget = [200_000] if budget is None else budget
    lut: list[int] = []
    offset = segments = 0
    while offset + 1 < len(words):
        opcode, length = words[offset], words[offset + 1]
        offset += 2
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("too many segments")
        if len(lut) + (length if opcode in (0, 1) else 0) > limit:
            raise ValueError("segmented LUT longer than its descriptor")
        if opcode == 0:
            lut.extend(words[offset:offset + length])
            offset += length
        elif opcode == 1:
            y0 = lut[-1] if lut else last
            if y0 is None:
                raise ValueError("linear segment first")
            y1 = words[offset]
            offset += 1
            if y0 == y1:
                lut.extend([y1] * length)
            else:
                step = (y1 - y0) / length
                lut.extend(int(v) for v in np.around(np.linspace(y0 + step, y1, length)))
        elif opcode == 2:
            if not lut or depth >= 2:
                raise ValueError("indirect segment first or nested too deep")
            byte_offset = words[offset + 1] << 16 | words[offset]  # as pydicom reads 16-bit entries
            offset += 2
            lut.extend(_expand_segmented(words[byte_offset:], limit - len(lut), nr_segments=length,
                                         last=lut[-1], depth=depth + 1, budget=budget))
        else:
            raise ValueError("unknown segment type")
        segments += 1
        if segments == nr_segments:
            break
    return lut


def _expand_segmented_palettes(ds: pydicom.Dataset, little_endian: bool) -> None:
    """Replace segmented palette LUT data by plain LUT data, expanded with a bound, in native byte order."""
    if "SegmentedRedPaletteColorLookupTableData" not in ds:
        return
    desc = ds.RedPaletteColorLookupTableDescriptor
    entries, bits = int(desc[0]) or 65536, int(desc[2])
    fmt = ("<" if little_endian else ">") + ("B" if bits == 8 else "H")
    dtype = np.uint8 if bits == 8 else np.uint16
    for colour in ("Red", "Green", "Blue", "Alpha"):
        keyword = f"Segmented{colour}PaletteColorLookupTableData"
        if keyword not in ds:
            continue
        raw = bytes(ds[keyword].value)
        size = struct.calcsize(fmt[1])
        words = struct.unpack(f"{fmt[0]}{len(raw) // size}{fmt[1]}", raw[:len(raw) // size * size])
        try:
            lut = _expand_segmented(words, 65536)
        except (ValueError, IndexError, RecursionError):
            raise UnprocessableImage("the DICOM file's segmented palette colour table is malformed or expands "
                                     "beyond its declared length: export the image as RGB and resend it") from None
        if not lut:
            raise UnprocessableImage("the DICOM file's segmented palette colour table is empty: export the "
                                     "image as RGB and resend it")
        lut = (lut + [lut[-1]] * entries)[:entries]
        del ds[keyword]  # pydicom reads plain LUT data in the machine's byte order
        setattr(ds, f"{colour}PaletteColorLookupTableData", np.asarray(lut, dtype=dtype).tobytes())


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
    # pynetdicom adds the UIDs newer than pydicom's table (e.g. Deflated Image Frame Compression) to that table when
    # it is imported; import it always, so that a message does not depend on what else the process has loaded
    import pynetdicom  # noqa: F401

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


# The bounded RLE decoder and the 12-bit JPEG one above, as pydicom plugins named "tafl". The JPEG one comes after
# Pillow and pydicom's own pylibjpeg plugin for a caller that names none (pydicom tries them in that order).
from pydicom.pixels.decoders import JPEGExtended12BitDecoder, RLELosslessDecoder

for _decoder, _function in ((RLELosslessDecoder, "_rle_decode_frame"),
                            (JPEGExtended12BitDecoder, "_jpeg12_decode_frame")):
    try:
        _decoder.add_plugin("tafl", (__name__, _function))
    except ValueError:  # added already (this module imported again, as importlib.reload does)
        pass
