"""FL methods by name. Each is a `tafl.training.contract.Method`, registered where it is defined
(`@register_method`); most extend `base.ClassifierMethod`, which composes the shared helpers.

Importing this package declares the built-in methods and registers their settings (the torch-free `*_config.py`
beside each), but loads no method and no torch: `tafl.training.config` validates names and settings at no cost,
and `method_class(name)` imports a method's module when it is first asked for. The contract's names
(`ClientData`, `ClientResult`, `GlobalState`, `Method`) are re-exported here; `METHODS` (every method class) loads
them all on first access.
"""

from __future__ import annotations

from typing import Any

from tafl.training.contract import (ClientData, ClientResult, GlobalState, Method, MethodConfig, config_class,
                                    declare_builtin, method_class, method_names, register_config, register_method)
from tafl.training.methods import dafl_config, fedavg_config, gtafl_config, lda_config  # noqa: F401  (they register)

# name -> the module that registers it, in the order --help and error messages list them
for _name, _module in (("fedavg", "fedavg"), ("fedprox", "fedavg"), ("creff", "gtafl"), ("gtafl", "gtafl"),
                       ("dafl", "dafl"), ("lda", "lda")):
    declare_builtin(_name, f"{__name__}.{_module}")


def __getattr__(name: str) -> Any:  # PEP 562: every method class, loaded (with torch) when first asked for
    if name == "METHODS":
        return {n: method_class(n) for n in method_names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ClientData", "ClientResult", "GlobalState", "METHODS", "Method", "MethodConfig", "config_class",
           "method_class", "method_names", "register_config", "register_method"]
