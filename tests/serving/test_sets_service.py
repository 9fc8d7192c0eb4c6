"""Every answer carries the prediction set (issue 54, item 2), against a real `bentoml serve`: /predict and
/predict/batch (with a request's coverage option, and a 400 naming the kept levels for any other), the Open
Inference Protocol's BOOL mask, the Python client, `tafl predict`, the scoring CSV, the DICOM SR (one item per class
in the set, the coverage stated) and the page."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file

from tafl.clients.client import Client
from tafl.packaging.package import load_package
from tests.conftest import TOKEN, digit_png

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def post(srv, data: bytes, name="x.png", ctype="image/png", route="/predict", **fields):
    return httpx.post(f"{srv.url}{route}", files={"file": (name, data, ctype)}, headers=AUTH,
                      data={k: str(v) for k, v in fields.items()}, timeout=60)


def test_predict_and_batch_answer_the_set_at_the_kept_levels(auth_server, gtafl_pkg):
    pkg = load_package(gtafl_pkg)
    t = pkg.meta.sets.thresholds
    for i in (0, 3, 7):
        b = post(auth_server, digit_png(i), posteriors="true").json()
        ps = b["prediction_set"]
        assert ps["coverage"] == 0.9 and ps["kind"] == "class-conditional" and ps["size"] == len(ps["classes"])
        # the set is the classes whose source-prior calibrated probability clears 1 − threshold
        cal = np.array([b["calibrated_probabilities"][c] for c in pkg.class_names])
        want = [c for c in range(len(cal)) if 1 - cal[c] <= t[0.9][c] + 1e-6]
        assert ps["labels"] == want and ps["classes"] == [pkg.class_names[c] for c in want]
        wide = post(auth_server, digit_png(i), coverage="95").json()["prediction_set"]
        assert wide["coverage"] == 0.95 and set(ps["labels"]) <= set(wide["labels"])
    bad = post(auth_server, digit_png(0), coverage="0.7")
    assert bad.status_code == 400 and "0.8, 0.9, 0.95" in bad.json()["error"]["message"]
    r = httpx.post(f"{auth_server.url}/predict/batch", headers=AUTH, data={"coverage": "0.8"}, timeout=60,
                   files=[("file", (f"{i}.png", digit_png(i), "image/png")) for i in (0, 3)])
    sets = [x["prediction_set"] for x in r.json()["results"]]
    assert [s["coverage"] for s in sets] == [0.8, 0.8]
    for i, s in zip((0, 3), sets):
        assert s == post(auth_server, digit_png(i), coverage="0.8").json()["prediction_set"]


def test_oip_answers_the_set_as_a_bool_mask(auth_server, gtafl_pkg):
    tc = pytest.importorskip("tritonclient.http", reason="needs tritonclient[http]: the dev extra")
    from tafl.imaging.decode import decode_image

    pkg = load_package(gtafl_pkg)
    pngs = [digit_png(i) for i in (0, 3, 5)]
    x = pkg.preprocess([decode_image(b).frames[0] for b in pngs])
    cli = tc.InferenceServerClient(auth_server.url.removeprefix("http://"), network_timeout=60)
    meta = cli.get_model_metadata(pkg.name, headers=dict(AUTH))
    assert {o["name"]: o["datatype"] for o in meta["outputs"]}["prediction_set"] == "BOOL"
    inp = tc.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    res = cli.infer(pkg.name, [inp], outputs=[tc.InferRequestedOutput("prediction_set")], headers=dict(AUTH))
    mask = res.as_numpy("prediction_set")
    assert mask.dtype == np.bool_ and mask.shape == (3, len(pkg.class_names))
    for i, png in enumerate(pngs):
        assert list(np.flatnonzero(mask[i])) == post(auth_server, png).json()["prediction_set"]["labels"]


def test_client_cli_and_csv_carry_the_set(auth_server, gtafl_pkg, tmp_path):
    with Client(auth_server.url, token=TOKEN) as c:
        p = c.predict(digit_png(3), coverage=0.95)
        assert p.prediction_set.coverage == 0.95 and p.prediction_set.classes
        batch = c.predict_batch([digit_png(3), digit_png(4)])
        assert all(b.prediction_set.coverage == 0.9 for b in batch)
    png = tmp_path / "three.png"
    png.write_bytes(digit_png(3))
    run = subprocess.run([sys.executable, "-m", "tafl.cli", "predict", str(png), "--url", auth_server.url, "--token",
                          TOKEN, "--coverage", "0.95"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"plausible (95% set): {', '.join(p.prediction_set.classes)}" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "tafl.cli", "predict", str(png), "--url", auth_server.url, "--token",
                          TOKEN, "--coverage", "0.5"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "0.8, 0.9, 0.95" in bad.stderr
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in (3, 4):
        (folder / f"{i}.png").write_bytes(digit_png(i))
    rows = {}
    for where in (["--url", auth_server.url, "--token", TOKEN], ["--package", str(gtafl_pkg)]):
        out = tmp_path / f"{where[0][2:]}.csv"
        s = subprocess.run([sys.executable, "-m", "tafl.cli", "score", str(folder), "--out", str(out), *where],
                           capture_output=True, text=True, timeout=300)
        assert s.returncode == 0, s.stderr
        rows[where[0]] = list(csv.DictReader(io.StringIO(out.read_text())))
    for a, b in zip(rows["--url"], rows["--package"]):  # through the service and in-process: the same sets
        assert a["prediction_set"] == b["prediction_set"] and a["set_coverage"] == b["set_coverage"] == "0.9"
    with Client(auth_server.url, token=TOKEN) as c:
        assert rows["--url"][0]["prediction_set"].split("|") == c.predict(digit_png(3)).prediction_set.classes


def test_the_sr_lists_the_set_and_its_coverage(auth_server, gtafl_pkg):
    raw = Path(get_testdata_file("CT_small.dcm")).read_bytes()
    js = post(auth_server, raw, "x.dcm", "application/dicom").json()
    r = post(auth_server, raw, "x.dcm", "application/dicom", format="sr")
    assert r.status_code == 200, r.text[:300]
    sr = pydicom.dcmread(io.BytesIO(r.content))

    def items(ds):
        for item in ds.get("ContentSequence", []):
            yield item
            yield from items(item)

    members = [i.ConceptCodeSequence[0].CodeMeaning for i in items(sr)
               if i.ConceptNameCodeSequence[0].CodeValue == "set-member"]
    assert members == js["prediction_set"]["classes"]
    nums = {i.ConceptNameCodeSequence[0].CodeValue: float(i.MeasuredValueSequence[0].NumericValue)
            for i in items(sr) if getattr(i, "ValueType", "") == "NUM"}
    assert nums["set-coverage"] == 0.9 and nums["set-size"] == len(members)


def test_the_page_states_the_sets(auth_server):
    html = httpx.get(f"{auth_server.url}/ui/panel", headers=AUTH, timeout=30).text
    assert "data-sets" in html and "whatever the case mix" in html
