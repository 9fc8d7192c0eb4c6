"""The `tafl` command: one clear error line and a non-zero exit for bad input, and kill + resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tests.conftest import CONFIGS  # noqa: E402

TAFL = [sys.executable, "-m", "tafl.cli"]


def run(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TAFL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def assert_clean_error(res: subprocess.CompletedProcess, pattern: str) -> None:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("tafl: error:")]
    assert len(errors) == 1 and pattern in errors[0], res.stderr


@pytest.mark.parametrize("flags,pattern", [
    (["--dataset", "cifar99"], "unknown dataset 'cifar99'"),
    (["--dataset", "dermamnist", "--data-root", "/nonexistent"], "dermamnist.npz not found"),
    (["--imbalance-factor", "0.5"], "imbalance factor must be >= 1"),
    (["--alpha", "0"], "Dirichlet concentration must be > 0"),
    (["--alpha", "-1"], "Dirichlet concentration must be > 0"),
    (["--clients", "5000"], "5000 clients but only"),
])
def test_train_bad_input_is_one_clear_line(tmp_path, flags, pattern):
    res = run("train", "--config", str(CONFIGS / "smoke.yaml"), "--out", str(tmp_path / "o"), *flags)
    assert_clean_error(res, pattern)
    assert not (tmp_path / "o").exists()  # a run that failed before its first round leaves no folder behind


def test_a_failed_start_does_not_block_the_retry(tmp_path):
    """The retry with the same --out after a missing .npz is not refused as "already holds files"; a folder that
    held other things keeps them and loses only the failed run's files."""
    out = tmp_path / "o"
    assert_clean_error(run("train", "--config", str(CONFIGS / "smoke.yaml"), "--out", str(out), "--dataset",
                           "dermamnist", "--data-root", str(tmp_path)), "dermamnist.npz not found")
    res = run("train", "--config", str(CONFIGS / "smoke.yaml"), "--out", str(out), "--rounds", "1", "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "final.pt").is_file()
    # --force over that finished run, failing at the data: the earlier run is gone (as --force said), no run.json
    # of the failed one is left to block the next try
    assert_clean_error(run("train", "--config", str(CONFIGS / "smoke.yaml"), "--out", str(out), "--force",
                           "--dataset", "cifar99"), "unknown dataset")
    assert not (out / "run.json").exists() and not (out / "final.pt").exists()
    res = run("train", "--config", str(CONFIGS / "smoke.yaml"), "--out", str(out), "--rounds", "1", "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]


def test_unknown_config_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rounds: 1\nlearning_rate: 0.1\n")
    assert_clean_error(run("train", "--config", str(cfg), "--out", str(tmp_path / "o")), "unknown config key 'learning_rate'")


def test_folder_csv_with_missing_images(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "labels.csv").write_text("image_id,dx\na,nv\nb,mel\n")
    res = run("train", "--config", str(CONFIGS / "smoke.yaml"), "--out", str(tmp_path / "o"), "--dataset", "folder",
              "--data-root", str(tmp_path), "--labels", "labels.csv", "--label-column", "dx")
    assert_clean_error(res, "2 image(s) named in the labels CSV are missing")


def test_empty_class_is_an_error(tmp_path):
    from PIL import Image

    (tmp_path / "images").mkdir()
    rows = ["image_id,dx"]
    for i in range(30):
        Image.new("L", (10, 10), i).save(tmp_path / "images" / f"i{i}.png")
        rows.append(f"i{i},{'a' if i < 29 else 'b'}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    res = run("train", "--config", str(CONFIGS / "smoke.yaml"), "--out", str(tmp_path / "o"), "--dataset", "folder",
              "--data-root", str(tmp_path), "--labels", "labels.csv", "--label-column", "dx")
    assert_clean_error(res, "class(es) b have no")


def test_corrupt_checkpoint_for_eval(tmp_path):
    bad = tmp_path / "final.pt"
    bad.write_bytes(b"\x00" * 100)
    assert_clean_error(run("eval", str(bad)), "not a readable tafl checkpoint")
    assert_clean_error(run("eval", str(tmp_path / "missing.pt")), "checkpoint not found")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    assert_clean_error(run("eval", str(tmp_path / "foreign.pt")), "not a tafl checkpoint")


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "run.json").write_text("{}")
    res = run("train", "--config", str(CONFIGS / "smoke.yaml"), "--out", str(out))
    assert_clean_error(res, "--force")


@pytest.mark.slow
def test_kill_then_resume_and_eval(tmp_path):
    """A run killed mid-way continues with --resume; `tafl eval` re-creates the report from final.pt."""
    out = tmp_path / "run"
    args = [*TAFL, "train", "--config", str(CONFIGS / "smoke.yaml"), "--rounds", "6", "--out", str(out),
            "--no-progress"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240

    def past_round_one() -> bool:  # any kept checkpoint after round 1 (the run keeps only its latest two)
        return any(int(f.stem.split("_")[1]) >= 2 for f in (out / "checkpoints").glob("round_*.pt"))

    while time.time() < deadline and not past_round_one():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final.pt").exists(), "the run finished before it could be killed"
    res = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "resuming after round" in res.stderr
    ref = tmp_path / "ref"
    res = run("train", "--config", str(CONFIGS / "smoke.yaml"), "--rounds", "6", "--out", str(ref), "--no-progress")
    assert res.returncode == 0, res.stderr
    a = torch.load(out / "final.pt", weights_only=True)["state"]["weights"]
    b = torch.load(ref / "final.pt", weights_only=True)["state"]["weights"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    res = run("eval", str(out / "final.pt"), "--out", str(tmp_path / "ev"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "ev" / "report.json").is_file() and (tmp_path / "ev" / "accuracy.png").is_file()


def _drop_timing(report):
    """A report without what differs between any two runs of the same config: the seconds things took."""
    if isinstance(report, dict):
        return {k: _drop_timing(v) for k, v in report.items() if k not in ("timing", "seconds")}
    if isinstance(report, list):
        return [_drop_timing(v) for v in report]
    return report


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["train", "retrain"])
def test_ctrl_c_then_the_printed_command_finishes_the_run(tmp_path, verb, gtafl_pkg):
    """Ctrl-C (a real SIGINT) prints how the run continues; that command, run literally (no --config, no flags),
    continues with the run's own configuration and ends with the report of an uninterrupted run."""
    import json
    import re
    import shlex

    import numpy as np

    if verb == "train":  # flags that differ from every default, as a user's first command has them
        first = ["train", "--config", str(CONFIGS / "smoke.yaml"), "--method", "fedavg", "--lr", "0.07"]
    else:
        first = ["retrain", "--from", str(gtafl_pkg), "--lr", "0.07"]
    first += ["--rounds", "8", "--no-progress"]  # rounds of half a second: room for the signal to land mid-run
    out = tmp_path / "run"
    # as a terminal's foreground job: SIGINT at its default (a test run as a shell's background job inherits it
    # ignored, and so would the child, which Ctrl-C then never stops)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([*TAFL, *first, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, cwd=tmp_path)
    finally:
        signal.signal(signal.SIGINT, before)
    deadline = time.time() + 240

    def past_round_one() -> bool:  # any kept checkpoint after round 1 (the run keeps only its latest two)
        return any(int(f.stem.split("_")[1]) >= 2 for f in (out / "checkpoints").glob("round_*.pt"))

    while time.time() < deadline and not past_round_one():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the terminal's whole foreground group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert not (out / "final.pt").exists(), "the run finished before it could be interrupted"
    said = re.search(r"^tafl: interrupted; it continues with: (tafl .*)$", err, re.M)
    assert said, err
    words = shlex.split(said.group(1))
    assert "--config" not in words and "--lr" not in words  # the printed command is the short one
    res = subprocess.run([*TAFL, *words[1:]], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming after round" in res.stderr

    ref = tmp_path / "ref"
    res = run(*first, "--out", str(ref), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = (json.loads((d / "report.json").read_text()) for d in (out, ref))
    assert a["config"]["lr"] == 0.07 and a["rounds_run"] == 8
    assert _drop_timing(a) == _drop_timing(b)
    wa = torch.load(out / "final.pt", weights_only=True)["state"]["weights"]
    wb = torch.load(ref / "final.pt", weights_only=True)["state"]["weights"]
    assert all(np.array_equal(wa[k].numpy(), wb[k].numpy()) for k in wa)


def test_resume_checks_only_the_flags_given_beside_it(tmp_path):
    """--resume with a flag that contradicts the run is refused naming it; only --rounds may change."""
    out = tmp_path / "o"
    res = run("train", "--config", str(CONFIGS / "smoke.yaml"), "--method", "fedavg", "--rounds", "1",
              "--out", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]
    assert_clean_error(run("train", "--out", str(out), "--resume", "--method", "gtafl"), "'method' was 'fedavg'")
    assert_clean_error(run("train", "--out", str(tmp_path / "none"), "--resume"), "holds no tafl run")


@pytest.mark.slow
def test_demo_without_a_terminal_keeps_serving_and_its_printed_lines_answer(tmp_path):
    """The README's main command run from a script (no terminal): GTAFL on digits, the verified package, the
    service; it keeps serving, every curl line it prints answers 200 and the page it names opens; SIGTERM stops
    it and the whole server with it."""
    import re

    import httpx
    import psutil

    port = __import__("tafl.procs", fromlist=["free_port"]).free_port()
    proc = subprocess.Popen([*TAFL, "demo", "--out", str(tmp_path / "demo"), "--no-progress", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            cwd=tmp_path)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Serving until Ctrl-C"):
                break
        out = "".join(lines)
        assert "Serving until Ctrl-C" in out, out[-3000:] + proc.stderr.read()[-3000:] if proc.poll() else out
        assert "gtafl on digits: mean prior-weighted accuracy" in out
        assert "tafl-demo 1.0.0: 3 experts, hard vote" in out
        answers = re.findall(r"digit_(\d)\.png \(a (\d)\) -> class (\d), (right|WRONG)", out)
        assert len(answers) == 3 and all(a == b for a, b, _, _ in answers), out
        assert all((said == truth) == (mark == "right") for _, truth, said, mark in answers), out
        # a wrong answer is never printed without saying that the small model gets some wrong
        assert ("some samples come back wrong" in out) == any(m == "WRONG" for *_, m in answers), out
        page = re.search(r"open (http://127\.0\.0\.1:\d+/) in a browser", out)
        assert page and httpx.get(page.group(1), timeout=30).status_code == 200
        curls = [ln.strip() for ln in lines if ln.strip().startswith("curl ")]
        assert len(curls) == 3, out
        for cmd in curls:  # as a user pastes them, in the folder the demo ran in; -w appends the status
            cmd = cmd.replace("curl -s", "curl -s -w '\\nHTTP %{http_code}\\n'", 1).split(" | head")[0]
            res = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=tmp_path, timeout=60)
            assert res.stdout.rstrip().endswith("HTTP 200"), (cmd, res.stdout[-500:], res.stderr)
        time.sleep(2)
        assert proc.poll() is None  # still serving: it waits for Ctrl-C or SIGTERM, terminal or not
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, alive  # no orphaned server keeps the port
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "demo" / "package" / "model.onnx").is_file()


def test_explain_a_gtafl_resnet8_checkpoint_writes_a_png_heatmap(gtafl_run, tmp_path, capsys):
    """`tafl explain` on a CNN (GTAFL's ResNet-8 experts): a class activation map overlay, no traceback."""
    from PIL import Image

    from tafl.cli import main
    from tests.conftest import digit_png

    img, out = tmp_path / "digit.png", tmp_path / "overlay.png"
    img.write_bytes(digit_png(3))
    assert main(["explain", str(gtafl_run / "final.pt"), str(img), "--out", str(out)]) == 0
    assert "class activation map written to" in capsys.readouterr().out
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(out) as im:
        im.verify()
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == (64, 64) and im.mode == "RGB"
    # a DICOM goes through the service's decoder too (CT_small: 128x128, modality LUT, min-max)
    import pydicom.data

    dcm = pydicom.data.get_testdata_file("CT_small.dcm")
    assert main(["explain", str(gtafl_run / "final.pt"), dcm, "--out", str(out)]) == 0
    with Image.open(out) as im:
        assert im.size == (128, 128)
    bad = tmp_path / "notes.txt"
    bad.write_text("not an image")
    assert main(["explain", str(gtafl_run / "final.pt"), str(bad), "--out", str(out)]) != 0
    assert "cannot read image" in capsys.readouterr().err


def test_flower_engine_without_the_federated_extra_names_it(tmp_path, monkeypatch, capsys):
    from tafl.cli import main

    monkeypatch.setitem(sys.modules, "flwr", None)  # `import flwr` raises ImportError, as when it is not installed
    monkeypatch.delitem(sys.modules, "tafl.training.flower", raising=False)
    code = main(["train", "--config", str(CONFIGS / "smoke.yaml"), "--engine", "flower", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("tafl: error:")]
    assert len(lines) == 1 and "pip install 'tafl[federated]'" in lines[0] and "flwr" in lines[0], err
    assert not (tmp_path / "o").exists()
