"""Admission limits and safe answers of a real `bentoml serve` (issue 15 items 2 and 5): the request-wide
frame and pixel caps (also across /predict/batch), the batcher's max batch for oversized submissions,
BentoML's max_concurrency (429, health exempt), a client that disconnects mid-upload (no 500, no traceback),
NaN in a package's stored metrics and non-Latin model and class names (no 500), and the OpenAPI document."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import socket
import time
from urllib.parse import unquote

import httpx
import numpy as np
import pydicom
import pytest

from tests.conftest import digit_png

pytestmark = pytest.mark.slow

MODEL = "derm-皮肤"
CLASS0 = "Mélanome / 黑色素瘤"


@pytest.fixture(scope="module")
def odd_pkg(gtafl_pkg, tmp_path_factory):
    """The smoke GTAFL package renamed with non-Latin names and a NaN among its stored metrics."""
    from tafl.packaging.package import SUMS, load_package, write_checksums

    folder = tmp_path_factory.mktemp("odd") / "pkg"
    shutil.copytree(gtafl_pkg, folder)
    meta = json.loads((folder / "metadata.json").read_text())
    meta["name"] = MODEL
    meta["class_names"][0] = CLASS0
    meta["metrics"] = {**(meta.get("metrics") or {}), "nan_probe": float("nan"), "inf_probe": float("inf")}
    (folder / "metadata.json").write_text(json.dumps(meta))  # json writes NaN / Infinity
    names = [line.split("  ", 1)[1] for line in (folder / SUMS).read_text().splitlines() if line.strip()]
    write_checksums(folder, names)
    load_package(folder)
    return folder


@pytest.fixture(scope="module")
def tight(odd_pkg, tmp_path_factory):
    from tafl.serving.launch import ServerProcess

    base = tmp_path_factory.mktemp("svc_tight")
    env = {"BENTOML_HOME": str(base / "home"), "TAFL_AUDIT_LOG": str(base / "audit.jsonl"),
           "TAFL_MAX_REQUEST_FRAMES": "6", "TAFL_MAX_BATCH": "4", "TAFL_MAX_CONCURRENCY": "2",
           "TAFL_MODEL_LANES": "2", "TAFL_WORKERS": "1"}  # one worker: /models shows the batches it answered
    with ServerProcess([str(odd_pkg)], env=env, log_path=base / "service.log") as srv:
        srv.audit, srv.log = base / "audit.jsonl", base / "service.log"
        yield srv


def _files(n: int) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("file", (f"{i}.png", digit_png(i), "image/png")) for i in range(n)]


def _multiframe_dicom(frames: int) -> bytes:
    ds = pydicom.Dataset()
    ds.file_meta = pydicom.dataset.FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = pydicom.uid.SecondaryCaptureImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
    ds.SOPClassUID, ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPClassUID, ds.file_meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.Rows, ds.Columns, ds.NumberOfFrames = "OT", 32, 32, frames
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = np.random.default_rng(0).integers(0, 255, (frames, 32, 32), np.uint8).tobytes()
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


def test_the_request_wide_frame_cap_counts_every_file_of_a_batch(tight):
    ok = httpx.post(f"{tight.url}/predict/batch", files=_files(6), timeout=60)
    assert ok.status_code == 200 and len(ok.json()["results"]) == 6
    over = httpx.post(f"{tight.url}/predict/batch", files=_files(7), timeout=60)
    assert over.status_code == 413, over.text
    assert "more than 6 frames" in over.json()["error"]["message"]
    # frames, not files: a 3-frame DICOM and four PNGs are 7 frames
    mixed = [("file", ("mf.dcm", _multiframe_dicom(3), "application/dicom"))] + _files(4)
    r = httpx.post(f"{tight.url}/predict/batch", files=mixed, timeout=60)
    assert r.status_code == 413, r.text
    one = httpx.post(f"{tight.url}/predict", files={"file": ("mf.dcm", _multiframe_dicom(7), "application/dicom")},
                     timeout=60)
    assert one.status_code == 413 and "7 frames" in one.json()["error"]["message"]


def test_an_oversized_batch_is_split_to_the_max_batch_and_answered_in_order(tight, odd_pkg):
    from tafl.imaging import decode_image
    from tafl.packaging.package import load_package

    r = httpx.post(f"{tight.url}/predict/batch", files=_files(6), timeout=60)
    assert r.status_code == 200
    labels = [item["label"] for item in r.json()["results"]]
    pkg = load_package(odd_pkg)
    expect = pkg.run(pkg.session(), [decode_image(digit_png(i)).frames[0] for i in range(6)])["label"]
    assert labels == [int(v) for v in expect]
    m = next(m for m in httpx.get(f"{tight.url}/models", timeout=30).json()["models"] if m["name"] == MODEL)
    assert m["recent_batch_sizes"]["max"] <= 4  # TAFL_MAX_BATCH, with two lanes (TAFL_MODEL_LANES) running at once
    assert m["lanes"] == 2


def test_nan_metrics_and_non_latin_names_answer_without_a_500(tight):
    r = httpx.get(f"{tight.url}/models", timeout=30)
    assert r.status_code == 200, r.text[:300]
    meta = r.json()["models"][0]["metadata"]
    assert meta["name"] == MODEL and meta["metrics"]["nan_probe"] is None and meta["metrics"]["inf_probe"] is None
    # a digit image the smoke model calls class 0, so its (non-Latin) class name goes into a header
    for i in range(40):
        h = httpx.post(f"{tight.url}/heatmap", files={"file": ("a.png", digit_png(i), "image/png")}, timeout=60)
        assert h.status_code == 200, h.text[:300]
        assert unquote(h.headers["x-tafl-model"]).startswith(MODEL + ":")
        if h.headers["x-tafl-label"] == "0":
            assert unquote(h.headers["x-tafl-class"]) == CLASS0
            break
    else:
        pytest.fail("the smoke model predicted class 0 for none of 40 digits")
    assert httpx.get(f"{tight.url}/metrics", timeout=30).status_code == 200


def test_max_concurrency_answers_429_while_health_stays_open(tight):
    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            files = _files(6)
            reqs = [c.post(f"{tight.url}/predict/batch", files=files) for _ in range(12)]
            health = [c.get(f"{tight.url}/healthz") for _ in range(4)]
            return await asyncio.gather(*reqs, *health)

    for _ in range(3):  # the flood must overlap in time; on a busy machine it may need another go
        res = asyncio.run(flood())
        codes = [r.status_code for r in res[:12]]
        assert set(codes) <= {200, 429}, codes
        assert all(r.status_code == 200 for r in res[12:])
        if 429 in codes:
            break
    assert 429 in codes and 200 in codes


def test_a_client_that_disconnects_mid_upload_is_dropped_quietly(tight):
    body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n\r\n" + digit_png(1)[:200]
    head = (f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            f"Content-Length: {len(body) + 100_000}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", tight.port)) as s:
        s.sendall(head + body)
        time.sleep(0.5)
    deadline = time.time() + 20
    while time.time() < deadline:
        lines = [json.loads(x) for x in tight.audit.read_text().splitlines() if x.strip()]
        gone = [x for x in lines if x.get("status") == 499]
        if gone:
            break
        time.sleep(0.3)
    assert gone and gone[-1]["error"] == "ClientDisconnected" and gone[-1]["route"] == "/predict"
    log = tight.log.read_text()
    assert "Traceback" not in log and " 500" not in log
    assert httpx.post(f"{tight.url}/predict", files={"file": ("a.png", digit_png(2), "image/png")},
                      timeout=60).status_code == 200


def test_the_service_publishes_its_openapi_document(tight):
    from tafl import __version__
    from tafl.serving.openapi import spec

    r = httpx.get(f"{tight.url}/openapi.json", timeout=30)
    assert r.status_code == 200
    doc = r.json()
    assert doc == json.loads(json.dumps(spec(__version__)))
    assert {p for p in doc["paths"] if not p.startswith("/v2")} == {"/predict", "/predict/batch", "/heatmap", "/models",
                                                                    "/admin/reload"}
    assert {"/v2", "/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/infer"} <= set(doc["paths"])
    # a path under /v2 that no route serves answers the Open Inference Protocol's JSON error
    r = httpx.get(f"{tight.url}/v2/models/a/b/c/d", timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}


def test_every_hostile_class_is_refused_by_the_live_service_in_bounded_memory(tight):
    """The crafted corpus (tests/hostile_corpus.py) through a real service: each class gets its 413/422 with a
    message, the worker's resident memory stays bounded, and /healthz answers throughout."""
    import psutil

    from tests.hostile_corpus import HOSTILE

    def tree_rss() -> int:
        root = psutil.Process(tight.proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])

    before = tree_rss()
    for name, (build, status) in HOSTILE.items():
        data = build()
        for send in ({"files": {"file": (f"{name}.bin", data, "application/octet-stream")}},
                     {"content": data, "headers": {"content-type": "application/dicom"}}):
            r = httpx.post(f"{tight.url}/predict", timeout=60, **send)
            assert r.status_code == status, (name, r.status_code, r.text[:200])
            assert len(r.json()["error"]["message"]) > 20
        assert httpx.get(f"{tight.url}/healthz", timeout=5).status_code == 200
    assert (tree_rss() - before) / 2**20 < 300
