"""FL methods by name: the one registry. Each is a `Method` implementing the transport-free steps of `base`.

`REGISTRY` maps a method's name to the module and class that implement it; importing this package
loads none of them (nor torch), so `tafl.training.config` validates names against its keys at no
cost. `method_class(name)` imports the class; `METHODS` and the `base` names
(`ClientData`, `ClientResult`, `GlobalState`, `Method`) load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tafl.errors import ConfigError

if TYPE_CHECKING:
    from tafl.training.methods.base import ClientData, ClientResult, GlobalState, Method

# name -> (module under tafl.training.methods, class)
REGISTRY: dict[str, tuple[str, str]] = {
    "fedavg": ("fedavg", "FedAvg"),
    "fedprox": ("fedavg", "FedProx"),
    "creff": ("gtafl", "CReFF"),
    "gtafl": ("gtafl", "GTAFL"),
    "dafl": ("dafl", "DAFL"),
    "lda": ("lda", "LDA"),
}


def method_names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def method_class(name: str) -> type[Method]:
    try:
        module, cls = REGISTRY[name]
    except KeyError:
        raise ConfigError(f"method '{name}' is not available; choose one of {', '.join(method_names())}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


_BASE_NAMES = ("ClientData", "ClientResult", "GlobalState", "Method")


def __getattr__(name: str) -> Any:  # PEP 562: the torch-heavy names load when first asked for
    if name in _BASE_NAMES:
        return getattr(importlib.import_module(f"{__name__}.base"), name)
    if name == "METHODS":
        return {n: method_class(n) for n in REGISTRY}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ClientData", "ClientResult", "GlobalState", "Method", "METHODS", "REGISTRY", "method_class",
           "method_names"]
