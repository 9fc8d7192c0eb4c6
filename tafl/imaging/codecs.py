"""Encapsulated pixel data, bounded (tafl.imaging.decode's codecs): each frame's header (JPEG SOF, JPEG 2000 SIZ)
checked against the data set's before a frame is decoded, RLE decoded with a cap on its output, 12-bit JPEG
Extended (which Pillow cannot read) handed to libjpeg only when whole, and segmented palette tables expanded with a
cap on their length. The RLE and 12-bit JPEG decoders are pydicom pixel-data plugins named "tafl", registered when
this module is imported."""

from __future__ import annotations

import re
import struct
import threading
from typing import Any

import numpy as np
import pydicom
from pydicom.uid import UID, JPEGExtended12Bit, RLELossless

from tafl.errors import UnprocessableImage
from tafl.imaging.dicom_scan import UNDEFINED

# --------------------------------------------------------------------------- encapsulated frames

_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xF7}


def jpeg_sof(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int, int] | None:
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


def check_encapsulated(pixel_data: bytes, tsyntax: UID, n_frames: int, rows: int, cols: int, spp: int,
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
        if tag != (0xFFFE, 0xE000) or length == UNDEFINED:
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
            size = jpeg_sof(buf, a, b)
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


rle_state = threading.local()  # too_long: this thread's last RLE decode stopped at the frame's size


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
            rle_state.too_long = True
            raise ValueError("RLE segment longer than the frame")
    return out


def rle_decode_frame(src: bytes, runner: Any) -> bytearray:
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

jpeg12_state = threading.local()  # cut: this thread's last 12-bit JPEG frame ended before its EOI marker
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # after entropy-coded data: not stuffing, RSTn or fill
_SEQUENTIAL_DCT = (0xC0, 0xC1)  # SOF0/SOF1: baseline and extended sequential, Huffman (what 1.2.4.50/51 allow)


def is_jpeg12(tsyntax: UID, ds: pydicom.Dataset) -> bool:
    """A JPEG Extended file with 12-bit samples: Pillow refuses those, pylibjpeg-libjpeg reads them through the
    plugin below (8-bit ones keep Pillow, as JPEG Baseline does)."""
    return tsyntax == JPEGExtended12Bit and (safe_int(ds.get("BitsStored")) or 8) > 8


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


def jpeg12_decode_frame(src: bytes, runner: Any) -> bytes | bytearray:
    """pydicom decoding plugin for 12-bit JPEG Extended: pydicom's pylibjpeg-libjpeg plugin, given only whole
    frames, with an all-zero sequential scan header read as IJG reads it."""
    from pydicom.pixels.decoders.pylibjpeg import _decode_frame

    tail = bytes(src[-64:])
    eoi = tail.rfind(b"\xff\xd9")
    if eoi < 0 or tail[eoi + 2:].strip(b"\x00\xff"):  # a frame is padded to an even length (JPEG-lossy.dcm: 0xFF)
        jpeg12_state.cut = True
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


def expand_segmented_palettes(ds: pydicom.Dataset, little_endian: bool) -> None:
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

def safe_int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


# The bounded RLE decoder and the 12-bit JPEG one above, as pydicom plugins named "tafl". The JPEG one comes after
# Pillow and pydicom's own pylibjpeg plugin for a caller that names none (pydicom tries them in that order).
from pydicom.pixels.decoders import JPEGExtended12BitDecoder, RLELosslessDecoder

for _decoder, _function in ((RLELosslessDecoder, "rle_decode_frame"),
                            (JPEGExtended12BitDecoder, "jpeg12_decode_frame")):
    try:
        _decoder.add_plugin("tafl", (__name__, _function))
    except ValueError:  # added already (this module imported again, as importlib.reload does)
        pass
