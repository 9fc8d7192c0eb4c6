"""Several worker processes (TAFL_WORKERS / `tafl serve --workers`) on a real `bentoml serve`: each loads the package
and answers as one worker does, /metrics counts every worker's predictions, /models says which worker answered, and
/admin/reload, which could only change one worker, is refused with a 409 that says what to do instead."""

from __future__ import annotations

import re

import httpx
import psutil
import pytest

from tafl.errors import ConfigError
from tafl.serving.runtime import lane_threads
from tafl.serving.settings import Settings, service_workers
from tests.conftest import digit_png

ADMIN = "workers-admin-token"


def test_lane_threads_share_the_cores_among_every_call_on_the_machine():
    assert lane_threads(2, 1, 1) is None  # one call: ONNX Runtime's own choice
    assert lane_threads(2, 3, 1) == 1
    assert lane_threads(8, 2, 2) == 2
    assert lane_threads(16, 1, 2) == 8
    assert lane_threads(2, 2, 2) == 1  # never below one


def test_workers_setting_is_checked_and_shares_out_the_decoder_processes(monkeypatch):
    monkeypatch.delenv("TAFL_DECODE_PROCESSES", raising=False)
    monkeypatch.delenv("TAFL_WORKERS", raising=False)
    one = Settings.from_env()
    assert one.workers == 1
    monkeypatch.setenv("TAFL_WORKERS", "2")
    two = Settings.from_env()
    assert two.workers == 2 and two.decode_processes == max(1, one.decode_processes // 2)
    for bad in ("0", "-1", "two", "65"):
        monkeypatch.setenv("TAFL_WORKERS", bad)
        with pytest.raises(ConfigError, match="TAFL_WORKERS"):
            service_workers()


def test_the_dicom_listener_keeps_its_decoder_processes_whatever_the_service_runs(gtafl_pkg, tmp_path,
                                                                                   monkeypatch):
    """TAFL_WORKERS shares the decoder processes out among the service's workers; the listener is one process, so
    the setting (even a bad one) must not halve its pool when both read one environment."""
    from tafl.serving.dicom_listener import Destination, Listener
    from tafl.serving.settings import default_processes

    monkeypatch.delenv("TAFL_DECODE_PROCESSES", raising=False)
    for value in ("2", "junk"):
        monkeypatch.setenv("TAFL_WORKERS", value)
        lst = Listener(gtafl_pkg, Destination(ae_title="DEST", host="127.0.0.1", port=9), spool=tmp_path / value)
        assert lst.pool.processes == default_processes() and lst.settings.workers == 1
        lst.pool.close()
    monkeypatch.setenv("TAFL_DECODE_PROCESSES", "1")  # an explicit count still decides
    assert Listener(gtafl_pkg, Destination(ae_title="DEST", host="127.0.0.1", port=9),
                    spool=tmp_path / "one").pool.processes == 1


def _worker_pids(srv) -> set[int]:
    tree = psutil.Process(srv.proc.pid).children(recursive=True)
    out = set()
    for p in tree:
        try:
            if "_bentoml_impl.worker.service" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
def test_two_workers_answer_alike_count_together_and_refuse_a_reload(gtafl_pkg, tmp_path):
    from tafl.serving.launch import ServerProcess

    env = {"BENTOML_HOME": str(tmp_path / "bentoml"), "TAFL_WORKERS": "2", "TAFL_ADMIN_TOKEN": ADMIN}
    images = [digit_png(i) for i in range(4)]
    with ServerProcess([str(gtafl_pkg)], env={"BENTOML_HOME": str(tmp_path / "bentoml1")},
                       log_path=tmp_path / "one.log") as one:
        expected = [httpx.post(f"{one.url}/predict", files={"file": ("a.png", d, "image/png")}, timeout=60).json()
                    for d in images]
    with ServerProcess([str(gtafl_pkg)], env=env, log_path=tmp_path / "two.log") as srv:
        pids = _worker_pids(srv)
        assert len(pids) == 2, pids
        answered = set()
        n = 0
        for _ in range(5):
            for d, want in zip(images, expected):
                with httpx.Client(timeout=60) as c:  # a fresh connection each time: either worker may take it
                    r = c.post(f"{srv.url}/predict", files={"file": ("a.png", d, "image/png")})
                    assert r.status_code == 200, r.text[:300]
                    got = r.json()
                    n += 1
                    assert got["label"] == want["label"]
                    assert got["probabilities"] == pytest.approx(want["probabilities"], abs=1e-6)
                    m = c.get(f"{srv.url}/models").json()
                    assert m["worker"]["workers"] == 2 and m["worker"]["pid"] in pids
                    answered.add(m["worker"]["pid"])
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        total = sum(float(v) for v in re.findall(r'^tafl_predicted_class_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M))
        assert total == n  # the counter sums over the workers
        r = httpx.post(f"{srv.url}/admin/reload", json={"package": "any"},
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert r.status_code == 409, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "Conflict" and "TAFL_WORKERS" in err["message"] and "restart" in err["message"]
        assert r.headers.get("x-request-id")
    assert answered  # at least one worker answered /models (which ones the kernel chose is not asserted)
