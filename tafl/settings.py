"""Numbers read from TAFL_* environment variables: one parser, one kind of message.

Every numeric TAFL_* setting (the service's limits in `tafl.serving.settings.Settings`, TAFL_MAX_CONCURRENCY,
TAFL_DRAIN_SECONDS) goes through `env_int` or `env_float`, so a bad value is a `ConfigError` that names the
variable and the value it got ("TAFL_MAX_FRAMES must be a whole number, got '64k'"), never a bare
`ValueError: invalid literal for int()`. An unset or blank variable takes its default. `tafl serve` checks
them before anything starts (`tafl.serving.launch.preflight`); a service started by `bentoml serve`
directly logs the same line and exits (`tafl.serving.service`). Standard library and tafl.errors only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from tafl.errors import ConfigError

__all__ = ["DEFAULT_MAX_UPLOAD_MB", "child_environment", "env_float", "env_int", "env_str", "set_env", "upload_limit"]


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(name, "").strip()


def env_int(name: str, default: int, *, minimum: int = 1, env: Mapping[str, str] | None = None) -> int:
    """The whole number in `name` (`default` when unset or blank), at least `minimum`. An integral float
    literal ("5e7", "64.0") is accepted; anything else raises ConfigError naming the variable."""
    raw = _raw(name, env)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        try:
            f = float(raw)
        except ValueError:
            f = math.nan
        if not (math.isfinite(f) and f.is_integer()):
            raise ConfigError(f"{name} must be a whole number, got {raw[:40]!r}") from None
        value = int(f)
    if value < minimum:
        raise ConfigError(f"{name} must be {'positive' if minimum == 1 else f'at least {minimum}'}, got {raw[:40]!r}")
    return value


def env_float(name: str, default: float, *, minimum: float = 0.0, inclusive: bool = False,
              env: Mapping[str, str] | None = None) -> float:
    """The finite number in `name` (`default` when unset or blank), greater than `minimum` (or equal to it
    with `inclusive`); otherwise ConfigError naming the variable."""
    raw = _raw(name, env)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a number, got {raw[:40]!r}")
    if value < minimum or (value == minimum and not inclusive):
        bound = ("positive" if minimum == 0 and not inclusive else f"at least {minimum:g}" if inclusive
                 else f"greater than {minimum:g}")
        raise ConfigError(f"{name} must be {bound}, got {raw[:40]!r}")
    return value


def env_str(name: str, default: str | None = None, *, env: Mapping[str, str] | None = None) -> str | None:
    """The text in `name`, stripped (`default` when unset or blank)."""
    return _raw(name, env) or default


def set_env(name: str, value: str) -> None:
    """Set `name` for this process and the processes it starts from now on (BentoML's workers, decoder processes)."""
    os.environ[name] = value


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, as a child process is to get it, with `extra` on top."""
    return {**os.environ, **(extra or {})}


DEFAULT_MAX_UPLOAD_MB = 50.0


def upload_limit() -> int:
    """TAFL_MAX_UPLOAD_MB (default 50) in bytes: the largest file the service takes in one upload. One reading for
    every path that receives a DICOM file: the service (tafl.serving.settings), and `tafl score --dicomweb`, which
    reads no WADO-RS answer past it (tafl.clients.dicomweb)."""
    return int(env_float("TAFL_MAX_UPLOAD_MB", DEFAULT_MAX_UPLOAD_MB) * 2**20)
