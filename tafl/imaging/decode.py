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
from tafl.imaging.codecs import (
    check_encapsulated,
    expand_segmented_palettes,
    is_jpeg12,
    jpeg12_state,
    jpeg_sof,
    rle_state,
    safe_int,
)
from tafl.imaging.dicom_scan import (
    LONG_VRS,
    MAX_DEPTH,
    inflate,
    prescan,
    scan_dicom,
    truncation,
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
            if data[pos + 4:pos + 6] in LONG_VRS:
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
    """Bounded at every step: the data set read (`_read_dataset`), its declared geometry checked against the limits
    (`_geometry`), its pixels decoded (`_decode_pixels`), then rendered to 8-bit frames."""
    ds, deflated, data = _read_dataset(data, max_bytes, max_frames)  # data: inflated, where it was deflated
    rows, cols, n_frames, spp = _geometry(ds, len(data), max_pixels, max_frames)
    arr, meta, tsyntax, ts_name = _decode_pixels(ds, deflated, rows, cols, n_frames, spp, max_frames)
    # One layout for everything: (F, H, W) or (F, H, W, 3), from the header, not from ndim alone.
    arr = arr[np.newaxis] if n_frames == 1 else arr
    if arr.shape[:3] != (n_frames, rows, cols) or arr.ndim != (4 if spp == 3 else 3):
        raise UnprocessableImage("the DICOM pixel data does not match its declared size: "
                                 "export it again from the PACS or modality and resend it")
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2")).strip().upper()
    decoded_as = str(meta.get("photometric_interpretation") or photometric).strip().upper()
    info: dict[str, Any] = {"modality": _safe_code(ds.get("Modality")),
                            "photometric": photometric if photometric in PHOTOMETRICS else "other",
                            "bits_allocated": safe_int(ds.get("BitsAllocated")),
                            "bits_stored": safe_int(ds.get("BitsStored")),
                            "transfer_syntax": ts_name, "frames": n_frames, "sop_class": _sop_class_name(ds)}

    if spp == 3:
        if decoded_as in ("YBR_FULL", "YBR_FULL_422") and arr.dtype == np.uint8:
            arr = convert_color_space(arr, decoded_as, "RGB", per_frame=True)
        out = _scale_colour(arr, safe_int(ds.get("BitsStored")) or arr.dtype.itemsize * 8)
    elif photometric == "PALETTE COLOR":
        rgb = _palette_to_rgb(arr, ds, little_endian=tsyntax.is_little_endian)
        out = _scale_colour(rgb, rgb.dtype.itemsize * 8)
    else:
        out, info["windowing"] = _render_grey(arr, ds, invert=photometric == "MONOCHROME1")
    frames = [np.ascontiguousarray(f, dtype=np.uint8) for f in out]
    return DecodedImage(frames=frames, kind="dicom", info={k: v for k, v in info.items() if v is not None})




def _read_dataset(data: bytes, max_bytes: int, max_frames: int) -> tuple[pydicom.Dataset, bool, bytes]:
    """The data set, read by pydicom once the pre-scan found it whole and within bounds; whether it was deflated;
    and its bytes (inflated, where they were deflated)."""
    max_elements = max(10_000, 100 * max_frames)  # real files: under 1 500 (an ECG waveform); pydicom ~30 µs each
    scan = prescan(data, max_elements)
    deflated = scan.deflated
    if deflated:  # inflated here, with a cap, rather than by pydicom (which inflates it whole)
        data = inflate(data, scan, max_bytes)
        scan = prescan(data, max_elements)
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
    return ds, deflated, data


def _geometry(ds: pydicom.Dataset, size: int, max_pixels: int, max_frames: int) -> tuple[int, int, int, int]:
    """(rows, columns, frames, samples per pixel) as the header declares them, each checked against the limits
    before any pixel is decoded."""
    if not any(k in ds for k in PIXEL_KEYWORDS):
        sop = _sop_class_name(ds)
        if "Rows" in ds or (sop and "Image Storage" in sop):  # an image object cut before its pixels
            raise UnprocessableImage(f"the DICOM file is truncated: {f'a {sop} object' if sop else 'an image'} "
                                     f"that ends after {size:,} bytes, before its pixel data; send the "
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

    return rows, cols, n_frames, spp


def _decode_pixels(ds: pydicom.Dataset, deflated: bool, rows: int, cols: int, n_frames: int, spp: int,
                   max_frames: int) -> tuple[np.ndarray, dict[str, Any], UID, str]:
    """The decoded samples (and pydicom's facts about them), the transfer syntax and its name: encapsulated frames
    are checked against the header first, RLE and 12-bit JPEG go to tafl's bounded decoders."""
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
        check_encapsulated(ds.PixelData, tsyntax, n_frames, rows, cols, spp, max_fragments=max(4096, 64 * max_frames))
    plugin = {"decoding_plugin": "tafl"} if tsyntax == RLELossless or is_jpeg12(tsyntax, ds) else {}
    if plugin and "tafl" not in decoder.available_plugins:  # 12-bit JPEG without pylibjpeg-libjpeg installed
        raise UnsupportedMedia(f"the DICOM transfer syntax '{ts_name}' with 12-bit samples is not "
                               "supported here: export the image uncompressed or as JPEG-LS, JPEG 2000 or RLE and "
                               "resend it")
    rle_state.too_long = jpeg12_state.cut = False
    try:
        arr, meta = decoder.as_array(ds, validate=True, raw=False, **plugin, **as_pixel_options(ds))
    except Exception:
        if tsyntax == RLELossless and getattr(rle_state, "too_long", False):
            raise UnprocessableImage("the DICOM file's RLE pixel data decodes to more than its declared image "
                                     "size: export it again from the PACS or modality and resend it") from None
        if getattr(jpeg12_state, "cut", False):
            raise UnprocessableImage("the DICOM file's JPEG pixel data is truncated: a frame ends before its "
                                     "end-of-image marker; send the complete file (export it again and resend "
                                     "it)") from None
        raise UnprocessableImage(f"the DICOM pixel data ({ts_name}) could not be decoded, it is truncated, "
                                 "corrupt or in an unsupported variant: export it again uncompressed and "
                                 "resend it") from None

    return arr, meta, tsyntax, ts_name


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
    expand_segmented_palettes(ds, little_endian)
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
            sof = jpeg_sof(data, 0, min(len(data), 1 << 20))
            if sof is None:
                return UNKNOWN_NBYTES
            h, w, comps = sof
            return w * max(h, 1) * comps * 2
        if data[128:132] == b"DICM" or _looks_like_bare_dataset(data):
            scan = scan_dicom(data, max_elements=_PROBE_ELEMENTS, max_depth=MAX_DEPTH, probe=True)
            if scan.deflated or scan.rows is None or scan.cols is None:
                return UNKNOWN_NBYTES
            px = scan.rows * scan.cols * max(1, scan.frames) * max(1, scan.spp)
            per_sample = max(1, -(-(scan.bits or 16) // 8))
            return px * (per_sample + 1 + 8) if scan.spp == 1 else px * (per_sample + 1)  # grey: + float temps
        return len(data)  # anything else is refused from its magic bytes, cheaply
    except Exception:  # noqa: BLE001 - a probe never fails: in doubt, off the loop
        return UNKNOWN_NBYTES


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
