"""A Flower federation on loopback: one SuperLink and N SuperNodes as separate processes on
127.0.0.1, for tests and benchmarks of the deployment path (the insecure variant; docs/flower.md
gives the TLS and SuperNode-authentication commands for real sites).

By default (`warm=True`) each SuperNode runs with `--isolation process` beside one long-lived
ClientApp process (`python -m tafl.training.flower`, see `flower.serve_clientapp`) that executes
all its messages: torch is imported and the node's data prepared once per run, not once per
message. `warm=False` keeps Flower's default, a fresh `flwr-clientapp` process per message.

`run` hands `flwr run` the Flower App folder, by default `APP_DIR`: deploy/flower of a source checkout (its
pyproject.toml names tafl's ServerApp and ClientApp; the components themselves are in the installed tafl). A
wheel does not ship deploy/, so from an installed tafl pass `app_dir` a copy of that folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tafl.errors import ServiceUnavailable
from tafl.procs import free_port, kill_group, start_group, stop_group, wait_http
from tafl.settings import child_environment, env_str

APP_DIR = Path(__file__).resolve().parents[2] / "deploy" / "flower"  # a source checkout's deploy/flower (not in a wheel)


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


class LocalFederation:
    def __init__(self, nodes: int, home: str | Path, *, node_configs: list[str] | None = None, warm: bool = True):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.warm = warm
        self.node_configs = node_configs or [f"partition-id={i} num-partitions={nodes}" for i in range(nodes)]
        # Flower's own processes start their helpers (flower-superexec, ...) by name: this interpreter's bin
        # folder goes first on their PATH, so a venv that was never activated works too
        path = os.pathsep.join([str(Path(sys.executable).parent), env_str("PATH", "")])
        self.env = child_environment({"FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                                      "FLWR_DISABLE_UPDATE_CHECK": "1", "PATH": path})
        self.link: subprocess.Popen | None = None
        self.supernodes: list[subprocess.Popen] = []
        self.clientapps: list[subprocess.Popen | None] = []  # the warm ClientApp process of each node (None: cold)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
            "insecure = true\n")

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        return start_group(args, env=self.env, log_path=self.home / log)

    def start(self, timeout: float = 120.0) -> LocalFederation:
        """The SuperLink, then each SuperNode and its ClientApp process; returns once the SuperLink
        answers and every ClientApp process has finished its imports."""
        self.link = self._spawn([_bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                                 "--host", "127.0.0.1", "--port", str(self.port),
                                 "--database", str(self.home / "state.db")], "superlink.log")
        try:
            wait_http(f"http://127.0.0.1:{self.port}/health", timeout=timeout, proc=self.link, name="the SuperLink",
                      hint=f"; see {self.home / 'superlink.log'}", ready=lambda status: status < 500)
            deadline = time.monotonic() + timeout
            ready_files = []
            for i, nc in enumerate(self.node_configs):
                runtime = f"127.0.0.1:{free_port()}"
                host, port = runtime.split(":")
                self.supernodes.append(self._spawn(
                    [_bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                     "--host", host, "--port", port, "--node-config", nc,
                     *(["--isolation", "process"] if self.warm else [])], f"supernode{i}.log"))
                if self.warm:
                    ready = self.home / f"clientapp{i}.ready"
                    ready.unlink(missing_ok=True)
                    ready_files.append(ready)
                    self.clientapps.append(self._spawn(
                        [sys.executable, "-m", "tafl.training.flower", "--runtime-api-address", runtime, "--insecure",
                         "--ready-file", str(ready)], f"clientapp{i}.log"))
                else:
                    self.clientapps.append(None)
            for i, ready in enumerate(ready_files):
                while not ready.exists():
                    if self.clientapps[i].poll() is not None or time.monotonic() > deadline:
                        raise ServiceUnavailable(f"ClientApp process {i} did not start; see "
                                                 f"{self.home / f'clientapp{i}.log'}")
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, run_config: dict[str, object], *, timeout: float = 600.0,
            app_dir: Path = APP_DIR) -> subprocess.CompletedProcess:
        """`flwr run APP loopback --stream` with the given run-config overrides; waits for the end."""
        def fmt(v: object) -> str:
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, str):
                return "'" + v.replace("'", "") + "'"
            return str(v)

        rc = " ".join(f"{k}={fmt(v)}" for k, v in run_config.items())
        return subprocess.run([_bin("flwr"), "run", str(app_dir), "loopback", "--stream", "--run-config", rc],
                              env=self.env, capture_output=True, text=True, timeout=timeout)

    def kill_node(self, i: int) -> None:
        """SIGKILL node i: its SuperNode and its ClientApp process, as a crashed site."""
        kill_group(self.supernodes[i])
        kill_group(self.clientapps[i])

    def stop(self) -> None:
        for p in [*self.clientapps, *self.supernodes, self.link]:
            stop_group(p)

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
