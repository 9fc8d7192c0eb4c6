"""The client library, `tafl predict`, folder scoring with resume, retries, and retrain -> export -> reload."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tafl.clients.client import Client, Prediction, ServiceCallError
from tafl.clients.score import score_folder
from tafl.errors import ConfigError
from tafl.packaging import load_package
from tafl.serving.launch import ServerProcess, free_port
from tests.conftest import SHARED_DATA, TOKEN, digit_png

TAFL = [sys.executable, "-m", "tafl.cli"]


# ------------------------------------------------------------------ retry logic (injected transport)
def _client_with(handler, **kw) -> Client:
    c = Client("http://svc", backoff=0.001, **kw)
    c.http = httpx.Client(transport=httpx.MockTransport(handler))
    return c


def _ok_body():
    return {"label": 1, "class_name": "b", "probability": 0.9, "probabilities": {"a": 0.1, "b": 0.9},
            "experts": [{"name": "uniform", "label": 1, "class_name": "b", "probability": 0.9}],
            "model": {"name": "m", "version": "1.0.0", "method": "gtafl"}, "request_id": "r", "timing_ms": {}}


def test_retries_on_503_and_connection_errors_but_not_on_4xx():
    calls = []

    def flaky(request):
        calls.append(1)
        if len(calls) < 3:
            return httpx.Response(503, json={"error": {"message": "busy", "code": "ServiceUnavailable"}})
        return httpx.Response(200, json=_ok_body())

    p = _client_with(flaky).predict(b"\x89PNG....")
    assert isinstance(p, Prediction) and p.class_name == "b" and p.experts[0].name == "uniform" and len(calls) == 3

    calls.clear()

    def bad(request):
        calls.append(1)
        return httpx.Response(415, json={"error": {"message": "not an image", "code": "UnsupportedMedia"}},
                              headers={"X-Request-ID": "abc"})

    with pytest.raises(ServiceCallError) as e:
        _client_with(bad).predict(b"text")
    assert e.value.status == 415 and e.value.code == "UnsupportedMedia" and e.value.request_id == "abc"
    assert len(calls) == 1  # no retry on 4xx

    calls.clear()

    def down(request):
        calls.append(1)
        raise httpx.ConnectError("refused")

    with pytest.raises(ServiceCallError) as e:
        _client_with(down, retries=2).predict(b"x")
    assert e.value.status == 0 and "cannot reach" in str(e.value) and len(calls) == 3


def test_unreadable_file_is_a_clear_error_not_an_unreachable_service(tmp_path):
    from tafl.errors import DataError

    with pytest.raises(DataError, match="cannot read .*missing.png") as e:
        Client("http://127.0.0.1:9").predict(tmp_path / "missing.png")
    assert not isinstance(e.value, ServiceCallError)  # status 0 would read as "the service did not answer"
    with pytest.raises(DataError, match="it is a folder"):
        Client("http://127.0.0.1:9").predict(tmp_path)


@pytest.mark.parametrize("url", ["127.0.0.1:3150", "localhost", "ftp://127.0.0.1:3000", "http://", ""])
def test_a_service_url_without_scheme_or_host_is_a_config_error(url):
    from tafl.clients import AsyncClient
    from tafl.errors import ConfigError

    for cls in (Client, AsyncClient):
        with pytest.raises(ConfigError, match="http://"):
            cls(url)
    assert Client("http://127.0.0.1:3150/").url == "http://127.0.0.1:3150"


def test_the_readme_api_imports_from_tafl_clients():
    import tafl.clients.client
    from tafl.clients import AsyncClient, Client as C, ServiceCallError as E
    from tafl.errors import ServiceCallError as TreeError, ServiceError, TaflError

    assert C is Client and E is ServiceCallError is TreeError is tafl.clients.client.ServiceCallError
    assert issubclass(E, ServiceError) and issubclass(E, TaflError)
    err = E(415, "not an image", "UnsupportedMedia", "rid")
    assert err.status == 415 and err.detail == "not an image" and err.message == "415: not an image"
    assert E(0, "down").message == "no answer: down"
    assert AsyncClient.__module__ == "tafl.clients.client"


def test_async_client_offers_every_call_of_client():
    import inspect

    from tafl.clients import AsyncClient

    public = [n for n, f in inspect.getmembers(Client, inspect.isfunction) if not n.startswith("_")]
    assert {"predict", "predict_batch", "heatmap", "models", "health", "reload", "close"} <= set(public)
    for name in public:
        twin = getattr(AsyncClient, name, None)
        assert twin is not None and inspect.iscoroutinefunction(twin), f"AsyncClient has no async {name}"
        assert list(inspect.signature(twin).parameters.values()) == \
            list(inspect.signature(getattr(Client, name)).parameters.values()), name


def test_async_client_batch_heatmap_and_reload_behave_as_the_sync_one():
    import asyncio

    from tafl.clients import AsyncClient

    seen = []

    def handler(request):
        seen.append((request.method, request.url.path, request.headers.get("Authorization")))
        if request.url.path == "/predict/batch":
            item = {k: v for k, v in _ok_body().items() if k not in ("model", "request_id")}
            return httpx.Response(200, json={"model": _ok_body()["model"], "request_id": "b", "results": [
                item, {"index": 1, "error": {"status": 415, "code": "UnsupportedMedia", "message": "not an image"}}]})
        if request.url.path == "/heatmap":
            return httpx.Response(200, content=b"\x89PNGfake", headers={"content-type": "image/png"})
        if request.url.path == "/admin/reload":
            if request.headers.get("Authorization") != "Bearer adm":
                return httpx.Response(401, json={"error": {"message": "wrong admin token", "code": "Unauthorized"}})
            return httpx.Response(200, json={"model": "m", "version": "1.1.0", "previous_version": "1.0.0"})
        return httpx.Response(404)

    async def go():
        async with AsyncClient("http://svc", backoff=0.001) as c:
            await c.http.aclose()
            c.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
            many = await c.predict_batch([b"a", b"b"], prior="adaptive")
            png = await c.heatmap(b"a")
            res = await c.reload("pkg", admin_token="adm")
            with pytest.raises(ServiceCallError) as e:
                await c.reload("pkg", admin_token="wrong")
            return many, png, res, e.value

    many, png, res, err = asyncio.run(go())
    assert isinstance(many[0], Prediction) and many[0].request_id == "b" and many[0].class_name == "b"
    assert isinstance(many[1], ServiceCallError) and many[1].status == 415 and many[1].request_id == "b"
    assert png.startswith(b"\x89PNG") and res["version"] == "1.1.0"
    assert err.status == 401 and err.code == "Unauthorized"
    assert ("POST", "/admin/reload", "Bearer adm") in seen and len(seen) == 4  # no retry on 401


# ------------------------------------------------------------------ against the real service
pytestmark = pytest.mark.slow


def test_client_against_the_service(server, tmp_path):
    with Client(server.url) as c:
        assert c.health()
        p = c.predict(digit_png(4), heatmap=True)
        assert p.model["name"] == "derm-gtafl" and len(p.experts) == 3 and p.heatmap is not None
        assert p.heatmap.png.startswith(b"\x89PNG") and p.heatmap.shape == (16, 16)
        assert {m["name"] for m in c.models()} == {"derm-gtafl", "derm-dafl"}
        many = c.predict_batch([digit_png(4), b"junk", digit_png(5)])
        assert many[0].label == p.label and isinstance(many[1], ServiceCallError) and many[1].status == 415
        d = c.predict(digit_png(4), model="derm-dafl")
        assert d.experts == [] and d.model_version == "1.0.0"
        with pytest.raises(ServiceCallError) as e:
            c.predict(digit_png(4), model="nope")
        assert e.value.status == 404
    assert not Client("http://127.0.0.1:9", retries=0).health()


def test_tafl_predict_cli(server, tmp_path):
    f1, f2 = tmp_path / "a.png", tmp_path / "b.png"
    f1.write_bytes(digit_png(1))
    f2.write_bytes(digit_png(2))
    r = subprocess.run([*TAFL, "predict", str(f1), str(f2), "--url", server.url, "--heatmap", str(tmp_path / "hm"),
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [Path(x["file"]).name for x in rows] == ["a.png", "b.png"]
    assert all(Path(x["heatmap"]).is_file() for x in rows)
    table = subprocess.run([*TAFL, "predict", str(f1), "--url", server.url], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "forward=" in table.stdout and "derm-gtafl 1.0.0" in table.stdout
    down = subprocess.run([*TAFL, "predict", str(f1), "--url", "http://127.0.0.1:9"], capture_output=True, text=True,
                          timeout=120)
    assert down.returncode == 2 and "cannot reach" in down.stderr and "Traceback" not in down.stderr


def test_exit_status_is_1_when_some_inputs_failed_and_2_when_none_was_answered(server, gtafl_pkg, tmp_path):
    """The README's rule, for the verbs over many inputs: 0 all answered, 1 some, 2 none."""
    import shutil

    good, bad = tmp_path / "in" / "a.png", tmp_path / "in" / "notes.png"
    good.parent.mkdir()
    good.write_bytes(digit_png(1))
    bad.write_text("a text file named like an image")

    def tafl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*TAFL, *args], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)

    assert tafl("predict", str(good), "--url", server.url).returncode == 0
    only_bad = tafl("predict", str(bad), "--url", server.url)
    assert only_bad.returncode == 2 and only_bad.stderr.count("tafl: error:") == 1, only_bad.stderr
    both = tafl("predict", str(good), str(bad), "--url", server.url)
    assert both.returncode == 1 and "a.png" in both.stdout and "notes.png" in both.stderr, both

    bad.write_bytes(digit_png(2)[:60])  # scoring skips what is no image at all; a cut PNG is an image that fails
    both = tafl("score", str(good.parent), "--out", str(tmp_path / "r.csv"), "--package", str(gtafl_pkg),
                "--no-progress")
    assert both.returncode == 1 and "failed: " in both.stdout, both
    good.unlink()
    only_bad = tafl("score", str(good.parent), "--out", str(tmp_path / "r2.csv"), "--package", str(gtafl_pkg),
                    "--no-progress")
    assert only_bad.returncode == 2, only_bad

    shelf = tmp_path / "shelf"
    shutil.copytree(gtafl_pkg, shelf / "good")
    assert tafl("packages", "list", str(shelf)).returncode == 0
    shutil.copytree(gtafl_pkg, shelf / "tampered")
    (shelf / "tampered" / "model.onnx").write_bytes(b"not the model that was signed off")
    listed = tafl("packages", "list", str(shelf))
    assert listed.returncode == 1 and "REFUSED" in listed.stdout and " ok " in listed.stdout, listed


def test_wrong_token_is_a_clear_error(auth_server, tmp_path):
    f = tmp_path / "a.png"
    f.write_bytes(digit_png(1))
    r = subprocess.run([*TAFL, "predict", str(f), "--url", auth_server.url, "--token", "wrong"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "401" in r.stderr and "Bearer" in r.stderr
    ok = subprocess.run([*TAFL, "predict", str(f), "--url", auth_server.url, "--token", TOKEN], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def _image_folder(root: Path, n_ham: int = 300) -> Path:
    """A hospital-style folder: HAM10000 JPEGs in subfolders, DICOMs with and without extension, junk."""
    folder = root / "incoming"
    (folder / "derm" / "batch1").mkdir(parents=True)
    (folder / "radiology").mkdir()
    ham = SHARED_DATA / "ham10000" / "images"
    if ham.is_dir():
        for i, p in enumerate(sorted(ham.glob("*.jpg"))[:n_ham]):
            shutil.copyfile(p, folder / "derm" / ("batch1" if i % 2 else "") / p.name)
    else:
        for i in range(40):
            (folder / "derm" / f"d{i}.png").write_bytes(digit_png(i))
    dicoms = SHARED_DATA / "dicom"
    if dicoms.is_dir():
        for name in ("liver.dcm", "MR2_J2KI.dcm", "SC_rgb_2frame.dcm", "US1_J2KR.dcm"):
            shutil.copyfile(dicoms / name, folder / "radiology" / name)
        shutil.copyfile(dicoms / "emri_small.dcm", folder / "radiology" / "IM000123")  # no extension
        shutil.copyfile(dicoms / "liver_deflate.dcm", folder / "radiology" / "deflated.dcm")  # unsupported: an error row
    (folder / "notes.txt").write_text("not an image")
    (folder / "radiology" / "README").write_text("hello")
    return folder


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_score_remote_and_in_process_agree(server, gtafl_pkg, tmp_path):
    folder = _image_folder(tmp_path)
    remote = score_folder(folder, tmp_path / "remote.csv", url=server.url, concurrency=4, batch_size=16,
                          progress=False)
    local = score_folder(folder, tmp_path / "local.jsonl", package=str(gtafl_pkg), batch_size=32, progress=False)
    r = {x["path"]: x for x in _rows(tmp_path / "remote.csv")}
    l = {json.loads(x)["path"]: json.loads(x) for x in (tmp_path / "local.jsonl").read_text().splitlines()}
    assert set(r) == set(l) and len(r) == remote["images"] == local["images"]
    scored = [p for p in r if not r[p]["error"]]
    assert len(scored) >= 40
    assert all(r[p]["class_name"] == l[p]["class_name"] and r[p]["expert_uniform"] == l[p]["expert_uniform"]
               for p in scored), "remote and in-process labels differ"
    assert {"notes.txt", "radiology/README"} <= set(remote["skipped"])
    if (SHARED_DATA / "dicom").is_dir():
        assert "radiology/IM000123" in r and not r["radiology/IM000123"]["error"]  # DICOM without an extension
        assert r["radiology/deflated.dcm"]["error"].startswith("415")
        assert l["radiology/deflated.dcm"]["error"].startswith("415")
    assert sum(m["predicted"] for m in remote["class_mix"]) == len(scored)
    assert set(_rows(tmp_path / "remote.csv")[0]) >= {"path", "label", "class_name", "probability", "expert_forward",
                                                      "expert_uniform", "expert_backward", "model_version", "error"}


def test_score_refuses_existing_output_and_empty_folders(tmp_path, gtafl_pkg):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.png").write_bytes(digit_png(1))
    out = tmp_path / "r.csv"
    first = score_folder(folder, out, package=str(gtafl_pkg), progress=False)
    r = subprocess.run([*TAFL, "score", str(folder), "--out", str(out), "--package", str(gtafl_pkg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--resume" in r.stderr and "--force" in r.stderr
    # --resume with nothing new: the class mix is the file's (its one prediction), not a table of zero shares
    r = subprocess.run([*TAFL, "score", str(folder), "--out", str(out), "--package", str(gtafl_pkg), "--resume"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "0 scored now, 1 already in" in r.stdout, r.stdout + r.stderr
    label = next(m["class_name"] for m in first["class_mix"] if m["predicted"] == 1)
    assert "class mix over all 1 predictions in the file" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.split()[:2] == [label, "1"])
    assert "100.0%" in row
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.txt").write_text("x")
    r = subprocess.run([*TAFL, "score", str(empty), "--out", str(tmp_path / "e.csv"), "--package", str(gtafl_pkg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "holds no DICOM, PNG or JPEG" in r.stderr
    r = subprocess.run([*TAFL, "score", str(folder), "--out", str(tmp_path / "u.csv"), "--url", "http://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot reach" in r.stderr and "Traceback" not in r.stderr


def test_kill_part_way_then_resume_scores_each_image_once(server, tmp_path):
    folder = _image_folder(tmp_path, n_ham=300)
    out = tmp_path / "results.csv"
    args = [*TAFL, "score", str(folder), "--out", str(out), "--url", server.url, "--concurrency", "2",
            "--no-progress"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 40):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = _rows(out)
    assert 20 < len(partial) < 290, "the job was not interrupted part-way"
    r = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600)
    failed_now = int(re.search(r"(\d+) failed", r.stdout).group(1))  # the folder's broken files, if this run met any
    assert r.returncode == (1 if failed_now else 0), r.stdout[-2000:] + r.stderr
    rows = _rows(out)
    paths = [x["path"] for x in rows]
    assert len(paths) == len(set(paths)), "an image was scored twice"
    images = [p for p in paths]
    assert len(images) == len(partial) + (len(rows) - len(partial))
    assert set(paths) >= {x["path"] for x in partial}
    total = sum(1 for p in folder.rglob("*") if p.is_file()) - 2  # notes.txt and README are skipped
    assert len(rows) == total
    assert all(x["model_version"] == "1.0.0" or x["error"] for x in rows)


def test_scoring_survives_a_server_restart(gtafl_pkg, tmp_path):
    port = free_port()
    env = {"BENTOML_HOME": str(tmp_path / "bentoml")}  # one BENTOML_HOME per service (Prometheus files)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(120):
        (folder / f"{i:03d}.png").write_bytes(digit_png(i))
    srv = ServerProcess([str(gtafl_pkg)], port=port, env=env, log_path=tmp_path / "svc1.log").start()
    seen: list = []
    result: dict = {}

    def job():
        result["summary"] = score_folder(folder, tmp_path / "r.csv", url=srv.url, concurrency=2, progress=False,
                                         on_row=seen.append)

    t = threading.Thread(target=job)
    t.start()
    while len(seen) < 20:
        time.sleep(0.02)
    srv.stop()  # the service goes down mid-job ...
    time.sleep(1.0)
    srv2 = ServerProcess([str(gtafl_pkg)], port=port, env=env, log_path=tmp_path / "svc2.log").start()  # ... and back
    try:
        t.join(300)
        assert not t.is_alive()
        s = result["summary"]
        assert s["predicted"] == 120 and not s["failed"]
        assert len(_rows(tmp_path / "r.csv")) == 120
    finally:
        srv2.stop()


def test_retrain_export_reload_loop(gtafl_pkg, tmp_path):
    pytest.importorskip("torch", reason="retrain and export need torch: the train extra (pip install -e '.[train]')")
    cfg = tmp_path / "more.yaml"
    cfg.write_text("rounds: 1\nseed: 11\n")
    run = tmp_path / "retrain"
    r = subprocess.run([*TAFL, "retrain", "--from", str(gtafl_pkg), "--config", str(cfg), "--out", str(run),
                        "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "becomes derm-gtafl 1.1.0" in r.stdout
    pkg2 = tmp_path / "pkg-1.1.0"
    r = subprocess.run([*TAFL, "export", str(run / "final.pt"), "--out", str(pkg2)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    meta = json.loads((pkg2 / "metadata.json").read_text())
    assert meta["name"] == "derm-gtafl" and meta["version"] == "1.1.0" and meta["parent_version"] == "1.0.0"
    env = {"BENTOML_HOME": str(tmp_path / "bentoml"), "TAFL_ADMIN_TOKEN": "admin", "TAFL_PACKAGE_ROOT": str(tmp_path)}
    with ServerProcess([str(gtafl_pkg)], env=env, log_path=tmp_path / "svc.log") as srv, Client(srv.url) as c:
        assert c.predict(digit_png(1)).model_version == "1.0.0"
        with pytest.raises(ServiceCallError) as e:
            c.reload(str(pkg2), admin_token="wrong")
        assert e.value.status == 401
        versions: list[str] = []
        errors: list[Exception] = []
        stop = threading.Event()

        def hammer():  # requests in flight while the version changes
            with Client(srv.url) as cc:
                while not stop.is_set():
                    try:
                        versions.append(cc.predict(digit_png(2)).model_version)
                    except Exception as exc:  # noqa: BLE001
                        errors.append(exc)

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        res = c.reload(str(pkg2), admin_token="admin")
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
        assert res["version"] == "1.1.0" and res["previous_version"] == "1.0.0"
        assert not errors, errors[:3]
        assert "1.0.0" in versions and versions[-1] == "1.1.0"
        assert c.predict(digit_png(3)).model_version == "1.1.0"
        assert [m["version"] for m in c.models()] == ["1.1.0"]


def _digit_folder(root: Path, n: int = 60) -> Path:
    folder = root / "digits"
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"d{i:03d}.png").write_bytes(digit_png(i))
    return folder


def test_score_with_an_adaptive_prior_re_decides_every_row_without_a_second_inference(server, gtafl_pkg, tmp_path):
    from tafl.prior import PriorEstimator, adapt

    folder = _digit_folder(tmp_path)
    local = score_folder(folder, tmp_path / "local.csv", package=str(gtafl_pkg), batch_size=16, progress=False,
                         prior="adaptive")
    remote = score_folder(folder, tmp_path / "remote.jsonl", url=server.url, batch_size=16, progress=False,
                          prior="adaptive")
    pr = local["prior"]
    assert pr["used"] == "adaptive" and pr["images"] == 60 and 0 <= pr["shift_from_source"] <= 1
    assert abs(sum(pr["estimate"].values()) - 1) < 1e-9
    rows = _rows(tmp_path / "local.csv")
    C = len(load_package(gtafl_pkg).class_names)
    P = np.array([[float(r[f"p{c}"]) for c in range(C)] for r in rows])
    meta = load_package(gtafl_pkg).metadata
    src = np.asarray(meta["prior"]["source_prior"])
    # the summary's estimate is the package's estimator (EM with its chosen smoothing) over the rows the file keeps
    assert pr["estimator"] == meta["prior"]["estimator"]
    q = PriorEstimator.from_dict(meta["prior"]["estimator"]).estimate(P, src).prior
    assert np.allclose(q, [pr["estimate"][n] for n in load_package(gtafl_pkg).class_names])
    assert [int(r["adaptive_label"]) for r in rows] == adapt(P, src, q).argmax(1).tolist()
    assert sum(m["adaptive_predicted"] for m in local["class_mix"]) == 60
    # the service's calibrated posteriors are the package's: the same estimate and decisions remotely
    rrows = [json.loads(x) for x in (tmp_path / "remote.jsonl").read_text().splitlines()]
    assert [r["adaptive_label"] for r in rrows] == [int(r["adaptive_label"]) for r in rows]
    assert np.allclose([remote["prior"]["estimate"][n] for n in pr["estimate"]], list(pr["estimate"].values()),
                       atol=1e-5)
    # an explicit prior goes to the graph; too few images fall back with a reason
    few = _digit_folder(tmp_path / "few", 5)
    small = score_folder(few, tmp_path / "few.csv", package=str(gtafl_pkg), progress=False, prior="adaptive")
    assert small["prior"]["used"] == "train" and "too few" in small["prior"]["fallback"]
    one_hot = ",".join("0.91" if c == 4 else "0.01" for c in range(C))
    ex = score_folder(few, tmp_path / "ex.csv", package=str(gtafl_pkg), progress=False, prior=one_hot)
    assert ex["prior"]["used"] == "explicit"
    with pytest.raises(ConfigError, match="sum to 1"):
        score_folder(few, tmp_path / "bad.csv", package=str(gtafl_pkg), progress=False, prior=",".join(["0.2"] * C))


def test_the_readme_client_example_runs_as_written(server, tmp_path, monkeypatch, capsys):
    """The README's Python block, with only the URL and the file path pointed at this test's service."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "from tafl.clients import Client, ServiceCallError" in block
    image = tmp_path / "my-images" / "images" / "img3.png"  # the file the README's folder recipe makes
    image.parent.mkdir(parents=True)
    image.write_bytes(digit_png(3))
    monkeypatch.chdir(tmp_path)
    exec(compile(block.replace("http://127.0.0.1:3000", server.url), "README.md", "exec"), {})
    out = capsys.readouterr().out.split()
    assert len(out) >= 2 and 0 <= float(out[1]) <= 1


def test_a_bad_adaptive_mode_fails_before_the_folder_is_scored(gtafl_pkg, tmp_path, monkeypatch):
    monkeypatch.setenv("TAFL_PRIOR_ADAPTIVE", "sometimes")
    folder = _digit_folder(tmp_path, 3)
    with pytest.raises(ConfigError, match="TAFL_PRIOR_ADAPTIVE must be checked or always"):
        score_folder(folder, tmp_path / "out.csv", package=str(gtafl_pkg), progress=False, prior="adaptive")
    assert not (tmp_path / "out.csv").exists()


def test_tafl_score_prior_site_takes_the_mix_from_the_environment(gtafl_pkg, tmp_path, monkeypatch, capsys):
    """`tafl score --prior site`: the site's mix comes from --site-mix or TAFL_SITE_MIX; the summary names it."""
    from tafl.cli import main

    folder = _digit_folder(tmp_path, 6)
    names = load_package(gtafl_pkg).class_names
    monkeypatch.setenv("TAFL_SITE_MIX", f"{names[7]}=90,{names[3]}=10")
    assert main(["score", str(folder), "--out", str(tmp_path / "s.csv"), "--package", str(gtafl_pkg), "--prior",
                 "site", "--no-progress"]) == 0
    assert f"decided for this site's own class mix (--prior site): {names[7]} 89.2%, {names[3]} 10.0%" in \
        capsys.readouterr().out
    monkeypatch.delenv("TAFL_SITE_MIX")
    assert main(["score", str(folder), "--out", str(tmp_path / "t.csv"), "--package", str(gtafl_pkg), "--prior",
                 "site", "--no-progress"]) != 0
    assert "--prior site decides every image for this site's own class mix" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()
