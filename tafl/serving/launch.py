"""Starting the service for local use: `tafl serve` and the service half of `tafl demo`.

`serve` verifies the packages first (a clear error beats a worker that dies at start), then runs
`bentoml serve` on 127.0.0.1 by default with TAFL_PACKAGES set. `ServerProcess` starts the same
command in the background, waits for /readyz, and stops the whole process group; tests and the
demo use it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tafl.errors import ServiceUnavailable
from tafl.serving.runtime import resolve_package

SERVICE = "tafl.serving.service:TaflService"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(host: str, port: int, target: str = SERVICE) -> list[str]:
    """`target`: the service's import path, or a built bento's tag (`tafl:latest`)."""
    return [sys.executable, "-m", "bentoml", "serve", target, "--host", host, "--port", str(port)]


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


def serve(packages: list[str], host: str = "127.0.0.1", port: int = 3000, token: str | None = None) -> int:
    for ref in packages:
        resolve_package(ref)  # PackageError names a missing or tampered package before anything starts
    proc = subprocess.Popen(serve_command(host, port), env=service_env(packages, token))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        return proc.wait()


def stop_group(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM a process started with start_new_session=True and its group; SIGKILL after `grace` s."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    except ProcessLookupError:
        pass


class ServerProcess:
    """`bentoml serve` in its own process group on 127.0.0.1, ready when /readyz answers 200."""

    def __init__(self, packages: list[str], *, port: int | None = None, token: str | None = None,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None, target: str = SERVICE):
        self.port = port or free_port()
        self.target = target
        self.url = f"http://127.0.0.1:{self.port}"
        self.packages, self.token, self.env, self.log_path = packages, token, env, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ServerProcess:
        import httpx

        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(serve_command("127.0.0.1", self.port, self.target), env=service_env(self.packages, self.token,
                                                                                              self.env),
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServiceUnavailable(f"the service exited with code {self.proc.returncode} while starting"
                                         + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise ServiceUnavailable(f"the service was not ready within {timeout:.0f} s")

    def stop(self, grace: float = 10.0) -> None:
        stop_group(self.proc, grace)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
