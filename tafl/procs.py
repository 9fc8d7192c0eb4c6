"""Background processes on this machine: the helpers the service launcher (`tafl.serving.launch`)
and the loopback Flower federation (`tafl.training.flower_local`) share.

Every process is started in its own session (`start_new_session=True`), so it leads a process
group: `stop_group` and `kill_group` reach the children it started in that group (a SuperNode's
SuperExec). A child can leave the group: BentoML starts each worker in a session of its own, so a
signal to the group never reaches it, and a worker whose parent was SIGKILLed keeps the port and
answers (measured). `ProcessTree` therefore also remembers every descendant (psutil, which
BentoML itself depends on) and SIGKILLs whatever of them outlives the deadline. Standard library,
httpx, psutil, tafl.errors and tafl.settings only: neither torch nor the serving or training stack is imported here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tafl.errors import ServiceUnavailable
from tafl.settings import set_env_default

# glibc's size from which one malloc is an mmap of its own, given back to the system when freed. Left to glibc the
# threshold rises after each large free, and large buffers (uploads, decoded images) then stay on the heap, where
# fragmentation holds them: a service's workers grew by 600 MB in a 60 s soak, 190 MB with it fixed, at the same
# throughput (docs/results.md, "Serving defaults"). Read at a process's start: set it for the processes to come.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}


def bounded_malloc_for_children() -> None:
    """Processes started from here on (decoder processes, BentoML's workers) give large buffers back when freed,
    unless the environment already says otherwise."""
    for name, value in MALLOC_ENV.items():
        set_env_default(name, value)


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


class ProcessTree:
    """A child process and every descendant seen so far, also those that left its process group or
    session (BentoML's workers) and those orphaned when their parent died.

    `refresh()` records the current descendants (call it now and then while the process runs: a
    child is found through its parent, so one whose parent is gone can only be remembered).
    `stop(sig, grace)` sends `sig` to the leader (to its group with `group=True`), waits up to `grace`
    s for the leader and every remembered process to exit, then SIGKILLs whatever is left and reaps
    the leader. A process counts as gone once it is a zombie (an orphan's zombie may never be reaped
    in a container) whose threads have all exited, and psutil's identity check keeps a recycled PID
    from being signalled.
    """

    def __init__(self, proc: subprocess.Popen, *, group: bool = True):
        self.proc, self.group = proc, group
        self.known: dict[int, Any] = {}  # pid -> psutil.Process
        self.refresh()

    def refresh(self) -> None:
        import psutil

        if self.proc.poll() is not None:
            return
        try:
            leader = psutil.Process(self.proc.pid)
            for p in [leader, *leader.children(recursive=True)]:
                self.known.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def alive(self) -> list[Any]:
        """The remembered processes that still run (not the leader once it has been reaped)."""
        self.proc.poll()
        return [p for p in self.known.values() if process_running(p)]

    def send(self, sig: int) -> None:
        if self.proc.poll() is not None:
            return
        try:
            if self.group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> bool:
        """True when the leader and every remembered process have exited within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.proc.wait(max(0.0, min(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.refresh()  # a worker started late is remembered before its parent goes
            if self.proc.returncode is not None and not self.alive():
                return True
            if time.monotonic() >= deadline:
                return False

    def kill(self) -> None:
        """SIGKILL the leader's group and every remembered process that still runs; reap the leader."""
        import psutil

        self.refresh()
        if self.group:  # also members of the group whose leader has already exited
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        else:
            self.send(signal.SIGKILL)
        survivors = self.alive()
        for p in survivors:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.proc.wait()
        deadline = time.monotonic() + 5
        while any(process_running(p) for p in survivors) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> int:
        """Send `sig`, allow `grace` s for the whole tree to exit, SIGKILL the rest; the leader's returncode."""
        self.refresh()
        self.send(sig)
        if not self.wait(grace):
            self.kill()
        return self.proc.returncode


def process_running(p: Any) -> bool:
    """Not exited. A zombie counts as exited once its other threads are gone too: a SIGKILLed
    multi-threaded process (ONNX Runtime's) shows Z while its threads still exit, and until the last
    one has, its files - the listening socket - stay open (measured: the port still accepted)."""
    import psutil

    try:
        if not p.is_running():
            return False
        if p.status() != psutil.STATUS_ZOMBIE:
            return True
        try:
            return len(os.listdir(f"/proc/{p.pid}/task")) > 1
        except OSError:
            return p.num_threads() > 1
    except psutil.Error:
        return False


def stop_group(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM a process started with start_new_session=True and its group; SIGKILL the group and
    every descendant still alive (also one in a session of its own) after `grace` s."""
    if proc is None or proc.poll() is not None:
        return
    ProcessTree(proc).stop(signal.SIGTERM, grace)


def kill_group(proc: subprocess.Popen | None) -> None:
    """SIGKILL a process started with start_new_session=True, its group and its descendants, and reap it."""
    if proc is None:
        return
    ProcessTree(proc).kill()


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
