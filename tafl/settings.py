"""The TAFL_* environment, read here and in tafl.serving.settings only: one parser, one kind of message.

Every numeric TAFL_* setting (the service's limits in `tafl.serving.settings.Settings`, TAFL_MAX_CONCURRENCY,
TAFL_DRAIN_SECONDS) goes through `env_int` or `env_float`, so a bad value is a `ConfigError` that names the
variable and the value it got ("TAFL_MAX_FRAMES must be a whole number, got '64k'"), never a bare
`ValueError: invalid literal for int()`. An unset or blank variable takes its default. `tafl serve` checks
them before anything starts (`tafl.serving.launch.preflight`); a service started by `bentoml serve`
directly logs the same line and exits (`tafl.serving.service`). The other settings the leaves, packaging and the
clients read have a function each below (`prior_adaptive_mode`, `trusted_keys_setting`, ...): a caller reads its
setting once, at the top of its job, and passes the value down. Standard library and tafl.errors only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from tafl.errors import ConfigError

__all__ = ["DEFAULT_MAX_UPLOAD_MB", "child_environment", "dicomweb_credentials", "env_float", "env_int", "env_str",
           "prior_adaptive_mode", "set_env", "set_env_default", "signing_key_setting", "trusted_keys_setting",
           "upload_limit"]


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


def set_env_default(name: str, value: str) -> None:
    """Set `name` for this process and the processes it starts, unless the environment already says otherwise."""
    os.environ.setdefault(name, value)


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, as a child process is to get it, with `extra` on top."""
    return {**os.environ, **(extra or {})}


DEFAULT_MAX_UPLOAD_MB = 50.0


def upload_limit() -> int:
    """TAFL_MAX_UPLOAD_MB (default 50) in bytes: the largest file the service takes in one upload. One reading for
    every path that receives a DICOM file: the service (tafl.serving.settings), and `tafl score --dicomweb`, which
    reads no WADO-RS answer past it (tafl.clients.dicomweb)."""
    return int(env_float("TAFL_MAX_UPLOAD_MB", DEFAULT_MAX_UPLOAD_MB) * 2**20)


def prior_adaptive_mode(env: Mapping[str, str] | None = None) -> str:
    """TAFL_PRIOR_ADAPTIVE: `checked` (default) follows each package's validation check before `prior=adaptive`
    adapts (tafl.prior.adaptive_blocked); `always` adapts anyway. ConfigError for any other value."""
    mode = (env_str("TAFL_PRIOR_ADAPTIVE", env=env) or "checked").lower()
    if mode not in ("checked", "always"):  # tafl.prior.ADAPTIVE_MODES: this leaf imports nothing of tafl but errors
        raise ConfigError(f"TAFL_PRIOR_ADAPTIVE must be checked or always, got {mode!r}")
    return mode


def trusted_keys_setting() -> str | None:
    """TAFL_TRUSTED_KEYS: comma-separated public key files or folders of `*.pub` (tafl.packaging.signing); None when
    unset or blank (signatures are then not required)."""
    return env_str("TAFL_TRUSTED_KEYS")


def signing_key_setting() -> str | None:
    """TAFL_SIGNING_KEY: the private key `tafl export` signs with where no --sign-key is given; None: unsigned."""
    return env_str("TAFL_SIGNING_KEY")


def dicomweb_credentials() -> tuple[str | None, str | None, str | None]:
    """(TAFL_DICOMWEB_TOKEN, TAFL_DICOMWEB_USER, TAFL_DICOMWEB_PASSWORD) as set, unstripped (a password may hold
    spaces); None for each unset or empty one. Credentials never go on the command line (tafl.clients.dicomweb)."""
    return tuple(os.environ.get(k) or None for k in  # type: ignore[return-value]
                 ("TAFL_DICOMWEB_TOKEN", "TAFL_DICOMWEB_USER", "TAFL_DICOMWEB_PASSWORD"))
