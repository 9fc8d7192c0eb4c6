"""Upload decoding: every DICOM in the corpora decodes or fails with a 4xx, pixels render correctly
(windowing, MONOCHROME1, YBR, palette, byte order), bad uploads get the right status, and no
patient data leaks into `info` or an error message."""

from __future__ import annotations

import asyncio
import io
import shutil
import struct
import subprocess
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pydicom
import pydicom.data
import pytest
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.pixels import get_decoder
from pydicom.uid import ExplicitVRLittleEndian, JPEGExtended12Bit, SecondaryCaptureImageStorage, generate_uid

from tafl.errors import ServiceError, UnprocessableImage
from tafl.imaging import DecodedImage, decode_image
from tafl.imaging.pool import DecodePool
from tests import hostile_corpus as hc
from tests.conftest import SHARED_DATA, shared

SHARED_DICOM = SHARED_DATA / "dicom"
# pydicom's bundled test files: what get_testdata_files("*.dcm") returns locally, without its
# attempt to download the external ones (which stalls for many seconds offline).
PYDICOM_FILES = Path(pydicom.data.__file__).parent / "test_files"

# Files that must decode, with their frame counts ("shared/..." need ../shared/data/dicom).
MUST_DECODE = {
    "pydicom/CT_small.dcm": 1, "pydicom/MR_small.dcm": 1, "shared/liver.dcm": 3, "shared/emri_small.dcm": 10,
    "shared/emri_small_jpeg_2k_lossless.dcm": 10, "shared/emri_small_jpeg_ls_lossless.dcm": 10,
    "shared/emri_small_RLE.dcm": 10, "shared/emri_small_big_endian.dcm": 10, "shared/JPEG-LL.dcm": 1,
    "shared/SC_rgb.dcm": 1, "shared/SC_rgb_2frame.dcm": 2, "shared/SC_ybr_full_uncompressed.dcm": 1,
    "shared/US1_J2KR.dcm": 1, "shared/MR2_J2KI.dcm": 1, "shared/OBXXXX1A_rle_2frame.dcm": 2,
    "shared/color-pl.dcm": 1, "shared/OT-PAL-8-face.dcm": 1,  # the last one has no preamble / 'DICM'
    "pydicom/JPEG-lossy.dcm": 1,  # 12-bit JPEG Extended (1.2.840.10008.1.2.4.51), whose scan header has Se = 0
}
# Files that must fail, with the status they must fail with.
MUST_FAIL = {
    "pydicom/rtplan.dcm": 422, "pydicom/test-SR.dcm": 422, "pydicom/MR_truncated.dcm": 422,
    "pydicom/SC_rgb_small_odd.dcm": 422, "shared/liver_deflate.dcm": 415,
    "shared/emri_small_jpeg_2k_lossless_too_short.dcm": 422,
}
OUTCOMES: dict[str, str] = {}


def _corpus() -> list:
    params = [pytest.param(p, id=f"pydicom/{p.name}") for p in sorted(PYDICOM_FILES.glob("*.dcm"))]
    if SHARED_DICOM.is_dir():
        params += [pytest.param(p, id=f"shared/{p.name}") for p in sorted(SHARED_DICOM.glob("*.dcm"))]
    else:
        params.append(pytest.param(None, id="shared-absent"))
    return params


def _path(folder: str, name: str) -> Path:
    return (PYDICOM_FILES if folder == "pydicom" else shared("dicom")) / name


def _decode_file(folder: str, name: str) -> DecodedImage:
    return decode_image(_path(folder, name).read_bytes())


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    if OUTCOMES:
        print(f"\n{len(OUTCOMES)} DICOM files: {sum(v == 'OK' for v in OUTCOMES.values())} decoded")
        for name, outcome in sorted(OUTCOMES.items()):
            if outcome != "OK":
                print(f"  {name:<58} {outcome}")


@pytest.mark.parametrize("path", _corpus())
def test_every_corpus_file_decodes_or_gets_a_4xx(path, request):
    if path is None:
        shared("dicom")  # skips: ../shared/data is absent
    key = request.node.callspec.id
    try:
        result = decode_image(path.read_bytes())
    except ServiceError as exc:
        OUTCOMES[key] = f"{exc.status} {exc.message}"
        assert 400 <= exc.status <= 499 and exc.message.strip()
        assert key not in MUST_DECODE, f"{key} must decode but got {exc.status}: {exc.message}"
        if key in MUST_FAIL:
            assert exc.status == MUST_FAIL[key]
        return
    OUTCOMES[key] = "OK"
    assert key not in MUST_FAIL
    assert result.kind == "dicom" and result.frames
    for frame in result.frames:
        assert frame.dtype == np.uint8 and frame.ndim in (2, 3)
        assert min(frame.shape[:2]) >= 8
        if frame.ndim == 3:
            assert frame.shape[2] == 3
    with warnings.catch_warnings():  # pydicom grumbles about some files' encodings
        warnings.simplefilter("ignore")
        ds = pydicom.dcmread(path, force=True, stop_before_pixels=True)
    assert len(result.frames) == int(ds.get("NumberOfFrames") or 1) == result.info["frames"]
    if key in MUST_DECODE:
        assert len(result.frames) == MUST_DECODE[key]
        assert any(f.max() > f.min() for f in result.frames)  # an image, not a blank


@pytest.mark.parametrize("group", [
    ["pydicom/MR_small.dcm", "pydicom/MR_small_expb.dcm", "pydicom/MR_small_bigendian.dcm",
     "pydicom/MR_small_implicit.dcm", "pydicom/MR_small_RLE.dcm", "pydicom/MR_small_jp2klossless.dcm",
     "pydicom/MR_small_jpeg_ls_lossless.dcm"],
    ["pydicom/SC_rgb_rle.dcm", "pydicom/SC_rgb_rle_16bit.dcm", "pydicom/SC_rgb_rle_32bit.dcm",
     "pydicom/SC_rgb_jpeg_gdcm.dcm"],
    ["shared/emri_small.dcm", "shared/emri_small_big_endian.dcm", "shared/emri_small_RLE.dcm",
     "shared/emri_small_jpeg_2k_lossless.dcm", "shared/emri_small_jpeg_ls_lossless.dcm"],
    ["shared/liver.dcm", "shared/liver_expb.dcm", "shared/liver_j2k.dcm"],
    ["shared/OBXXXX1A.dcm", "shared/OBXXXX1A_expb.dcm", "shared/OBXXXX1A_rle.dcm"],
    ["shared/OBXXXX1A_2frame.dcm", "shared/OBXXXX1A_expb_2frame.dcm", "shared/OBXXXX1A_rle_2frame.dcm"],
    ["shared/gdcm-US-ALOKA-16.dcm", "shared/gdcm-US-ALOKA-16_big.dcm"],
    ["shared/SC_rgb.dcm", "shared/SC_rgb_expb.dcm", "shared/SC_rgb_16bit.dcm", "shared/SC_rgb_32bit.dcm",
     "shared/SC_rgb_expb_32bit.dcm", "shared/SC_rgb_gdcm2k_uncompressed.dcm"],
], ids=lambda g: g[0].split("/")[1])
def test_lossless_encodings_of_one_image_decode_identically(group):
    """Byte order, RLE, JPEG-LS/2000 lossless and bit depth must not change the rendered pixels
    (a big-endian palette once came out nearly black)."""
    ref = _decode_file(*group[0].split("/")).frames
    for key in group[1:]:
        other = _decode_file(*key.split("/")).frames
        assert len(other) == len(ref)
        for a, b in zip(ref, other):
            assert a.shape == b.shape
            assert np.abs(a.astype(int) - b.astype(int)).max() <= 1, key


def test_ct_small_uses_the_full_range():
    result = _decode_file("pydicom", "CT_small.dcm")
    frame = result.frames[0]
    assert frame.shape == (128, 128)
    assert frame.min() <= 5 and frame.max() >= 250 and len(np.unique(frame)) > 50
    assert result.info["modality"] == "CT" and result.info["windowing"] == "min-max"


def test_window_tags_and_voi_lut_are_recorded():
    assert _decode_file("pydicom", "MR_small.dcm").info["windowing"] == "window centre/width"
    assert _decode_file("shared", "vlut_04.dcm").info["windowing"] == "VOI LUT"


# --------------------------------------------------------------------------- synthetic DICOM


def _dicom(pixels: np.ndarray | None = None, *, preamble: bool = True, **tags) -> bytes:
    """A small 16-bit grey DICOM (with patient data, for the privacy checks); `tags` override."""
    ds = Dataset()
    ds.SOPClassUID, ds.SOPInstanceUID = SecondaryCaptureImageStorage, generate_uid()
    ds.Modality, ds.PatientName, ds.PatientID, ds.PatientBirthDate = "OT", "Doe^Jane", "PID-998877", "19700101"
    if pixels is not None:
        ds.Rows, ds.Columns = pixels.shape
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
        ds.PixelData = pixels.astype("<u2").tobytes()
    for key, value in tags.items():
        if value is None:
            delattr(ds, key)
        else:
            setattr(ds, key, value)
    buf = io.BytesIO()
    if preamble:
        ds.file_meta = FileMetaDataset()
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.save_as(buf, enforce_file_format=True)
    else:  # a bare data set: no preamble, no 'DICM', no file meta
        ds.save_as(buf, implicit_vr=True, little_endian=True, enforce_file_format=False)
    return buf.getvalue()


GRADIENT = np.arange(256, dtype=np.uint16).reshape(16, 16) * 16  # 0..4080, 12 bits


def _assert_private(exc_or_info) -> None:
    text = exc_or_info.value.message if hasattr(exc_or_info, "value") else repr(exc_or_info)
    for value in ("Doe", "Jane", "PID-998877", "19700101"):
        assert value not in text


def test_monochrome1_is_the_inverse_of_monochrome2():
    mono2 = decode_image(_dicom(GRADIENT)).frames[0].astype(int)
    mono1 = decode_image(_dicom(GRADIENT, PhotometricInterpretation="MONOCHROME1")).frames[0].astype(int)
    assert mono2[0, 0] == 0 and mono2[-1, -1] == 255
    assert np.abs(mono1 + mono2 - 255).max() <= 1


def test_window_centre_width_is_applied():
    result = decode_image(_dicom(GRADIENT, WindowCenter=2048, WindowWidth=1024))
    frame = result.frames[0].ravel()
    assert result.info["windowing"] == "window centre/width"
    # values below 1536 saturate to black, above 2560 to white; in between a linear ramp
    assert np.all(frame[GRADIENT.ravel() < 1530] == 0) and np.all(frame[GRADIENT.ravel() > 2570] == 255)
    assert 0 < frame[GRADIENT.ravel() == 2048][0] < 255


def test_bare_data_set_without_preamble_decodes():
    data = _dicom(GRADIENT, preamble=False)
    assert data[128:132] != b"DICM"
    result = decode_image(data)
    assert result.frames[0].shape == (16, 16) and result.info["transfer_syntax"] == "Implicit VR Little Endian"
    _assert_private(result.info)


def test_dicom_without_pixel_data_is_422_naming_the_sop_class():
    rtplan = _dicom(None, SOPClassUID="1.2.840.10008.5.1.4.1.1.481.5", Modality="RTPLAN")
    with pytest.raises(ServiceError) as exc:
        decode_image(rtplan)
    assert exc.value.status == 422 and "no image" in exc.value.message and "RT Plan Storage" in exc.value.message
    _assert_private(exc)


def test_huge_dicom_header_is_413_before_decoding():
    with pytest.raises(ServiceError) as exc:
        decode_image(_dicom(GRADIENT, Rows=60000, Columns=60000))
    assert exc.value.status == 413
    with pytest.raises(ServiceError) as exc:
        decode_image(_dicom(GRADIENT, NumberOfFrames=65))
    assert exc.value.status == 413 and "frames" in exc.value.message


# --------------------------------------------------------------------------- colour


def _ybr_variants() -> list:
    names = ["pydicom/SC_ybr_full_422_uncompressed.dcm", "pydicom/SC_rgb_jpeg_dcmtk.dcm",
             "pydicom/SC_rgb_jpeg_lossy_gdcm.dcm"]
    names += [f"pydicom/{p.name}" for p in sorted(PYDICOM_FILES.glob("SC_rgb_dcmtk_*.dcm"))]
    if SHARED_DICOM.is_dir():
        names += ["shared/SC_ybr_full_uncompressed.dcm"]
        names += [f"shared/{p.name}" for p in sorted(SHARED_DICOM.glob("SC_rgb_dcmtk_*.dcm"))]
    return names


@pytest.mark.parametrize("key", _ybr_variants())
def test_ybr_and_jpeg_variants_look_like_the_rgb_original(key):
    ref = _decode_file("pydicom", "SC_rgb_rle.dcm").frames[0].astype(int)  # lossless RGB original
    frame = _decode_file(*key.split("/")).frames[0]
    assert frame.shape == (100, 100, 3)
    assert np.abs(frame.astype(int) - ref).mean() < 10


def test_palette_colour_becomes_rgb():
    frame = _decode_file("shared", "OT-PAL-8-face.dcm").frames[0]
    assert frame.shape == (480, 640, 3) and frame.max() > 200
    assert np.abs(frame[..., 0].astype(int) - frame[..., 2]).mean() > 1  # really colour, not grey


# --------------------------------------------------------------------------- bad uploads


NOISE = np.random.default_rng(1).integers(0, 256, (64, 64), dtype=np.uint8)  # does not compress


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _png(im: Image.Image) -> bytes:
    return _encode(im, "PNG")


def _png_declaring(width: int, height: int) -> bytes:
    """A real 8×8 PNG whose IHDR claims width×height (CRC fixed so only the size is a lie)."""
    data = bytearray(_png(Image.new("L", (8, 8))))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _jpeg_declaring(width: int, height: int) -> bytes:
    """A real 16×16 JPEG whose SOF0 header claims width×height."""
    data = bytearray(_encode(Image.fromarray(NOISE[:16, :16]), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.mark.parametrize("data,status,words", [
    (b"", 400, "empty"),
    (b"hello world", 415, "text file"),
    (b"GIF89a\x10\x00\x10\x00\x80\x00\x00" + bytes(200), 415, "GIF"),
    (b"%PDF-1.7\n" + bytes(300), 415, "PDF"),
    (_png(Image.fromarray(NOISE))[:100], 422, "PNG file is truncated"),
    (_png(Image.new("L", (1, 1))), 422, "1×1"),
    (_png(Image.new("RGB", (40, 5))), 422, "at least 8×8"),
    (_png_declaring(20000, 20000), 413, "pixel"),
    (_png_declaring(8000, 8000), 413, "8000×8000"),
    (_jpeg_declaring(9000, 9000), 413, "9000×9000"),
    (_encode(Image.fromarray(NOISE), "JPEG")[:300], 422, "JPEG file is truncated"),
    (bytes(128) + b"DICM" + bytes(range(256)) * 4, 422, "DICOM"),
], ids=["empty", "text", "gif", "pdf", "truncated-png", "png-1x1", "png-40x5", "png-bomb-400mp", "png-64mp",
        "jpeg-81mp", "truncated-jpeg", "dicm-garbage"])
def test_bad_uploads_get_the_right_status(data, status, words):
    start = time.perf_counter()
    with pytest.raises(ServiceError) as exc:
        decode_image(data)
    assert exc.value.status == status and words in exc.value.message
    assert "DICOM, PNG or JPEG" in exc.value.message or status != 415
    assert time.perf_counter() - start < 1.0  # size limits are checked before any pixel is decoded


def test_payload_over_max_bytes_is_413():
    with pytest.raises(ServiceError) as exc:
        decode_image(_png(Image.fromarray(NOISE)), max_bytes=100)
    assert exc.value.status == 413


def test_truncated_dicom_is_422_without_patient_data():
    path = PYDICOM_FILES / "CT_small.dcm"
    ds = pydicom.dcmread(path)
    name, pid = str(ds.PatientName), str(ds.PatientID)
    assert name and pid
    with pytest.raises(ServiceError) as exc:
        decode_image(path.read_bytes()[:2000])
    assert exc.value.status == 422 and "DICOM" in exc.value.message
    assert name not in exc.value.message and pid not in exc.value.message
    result = decode_image(path.read_bytes())
    assert name not in repr(result.info) and pid not in repr(result.info)
    assert set(result.info) <= {"modality", "photometric", "bits_allocated", "bits_stored", "transfer_syntax",
                                "frames", "sop_class", "windowing"}


@pytest.mark.parametrize("cut", [4, 131, 140, 400, 1000, 3000, -500, -1500])  # the last 138 bytes are padding
def test_any_truncation_of_a_dicom_is_a_4xx(cut):
    data = (PYDICOM_FILES / "MR_small.dcm").read_bytes()[:cut]
    with pytest.raises(ServiceError) as exc:
        decode_image(data)
    assert 400 <= exc.value.status <= 499


def test_synthetic_errors_never_quote_patient_data():
    for data in (_dicom(GRADIENT)[:700], _dicom(GRADIENT, Rows=4, Columns=4),
                 _dicom(GRADIENT, BitsAllocated=32, BitsStored=32, HighBit=31)):  # half the pixel data
        with pytest.raises(ServiceError) as exc:
            decode_image(data)
        assert exc.value.status == 422
        _assert_private(exc)
    _assert_private(decode_image(_dicom(GRADIENT)).info)


# --------------------------------------------------------------------------- PNG / JPEG


def test_png_and_jpeg_modes():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
    grey = rng.integers(0, 256, (24, 32), dtype=np.uint8)

    jpeg = decode_image(_encode(Image.fromarray(rgb), "JPEG", quality=95))
    assert jpeg.kind == "jpeg" and jpeg.frames[0].shape == (24, 32, 3)

    png = decode_image(_encode(Image.fromarray(grey), "PNG"))
    assert png.kind == "png" and np.array_equal(png.frames[0], grey)  # lossless, untouched

    rgba = np.dstack([rgb, np.full((24, 32), 255, np.uint8)])
    rgba[:, :16, 3] = 0  # left half transparent -> black
    out = decode_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG")).frames[0]
    assert out.shape == (24, 32, 3) and out[:, :16].max() == 0 and np.array_equal(out[:, 16:], rgb[:, 16:])

    pal = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    out = decode_image(_encode(pal, "PNG")).frames[0]
    assert out.shape == (24, 32, 3) and np.array_equal(out, np.asarray(pal.convert("RGB")))

    deep = (np.arange(24 * 32, dtype=np.uint16).reshape(24, 32) * 80)
    out = decode_image(_encode(Image.fromarray(deep), "PNG")).frames[0]  # mode I;16
    assert out.dtype == np.uint8 and out.shape == (24, 32) and out.min() == 0 and out.max() == 255

    out = decode_image(_encode(Image.fromarray(grey).convert("1"), "PNG")).frames[0]
    assert out.shape == (24, 32) and set(np.unique(out)) <= {0, 255}


def test_jpeg_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    data = _encode(Image.new("RGB", (40, 20), (200, 10, 10)), "JPEG", exif=exif)
    result = decode_image(data)
    assert result.frames[0].shape == (40, 20, 3)  # H and W swapped
    assert result.info["exif_orientation"] == 6


def _pixel_data_end(data: bytes) -> tuple[int, bool]:
    """The offset just after a file's pixel data element, and whether it is encapsulated."""
    ds = pydicom.dcmread(io.BytesIO(data))
    at = data.rfind(b"\xe0\x7f\x10\x00")
    assert data[at + 4:at + 6] in (b"OB", b"OW"), "the test files are explicit VR little endian"
    if ds["PixelData"].is_undefined_length:
        return len(data), True  # the fragments and their delimiter end the file
    return at + 12 + int.from_bytes(data[at + 8:at + 12], "little"), False


@pytest.mark.parametrize("name", ["CT_small.dcm", "MR_small.dcm", "JPEG2000.dcm", "SC_rgb_rle.dcm"])
def test_a_truncated_dicom_is_422_saying_it_is_truncated(name):
    """Issue 32: a DICOM cut short anywhere before the end of its pixel data (in its header, mid-element, at
    an element boundary, inside a sequence, in its pixel data) says it is truncated, not that it 'holds no
    image'; one cut only in the padding after its pixels still holds its whole image."""
    data = _path("pydicom", name).read_bytes()
    pixel_end, encapsulated = _pixel_data_end(data)
    pixel_start = data.rfind(b"\xe0\x7f\x10\x00")
    cuts = sorted({132, 133, 140, 200, 300, 400, 700, pixel_start, pixel_start + 5, pixel_start + 13,
                   *np.linspace(132, pixel_end - 1, 40).astype(int).tolist(), pixel_end - 1})
    cuts = [c for c in cuts if 132 <= c < pixel_end]
    for cut in cuts:
        with pytest.raises(ServiceError) as exc:
            decode_image(data[:cut])
        msg = exc.value.message
        assert exc.value.status == 422, (cut, msg)
        assert msg.startswith("the DICOM file is truncated"), (cut, msg)
        if cut >= pixel_start + 12 and not encapsulated:  # the pixel data's own header is complete
            want = pixel_end - pixel_start - 12
            assert f"its pixel data holds {cut - pixel_start - 12:,} of {want:,} bytes" in msg, (cut, msg)
        if cut > pixel_start + 12 and encapsulated:
            assert "compressed pixel data ends" in msg, (cut, msg)
        _assert_private(exc)
    for cut in range(pixel_end, len(data)):  # CT_small: trailing padding after its pixels
        try:  # the image is whole: it decodes, unless the cut leaves an element header pydicom cannot read
            assert decode_image(data[:cut]).frames[0].size > 0
        except ServiceError as exc:
            assert exc.status == 422 and exc.message.startswith("the DICOM file is truncated: it ends inside"), \
                (cut, exc.message)


def test_a_transfer_syntax_is_named_the_same_whatever_the_process_imported_before():
    """pynetdicom adds newer UIDs to pydicom's table when imported; a message must not depend on that (a Ray
    worker and the driver gave different 415 texts for the same file)."""
    import subprocess
    import sys

    code = ("import sys; from tafl.imaging.decode import _uid_name; "
            "print(_uid_name('1.2.840.10008.1.2.8.1'))")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    import pynetdicom  # noqa: F401  - as in a process that runs the listener
    from tafl.imaging.decode import _uid_name

    assert fresh == _uid_name("1.2.840.10008.1.2.8.1") == "Deflated Image Frame Compression"


# --------------------------------------------------------------------------- 12-bit JPEG Extended (issue 51, item 6)


def _raw_12_bit(data: bytes) -> np.ndarray:
    """The stored 12-bit values of a JPEG Extended file as tafl's decoder plugin gives them (before the display
    pipeline, which a min-max stretch would let hide a wrong decode)."""
    ds = pydicom.dcmread(io.BytesIO(data))
    return get_decoder(JPEGExtended12Bit).as_array(ds, decoding_plugin="tafl")[0]


@pytest.mark.skipif(shutil.which("dcmdjpeg") is None, reason="needs dcmtk's dcmdjpeg (Debian package dcmtk)")
def test_12_bit_jpeg_extended_decodes_as_dcmtk_does(tmp_path):
    """dcmtk's dcmdjpeg (IJG's 12-bit codec) is the reference PACS and viewers agree with. libjpeg's and IJG's
    inverse DCTs round differently, so a lossy decode may differ by 1 (in 1.4% of this image's pixels), never
    more; the rendered frames then differ by at most 1 grey level."""
    src = _path("pydicom", "JPEG-lossy.dcm")
    ref_path = tmp_path / "dcmdjpeg.dcm"
    subprocess.run(["dcmdjpeg", str(src), str(ref_path)], check=True, capture_output=True, timeout=60)
    ref = pydicom.dcmread(ref_path)
    assert ref.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian and ref.BitsStored == 12
    raw = _raw_12_bit(src.read_bytes())
    assert raw.dtype == np.uint16 and raw.shape == ref.pixel_array.shape == (1024, 256)
    diff = np.abs(raw.astype(int) - ref.pixel_array.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.05, (diff.max(), (diff > 0).mean())
    assert raw.max() > 200  # 12-bit values, not a grey fill: this image's are 0..264
    ours, theirs = decode_image(src.read_bytes()), decode_image(ref_path.read_bytes())
    assert ours.info["transfer_syntax"] == "JPEG Extended (Process 2 and 4)" and ours.info["bits_stored"] == 12
    assert np.abs(ours.frames[0].astype(int) - theirs.frames[0].astype(int)).max() <= 1


def test_12_bit_scan_header_repair_is_what_a_conformant_header_decodes_to():
    """Old encoders wrote all zeroes where a sequential scan header says Ss = 0, Se = 63 (IJG and dcmtk read
    them as 0..63, libjpeg refuses them): the repaired frame decodes as the same frame with a conformant header,
    and a scan header wrong in any other way is still refused."""
    frame = bytearray(hc._jpeg12_frame())
    sos = frame.index(b"\xff\xda")
    params = sos + 5 + 2 * frame[sos + 4]  # Ss, Se, Ah/Al after the component selectors
    assert frame[params:params + 3] == b"\x00\x00\x00"  # the quirk, as sent
    quirky = _raw_12_bit(hc.jpeg12_dicom(bytes(frame)))
    frame[params + 1] = 63
    assert np.array_equal(quirky, _raw_12_bit(hc.jpeg12_dicom(bytes(frame))))
    frame[params] = 1  # Ss = 1: a progressive scan's header in a sequential frame, not the zeroes quirk
    with pytest.raises(UnprocessableImage, match="could not be decoded"):
        decode_image(hc.jpeg12_dicom(bytes(frame)))


def test_12_bit_jpeg_decodes_in_the_decoder_pool_under_its_deadline():
    """The service sends it to the same decoder processes as every compressed DICOM, where the same deadline
    holds: the frames are the in-process ones, and a deadline shorter than the decode is its 422."""
    from tafl.serving.decoding import needs_codec

    data = _path("pydicom", "JPEG-lossy.dcm").read_bytes()
    assert needs_codec(data)
    want = decode_image(data)
    pool = DecodePool(1, deadline=60)
    try:
        pool.warm()
        got = asyncio.run(pool.decode(data))
        assert got.info == want.info and np.array_equal(got.frames[0], want.frames[0])
        pool.deadline = 1e-4
        with pytest.raises(UnprocessableImage, match="took longer than"):
            asyncio.run(pool.decode(data))
    finally:
        pool.close()
