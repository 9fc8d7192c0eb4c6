"""FL methods by name. Each is a `Method` implementing the transport-free steps of `base`."""

from __future__ import annotations

from tafl.errors import ConfigError
from tafl.training.methods.base import ClientData, ClientResult, GlobalState, Method
from tafl.training.methods.fedavg import FedAvg, FedProx
from tafl.training.methods.dafl import DAFL
from tafl.training.methods.gtafl import GTAFL, CReFF

METHODS: dict[str, type[Method]] = {"fedavg": FedAvg, "fedprox": FedProx, "creff": CReFF, "gtafl": GTAFL,
                                   "dafl": DAFL}


def method_class(name: str) -> type[Method]:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"method '{name}' is not available; choose one of {', '.join(sorted(METHODS))}") from None


__all__ = ["ClientData", "ClientResult", "GlobalState", "Method", "METHODS", "method_class"]
