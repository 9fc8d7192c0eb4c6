"""Crafted inputs that are cheap to send and costly to decode, built in Python (no committed binaries).

Each builder returns the file's bytes. `HOSTILE` maps a class name to (builder, expected status);
`CONTROLS` maps a class name to a valid-but-unusual file of the same family that must still decode.
Used by tests/test_imaging_hostile.py and benchmarks/hostile_decode.py; `scale` grows the inputs for
the benchmark (1 in tests).
"""

from __future__ import annotations

import struct
import zlib
from io import BytesIO

import numpy as np
import pydicom
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.uid import (
    UID,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    RLELossless,
    SecondaryCaptureImageStorage,
    generate_uid,
)


def _dataset(rows: int, cols: int, *, bits: int = 8, spp: int = 1, frames: int | None = None,
             photometric: str = "MONOCHROME2") -> Dataset:
    ds = Dataset()
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.SOPInstanceUID = generate_uid()
    ds.PatientName = "Hostile^Test"
    ds.Modality = "OT"
    ds.Rows, ds.Columns = rows, cols
    ds.SamplesPerPixel = spp
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = bits, bits, bits - 1
    ds.PixelRepresentation = 0
    if spp == 3:
        ds.PlanarConfiguration = 0
    if frames is not None:
        ds.NumberOfFrames = frames
    return ds


def _file(ds: Dataset, tsyntax: UID) -> bytes:
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = ds.SOPClassUID
    meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    meta.TransferSyntaxUID = tsyntax
    ds.file_meta = meta
    buf = BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


def _split_meta(data: bytes) -> tuple[bytes, bytes]:
    """(preamble + DICM + file meta, data set) of an Explicit VR Little Endian file."""
    pos = 132
    while data[pos:pos + 2] == b"\x02\x00":
        vr = data[pos + 4:pos + 6]
        if vr in (b"OB", b"OW", b"UN", b"SQ", b"UT", b"UC", b"UR", b"OD", b"OF", b"OL", b"OV"):
            pos += 12 + int.from_bytes(data[pos + 8:pos + 12], "little")
        else:
            pos += 8 + int.from_bytes(data[pos + 6:pos + 8], "little")
    return data[:pos], data[pos:]


def _zeros_deflate(n_bytes: int) -> bytes:
    """A raw deflate stream (no final block) of `n_bytes` zeros, built in O(16 MiB) of work."""
    chunk = 16 * 2**20
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = co.compress(b"\x00" * chunk) + co.flush(zlib.Z_FULL_FLUSH)  # byte-aligned, no back references
    whole, rest = divmod(n_bytes, chunk)
    tail = zlib.compressobj(9, zlib.DEFLATED, -15)
    return block * whole + tail.compress(b"\x00" * rest) + tail.flush(zlib.Z_FULL_FLUSH)


# --------------------------------------------------------------------------- deflate


def deflated_dicom(rows: int = 64, cols: int = 64, extra: int = 0) -> bytes:
    """A Deflated Explicit VR Little Endian file; `extra` bytes of zeros in a private OB element."""
    ds = _dataset(rows, cols)
    ds.PixelData = (np.arange(rows * cols) % 251).astype(np.uint8).tobytes()
    _, body = _split_meta(_file(ds, ExplicitVRLittleEndian))
    head, _ = _split_meta(_file(ds, DeflatedExplicitVRLittleEndian))
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    out = [co.compress(body) + co.flush(zlib.Z_FULL_FLUSH)]
    if extra:  # (0009,0010) private creator, (0009,1000) OB of `extra` zeros, after the pixel data
        creator = b"HOSTILE "
        elem = b"\x09\x00\x10\x00LO" + struct.pack("<H", len(creator)) + creator
        elem += b"\x09\x00\x00\x10OB\x00\x00" + struct.pack("<I", extra)
        out.append(co.compress(elem) + co.flush(zlib.Z_FULL_FLUSH))
        out.append(_zeros_deflate(extra))
    out.append(zlib.compressobj(9, zlib.DEFLATED, -15).flush())  # the final (empty) block
    return head + b"".join(out)


def deflate_bomb(scale: int = 1) -> bytes:
    """About 0.5 MB that inflates to 512 MiB × scale of zeros."""
    return deflated_dicom(extra=512 * 2**20 * scale)


# --------------------------------------------------------------------------- RLE


def _rle_header(offsets: list[int]) -> bytes:
    return struct.pack("<16I", len(offsets), *offsets, *([0] * (15 - len(offsets))))


def rle_dicom(rows: int = 64, cols: int = 64, segment: bytes | None = None, bits: int = 8) -> bytes:
    """RLE Lossless; by default a conformant segment of replicate runs per byte plane."""
    ds = _dataset(rows, cols, bits=bits)
    n_seg = bits // 8
    if segment is None:
        n = rows * cols
        segment = (b"\x81\x07" * (n // 128)) + (bytes([256 - (n % 128) + 1, 7]) if n % 128 else b"")
        if len(segment) % 2:
            segment += b"\x80"  # no-op run as padding
    offsets, pos = [], 64
    for _ in range(n_seg):
        offsets.append(pos)
        pos += len(segment)
    ds.PixelData = encapsulate([_rle_header(offsets) + segment * n_seg])
    return _file(ds, RLELossless)


def rle_bomb(scale: int = 1) -> bytes:
    """A 64×64 image whose one RLE segment decodes to 128 × 1.5 MB × scale = 192 MB × scale."""
    return rle_dicom(segment=b"\x81\x00" * (750_000 * scale))


def rle_big_grey(side: int = 4096) -> bytes:
    """A valid 16-bit RLE image of side² pixels (a few hundred KB): the float64 grey path's cost."""
    return rle_dicom(side, side, bits=16)


# --------------------------------------------------------------------------- encapsulated frames


def _jpeg(rows: int, cols: int, quality: int = 50) -> bytes:
    buf = BytesIO()
    img = (np.add.outer(np.arange(rows), np.arange(cols)) % 256).astype(np.uint8)
    Image.fromarray(img).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _patch_sof(jpeg: bytes, rows: int, cols: int) -> bytes:
    i = jpeg.index(b"\xff\xc0")
    return jpeg[:i + 5] + struct.pack(">HH", rows, cols) + jpeg[i + 9:]


def jpeg_dicom(rows: int = 64, cols: int = 64, *, frames: list[bytes] | None = None,
               number_of_frames: int | None = None) -> bytes:
    ds = _dataset(rows, cols, frames=number_of_frames)
    ds.PixelData = encapsulate(frames if frames is not None else [_jpeg(rows, cols)])
    ds.PhotometricInterpretation = "MONOCHROME2"
    return _file(ds, JPEGBaseline8Bit)


def jpeg_sof_larger(scale: int = 1) -> bytes:
    """A 64×64 header whose JPEG frame's SOF says 16000×16000 × scale (caps at 65535)."""
    side = min(65535, 16000 * scale)
    return jpeg_dicom(frames=[_patch_sof(_jpeg(64, 64), side, side)])


def jpeg_real_larger(scale: int = 1) -> bytes:
    """A 64×64 header whose JPEG frame really is 4000×4000 × scale (a few hundred KB)."""
    side = 4000 * scale
    buf = BytesIO()
    Image.new("L", (side, side)).save(buf, format="JPEG", quality=10)
    return jpeg_dicom(frames=[buf.getvalue()])


def fragments_excess(scale: int = 1) -> bytes:
    """NumberOfFrames 2 but 20000 × scale fragments, each a whole 64×64 JPEG."""
    one = _jpeg(64, 64, quality=5)
    return jpeg_dicom(frames=[one] * (20000 * scale), number_of_frames=2)


def _j2k(rows: int, cols: int) -> bytes:
    buf = BytesIO()
    Image.fromarray(np.zeros((rows, cols), np.uint8)).save(buf, format="JPEG2000", irreversible=False)
    return buf.getvalue()


def j2k_dicom() -> bytes:
    ds = _dataset(64, 64)
    ds.PixelData = encapsulate([_j2k(64, 64)])
    return _file(ds, JPEG2000Lossless)


def j2k_siz_larger(scale: int = 1) -> bytes:
    """A 64×64 header whose J2K codestream's SIZ says 30000×30000 × scale."""
    cs = _j2k(64, 64)
    side = min(2**31 - 1, 30000 * scale)
    i = cs.index(b"\xff\x51")
    cs = cs[:i + 6] + struct.pack(">II", side, side) + cs[i + 14:]
    ds = _dataset(64, 64)
    ds.PixelData = encapsulate([cs])
    return _file(ds, JPEG2000Lossless)


def _jpeg12_frame() -> bytes:
    """The 12-bit JPEG Extended frame of pydicom's JPEG-lossy.dcm (1024×256, 76:1), as PACS send them: nothing in
    Python encodes 12-bit JPEG. Its scan header holds Ss = Se = 0, a quirk of old encoders that dcmtk accepts."""
    from pydicom.data import get_testdata_file
    from pydicom.encaps import generate_frames

    ds = pydicom.dcmread(get_testdata_file("JPEG-lossy.dcm"))
    return next(generate_frames(ds.PixelData, number_of_frames=1))


def jpeg12_dicom(frame: bytes | None = None) -> bytes:
    ds = _dataset(1024, 256, bits=16)
    ds.BitsStored, ds.HighBit = 12, 11
    ds.PixelData = encapsulate([frame if frame is not None else _jpeg12_frame()])
    return _file(ds, JPEGExtended12Bit)


def jpeg12_truncated() -> bytes:
    """A complete DICOM file whose 12-bit JPEG frame is cut to half its bytes (its end-of-image marker lost): the
    codec decodes what is there and fills the rest with grey, an image that must not be scored."""
    frame = _jpeg12_frame()
    return jpeg12_dicom(frame[:len(frame) // 2])


def jpeg12_corrupt() -> bytes:
    """A 12-bit JPEG frame whose entropy-coded data is noise from 100 bytes into its scan to its end-of-image
    marker."""
    frame = bytearray(_jpeg12_frame())
    start = frame.index(b"\xff\xda") + 100
    end = frame.rindex(b"\xff\xd9")
    frame[start:end] = np.random.default_rng(12).integers(0, 256, end - start, dtype=np.uint8).tobytes()
    return jpeg12_dicom(bytes(frame))


# --------------------------------------------------------------------------- palette LUTs


def palette_dicom(segments: bytes | None = None, entries: int = 256) -> bytes:
    """PALETTE COLOR 64×64 8-bit; plain 16-bit LUTs, or the same segmented data for R, G and B."""
    ds = _dataset(64, 64, photometric="PALETTE COLOR")
    ds.PixelData = (np.arange(64 * 64) % 256).astype(np.uint8).tobytes()
    for c in ("Red", "Green", "Blue"):
        setattr(ds, f"{c}PaletteColorLookupTableDescriptor", [entries, 0, 16])
        if segments is None:
            setattr(ds, f"{c}PaletteColorLookupTableData",
                    (np.arange(entries, dtype="<u2") * 257).tobytes())
        else:
            setattr(ds, f"Segmented{c}PaletteColorLookupTableData", segments)
    return _file(ds, ExplicitVRLittleEndian)


def segmented_lut_valid() -> bytes:
    """A conformant segmented palette: discrete 0, then one linear segment to 65535 over 255 entries."""
    return palette_dicom(struct.pack("<6H", 0, 1, 0, 1, 255, 65535))


def segmented_lut_bomb(n: int = 3700) -> bytes:
    """About 71 KB: `n` linear segments of 65535 entries per colour, ramping 0 → 65535 → 0 → ...
    (242 M entries per colour; as pydicom expands them, a Python list of distinct ints: ~36 bytes each)."""
    ramps = struct.pack("<6H", 1, 65535, 65535, 1, 65535, 0) * (n // 2)
    return palette_dicom(struct.pack("<3H", 0, 1, 0) + ramps)


def segmented_lut_indirect(scale: int = 1) -> bytes:
    """Indirect segments that each replay all earlier segments: exponential expansion."""
    words = [0, 1, 0, 1, 65535, 100]
    for _ in range(24 * scale):
        words += [2, 2 + len(words) // 3, 0, 0]  # replay everything from byte offset 0
    return palette_dicom(struct.pack(f"<{len(words)}H", *words))


# --------------------------------------------------------------------------- sequences


def _sq_item(inner: bytes) -> bytes:
    """An undefined-length item holding `inner`, closed by its delimiter."""
    return b"\xfe\xff\x00\xe0\xff\xff\xff\xff" + inner + b"\xfe\xff\x0d\xe0\x00\x00\x00\x00"


def _sq(tag: int, items: bytes) -> bytes:
    """An undefined-length explicit VR sequence element."""
    return (struct.pack("<HH", tag >> 16, tag & 0xFFFF) + b"SQ\x00\x00\xff\xff\xff\xff" + items
            + b"\xfe\xff\xdd\xe0\x00\x00\x00\x00")


def _with_sequence(seq: bytes) -> bytes:
    """A valid 64×64 file with `seq` inserted as (0009,1001) before the pixel data."""
    ds = _dataset(64, 64)
    ds.PixelData = (np.arange(64 * 64) % 251).astype(np.uint8).tobytes()
    data = _file(ds, ExplicitVRLittleEndian)
    creator = b"HOSTILE "
    private = b"\x09\x00\x10\x00LO" + struct.pack("<H", len(creator)) + creator
    i = data.index(b"\x28\x00\x02\x00")  # (0028,0002) SamplesPerPixel: private group 0009 goes before it
    return data[:i] + private + seq + data[i:]


def deep_sequence(depth: int = 5000) -> bytes:
    inner = b""
    for _ in range(depth):
        inner = _sq(0x00091001, _sq_item(inner))
    return _with_sequence(inner)


def huge_sequence(items: int = 750_000) -> bytes:
    """About 6 MB: one sequence of 750 000 empty defined-length items."""
    items = b"\xfe\xff\x00\xe0\x00\x00\x00\x00" * items
    return _with_sequence(_sq(0x00091001, items))


def many_elements(scale: int = 1) -> bytes:
    """About 6 MB × scale: one sequence item holding 500 000 × scale short private elements."""
    elems = b"".join(struct.pack("<HH", 0x0009, 0x1002) + b"SH\x04\x00ABCD" for _ in range(1))
    return _with_sequence(_sq(0x00091001, _sq_item(elems * (500_000 * scale))))


def nested_sequence_valid() -> bytes:
    """A sequence three deep with a few items: the shape of real functional groups."""
    leaf = struct.pack("<HH", 0x0009, 0x1002) + b"SH\x04\x00ABCD"
    return _with_sequence(_sq(0x00091001, _sq_item(_sq(0x00091001, _sq_item(_sq(0x00091001, _sq_item(leaf)))))
                                          * 3))


# --------------------------------------------------------------------------- PNG


def png_1bit(side: int = 7000, mode: str = "1") -> bytes:
    """A blank low-bit-depth PNG: a few KB for side² pixels (7000² = 49 M, within a 50 M cap)."""
    buf = BytesIO()
    if mode == "P":
        im = Image.new("P", (side, side))
        im.putpalette([0, 0, 0, 255, 255, 255])
        im.save(buf, format="PNG", bits=1, optimize=False)
    elif mode == "LA":
        Image.new("LA", (side, side)).save(buf, format="PNG")
    else:
        Image.new(mode, (side, side)).save(buf, format="PNG")
    return buf.getvalue()


def png_1bit_p(side: int = 7000) -> bytes:
    return png_1bit(side, "P")


HOSTILE = {
    "deflate_bomb": (deflate_bomb, 413),
    "rle_bomb": (rle_bomb, 422),
    "png_1bit_huge": (png_1bit, 413),
    "png_1bit_palette_huge": (png_1bit_p, 413),
    "segmented_lut_bomb": (segmented_lut_bomb, 422),
    "segmented_lut_indirect": (segmented_lut_indirect, 422),
    "fragments_excess": (fragments_excess, 422),
    "jpeg_sof_larger": (jpeg_sof_larger, 422),
    "jpeg_real_larger": (jpeg_real_larger, 422),
    "j2k_siz_larger": (j2k_siz_larger, 422),
    "jpeg12_truncated": (jpeg12_truncated, 422),
    "jpeg12_corrupt": (jpeg12_corrupt, 422),
    "deep_sequence": (deep_sequence, 422),
    "huge_sequence": (huge_sequence, 413),
    "many_elements": (many_elements, 413),
}

CONTROLS = {
    "deflate_bomb": lambda: deflated_dicom(extra=64 * 1024),
    "rle_bomb": rle_dicom,
    "png_1bit_huge": lambda: png_1bit(1000),
    "png_1bit_palette_huge": lambda: png_1bit(1000, "P"),
    "segmented_lut_bomb": segmented_lut_valid,
    "segmented_lut_indirect": segmented_lut_valid,
    "fragments_excess": lambda: jpeg_dicom(frames=[_jpeg(64, 64)] * 2, number_of_frames=2),
    "jpeg_sof_larger": jpeg_dicom,
    "jpeg_real_larger": jpeg_dicom,
    "j2k_siz_larger": lambda: j2k_dicom(),
    "jpeg12_truncated": jpeg12_dicom,
    "jpeg12_corrupt": jpeg12_dicom,
    "deep_sequence": nested_sequence_valid,
    "huge_sequence": nested_sequence_valid,
    "many_elements": nested_sequence_valid,
}

# Valid inputs whose decode cost the fix must bound (they decode, in less memory than before).
def png_palette_noise(side: int = 7000) -> bytes:
    """A 1-bit palette PNG of noise: side² pixels in side²/8 bytes, too random for the ratio guard."""
    bits = np.random.default_rng(0).integers(0, 2, (side, side), dtype=np.uint8)
    im = Image.fromarray(bits, "L").convert("P")
    im.putpalette([0, 0, 0, 255, 255, 255])
    buf = BytesIO()
    im.save(buf, format="PNG", bits=1)
    return buf.getvalue()


HEAVY_VALID = {
    "rle_16bit_4096": rle_big_grey,
    "sequence_just_under_the_element_cap": lambda: huge_sequence(9_900),
    "png_1bit_palette_noise_7000": png_palette_noise,
}


def read(data: bytes) -> Dataset:  # for debugging a builder
    return pydicom.dcmread(BytesIO(data), force=True)


def warning_dicom(secret: str = "S3CR3T!!") -> bytes:
    """An image whose Number of Frames (IS) holds `secret` (8 characters), which pydicom warns and logs
    about, quoting it, when the decoder reads it: a stand-in for a tag value in a log."""
    assert len(secret) == 8
    ds = _dataset(64, 64, frames=12345678)
    ds.PixelData = (np.arange(64 * 64) % 251).astype(np.uint8).tobytes()
    data = _file(ds, ExplicitVRLittleEndian)
    return data.replace(b"IS\x08\x0012345678", b"IS\x08\x00" + secret.encode(), 1)


def corpus() -> dict[str, bytes]:
    """Every hostile class at test scale, by name (for the soak benchmark and the fuzz tests)."""
    return {name: build() for name, (build, _) in HOSTILE.items()}
