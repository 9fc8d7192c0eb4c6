"""A deployment install (`pip install tafl`: the core, no `train` extra) serves, predicts and scores without torch.

`test_a_core_install_serves_predicts_and_scores` runs only where torch is absent: CI's core part (`.ci/run core`,
a venv with `.[dev]` and the packages part 1 exported with torch, named by TAFL_TEST_PACKAGES). There any torch
import on these paths would fail outright; on top of that each `tafl` process (and the service's worker, through
the shared libraries it maps) is checked for the training stack's modules, which `.[dev]` partly installs
(scikit-learn, SciPy). Where torch is installed it skips: that venv cannot show a deployment runs without it.
`test_the_deployment_modules_import_no_training_stack` runs everywhere: with torch installed, it is the check that
the serving, client and listener modules never import it.
"""

from __future__ import annotations

import ast
import csv
import importlib.metadata as md
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import digit_png

# top-level modules of the `train` extra and of what it pulls (scikit-learn brings SciPy); none may load on the
# deployment paths
TRAIN_ONLY = ("torch", "torchvision", "timm", "medmnist", "matplotlib", "onnx", "onnxscript", "sklearn", "scipy")
# the `train` extra's distributions that `.[dev]` does not install too
TRAIN_DISTRIBUTIONS = ("torch", "torchvision", "timm", "medmnist", "matplotlib", "onnx", "onnxscript")

# `tafl ARGS...` in a fresh interpreter that reports, as its last line, which TRAIN_ONLY modules it imported
TAFL = f"""
import sys
from tafl.cli import main
try:
    rc = main(sys.argv[1:])
finally:
    print("TRAIN_ONLY_MODULES", sorted({{m.split(".")[0] for m in sys.modules}} & set({TRAIN_ONLY!r})), flush=True)
sys.exit(rc)
"""


def train_modules(output: str) -> list[str]:
    """The TRAIN_ONLY modules a TAFL process reported; fails if it did not get to report."""
    lines = [ln for ln in output.splitlines() if ln.startswith("TRAIN_ONLY_MODULES ")]
    assert lines, f"the process did not report its modules:\n{output[-3000:]}"
    return ast.literal_eval(lines[-1].split(" ", 1)[1])


def tafl(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TAFL, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_the_deployment_modules_import_no_training_stack():
    code = ("import sys, tafl.cli, tafl.serving.service, tafl.serving.launch, tafl.serving.dicom_listener, "
            "tafl.clients, tafl.clients.score, tafl.clients.validate, tafl.clients.validate_report, tafl.packaging, tafl.packaging.signing, tafl.prior, "
            "tafl.imaging.dicom_sr; tafl.cli.build_parser(); "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({TRAIN_ONLY!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", f"deployment modules import the training stack: {res.stdout}"


def _mapped_files(pids: list[int]) -> dict[int, list[str]]:
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = [m.path for m in psutil.Process(pid).memory_maps()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="torch is installed here, so this venv cannot show that a deployment runs without it; "
                           "CI's core part (.ci/run core) runs this test")
def test_a_core_install_serves_predicts_and_scores(gtafl_pkg, tmp_path):
    import httpx

    from tafl.procs import ProcessTree, free_port, wait_http

    installed = []
    for name in TRAIN_DISTRIBUTIONS:
        try:
            installed.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    assert not installed, f"not a core install: the train extra's {installed} are installed"

    images = tmp_path / "images"
    images.mkdir()
    for i in (0, 3, 8):
        (images / f"digit_{i}.png").write_bytes(digit_png(i))
    files = sorted(str(p) for p in images.iterdir())

    # `tafl serve`: the wrapper, `bentoml serve` and the worker that loads the package
    port = free_port()
    env = {**os.environ, "BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "True"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", TAFL, "serve", str(gtafl_pkg), "--port", str(port),
                                 "--drain-seconds", "10"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    tree = ProcessTree(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/readyz", timeout=180, proc=proc, name="tafl serve", hint=f"; see {log}")
        tree.refresh()

        # `tafl predict` against it
        pred = tafl("predict", *files, "--url", url, "--json", env=env)
        assert pred.returncode == 0, pred.stderr[-3000:]
        assert train_modules(pred.stdout) == []
        rows = json.loads(pred.stdout[:pred.stdout.rindex("TRAIN_ONLY_MODULES")])
        assert [r["file"] for r in rows] == files
        assert all(isinstance(r["label"], int) and 0 <= r["probability"] <= 1 for r in rows), rows
        assert {r["model"]["name"] for r in rows} == {"derm-gtafl"}
        served = {Path(r["file"]).name: r["label"] for r in rows}

        # the worker ran the model (ONNX Runtime's extension is mapped into it) and maps nothing of the training
        # stack; a Python import of any of these packages loads its shared libraries (libtorch, SciPy's, ...)
        tree.refresh()
        maps = _mapped_files([p for p in tree.known if p != proc.pid] + [proc.pid])
        runners = [pid for pid, paths in maps.items() if any("onnxruntime_pybind11_state" in p for p in paths)]
        assert runners, f"no process of the service tree loaded ONNX Runtime: {sorted(maps)}"
        marks = [f"/site-packages/{m}/" for m in TRAIN_ONLY] + [f"/site-packages/{m}.libs/" for m in TRAIN_ONLY]
        loaded = sorted({p for paths in maps.values() for p in paths if any(k in p for k in marks)})
        assert not loaded, f"the service maps the training stack's libraries: {loaded[:5]}"
        assert httpx.get(url + "/models", timeout=30).status_code == 200
    finally:
        stopped = False
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the wrapper drains the service and returns from main()
            stopped = tree.wait(60)
        if not stopped:
            tree.kill()
    assert stopped and proc.returncode == 0, f"`tafl serve` did not stop cleanly on SIGTERM (see {log})"
    text = log.read_text(errors="replace")
    assert train_modules(text) == [], text[-3000:]  # `tafl serve` itself, after its clean stop

    # `tafl score --package`: in-process with ONNX Runtime; the same graph answers as the service did
    results = tmp_path / "x.csv"
    sc = tafl("score", str(images), "--out", str(results), "--package", str(gtafl_pkg), "--no-progress", env=env)
    assert sc.returncode == 0, sc.stderr[-3000:]
    assert train_modules(sc.stdout) == []
    with open(results, newline="") as fh:
        scored = {Path(r["path"]).name: int(r["label"]) for r in csv.DictReader(fh)}
    assert scored == served
