"""`tafl serve` and `ServerProcess` stop the whole server on a stop signal: a real `bentoml serve`.

The tree, measured: `tafl serve` (the wrapper) -> `bentoml serve` (circus arbiter, a session of its
own) -> the worker `_bentoml_impl.worker.service` (another session of its own). Before the wrapper
forwarded signals, a SIGTERM to it left the other two running and answering 200 on the port.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tafl.procs import free_port, process_running, wait_http
from tests.conftest import digit_png

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process sessions and /proc: Linux")

ROOT = Path(__file__).resolve().parents[2]


def running(p) -> bool:
    """Not exited: a zombie (an orphan's zombie may never be reaped in a container) counts as exited
    once its other threads are gone too (until then its files, the port, stay open)."""
    return process_running(p)


def tree_of(pid: int) -> list:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def wait_gone(procs: list, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def assert_port_free(port: int) -> None:
    holders = [(c.pid, c.status) for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
               and c.status == psutil.CONN_LISTEN]
    assert not holders, f"port {port} is still listened on by {holders}"
    with socket.socket() as s:
        s.settimeout(2)
        err = s.connect_ex(("127.0.0.1", port))
        assert err == errno.ECONNREFUSED, f"port {port}: connect gave {errno.errorcode.get(err, err)}"
    with socket.socket() as s:  # nothing listens there any more (TIME_WAIT from the polls is allowed)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


class TaflServe:
    """`python -m tafl.cli serve PKG --port P` in a session of its own (as under a supervisor)."""

    def __init__(self, pkg: Path, tmp_path: Path, drain: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "serve.log"
        env = dict(os.environ, BENTOML_HOME=str(tmp_path / "bentoml_home"), BENTOML_DO_NOT_TRACK="True")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tafl.cli", "serve", str(pkg), "--port", str(self.port),
                                          "--drain-seconds", str(drain)], env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        wait_http(self.url + "/readyz", timeout=120, proc=self.proc, name="tafl serve", hint=f"; see {self.log}")
        deadline = time.monotonic() + 30
        while len(tree := tree_of(self.proc.pid)) < 3:  # the wrapper, bentoml serve, its worker
            assert time.monotonic() < deadline, f"process tree {[p.cmdline()[:3] for p in tree]}"
            time.sleep(0.2)
        self.tree = tree

    def cleanup(self) -> None:
        for p in self.tree:
            if running(p):
                p.kill()


def test_the_drain_deadline_reaches_the_worker_and_comes_from_the_environment(monkeypatch):
    from tafl.errors import ConfigError
    from tafl.serving.launch import DRAIN_SECONDS, drain_seconds_from_env, serve_command

    cmd = serve_command("127.0.0.1", 3000, drain_seconds=20)
    assert cmd[cmd.index("--timeout-graceful-shutdown") + 1] == "15"  # 5 s kept for the server to close
    assert serve_command("127.0.0.1", 3000, drain_seconds=3)[-1] == "1"
    assert "--timeout-graceful-shutdown" not in serve_command("127.0.0.1", 3000)
    monkeypatch.delenv("TAFL_DRAIN_SECONDS", raising=False)
    assert drain_seconds_from_env() == DRAIN_SECONDS == 20
    monkeypatch.setenv("TAFL_DRAIN_SECONDS", "7.5")
    assert drain_seconds_from_env() == 7.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("TAFL_DRAIN_SECONDS", bad)
        with pytest.raises(ConfigError, match="TAFL_DRAIN_SECONDS"):
            drain_seconds_from_env()


@pytest.fixture
def tafl_serve(gtafl_pkg, tmp_path):
    started: list[TaflServe] = []

    def start(drain: float = 20.0) -> TaflServe:
        started.append(TaflServe(gtafl_pkg, tmp_path, drain))
        return started[-1]

    yield start
    for s in started:
        s.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_tafl_serve_stops_the_whole_server(tafl_serve, sig):
    srv = tafl_serve(drain=20)
    wrapper, server = srv.tree[0], srv.tree[1]
    worker = next(p for p in srv.tree if "_bentoml_impl.worker" in " ".join(p.cmdline()))
    assert "bentoml" in " ".join(server.cmdline())
    assert any("multiprocessing" in " ".join(p.cmdline()) for p in srv.tree)  # the decoder processes go too
    assert os.getsid(worker.pid) != os.getsid(wrapper.pid)  # the reason a group signal never reached it
    assert httpx.post(srv.url + "/predict", files={"file": ("a.png", digit_png(1), "image/png")},
                      timeout=60).status_code == 200
    t0 = time.monotonic()
    os.kill(srv.proc.pid, sig)  # the wrapper only, as a supervisor's stop
    status = srv.proc.wait(30)
    took = time.monotonic() - t0
    assert status == 0, srv.log.read_text()[-2000:]
    assert took < 20, f"stopped after {took:.1f} s"
    assert not wait_gone(srv.tree, 2), f"still running: {[p.pid for p in srv.tree if running(p)]}"
    assert_port_free(srv.port)
    assert f"tafl serve: {signal.Signals(sig).name}: stopping the service" in srv.log.read_text()


def _slow_upload(url: str, data: bytes, seconds: float, sent_first: threading.Event, out: dict) -> None:
    """POST /predict whose multipart body trickles in over `seconds`: a request in flight."""
    req = httpx.Request("POST", url + "/predict", files={"file": ("slow.png", data, "image/png")})
    body = req.read()
    pieces = 20
    step = -(-len(body) // pieces)

    def trickle():
        for i in range(0, len(body), step):
            yield body[i:i + step]
            sent_first.set()
            time.sleep(seconds / pieces)

    headers = {"Content-Type": req.headers["Content-Type"], "Content-Length": str(len(body))}
    try:
        r = httpx.post(url + "/predict", content=trickle(), headers=headers, timeout=60)
        out["status"], out["body"], out["done"] = r.status_code, r.json(), time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported by the test
        out["error"], out["done"] = repr(exc), time.monotonic()


@pytest.mark.slow
def test_a_request_in_flight_at_sigterm_still_gets_its_answer(tafl_serve):
    srv = tafl_serve(drain=20)
    sent_first, out = threading.Event(), {}
    client = threading.Thread(target=_slow_upload, args=(srv.url, digit_png(3), 4.0, sent_first, out))
    client.start()
    assert sent_first.wait(30)
    time.sleep(0.5)  # the request is being read by the worker
    t0 = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGTERM)
    time.sleep(1.0)
    with pytest.raises(httpx.HTTPError):  # a draining server takes no new request
        httpx.get(srv.url + "/readyz", timeout=3)
    status = srv.proc.wait(30)
    took = time.monotonic() - t0
    client.join(30)
    assert "error" not in out, out.get("error")
    assert out["status"] == 200 and "class_name" in out["body"], out
    assert out["done"] - t0 > 1.5  # it was answered while the server drained, not before the signal
    assert status == 0 and took < 20, (status, took, srv.log.read_text()[-2000:])
    assert not wait_gone(srv.tree, 2)
    assert_port_free(srv.port)


@pytest.mark.slow
def test_a_server_that_does_not_stop_is_killed_at_the_deadline(tafl_serve):
    srv = tafl_serve(drain=3)
    server = srv.tree[1]
    server.suspend()  # SIGSTOP: bentoml serve can no longer act on the SIGTERM it is sent
    t0 = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGTERM)
    status = srv.proc.wait(30)
    took = time.monotonic() - t0
    assert status == 128 + signal.SIGKILL, srv.log.read_text()[-2000:]  # the server's status, as a shell says
    assert 3 <= took < 10
    assert not wait_gone(srv.tree, 5), "the worker (a session of its own) outlived its killed parent"
    assert_port_free(srv.port)
    assert "did not stop within 3 s; killing it" in srv.log.read_text()


@pytest.mark.slow
def test_a_sigkilled_wrapper_takes_the_server_with_it(tafl_serve):
    """Nobody forwards anything then: the server gets SIGTERM from the kernel (PR_SET_PDEATHSIG)."""
    srv = tafl_serve(drain=20)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    assert not wait_gone(srv.tree, 20), f"still running: {[p.cmdline()[:3] for p in srv.tree if running(p)]}"
    assert_port_free(srv.port)


@pytest.mark.slow
def test_server_process_stop_leaves_no_worker_behind(gtafl_pkg, tmp_path):
    """`ServerProcess.stop` (tests, the demo): also when its SIGTERM is not obeyed and the group is
    SIGKILLed, the worker in its own session goes too (before: it kept the port and answered)."""
    from tafl.serving.launch import ServerProcess

    srv = ServerProcess([str(gtafl_pkg)], env={"BENTOML_HOME": str(tmp_path / "home")},
                        log_path=tmp_path / "service.log").start()
    tree: list = []
    try:
        deadline = time.monotonic() + 30
        while len(tree := tree_of(srv.proc.pid)) < 2:  # bentoml serve and its worker
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert len(tree) >= 2
        tree[0].suspend()
        t0 = time.monotonic()
        srv.stop(grace=2)
        assert time.monotonic() - t0 < 10
        assert not wait_gone(tree, 5), f"still running: {[p.cmdline()[:3] for p in tree if running(p)]}"
        assert_port_free(srv.port)
    finally:
        for p in tree:
            if running(p):
                p.kill()
