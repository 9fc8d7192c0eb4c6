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

`preflight` checks what the user named before anything starts: the packages, the TAFL_* settings and
that the port can be bound, each failure one TaflError line. The server runs BentoML's CLI through
`bentoml_main`, which gives it a Prometheus multiprocess folder of its own (BentoML empties
$BENTOML_HOME/prometheus_multiproc_dir whenever a server starts, even one that then fails to bind, so
a second server with the same BENTOML_HOME wiped the first one's /metrics) and turns a port taken
between the check and the bind into exit status EXIT_PORT_IN_USE instead of a traceback.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tafl.errors import ConfigError, PackageError, ServiceUnavailable
from tafl.procs import MALLOC_ENV, ProcessTree, free_port, start_group, stop_group, wait_http
from tafl.serving.runtime import resolve_package
from tafl.settings import child_environment, env_float, env_str

__all__ = ["DRAIN_SECONDS", "EXIT_PORT_IN_USE", "SERVICE", "ServerProcess", "check_port", "drain_seconds_from_env",
           "free_port", "preflight", "serve", "serve_command", "service_env", "stop_group"]

SERVICE = "tafl.serving.service:TaflService"
DRAIN_SECONDS = 20.0  # fits Kubernetes' default 30 s grace period; systemd allows 90 s, `docker stop` only 10 s
EXIT_MARGIN = 5.0  # of the drain deadline, kept for the server to close down after its last request


EXIT_PORT_IN_USE = 98  # bentoml_main's status when the port was taken after the check (98: EADDRINUSE on Linux)
PROMETHEUS_ENV = "TAFL_PROMETHEUS_DIR"  # the server's own Prometheus multiprocess folder (set by the launchers)
PROMETHEUS_PREFIX = "tafl-prometheus-"


def drain_seconds_from_env(default: float = DRAIN_SECONDS) -> float:
    return env_float("TAFL_DRAIN_SECONDS", default)


# ------------------------------------------------------------------ checks before anything starts
def port_in_use_message(host: str, port: int) -> str:
    return f"port {port} on {host} is in use (by another service?); choose another with --port"


def check_port(host: str, port: int) -> None:
    """ConfigError unless a server could bind `port` on `host` now, as BentoML's circus does (SO_REUSEADDR,
    so connections in TIME_WAIT do not count). The port is released again at once."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # BentoML accepts IP addresses only
        raise ConfigError(f"--host must be an IP address (127.0.0.1: this machine only, 0.0.0.0: every "
                          f"interface), got {host[:80]!r}") from None
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ConfigError(f"--port must be a whole number from 1 to 65535, got {port!r}")
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(port_in_use_message(host, port)) from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"port {port} on {host} may not be opened by this user (ports below 1024 need "
                                  "privileges); choose another with --port") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{host} is not an address of this machine; choose another with --host "
                                  "(127.0.0.1: this machine only, 0.0.0.0: every interface)") from None
            raise ConfigError(f"port {port} on {host} cannot be opened ({exc.strerror or exc}); choose another "
                              "with --port or --host") from None


def preflight(packages: list[str], host: str = "127.0.0.1", port: int = 3000) -> list[Any]:
    """Check everything `serve` would otherwise find only once the server runs; the loaded packages
    (tafl.packaging.package.ModelPackage, in order).

    In this order: the TAFL_* settings the service reads (ConfigError naming the variable: "TAFL_MAX_FRAMES
    must be a whole number, got '64k'"); each package (PackageError: a missing folder, a training run folder
    with the `tafl export` line that makes a package, a tampered or unsigned one as the loader says, two
    packages with one name; ConfigError: a TAFL_SITE_MIX naming a class the package lacks), verified against
    TAFL_TRUSTED_KEYS as the service will; then the port (ConfigError: "port 3000 on 127.0.0.1 is in use (by
    another service?); choose another with --port", a host that is not an IP address of this machine, a
    privileged port). Every message is one line."""
    from tafl.prior import parse_site_mix
    from tafl.serving.settings import check_service_env

    settings = check_service_env()
    loaded, names = [], {}
    for ref in packages:
        pkg = resolve_package(ref)
        if pkg.name in names:
            raise PackageError(f"{names[pkg.name]} and {ref} are both named '{pkg.name}'; give them distinct "
                               "names at export (tafl export --name)")
        names[pkg.name] = ref
        if settings.site_mix and pkg.meta.prior is not None:  # a class this model lacks: one line, nothing started
            parse_site_mix(settings.site_mix, pkg.class_names, f"TAFL_SITE_MIX for {pkg.name}")
        loaded.append(pkg)
    if settings.site and not any(settings.site in p.meta.sets.sites for p in loaded if p.meta.sets.fitted):
        known = sorted({s for p in loaded if p.meta.sets.fitted for s in p.meta.sets.sites})
        raise ConfigError(f"TAFL_SITE={settings.site!r}: no package has prediction-set thresholds for that site "
                          f"({'its sites: ' + ', '.join(known) if known else 'none has any site of its own'}); "
                          "leave it unset for the federation's")
    check_port(host, port)
    return loaded


# ------------------------------------------------------------------ the server process
def bentoml_main(argv: list[str] | None = None) -> int:
    """The server process: BentoML's CLI (`bentoml serve ...`, argv as after `bentoml`) in this process.
    With TAFL_PROMETHEUS_DIR it keeps its Prometheus multiprocess files there instead of in
    $BENTOML_HOME/prometheus_multiproc_dir, which BentoML empties at every start (its workers get the folder
    as PROMETHEUS_MULTIPROC_DIR). A port taken since the check ends it with EXIT_PORT_IN_USE, no traceback."""
    prom = env_str(PROMETHEUS_ENV)
    if prom:
        from bentoml._internal.configuration.containers import BentoMLContainer

        BentoMLContainer.prometheus_multiproc_dir.set(prom)
    from bentoml_cli.cli import cli

    try:
        cli.main(args=argv, prog_name="bentoml")
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return EXIT_PORT_IN_USE
        raise
    return 0


_BOOT = "import sys; from tafl.serving.launch import bentoml_main; sys.exit(bentoml_main())"


def prometheus_dir() -> str:
    """A new, empty Prometheus multiprocess folder for one server (removed by its launcher at stop); folders
    left by launchers that died (SIGKILL) are removed here."""
    import psutil

    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob(f"{PROMETHEUS_PREFIX}*-*"):
        pid = old.name[len(PROMETHEUS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{PROMETHEUS_PREFIX}{os.getpid()}-")


def serve_command(host: str, port: int, target: str = SERVICE, drain_seconds: float | None = None) -> list[str]:
    """`bentoml serve` through `bentoml_main`. `target`: the service's import path, or a built bento's tag
    (`tafl:latest`). With `drain_seconds` the worker (uvicorn) waits at most that long, less EXIT_MARGIN, for
    requests in flight when it is told to stop, then cancels them (BentoML's hidden
    `--timeout-graceful-shutdown`; without it a stuck request holds the shutdown forever)."""
    cmd = [sys.executable, "-c", _BOOT, "serve", target, "--host", host, "--port", str(port)]
    if drain_seconds is not None:
        cmd += ["--timeout-graceful-shutdown", str(max(1, int(drain_seconds - EXIT_MARGIN)))]
    return cmd


def service_env(packages: list[str], token: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = child_environment()
    if packages:
        env["TAFL_PACKAGES"] = ",".join(str(Path(p).resolve()) if Path(p).is_dir() else p for p in packages)
    else:  # the service's default: the store model a built bento bundles
        env.pop("TAFL_PACKAGES", None)
    env.setdefault("BENTOML_DO_NOT_TRACK", "True")
    for name, value in MALLOC_ENV.items():  # the server and its workers give large buffers back when freed
        env.setdefault(name, value)
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
          drain_seconds: float = DRAIN_SECONDS, on_checked: Callable[[], None] | None = None) -> int:
    """Run `bentoml serve` until it exits or the wrapper is told to stop; the server's exit status.

    `preflight` runs first (ConfigError, PackageError: one line, nothing started). The server gets a
    Prometheus multiprocess folder of its own, removed when it has stopped. A port taken between the check
    and the server's bind raises the same ConfigError as the check. SIGTERM, SIGINT and SIGHUP (as SIGTERM)
    go to the server only (it runs in a session of its own, so a Ctrl-C at a terminal reaches it once,
    through here); it stops its worker, which finishes the requests in flight. After `drain_seconds`
    whatever is left of the tree (the worker too, though it is in another session) is SIGKILLed. A second
    stop signal kills at once.
    """
    if drain_seconds <= 0:
        raise ConfigError(f"--drain-seconds must be positive, got {drain_seconds}")
    preflight(packages, host, port)
    if on_checked is not None:  # the caller's "serving ..." line, once everything it names is known to be good
        on_checked()
    prom = prometheus_dir()
    try:
        status = _run_server(packages, host, port, token, drain_seconds, prom)
    finally:
        shutil.rmtree(prom, ignore_errors=True)
    if status == EXIT_PORT_IN_USE:
        raise ConfigError(port_in_use_message(host, port))
    return status


def _run_server(packages: list[str], host: str, port: int, token: str | None, drain_seconds: float,
                prom: str) -> int:
    received: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if len(received) == 2:
            raise _Forced

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}  # before the child exists: no gap
    proc: subprocess.Popen | None = None
    tree: ProcessTree | None = None
    linux = sys.platform.startswith("linux")  # where the child can be told to die with its parent (prctl)
    try:
        proc = subprocess.Popen(serve_command(host, port, drain_seconds=drain_seconds),
                                env=service_env(packages, token, {PROMETHEUS_ENV: prom}), start_new_session=True,
                                # the wrapper runs no other thread here, so preexec_fn is safe
                                preexec_fn=_die_with_parent if linux else None)  # noqa: PLW1509
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
    worker too, which is in a session of its own. Each server keeps its Prometheus files in a folder of
    its own (removed at stop), so servers sharing a BENTOML_HOME never clear each other's /metrics. A
    port that is in use raises ConfigError (`check_port`; the packages are the caller's to check)."""

    def __init__(self, packages: list[str], *, port: int | None = None, token: str | None = None,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None, target: str = SERVICE):
        self.port = port or free_port()
        self.target = target
        self.url = f"http://127.0.0.1:{self.port}"
        self.packages, self.token, self.env, self.log_path = packages, token, env, log_path
        self.proc: subprocess.Popen | None = None
        self.prometheus_dir: str | None = None  # ours to remove, unless the caller's env named one

    def start(self, timeout: float = 120.0) -> ServerProcess:
        check_port("127.0.0.1", self.port)  # else /readyz could be answered by whatever holds the port
        env = dict(self.env or {})
        if not env.get(PROMETHEUS_ENV):
            self.prometheus_dir = env[PROMETHEUS_ENV] = prometheus_dir()
        self.proc = start_group(serve_command("127.0.0.1", self.port, self.target),
                                env=service_env(self.packages, self.token, env), log_path=self.log_path)
        try:
            wait_http(self.url + "/readyz", timeout=timeout, proc=self.proc, name="the service",
                      hint=f"; see {self.log_path}" if self.log_path else "")
        except ServiceUnavailable:
            self.stop()
            if self.proc.returncode == EXIT_PORT_IN_USE:
                raise ConfigError(port_in_use_message("127.0.0.1", self.port)) from None
            raise
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 10.0) -> None:
        try:
            stop_group(self.proc, grace)
        finally:
            if self.prometheus_dir and (self.proc is None or self.proc.poll() is not None):
                shutil.rmtree(self.prometheus_dir, ignore_errors=True)
                self.prometheus_dir = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
