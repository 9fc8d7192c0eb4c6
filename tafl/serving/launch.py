"""Starting the service for local use: `tafl serve` and the service half of `tafl demo`.

`serve` verifies the packages first (a clear error beats a worker that dies at start), then runs
`bentoml serve` on 127.0.0.1 by default with TAFL_PACKAGES set, and stays its parent: SIGTERM,
SIGINT and SIGHUP are forwarded to it, it gets `drain_seconds` to finish the requests in flight and
exit, and whatever is left of its tree is then SIGKILLed, so a supervisor's stop or restart never
leaves an orphan holding the port. BentoML starts its worker in a session of its own: a signal to
the wrapper's process group does not reach it, and a worker whose `bentoml serve` parent was
SIGKILLed keeps answering (measured), which is why the wrapper does not simply exec the server.
`ServerProcess` starts the same command in the background, waits for /readyz, and stops the whole
tree; tests and the demo use it. The process helpers live in `tafl.procs` (re-exported here:
`free_port`, `stop_group`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tafl.errors import ConfigError
from tafl.procs import ProcessTree, free_port, start_group, stop_group, wait_http
from tafl.serving.runtime import resolve_package

__all__ = ["DRAIN_SECONDS", "SERVICE", "ServerProcess", "drain_seconds_from_env", "free_port", "serve",
           "serve_command", "service_env", "stop_group"]

SERVICE = "tafl.serving.service:TaflService"
DRAIN_SECONDS = 20.0  # fits Kubernetes' default 30 s grace period; systemd allows 90 s, `docker stop` only 10 s
EXIT_MARGIN = 5.0  # of the drain deadline, kept for the server to close down after its last request


def drain_seconds_from_env(default: float = DRAIN_SECONDS) -> float:
    raw = os.environ.get("TAFL_DRAIN_SECONDS", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"TAFL_DRAIN_SECONDS must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"TAFL_DRAIN_SECONDS must be positive, got {raw!r}")
    return value


def serve_command(host: str, port: int, target: str = SERVICE, drain_seconds: float | None = None) -> list[str]:
    """`target`: the service's import path, or a built bento's tag (`tafl:latest`). With `drain_seconds`
    the worker (uvicorn) waits at most that long, less EXIT_MARGIN, for requests in flight when it is
    told to stop, then cancels them (BentoML's hidden `--timeout-graceful-shutdown`; without it a
    stuck request holds the shutdown forever)."""
    cmd = [sys.executable, "-m", "bentoml", "serve", target, "--host", host, "--port", str(port)]
    if drain_seconds is not None:
        cmd += ["--timeout-graceful-shutdown", str(max(1, int(drain_seconds - EXIT_MARGIN)))]
    return cmd


def service_env(packages: list[str], token: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if packages:
        env["TAFL_PACKAGES"] = ",".join(str(Path(p).resolve()) if Path(p).is_dir() else p for p in packages)
    else:  # the service's default: the store model a built bento bundles
        env.pop("TAFL_PACKAGES", None)
    env.setdefault("BENTOML_DO_NOT_TRACK", "True")
    if token:
        env["TAFL_API_TOKEN"] = token
    env.update(extra or {})
    return env


class _Forced(BaseException):
    """A second stop signal while the server drains: kill it now."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128 + N, as a shell says


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM the server if the wrapper itself is SIGKILLed (then nobody forwards anything)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(packages: list[str], host: str = "127.0.0.1", port: int = 3000, token: str | None = None,
          drain_seconds: float = DRAIN_SECONDS) -> int:
    """Run `bentoml serve` until it exits or the wrapper is told to stop; the server's exit status.

    SIGTERM, SIGINT and SIGHUP (as SIGTERM) go to the server only (it runs in a session of its own,
    so a Ctrl-C at a terminal reaches it once, through here); it stops its worker, which finishes
    the requests in flight. After `drain_seconds` whatever is left of the tree (the worker too,
    though it is in another session) is SIGKILLed. A second stop signal kills at once.
    """
    for ref in packages:
        resolve_package(ref)  # PackageError names a missing or tampered package before anything starts
    if drain_seconds <= 0:
        raise ConfigError(f"--drain-seconds must be positive, got {drain_seconds}")
    received: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if len(received) == 2:
            raise _Forced

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}  # before the child exists: no gap
    proc: subprocess.Popen | None = None
    tree: ProcessTree | None = None
    try:
        proc = subprocess.Popen(serve_command(host, port, drain_seconds=drain_seconds),
                                env=service_env(packages, token), start_new_session=True,
                                # the wrapper runs no other thread here, so preexec_fn is safe
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)  # noqa: PLW1509
        tree = ProcessTree(proc)
        last_scan = time.monotonic()
        while proc.poll() is None and not received:
            try:
                proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - last_scan > 2:  # remember the worker while its parent can still name it
                tree.refresh()
                last_scan = time.monotonic()
        if received:
            sig = signal.SIGTERM if received[0] == signal.SIGHUP else received[0]
            print(f"tafl serve: {signal.Signals(received[0]).name}: stopping the service (in-flight requests "
                  f"get up to {drain_seconds:g} s)", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            tree.refresh()
            tree.send(sig)
            if not tree.wait(drain_seconds):
                print(f"tafl serve: the service did not stop within {drain_seconds:g} s; killing it",
                      file=sys.stderr, flush=True)
                tree.kill()
            print(f"tafl serve: stopped in {time.monotonic() - t0:.1f} s (exit status "
                  f"{_exit_status(proc.returncode)})", file=sys.stderr, flush=True)
        elif tree.wait(2.0) is False:  # the server exited by itself: no worker of it may stay behind
            tree.kill()
        return _exit_status(proc.returncode)
    except _Forced:
        print("tafl serve: second stop signal: killing the service", file=sys.stderr, flush=True)
        if proc is None:
            return 128 + received[-1]
        (tree or ProcessTree(proc)).kill()
        return _exit_status(proc.returncode)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class ServerProcess:
    """`bentoml serve` in its own process group on 127.0.0.1, ready when /readyz answers 200. `stop`
    SIGTERMs the group and, after `grace` s, SIGKILLs it and every descendant still running: the
    worker too, which is in a session of its own."""

    def __init__(self, packages: list[str], *, port: int | None = None, token: str | None = None,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None, target: str = SERVICE):
        self.port = port or free_port()
        self.target = target
        self.url = f"http://127.0.0.1:{self.port}"
        self.packages, self.token, self.env, self.log_path = packages, token, env, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ServerProcess:
        self.proc = start_group(serve_command("127.0.0.1", self.port, self.target),
                                env=service_env(self.packages, self.token, self.env), log_path=self.log_path)
        try:
            wait_http(self.url + "/readyz", timeout=timeout, proc=self.proc, name="the service",
                      hint=f"; see {self.log_path}" if self.log_path else "")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 10.0) -> None:
        stop_group(self.proc, grace)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
