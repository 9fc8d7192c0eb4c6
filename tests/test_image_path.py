"""One image path: a file is the same model input in the training folder dataset and in the service.

The awkward files a hospital folder holds (an EXIF-rotated phone JPEG, an RGBA PNG, a 16-bit PNG, a
MONOCHROME1 DICOM, a multi-frame DICOM, a 12-bit JPEG Extended DICOM) go through `--dataset folder` and
through a live `bentoml serve`: the training rows must be exactly what the service's decoder and preprocessing
make of the bytes, and the service's probabilities must be the package's on those training rows.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import httpx
import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

from tafl.errors import DataError
from tafl.imaging import decode_image
from tafl.packaging import load_package
from tafl.training.config import load_config
from tafl.training.data import load_dataset
from tests.conftest import CONFIGS


def _pattern(h: int, w: int, seed: int) -> np.ndarray:
    """An asymmetric picture (a bright corner, a gradient): rotation and alpha visibly change it."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = (x * 255 // max(w - 1, 1)).astype(np.float64)
    img[: h // 3, : w // 4] = 255
    return np.clip(img + rng.normal(0, 8, (h, w)), 0, 255).astype(np.uint8)


def _jpeg_exif_rotated() -> bytes:
    rgb = np.stack([_pattern(30, 48, 1)] * 3, -1)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def _png_rgba() -> bytes:
    g = _pattern(40, 40, 2)
    alpha = np.tile(np.linspace(0, 255, 40).astype(np.uint8), (40, 1)).T
    buf = io.BytesIO()
    Image.fromarray(np.dstack([g, 255 - g, g, alpha]), "RGBA").save(buf, "PNG")
    return buf.getvalue()


def _png_16bit() -> bytes:
    g = _pattern(36, 36, 3).astype(np.uint16) * 40 + 1000  # 1000..11200: not 8-bit, not full range
    buf = io.BytesIO()
    Image.fromarray(g).save(buf, "PNG")  # mode I;16
    return buf.getvalue()


def _dicom(frames: np.ndarray, photometric: str) -> bytes:
    ds = Dataset()
    ds.SOPClassUID, ds.SOPInstanceUID = SecondaryCaptureImageStorage, generate_uid()
    ds.Modality = "OT"
    ds.NumberOfFrames = len(frames)
    ds.Rows, ds.Columns = frames.shape[1:]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.PixelData = frames.astype("<u2").tobytes()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


AWKWARD = {
    "exif.jpg": _jpeg_exif_rotated,
    "rgba.png": _png_rgba,
    "deep.png": _png_16bit,
    "mono1.dcm": lambda: _dicom(_pattern(32, 32, 4)[None].astype(np.uint16) * 16, "MONOCHROME1"),
    "multi.dcm": lambda: _dicom(np.stack([_pattern(24, 24, s) for s in (5, 6, 7)]).astype(np.uint16) * 16,
                                "MONOCHROME2"),
    # 12-bit JPEG Extended (1.2.840.10008.1.2.4.51), as PACS send NM and older CR/DX: 1024×256, lossy 76:1
    "jpeg12.dcm": lambda: Path(get_testdata_file("JPEG-lossy.dcm")).read_bytes(),
}


def _folder(tmp_path, pre, *, fillers: int = 14):
    """A labels CSV over the awkward files and plain PNG fillers (two classes, enough to stratify)."""
    images = tmp_path / "images"
    images.mkdir()
    rows = []
    for i, (name, make) in enumerate(AWKWARD.items()):
        (images / name).write_bytes(make())
        rows.append((name.split(".")[0], "ab"[i % 2]))
    for i in range(fillers):
        buf = io.BytesIO()
        Image.fromarray(_pattern(20, 20, 100 + i)).save(buf, "PNG")
        (images / f"fill{i}.png").write_bytes(buf.getvalue())
        rows.append((f"fill{i}", "ab"[i % 2]))
    with open(tmp_path / "labels.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["image_id", "label"])
        w.writerows(rows)
    return load_config(CONFIGS / "smoke.yaml", {"dataset": "folder", "data_root": str(tmp_path),
                                                 "labels": "labels.csv", "img_size": pre.size,
                                                 "channels": pre.channels, "cache_dir": "",
                                                 "val_fraction": 0.2, "test_fraction": 0.2})


def _training_rows(ds) -> dict[str, np.ndarray]:
    out = {}
    for split in (ds.train, ds.val, ds.test):
        for i, sid in enumerate(split.ids):
            out[str(sid)] = split.images[i]
    return out


def test_training_rows_are_the_service_decoders_model_inputs(tmp_path, gtafl_pkg):
    pre = load_package(gtafl_pkg).preprocess
    ds = load_dataset(_folder(tmp_path, pre))
    rows = _training_rows(ds)
    assert {"multi#0", "multi#1", "multi#2"} <= rows.keys() and "multi" not in rows  # one sample per frame
    splits = {s: {str(i) for i in getattr(ds, s).ids} for s in ("train", "val", "test")}
    assert sum(any(k.startswith("multi#") for k in ids) for ids in splits.values()) == 1  # frames stay together
    for name in AWKWARD:
        served = [pre.to_uint8(f) for f in decode_image((tmp_path / "images" / name).read_bytes()).frames]
        stem = name.split(".")[0]
        keys = [stem] if len(served) == 1 else [f"{stem}#{k}" for k in range(len(served))]
        for key, want in zip(keys, served):
            np.testing.assert_array_equal(rows[key], want, err_msg=name)
    # the files are awkward for real: a reader that ignored EXIF or alpha would give other inputs
    raw = Image.open(tmp_path / "images" / "exif.jpg")
    assert raw.size == (48, 30) and decode_image((tmp_path / "images" / "exif.jpg").read_bytes()).frames[0].shape[:2] == (48, 30)
    dropped_alpha = np.asarray(Image.open(tmp_path / "images" / "rgba.png").convert("RGB").convert("L")
                               .resize((pre.size, pre.size), Image.Resampling.BILINEAR))
    assert np.abs(rows["rgba"][..., 0].astype(int) - dropped_alpha).max() > 30


def test_refused_multiframe_and_unreadable_files_name_the_file(tmp_path, gtafl_pkg):
    pre = load_package(gtafl_pkg).preprocess
    cfg = _folder(tmp_path, pre)
    cfg.folder_frames = "refuse"
    with pytest.raises(DataError, match=r"multi\.dcm is a multi-frame image \(3 frames\)"):
        load_dataset(cfg)
    cfg.folder_frames = "each"
    (tmp_path / "images" / "fill3.png").write_bytes(b"not a picture at all")
    with pytest.raises(DataError, match=r"cannot read image .*fill3\.png: the upload is a text file"):
        load_dataset(cfg)


@pytest.mark.slow
def test_the_service_scores_a_file_as_the_model_scores_its_training_row(tmp_path, server, gtafl_pkg):
    pkg = load_package(gtafl_pkg)
    rows = _training_rows(load_dataset(_folder(tmp_path, pkg.preprocess)))
    session = pkg.session(["CPUExecutionProvider"])
    for name in AWKWARD:
        data = (tmp_path / "images" / name).read_bytes()
        r = httpx.post(f"{server.url}/predict", files={"file": (name, data, "application/octet-stream")},
                       data={"model": "derm-gtafl"}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        frames = body.get("frames") or [body]
        stem = name.split(".")[0]
        keys = [stem] if len(frames) == 1 else [f"{stem}#{k}" for k in range(len(frames))]
        want = pkg.run(session, pkg.preprocess.normalize(np.stack([rows[k] for k in keys])))
        for f, probs in zip(frames, want["probs"]):
            got = np.array([f["probabilities"][c] for c in pkg.class_names])
            np.testing.assert_allclose(got, probs, atol=1e-5, err_msg=name)


def test_a_12_bit_jpeg_dicom_becomes_a_prediction(gtafl_pkg):
    """Decoded, preprocessed and run through the package: the probabilities of a real image (not refused, and not
    a blank: the network input varies)."""
    pkg = load_package(gtafl_pkg)
    decoded = decode_image(AWKWARD["jpeg12.dcm"]())
    assert decoded.info["transfer_syntax"] == "JPEG Extended (Process 2 and 4)" and len(decoded.frames) == 1
    x = pkg.preprocess.normalize(np.stack([pkg.preprocess.to_uint8(decoded.frames[0])]))
    assert x.shape == (1, pkg.preprocess.channels, pkg.preprocess.size, pkg.preprocess.size) and x.std() > 0.1
    probs = pkg.run(pkg.session(["CPUExecutionProvider"]), x)["probs"]
    assert probs.shape == (1, len(pkg.class_names)) and abs(float(probs.sum()) - 1) < 1e-4


def test_dicom_pixels_reach_the_training_row_inverted_for_monochrome1(tmp_path, gtafl_pkg):
    pre = load_package(gtafl_pkg).preprocess
    ds = load_dataset(_folder(tmp_path, pre))
    mono1 = _training_rows(ds)["mono1"][..., 0].astype(int)
    src = pydicom.dcmread(tmp_path / "images" / "mono1.dcm").pixel_array.astype(float)
    plain = np.asarray(Image.fromarray(((src - src.min()) * 255 / np.ptp(src)).astype(np.uint8))
                       .resize((pre.size, pre.size), Image.Resampling.BILINEAR)).astype(int)
    # MONOCHROME1: high values are dark, so the row is the inverse of the plain stretch
    assert np.abs(mono1 - (255 - plain)).mean() < 3 and np.abs(mono1 - plain).mean() > 50


def test_an_oversized_training_file_is_refused_before_it_is_read(tmp_path):
    from tafl.imaging import decode_file

    big = tmp_path / "big.png"
    big.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(2 * 2**20))
    with pytest.raises(DataError, match=r"big\.png: the file is 2\.0 MiB, over the 1 MiB limit"):
        decode_file(big, max_bytes=2**20)
