"""Run settings as flags: one flag per setting (`--local-epochs 2`), flat, so a YAML config and the command line share
one vocabulary; flags override the file. `tafl train --help` shows the shared settings, then each method's."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def none_or(typ):
    def parse(text: str):
        if text.lower() in ("none", "null", "natural"):
            return None
        return typ(text)
    parse.__name__ = typ.__name__
    return parse


def shown(value: Any) -> str:
    """A default as a user types it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per setting, flat (`--gff-m`); every default is None so only given flags override the file.

    The shared settings come first, then one group per method config (`tafl train --help` groups them by method).
    The help of each is its field's comment (`config.field_docs`), the one place it is documented, with its default;
    fixed sets of values are argparse `choices` from `config.choices()`."""
    from tafl.training.config import RunConfig, choices, field_docs
    from tafl.training.contract import config_classes

    docs, defaults, allowed = field_docs(), RunConfig(), choices()
    shared = p.add_argument_group("run configuration (each overrides the --config file; YAML keys use _ for -)")
    _add_flags(shared, RunConfig, docs, defaults, allowed)
    for cls, names in config_classes().items():
        group = p.add_argument_group(f"settings of method {' and '.join(names)} (ignored by the other methods)")
        _add_flags(group, cls, docs, defaults.settings_of(cls), allowed)


def _add_flags(group, cls: type, docs: dict[str, str], defaults: Any, allowed: dict[str, tuple[str, ...]]) -> None:
    """A flag for each field of the dataclass `cls` (its value in `defaults` shown as the default)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        base = next(a for a in args if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        doc = docs.get(f.name) or f.name.replace("_", " ")
        help_text = f"{doc} (default: {shown(getattr(defaults, f.name))})".replace("%", "%%")
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name in allowed:
            group.add_argument(flag, dest=f.name, choices=allowed[f.name], default=None, help=help_text)
        else:
            parse = none_or(base) if type(None) in args else base
            group.add_argument(flag, dest=f.name, type=parse, default=None, metavar=base.__name__.upper(),
                               help=help_text)


def config_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    from tafl.training.config import flat_keys

    return {k: getattr(ns, k) for k in flat_keys() if getattr(ns, k, None) is not None}
