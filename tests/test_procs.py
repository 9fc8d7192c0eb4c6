"""tafl.procs: the process helpers the service launcher and the loopback Flower federation share."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tafl.errors import ServiceUnavailable
from tafl.procs import ProcessTree, free_port, kill_group, start_group, stop_group, wait_http


def _alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie may never be reaped in a container)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_file(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.05)
    return path.read_text().strip()


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_procs_imports_neither_torch_nor_serving_nor_training():
    code = ("import sys, tafl.procs; bad = [m for m in ('torch', 'tafl.serving', 'tafl.training') if m in sys.modules];"
            " sys.exit(str(bad) if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_the_whole_group_goes(tmp_path, how):
    """A child the leader started (a SuperNode's SuperExec, BentoML's workers) goes with it."""
    pid_file = tmp_path / "child.pid"
    proc = start_group(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], log_path=tmp_path / "log")
    child = int(_wait_file(pid_file))
    assert _alive(child)
    if how == "stop":
        stop_group(proc, grace=5)
    else:
        kill_group(proc)
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    stop_group(proc)  # a stopped process: nothing to do
    kill_group(proc)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_child_in_its_own_session_goes_too(tmp_path, how):
    """BentoML starts its worker in a session of its own: no signal to the group reaches it, and it
    outlives its parent (holding the port) unless the tree is remembered and killed."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys; c = subprocess.Popen(['sleep', '60'], start_new_session=True);"
            f" open({str(pid_file)!r}, 'w').write(str(c.pid)); c.wait()")
    proc = start_group([sys.executable, "-c", code], log_path=tmp_path / "log")
    child = int(_wait_file(pid_file))
    assert _alive(child) and os.getsid(child) != os.getsid(proc.pid)
    t0 = time.monotonic()
    if how == "stop":
        stop_group(proc, grace=1)  # the leader dies of SIGTERM at once; its orphan is SIGKILLed at the deadline
    else:
        kill_group(proc)
    assert proc.returncode is not None and time.monotonic() - t0 < 10
    assert not _alive(child)


def test_process_tree_stop_returns_the_leaders_status(tmp_path):
    ready = tmp_path / "ready"
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3));"
            f" open({str(ready)!r}, 'w').write('1'); time.sleep(60)")
    proc = start_group([sys.executable, "-c", code])
    _wait_file(ready)
    assert ProcessTree(proc).stop(signal.SIGTERM, grace=10) == 3


def test_stop_group_kills_what_ignores_sigterm(tmp_path):
    ready = tmp_path / "ready"
    code = (f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').write('1');"
            " time.sleep(60)")
    proc = start_group([sys.executable, "-c", code])
    _wait_file(ready)
    t0 = time.monotonic()
    stop_group(proc, grace=0.5)
    assert proc.returncode == -9 and time.monotonic() - t0 < 10


def test_start_group_appends_to_its_log(tmp_path):
    log = tmp_path / "out.log"
    log.write_text("before\n")
    proc = start_group([sys.executable, "-c", "import sys; print('out', flush=True); print('err', file=sys.stderr)"], log_path=log)
    proc.wait(20)
    assert log.read_text().split() == ["before", "out", "err"]


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/ok" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wait_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        wait_http(url + "/ok", timeout=10)
        wait_http(url + "/busy", timeout=10, ready=lambda status: status < 504)  # a 503 can count as up
        with pytest.raises(ServiceUnavailable, match=r"^the thing was not ready within 1 s; see LOG$"):
            wait_http(url + "/busy", timeout=1, interval=0.1, name="the thing", hint="; see LOG")
    finally:
        server.shutdown()
        server.server_close()


def test_wait_http_notices_an_exited_process():
    proc = start_group([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(20)
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="the service exited with code 3 while starting"):
        wait_http(f"http://127.0.0.1:{free_port()}/readyz", timeout=60, proc=proc, name="the service")
    assert time.monotonic() - t0 < 10
