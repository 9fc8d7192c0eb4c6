"""A bounded walk over a DICOM data set's elements, before pydicom parses it (tafl.imaging.decode's first DICOM
step): the element count and sequence depth are capped, the image header's geometry (rows, columns, frames,
samples, bits) is read, truncation is told from the declared lengths, and a deflated data set is inflated with a
cap on its output. Reads element headers only; never allocates by what a header declares."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import pydicom
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
)

from tafl.errors import PayloadTooLarge, UnprocessableImage

MAX_DEPTH = 16  # sequences nested deeper than this are refused (functional groups nest 3–4 deep)
LONG_VRS = {b"OB", b"OD", b"OF", b"OL", b"OV", b"OW", b"SQ", b"SV", b"UC", b"UN", b"UR", b"UT", b"UV"}
_ALL_VRS = LONG_VRS | {b"AE", b"AS", b"AT", b"CS", b"DA", b"DS", b"DT", b"FD", b"FL", b"IS", b"LO", b"LT",
                        b"PN", b"SH", b"SL", b"SS", b"ST", b"TM", b"UI", b"UL", b"US"}
UNDEFINED = 0xFFFFFFFF
_ITEM, _ITEM_END, _SEQ_END = 0xFFFEE000, 0xFFFEE00D, 0xFFFEE0DD
_HEADER_TAGS = {0x00280010: "rows", 0x00280011: "cols", 0x00280008: "frames", 0x00280002: "spp",
                0x00280100: "bits"}


class _Limit(Exception):
    """The pre-scan hit a bound: `what` is 'elements' or 'depth'."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@dataclass
class Scan:
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


def scan_dicom(data: bytes, *, max_elements: int, max_depth: int, probe: bool = False) -> Scan:
    """Walk the element headers of a DICOM file without decoding any value: the transfer syntax and
    image size, and the number of elements and depth of sequences, raising _Limit past a bound."""
    st = Scan()
    pos = 132 if data[128:132] == b"DICM" else 0
    end = len(data)
    # File meta (group 0002): always explicit VR little endian.
    while pos + 8 <= end and data[pos:pos + 2] == b"\x02\x00":
        elem = int.from_bytes(data[pos + 2:pos + 4], "little")
        vr = data[pos + 4:pos + 6]
        if vr in LONG_VRS:
            length, hdr = int.from_bytes(data[pos + 8:pos + 12], "little"), 12
        elif vr in _ALL_VRS:
            length, hdr = int.from_bytes(data[pos + 6:pos + 8], "little"), 8
        else:
            break  # implicit VR meta (non-conformant): leave it to pydicom
        if length == UNDEFINED or pos + hdr + length > end:
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


def truncation(st: Scan, size: int, header: int) -> str | None:
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


def _walk(data: bytes, pos: int, end: int, explicit: bool, little: bool, depth: int, st: Scan,
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
            if vr in LONG_VRS:
                length, pos = u32.unpack_from(data, pos + 8)[0], pos + 12
            elif vr in _ALL_VRS:
                length, pos = u16.unpack_from(data, pos + 6)[0], pos + 8
            else:
                st.confused = True
                return end
            is_sq = vr == b"SQ" or (vr == b"UN" and length == UNDEFINED)
            implicit_here = vr == b"UN"  # an undefined-length UN holds an implicit VR LE sequence
        else:
            length, pos = u32.unpack_from(data, pos + 4)[0], pos + 8
            is_sq = length == UNDEFINED or _dictionary_vr(tag) == "SQ"
        if depth == 0 and tag in _HEADER_TAGS and length != UNDEFINED and length <= 16:
            _record(st, tag, data[pos:pos + length], explicit and not implicit_here, order)
        if tag == 0x7FE00010 and depth == 0:
            if probe:
                return end
            if length == UNDEFINED:  # encapsulated: skip its items (checked after pydicom reads them)
                pos, complete = _skip_items(data, pos, end, u32, u16)
                st.pixels_cut = st.pixels_cut or not complete
                st.pixels = st.pixels or (0, 0)
                continue
            st.pixels = (max(0, min(length, end - pos)), length)
            is_sq = False
        if st.cut_at is None and length != UNDEFINED and pos + length > len(data):
            st.cut_at = pos  # the file ends inside this element's value
        if is_sq and tag != 0x7FE00010:
            if depth + 1 > max_depth:
                raise _Limit("depth")
            st.depth = max(st.depth, depth + 1)
            stop = end if length == UNDEFINED else min(end, pos + length)
            sub_explicit = explicit and not implicit_here
            sub_little = little and not implicit_here or implicit_here
            pos = _walk_items(data, pos, stop, sub_explicit, sub_little, depth + 1, st, max_elements,
                              max_depth, probe, open_seq=length == UNDEFINED)
            continue
        if length == UNDEFINED:
            st.confused = True
            return end
        pos += length
    if open_item and end >= len(data) and st.cut_at is None and not probe:
        st.cut_at = pos  # the file ends before the item's delimiter
    return pos


def _walk_items(data: bytes, pos: int, stop: int, explicit: bool, little: bool, depth: int, st: Scan,
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
        if length == UNDEFINED:
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
        if tag != _ITEM or length == UNDEFINED:
            return end, True  # not items: left to pydicom and the fragment checks
        pos += 8 + length
    return end, False


def _record(st: Scan, tag: int, raw: bytes, explicit: bool, order: str) -> None:
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


def prescan(data: bytes, max_elements: int) -> Scan:
    """The bounded walk before pydicom parses anything: too many elements is 413, too deep 422."""
    try:
        return scan_dicom(data, max_elements=max_elements, max_depth=MAX_DEPTH)
    except _Limit as exc:
        if exc.what == "depth":
            raise UnprocessableImage(f"the DICOM file nests sequences more than {MAX_DEPTH} deep, which no image "
                                     "object needs: export it again from the PACS or modality and resend it") from None
        raise PayloadTooLarge(f"the DICOM file holds more than {max_elements:,} data elements: send a single "
                              "image object without large attached sequences") from None


def inflate(data: bytes, scan: Scan, limit: int) -> bytes:
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
