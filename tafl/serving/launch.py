"""Starting the service for local use: `tafl serve` and the service half of `tafl demo`.

`serve` verifies the packages first (a clear error beats a worker that dies at start), then runs
`bentoml serve` on 127.0.0.1 by default with TAFL_PACKAGES set. `ServerProcess` starts the same
command in the background, waits for /readyz, and stops the whole process group; tests and the
demo use it. The process helpers live in `tafl.procs` (re-exported here: `free_port`, `stop_group`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tafl.procs import free_port, start_group, stop_group, wait_http
from tafl.serving.runtime import resolve_package

__all__ = ["SERVICE", "ServerProcess", "free_port", "serve", "serve_command", "service_env", "stop_group"]

SERVICE = "tafl.serving.service:TaflService"


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
