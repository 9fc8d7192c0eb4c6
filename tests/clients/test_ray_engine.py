"""`tafl score --engine ray`: the same rows as in-process, a killed actor retried, a killed driver resumed.

One local Ray (2 CPUs, a small object store, no dashboard) serves the module; the driver-kill test runs the CLI
in a subprocess that joins it (--address) and is killed, then reruns it with a local Ray of its own.
Without Ray Data (the `ray` extra) every test but the missing-extra one skips.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tafl.clients.score import score_folder
from tafl.errors import ConfigError
from tests.clients.test_clients import _image_folder
from tests.conftest import SHARED_DATA, digit_png

TAFL = [sys.executable, "-m", "tafl.cli"]
ACTOR = "MapBatches(ScoreBatch)"  # in the process title Ray gives each scoring actor


def _no_ray_data() -> bool:
    try:  # found without importing: no Ray start-up cost at collection, and no package trained to skip after
        return any(importlib.util.find_spec(m) is None for m in ("ray", "pyarrow", "pandas"))
    except (ImportError, ValueError):
        return True


needs_ray = pytest.mark.skipif(_no_ray_data(), reason="Ray Data is not installed (pip install 'tafl[ray]')")


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(address="local", num_cpus=2, object_store_memory=128 * 2**20, include_dashboard=False,
             logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _many(root: Path, n: int) -> Path:
    """n images: HAM10000 JPEGs (linked) where ../shared/data has them, else digit PNGs."""
    folder = root / "many"
    folder.mkdir()
    ham = sorted((SHARED_DATA / "ham10000" / "images").glob("*.jpg"))[:n]
    for p in ham:
        (folder / p.name).symlink_to(p)
    for i in range(len(ham), n):
        (folder / f"d{i:05d}.png").write_bytes(digit_png(i % 100))
    return folder


def test_a_missing_extra_names_it(tmp_path, gtafl_pkg, monkeypatch, capsys):
    from tafl.cli import main

    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.png").write_bytes(digit_png(1))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where the extra is not installed
    monkeypatch.setitem(sys.modules, "ray.data", None)
    with pytest.raises(ConfigError, match=r"pip install 'tafl\[ray\]'"):
        score_folder(folder, tmp_path / "r.csv", package=str(gtafl_pkg), engine="ray", progress=False)
    assert not (tmp_path / "r.csv").exists()
    rc = main(["score", str(folder), "--out", str(tmp_path / "r.csv"), "--package", str(gtafl_pkg), "--engine", "ray"])
    assert rc == 2 and "tafl[ray]" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--package"):
        score_folder(folder, tmp_path / "r.csv", url="http://127.0.0.1:9", engine="ray", progress=False)
    with pytest.raises(ConfigError, match="--engine ray"):
        score_folder(folder, tmp_path / "r.csv", package=str(gtafl_pkg), workers=2, progress=False)


@needs_ray
def test_ray_gives_the_in_process_rows_labels_priors_and_summary(local_ray, gtafl_pkg, tmp_path):
    folder = _image_folder(tmp_path)
    for prior in ("train", "adaptive"):
        here = score_folder(folder, tmp_path / f"local-{prior}.csv", package=str(gtafl_pkg), batch_size=16,
                            progress=False, prior=prior)
        ray = score_folder(folder, tmp_path / f"ray-{prior}.csv", package=str(gtafl_pkg), batch_size=16,
                           progress=False, prior=prior, engine="ray", workers=2)
        a = {r["path"]: r for r in _rows(tmp_path / f"local-{prior}.csv")}
        b = {r["path"]: r for r in _rows(tmp_path / f"ray-{prior}.csv")}
        assert list(a[next(iter(a))]) == list(b[next(iter(b))]), "other columns"
        assert set(a) == set(b) and len(b) == len(_rows(tmp_path / f"ray-{prior}.csv")) == here["images"]
        scored = [p for p in a if not a[p]["error"]]
        assert len(scored) >= 40
        for p in a:
            ra, rb = a[p], b[p]
            assert {k: v for k, v in ra.items() if k != "probability" and not k.startswith("p")} == \
                   {k: v for k, v in rb.items() if k != "probability" and not k.startswith("p")}, p
            for k in ra:
                if (k == "probability" or k[:1] == "p" and k[1:].isdigit()) and ra[k]:
                    assert abs(float(ra[k]) - float(rb[k])) <= 1e-5, (p, k)
        if (SHARED_DATA / "dicom").is_dir():
            assert b["radiology/deflated.dcm"]["error"].startswith("415")  # unreadable: an error row, as here
        for key in ("images", "scored_now", "already_done", "predicted", "skipped", "class_mix"):
            assert here[key] == ray[key], key
        assert sorted(here["failed"]) == sorted(ray["failed"])
        if prior == "adaptive":
            assert ray["prior"]["used"] == here["prior"]["used"] == "adaptive"
            assert all(abs(ray["prior"]["estimate"][n] - v) < 1e-5 for n, v in here["prior"]["estimate"].items())


@needs_ray
def test_a_killed_actor_is_retried_and_every_input_appears_once(local_ray, gtafl_pkg, tmp_path):
    folder = _many(tmp_path, 1200)
    me = psutil.Process()
    killed: list[int] = []
    seen = [0]

    def on_row(row):
        seen[0] += 1
        if seen[0] == 100:  # part-way: one of the two actors dies with whatever batch it holds
            actors = [p for p in me.children(recursive=True) if ACTOR in " ".join(p.cmdline())]
            assert actors, "no scoring actor found among this test's processes"
            actors[0].send_signal(signal.SIGKILL)
            killed.append(actors[0].pid)

    s = score_folder(folder, tmp_path / "r.csv", package=str(gtafl_pkg), batch_size=8, progress=False,
                     engine="ray", workers=2, on_row=on_row)
    assert killed and not psutil.pid_exists(killed[0])
    paths = [r["path"] for r in _rows(tmp_path / "r.csv")]
    assert len(paths) == len(set(paths)) == 1200 == s["images"], "an input lost or scored twice"
    assert s["predicted"] == 1200 and not s["failed"]


@needs_ray
def test_a_killed_driver_leaves_a_file_the_rerun_completes_without_duplicates(local_ray, gtafl_pkg, tmp_path):
    folder = _many(tmp_path, 1500)
    out = tmp_path / "r.csv"
    args = [*TAFL, "score", str(folder), "--out", str(out), "--package", str(gtafl_pkg), "--engine", "ray",
            "--workers", "2", "--batch-size", "8", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # the killed driver joins the module's Ray (--address: a cluster outlives its drivers); the rerun starts and
    # stops a local Ray of its own (no --address)
    address = local_ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(args + ["--address", address], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and (not out.exists() or out.read_text().count("\n") < 200):
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = _rows(out)
    assert 150 < len(partial) < 1450, f"not killed part-way ({len(partial)} rows)"
    with open(out, "ab") as fh:  # a kill in the middle of a write: the torn line is dropped and scored again
        fh.write(b'"derm/half-written.jpg",3,mel')
    r = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = _rows(out)
    paths = [x["path"] for x in rows]
    assert len(paths) == len(set(paths)) == 1500, "an input lost or scored twice"
    assert {x["path"] for x in partial} <= set(paths)
    assert f"{1500 - len(partial)} scored now, {len(partial)} already in" in r.stdout
    assert all(x["model_version"] and not x["error"] for x in rows)
