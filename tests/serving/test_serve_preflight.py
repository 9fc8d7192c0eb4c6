"""Issue 32: `tafl serve` checks before it starts (launch.preflight), one line per error; a second server never
touches a running one's /metrics; bad TAFL_* numbers name their variable; the service stops without leaking
semaphores. Real servers (`bentoml serve` on 127.0.0.1), no mocks."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tafl.errors import ConfigError, PackageError
from tafl.procs import free_port
from tests.conftest import digit_png

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, BENTOML_DO_NOT_TRACK="True", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _tafl_serve(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tafl.cli", "serve", *args], env=env, cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


# ------------------------------------------------------------------ TAFL_* numbers
@pytest.mark.parametrize("name, bad, says", [
    ("TAFL_MAX_FRAMES", "64k", "TAFL_MAX_FRAMES must be a whole number, got '64k'"),
    ("TAFL_MAX_FRAMES", "0", "TAFL_MAX_FRAMES must be positive, got '0'"),
    ("TAFL_MAX_PIXELS", "5.5e0", "TAFL_MAX_PIXELS must be a whole number, got '5.5e0'"),
    ("TAFL_MAX_UPLOAD_MB", "lots", "TAFL_MAX_UPLOAD_MB must be a number, got 'lots'"),
    ("TAFL_MAX_UPLOAD_MB", "-1", "TAFL_MAX_UPLOAD_MB must be positive, got '-1'"),
    ("TAFL_REQUEST_TIMEOUT_S", "nan", "TAFL_REQUEST_TIMEOUT_S must be a number, got 'nan'"),
    ("TAFL_BATCH_WAIT_MS", "-2", "TAFL_BATCH_WAIT_MS must be at least 0, got '-2'"),
    ("TAFL_DECODE_PROCESSES", "-1", "TAFL_DECODE_PROCESSES must be at least 0, got '-1'"),
    ("TAFL_ORT_THREADS", "two", "TAFL_ORT_THREADS must be a whole number, got 'two'"),
    ("TAFL_MODEL_LANES", "-1", "TAFL_MODEL_LANES must be at least 0, got '-1'"),
    ("TAFL_MAX_BATCH", "1.5", "TAFL_MAX_BATCH must be a whole number, got '1.5'"),
    ("TAFL_PRIOR_WINDOW", "x", "TAFL_PRIOR_WINDOW must be a whole number"),
    ("TAFL_PRIOR_REFRESH", "0", "TAFL_PRIOR_REFRESH must be positive"),
    ("TAFL_PRIOR_MIN_IMAGES", "1e", "TAFL_PRIOR_MIN_IMAGES must be a whole number"),
    ("TAFL_MAX_BATCH_FILES", "", None),  # blank: the default
    ("TAFL_MAX_REQUEST_FRAMES", "1k", "TAFL_MAX_REQUEST_FRAMES must be a whole number"),
    ("TAFL_MAX_REQUEST_PIXELS", "1e8", None),  # an integral float literal is a whole number
    ("TAFL_MAX_CONCURRENCY", "many", "TAFL_MAX_CONCURRENCY must be a whole number, got 'many'"),
    ("TAFL_PRIOR_ADAPTIVE", "sometimes", "TAFL_PRIOR_ADAPTIVE must be checked or always"),
])
def test_a_bad_tafl_setting_is_one_config_error_naming_it(monkeypatch, name, bad, says):
    from tafl.serving.settings import check_service_env

    monkeypatch.setenv(name, bad)
    if says is None:
        check_service_env()
        return
    with pytest.raises(ConfigError) as exc:
        check_service_env()
    assert says in exc.value.message and "\n" not in exc.value.message


def test_settings_read_their_numbers(monkeypatch):
    from tafl.serving.settings import Settings

    for k in ("TAFL_MAX_FRAMES", "TAFL_ORT_THREADS", "TAFL_MAX_PIXELS", "TAFL_MAX_UPLOAD_MB", "TAFL_MODEL_LANES"):
        monkeypatch.delenv(k, raising=False)
    s = Settings.from_env()
    assert (s.max_frames, s.ort_threads, s.max_pixels, s.max_upload_bytes) == (64, None, 50_000_000, 50 * 2**20)
    assert s.model_lanes is None  # unset: one lane
    monkeypatch.setenv("TAFL_MAX_FRAMES", " 12 ")
    monkeypatch.setenv("TAFL_ORT_THREADS", "3")
    monkeypatch.setenv("TAFL_MAX_PIXELS", "5e7")
    monkeypatch.setenv("TAFL_MAX_UPLOAD_MB", "0.5")
    monkeypatch.setenv("TAFL_MODEL_LANES", "4")
    s = Settings.from_env()
    assert (s.max_frames, s.ort_threads, s.max_pixels, s.max_upload_bytes) == (12, 3, 50_000_000, 2**19)
    assert s.model_lanes == 4


def test_bentoml_serve_with_a_bad_setting_logs_it_and_exits(tmp_path):
    """The service started by `bentoml serve` itself: one line naming the variable, exit status 2, at once
    (before: a worker traceback every 10 s, restarted for ever)."""
    from tafl.serving.launch import serve_command

    env = _env(BENTOML_HOME=str(tmp_path / "home"), TAFL_MAX_FRAMES="64k", TAFL_PACKAGES=str(tmp_path / "none"))
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "bentoml", *serve_command("127.0.0.1", free_port())[3:]]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    log = out.stdout + out.stderr
    assert out.returncode == 2, log[-2000:]
    assert "TAFL_MAX_FRAMES must be a whole number, got '64k'" in log
    assert "Traceback" not in log and time.monotonic() - t0 < 60


def test_tafl_serve_with_a_bad_setting_says_one_line(tmp_path):
    out = _tafl_serve([str(tmp_path), "--port", str(free_port())],
                      _env(BENTOML_HOME=str(tmp_path / "home"), TAFL_MAX_FRAMES="64k"))
    assert out.returncode == 2
    assert out.stderr.strip() == "tafl: error: TAFL_MAX_FRAMES must be a whole number, got '64k'"


# ------------------------------------------------------------------ preflight: packages and port
def test_preflight_names_a_missing_folder_and_a_run_folder(tmp_path):
    from tafl.serving.launch import preflight

    with pytest.raises(PackageError, match="model package folder not found: packages/does-not-exist"):
        preflight(["packages/does-not-exist"], "127.0.0.1", free_port())
    run = tmp_path / "run"
    run.mkdir()
    (run / "final.pt").write_bytes(b"x")
    (run / "run.json").write_text("{}")
    with pytest.raises(PackageError) as exc:
        preflight([str(run)], "127.0.0.1", free_port())
    assert exc.value.message == (f"{run} is a training run folder, not a model package; make one with: "
                                 f"tafl export {run / 'final.pt'} --out PKG")
    (run / "final.pt").unlink()
    with pytest.raises(PackageError, match="training run folder without a final model"):
        preflight([str(run)], "127.0.0.1", free_port())


def test_preflight_checks_the_port(gtafl_pkg):
    from tafl.serving.launch import check_port, preflight

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError) as exc:
            preflight([str(gtafl_pkg)], "127.0.0.1", port)
        assert exc.value.message == (f"port {port} on 127.0.0.1 is in use (by another service?); choose another "
                                     "with --port")
        with pytest.raises(ConfigError, match="is in use"):  # a listener on 127.0.0.1 blocks 0.0.0.0 too
            check_port("0.0.0.0", port)
    pkgs = preflight([str(gtafl_pkg)], "127.0.0.1", port)  # free again
    assert [p.name for p in pkgs] == ["derm-gtafl"]
    with pytest.raises(ConfigError, match="--host must be an IP address"):
        check_port("localhost", port)
    with pytest.raises(ConfigError, match="not an address of this machine"):
        check_port("192.0.2.1", port)  # TEST-NET-1: never local
    for bad in (0, 70000):
        with pytest.raises(ConfigError, match="--port must be"):
            check_port("127.0.0.1", bad)
    with pytest.raises(PackageError, match="both named 'derm-gtafl'"):
        preflight([str(gtafl_pkg), str(gtafl_pkg)], "127.0.0.1", port)


def test_preflight_refuses_a_tampered_package(gtafl_pkg, tmp_path):
    from tafl.serving.launch import preflight

    pkg = tmp_path / "pkg"
    shutil.copytree(gtafl_pkg, pkg)
    (pkg / "README.md").write_text((pkg / "README.md").read_text() + "\nedited")
    with pytest.raises(PackageError, match="README.md"):
        preflight([str(pkg)], "127.0.0.1", free_port())


# ------------------------------------------------------------------ two servers, one BENTOML_HOME
def _predicted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tafl_predicted_class_total{"))


@pytest.mark.slow
def test_a_second_server_never_touches_the_first_ones_metrics(gtafl_pkg, tmp_path):
    """BentoML empties $BENTOML_HOME/prometheus_multiproc_dir whenever a server starts, even one that then
    fails to bind: a second `tafl serve` on the busy port emptied the running service's /metrics. Each server
    now has a folder of its own; the second one fails with one line; the first one's counters stay."""
    from tafl.serving.launch import (EXIT_PORT_IN_USE, PROMETHEUS_ENV, ServerProcess, prometheus_dir,
                                     serve_command, service_env)

    home = tmp_path / "bentoml_home"
    env = {"BENTOML_HOME": str(home)}
    first = ServerProcess([str(gtafl_pkg)], env=env, log_path=tmp_path / "first.log").start()
    try:
        for i in range(3):
            assert httpx.post(first.url + "/predict", files={"file": ("a.png", digit_png(i), "image/png")},
                              timeout=60).status_code == 200
        assert _predicted(first.url) == 3
        assert first.prometheus_dir and any(Path(first.prometheus_dir).iterdir())

        # `tafl serve` on the same port: the check, before anything starts
        out = _tafl_serve([str(gtafl_pkg), "--port", str(first.port)], _env(BENTOML_HOME=str(home)))
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [
            f"tafl: error: port {first.port} on 127.0.0.1 is in use (by another service?); choose another with --port"]
        assert _predicted(first.url) == 3

        # a ServerProcess checks the port too (else the first server's /readyz would pass for its own)
        with pytest.raises(ConfigError, match=f"port {first.port} on 127.0.0.1 is in use"):
            ServerProcess([str(gtafl_pkg)], port=first.port, env=env, log_path=tmp_path / "second.log").start()

        # past the check (a port taken between check and bind): BentoML itself fails to bind, which used to
        # clear the shared folder first; the server command ends with EXIT_PORT_IN_USE, not a 56-line traceback
        prom = prometheus_dir()
        try:
            out = subprocess.run(serve_command("127.0.0.1", first.port),
                                 env=service_env([str(gtafl_pkg)], None, {**env, PROMETHEUS_ENV: prom}),
                                 capture_output=True, text=True, timeout=120)
        finally:
            shutil.rmtree(prom, ignore_errors=True)
        assert out.returncode == EXIT_PORT_IN_USE, out.stderr[-2000:]
        assert "Traceback" not in out.stdout + out.stderr
        assert _predicted(first.url) == 3
        assert httpx.get(first.url + "/readyz", timeout=10).status_code == 200

        # a second server on another port with the same BENTOML_HOME counts its own predictions only
        with ServerProcess([str(gtafl_pkg)], env=env, log_path=tmp_path / "third.log") as third:
            assert third.prometheus_dir != first.prometheus_dir
            assert httpx.post(third.url + "/predict", files={"file": ("a.png", digit_png(5), "image/png")},
                              timeout=60).status_code == 200
            assert _predicted(third.url) == 1
            assert _predicted(first.url) == 3
            third_dir = Path(third.prometheus_dir)
        assert not third_dir.exists()  # removed at stop
        assert _predicted(first.url) == 3
        assert PROMETHEUS_ENV not in os.environ
    finally:
        first_dir = first.prometheus_dir
        first.stop()
    assert first_dir and not Path(first_dir).exists()
    log = (tmp_path / "first.log").read_text()
    # issue 32 item 5: the decoder processes' queues were never released (uvicorn re-raises SIGTERM after its
    # shutdown, so no atexit handler runs): multiprocessing's resource tracker printed "5 leaked semaphore
    # objects" at every stop
    assert "Running cleanup hook" in log and "leaked semaphore" not in log, log[-2000:]
