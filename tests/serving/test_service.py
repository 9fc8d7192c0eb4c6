"""The service over HTTP, against a real `bentoml serve` on 127.0.0.1."""

from __future__ import annotations

import base64
import io
import json
import re
import struct
import zlib

import httpx
import numpy as np
import pydicom
import pytest
from PIL import Image

from tafl.packaging import load_package
from tests.conftest import SHARED_DATA
from tests.conftest import TOKEN, digit_png, png_bytes

pytestmark = pytest.mark.slow


def post(srv, data: bytes, name="img.png", ctype="image/png", **fields):
    return httpx.post(f"{srv.url}/predict", files={"file": (name, data, ctype)},
                      data={k: str(v) for k, v in fields.items()}, timeout=60)


def _dicom_files():
    out = []
    for name in ("CT_small.dcm", "MR_small.dcm"):
        out.append(pydicom.data.get_testdata_file(name))
    shared = SHARED_DATA / "dicom"
    for name in ("liver.dcm", "US1_J2KR.dcm", "emri_small_jpeg_ls_lossless.dcm", "SC_rgb_2frame.dcm",
                 "OBXXXX1A_rle_2frame.dcm", "MR2_J2KI.dcm"):
        if (shared / name).is_file():
            out.append(str(shared / name))
    return out


def test_png_and_jpeg_predictions_with_expert_votes(server, gtafl_pkg):
    names = load_package(gtafl_pkg).class_names
    for data, ctype in ((digit_png(0), "image/png"), (digit_png(5, fmt="JPEG"), "image/jpeg")):
        r = post(server, data, ctype=ctype)
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["class_name"] in names and b["label"] == names.index(b["class_name"])
        assert abs(sum(b["probabilities"].values()) - 1) < 1e-4
        assert [e["name"] for e in b["experts"]] == ["forward", "uniform", "backward"]
        assert all(e["class_name"] in names and 0 <= e["probability"] <= 1 for e in b["experts"])
        assert b["model"] == {"name": "derm-gtafl", "version": "1.0.0", "method": "gtafl"}
        assert "heatmap" not in b and b["timing_ms"]["total"] > 0 and r.headers["X-Request-ID"] == b["request_id"]


@pytest.mark.parametrize("path", _dicom_files(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_real_dicoms_predict(server, path):
    raw = open(path, "rb").read()
    r = post(server, raw, name="x.dcm", ctype="application/dicom")
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["input"]["kind"] == "dicom"
    frames = int(getattr(pydicom.dcmread(path, stop_before_pixels=True), "NumberOfFrames", 1) or 1)
    if frames > 1:
        assert len(b["frames"]) == frames and [f["frame"] for f in b["frames"]] == list(range(frames))
    else:
        assert "frames" not in b


def test_heatmap_on_and_off_and_the_png_route(server):
    r = post(server, digit_png(3), heatmap="true")
    hm = r.json()["heatmap"]
    img = Image.open(io.BytesIO(base64.b64decode(hm["png_base64"])))
    assert img.format == "PNG" and img.size == (64, 64) and hm["shape"] == [16, 16]
    assert "heatmap" not in post(server, digit_png(3), heatmap="false").json()
    r = httpx.post(f"{server.url}/heatmap", files={"file": ("a.png", digit_png(3), "image/png")},
                   data={"model": "derm-dafl"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(r.content)).size == (64, 64)


def test_two_models_and_models_route(server):
    r = post(server, digit_png(1), model="derm-dafl", heatmap="true")
    b = r.json()
    assert r.status_code == 200 and b["model"]["name"] == "derm-dafl" and b["experts"] == []
    assert "rollout" in b["heatmap"]["kind"]
    m = httpx.get(f"{server.url}/models", timeout=30).json()["models"]
    assert [x["name"] for x in m] == ["derm-gtafl", "derm-dafl"]
    for x in m:
        assert "CPUExecutionProvider" in x["providers"] and x["metadata"]["version"] == "1.0.0"
        assert x["card"].startswith(f"# {x['name']} 1.0.0")


def _counter(srv, model: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tafl_predicted_class_total{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_count_predicted_classes(server):
    before = _counter(server, "derm-gtafl")
    for i in range(3):
        assert post(server, digit_png(i)).status_code == 200
    assert _counter(server, "derm-gtafl") == before + 3
    r = httpx.post(f"{server.url}/heatmap", files={"file": ("a.png", digit_png(1), "image/png")}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert _counter(server, "derm-gtafl") == before + 4  # a heatmap is a prediction too
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert httpx.get(f"{server.url}/livez").status_code == 200 and httpx.get(f"{server.url}/readyz").status_code == 200


@pytest.fixture(scope="module")
def slow_server(gtafl_pkg, tmp_path_factory):
    """A service whose request deadline no request can meet."""
    from tafl.serving.launch import ServerProcess

    home = tmp_path_factory.mktemp("bentoml_home_timeout")
    with ServerProcess([str(gtafl_pkg)], env={"BENTOML_HOME": str(home), "TAFL_REQUEST_TIMEOUT_S": "0.000001"},
                       log_path=tmp_path_factory.mktemp("svc_timeout") / "service.log") as srv:
        yield srv


def test_request_past_its_deadline_is_a_503_with_retry_after(slow_server):
    for route in ("/predict", "/heatmap", "/predict/batch"):
        r = httpx.post(f"{slow_server.url}{route}", files={"file": ("a.png", digit_png(0), "image/png")}, timeout=60)
        assert r.status_code == 503, (route, r.text)
        assert r.headers["retry-after"] == "1" and "longer than" in r.json()["error"]["message"]
    assert httpx.get(f"{slow_server.url}/readyz", timeout=30).status_code == 200
    assert httpx.get(f"{slow_server.url}/models", timeout=30).status_code == 200


def test_auth_on(auth_server):
    r = post(auth_server, digit_png(0))
    assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
    bad = httpx.post(f"{auth_server.url}/predict", files={"file": ("a.png", digit_png(0), "image/png")},
                     headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert bad.status_code == 401
    ok = httpx.post(f"{auth_server.url}/predict", files={"file": ("a.png", digit_png(0), "image/png")},
                    headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(f"{auth_server.url}/models").status_code == 401
    assert httpx.get(f"{auth_server.url}/readyz").status_code == 200  # health stays open


def _png_header(width: int, height: int) -> bytes:
    raw = bytearray(png_bytes(np.zeros((8, 8), np.uint8)))
    ihdr = raw[16:29]
    ihdr[0:8] = struct.pack(">II", width, height)
    raw[16:29] = ihdr
    raw[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(raw)


def _rt_plan() -> bytes:
    ds = pydicom.Dataset()
    ds.file_meta = pydicom.dataset.FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.481.5"
    ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.481.5"
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID
    ds.Modality = "RTPLAN"
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


def test_bad_inputs_are_4xx_with_messages_and_the_server_survives(server):
    ct = open(pydicom.data.get_testdata_file("CT_small.dcm"), "rb").read()
    good_png = digit_png(2)
    cases = [
        ("empty", lambda: post(server, b""), 400),
        ("text", lambda: post(server, b"hello, this is not an image\n", name="a.txt", ctype="text/plain"), 415),
        ("truncated png", lambda: post(server, good_png[:60]), 422),
        ("truncated dicom", lambda: post(server, ct[:3000], ctype="application/dicom"), 422),
        ("rt plan, no pixel data", lambda: post(server, _rt_plan(), ctype="application/dicom"), 422),
        ("1x1 image", lambda: post(server, png_bytes(np.zeros((1, 1), np.uint8))), 422),
        ("20000x20000 header", lambda: post(server, _png_header(20000, 20000)), 413),
        ("over the upload limit", lambda: post(server, b"\x89PNG" + b"\0" * (9 * 2**20)), 413),
        ("wrong model", lambda: post(server, good_png, model="nope"), 404),
        ("bad flag", lambda: post(server, good_png, heatmap="maybe"), 400),
        ("no file field", lambda: httpx.post(f"{server.url}/predict", data={"model": "derm-gtafl"},
                                             files={"other": ("x", b"", "text/plain")}, timeout=30), 400),
        ("misnamed field", lambda: httpx.post(f"{server.url}/predict", files={"image": ("a.png", good_png, "image/png")},
                                              timeout=30), 400),
        ("json body", lambda: httpx.post(f"{server.url}/predict", json={"file": "a.png"}, timeout=30), 415),
        ("garbage multipart", lambda: httpx.post(f"{server.url}/predict", content=b"--x\r\nnonsense",
                                                 headers={"content-type": "multipart/form-data; boundary=x"},
                                                 timeout=30), 400),
    ]
    for what, call, status in cases:
        r = call()
        assert r.status_code == status, (what, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["status"] == status and len(err["message"]) > 10, what
        assert post(server, good_png).status_code == 200, f"server unhealthy after {what}"


def test_same_labels_as_the_package_in_process(server, gtafl_pkg):
    pkg = load_package(gtafl_pkg)
    sess = pkg.session(["CPUExecutionProvider"])
    images = [digit_png(i) for i in range(0, 40, 4)]
    local = pkg.run(sess, [Image.open(io.BytesIO(b)) for b in images])["label"].tolist()
    remote = [post(server, b).json()["label"] for b in images]
    assert remote == local


def test_no_patient_data_in_responses_or_audit_log(server, audit_file):
    path = pydicom.data.get_testdata_file("CT_small.dcm")
    ds = pydicom.dcmread(path)
    secrets = [str(ds.PatientName), str(ds.PatientID)]
    raw = open(path, "rb").read()
    r1 = post(server, raw, name=f"{secrets[0]}.dcm", ctype="application/dicom", heatmap="true")
    r2 = post(server, raw[:4000], name=f"{secrets[0]}.dcm", ctype="application/dicom")
    assert r1.status_code == 200 and r2.status_code == 422
    lines = audit_file.read_text().splitlines()
    assert lines, "no audit lines written"
    rec = json.loads(lines[-1])
    assert {"request_id", "status", "timing_ms"} <= set(rec)
    ok = [json.loads(x) for x in lines if json.loads(x).get("status") == 200 and json.loads(x).get("route") == "/predict"]
    assert ok and {"model", "version", "label", "class_name"} <= set(ok[-1])
    for text in (r1.text, r2.text, audit_file.read_text()):
        for s in secrets:
            assert s not in text
    assert not re.search(r"CompressedSamples", audit_file.read_text())


def test_batch_endpoint_answers_each_image_in_order(server):
    ct = open(pydicom.data.get_testdata_file("CT_small.dcm"), "rb").read()
    files = [("file", ("a.png", digit_png(0), "image/png")), ("file", ("b.txt", b"not an image", "text/plain")),
             ("file", ("c.dcm", ct, "application/dicom")), ("file", ("d.png", digit_png(7), "image/png"))]
    r = httpx.post(f"{server.url}/predict/batch", files=files, timeout=60)
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [x["index"] for x in res] == [0, 1, 2, 3]
    assert res[1]["error"]["status"] == 415 and "label" not in res[1]
    single = [post(server, digit_png(i)).json()["label"] for i in (0, 7)]
    assert [res[0]["label"], res[3]["label"]] == single
    assert res[2]["input"]["kind"] == "dicom" and len(res[0]["experts"]) == 3
    too_many = [("file", (f"{i}.png", digit_png(i), "image/png")) for i in range(65)]
    r = httpx.post(f"{server.url}/predict/batch", files=too_many, timeout=60)
    assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/predict/batch", files=files[:1], data={"heatmap": "true"}, timeout=60)
    assert r.status_code == 400


def test_reload_of_a_bad_package_answers_the_package_error_status(server, tmp_path):
    """A PackageError on /admin/reload answers tafl.errors' status (400), not 404, and the served models stay;
    the folders lie under the service's TAFL_PACKAGE_ROOT (the session's temporary root), and no answer names
    a host path."""
    from tafl.errors import PackageError

    broken = tmp_path / "broken-pkg"
    broken.mkdir()
    (broken / "metadata.json").write_text("{}")  # a folder, but no model package
    before = httpx.get(f"{server.url}/models", timeout=30).json()["models"]
    auth = {"Authorization": "Bearer admin-test-token"}
    for ref in (str(tmp_path / "no-such-pkg"), str(broken), "no-such-model:1_0_0"):
        r = httpx.post(f"{server.url}/admin/reload", json={"package": ref}, headers=auth, timeout=60)
        assert r.status_code == PackageError.status == 400, (ref, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["status"] == 400 and err["code"] == "PackageError" and len(err["message"]) > 10, ref
        assert str(tmp_path.parent) not in r.text and "/tmp" not in r.text, r.text[:300]
    after = httpx.get(f"{server.url}/models", timeout=30).json()["models"]
    assert [(m["name"], m["version"]) for m in after] == [(m["name"], m["version"]) for m in before]
    assert post(server, digit_png(2)).status_code == 200
