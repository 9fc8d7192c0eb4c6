"""Background processes on this machine: the helpers the service launcher (`tafl.serving.launch`)
and the loopback Flower federation (`tafl.training.flower_local`) share.

Every process is started in its own session (`start_new_session=True`), so it leads a process
group: `stop_group` and `kill_group` reach the children it started too (a SuperNode's SuperExec,
BentoML's workers). Standard library, httpx and tafl.errors only: neither torch nor the serving or
training stack is imported here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tafl.errors import ServiceUnavailable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(args: Sequence[str], *, env: dict[str, str] | None = None,
                log_path: str | Path | None = None) -> subprocess.Popen:
    """Start `args` as the leader of a new process group; stdout and stderr append to `log_path`
    (discarded without one)."""
    if log_path is None:
        return subprocess.Popen(list(args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
    with open(log_path, "ab") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(list(args), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM a process started with start_new_session=True and its group; SIGKILL after `grace` s."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        kill_group(proc)
    except ProcessLookupError:
        pass


def kill_group(proc: subprocess.Popen | None) -> None:
    """SIGKILL a process started with start_new_session=True and its group, and reap it."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_http(url: str, *, timeout: float, proc: subprocess.Popen | None = None, name: str = "the process",
              hint: str = "", ready: Callable[[int], bool] = lambda status: status == 200,
              interval: float = 0.3) -> None:
    """Poll `url` until its status satisfies `ready`. ServiceUnavailable when `proc` exits first or
    `timeout` s pass; `hint` ("; see LOG") ends the message."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServiceUnavailable(f"{name} exited with code {proc.returncode} while starting{hint}")
        try:
            if ready(httpx.get(url, timeout=2).status_code):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise ServiceUnavailable(f"{name} was not ready within {timeout:.0f} s{hint}")
        time.sleep(interval)
