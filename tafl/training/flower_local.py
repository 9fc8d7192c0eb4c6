"""A Flower federation on loopback: one SuperLink and N SuperNodes as separate processes on
127.0.0.1, for tests and benchmarks of the deployment path (the insecure variant; docs/flower.md
gives the TLS and SuperNode-authentication commands for real sites).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tafl.serving.launch import free_port, stop_group

APP_DIR = Path(__file__).resolve().parents[2] / "deploy" / "flower"


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


class LocalFederation:
    def __init__(self, nodes: int, home: str | Path, *, node_configs: list[str] | None = None):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.node_configs = node_configs or [f"partition-id={i} num-partitions={nodes}" for i in range(nodes)]
        self.env = dict(os.environ, FLWR_HOME=str(self.home), FLWR_TELEMETRY_ENABLED="0",
                        FLWR_DISABLE_UPDATE_CHECK="1")
        self.link: subprocess.Popen | None = None
        self.supernodes: list[subprocess.Popen] = []
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
            "insecure = true\n")

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        return subprocess.Popen(args, env=self.env, stdout=open(self.home / log, "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start(self, timeout: float = 60.0) -> LocalFederation:
        self.link = self._spawn([_bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                                 "--host", "127.0.0.1", "--port", str(self.port),
                                 "--database", str(self.home / "state.db")], "superlink.log")
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code < 500:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            self.stop()
            raise RuntimeError(f"the SuperLink did not start; see {self.home / 'superlink.log'}")
        for i, nc in enumerate(self.node_configs):
            self.supernodes.append(self._spawn([_bin("flower-supernode"), "--insecure", "--superlink",
                                                f"127.0.0.1:{self.port}", "--port", str(free_port()),
                                                "--node-config", nc], f"supernode{i}.log"))
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
        p = self.supernodes[i]
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop(self) -> None:
        for p in [*self.supernodes, self.link]:
            stop_group(p)

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
