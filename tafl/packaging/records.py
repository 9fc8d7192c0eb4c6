"""Reading metadata.json with every problem named (tafl.packaging.metadata's building blocks): `Reader` collects
each problem by its field's path, `Record` carries a record other parts of tafl wrote, whole, as written.
Standard library and tafl.errors only."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")

NUMBER = (int, float)
STR_OR_NULL = (str, type(None))
_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object",
               bool: "true or false", type(None): "null"}


class Reader:
    """One JSON object of the metadata, read key by key; each problem is kept with its field's dotted path."""

    def __init__(self, obj: Mapping[str, Any], path: str, problems: list[str]):
        self.obj, self.path, self.problems = obj, path, problems

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def problem(self, key: str, text: str) -> None:
        self.problems.append(f"'{self.name(key)}' {text}")

    def __call__(self, key: str, types: tuple[type, ...], *, optional: bool = False, default: Any = None) -> Any:
        """The value at `key` when it has one of `types`; else a problem (missing, or of the wrong type) and
        `default`. An `optional` key may be absent (then `default`)."""
        if key not in self.obj:
            if not optional:
                self.problems.append(f"missing '{self.name(key)}'")
            return default
        value = self.obj[key]
        if not isinstance(value, types):
            words = " or ".join(dict.fromkeys(_TYPE_WORDS.get(t, t.__name__) for t in types))
            self.problem(key, f"has type {type(value).__name__}, expected {words}")
            return default
        return value

    def numbers(self, key: str, *, optional: bool = False, length: int | None = None) -> tuple | None:
        """A list of numbers (of `length` where given) as a tuple; None with a problem otherwise."""
        values = self(key, (list,), optional=optional)
        if values is None:
            return None
        if not all(isinstance(v, NUMBER) and not isinstance(v, bool) for v in values):
            self.problem(key, "must be a list of numbers")
            return None
        if length is not None and len(values) != length:
            self.problem(key, f"has {len(values)} values, expected one per class ({length})")
            return None
        return tuple(values)

    def semver(self, key: str, *, nullable: bool = False) -> str | None:
        v = self(key, (str, type(None)) if nullable else (str,))
        if isinstance(v, str) and not VERSION_RE.match(v):
            self.problem(key, f"is {v!r}, not a semantic version (MAJOR.MINOR.PATCH)")
        return v

    def objects(self, key: str) -> list[Reader]:
        """A list of JSON objects, each as a reader of its own (path `key[i]`)."""
        items = self(key, (list,))
        if items is None:
            return []
        out = []
        for i, item in enumerate(items):
            if isinstance(item, dict):
                out.append(Reader(item, f"{self.name(key)}[{i}]", self.problems))
            else:
                self.problems.append(f"'{self.name(key)}[{i}]' has type {type(item).__name__}, expected an object")
        return out

    def object(self, key: str, *, optional: bool = False) -> Reader | None:
        """The JSON object at `key` as a reader of its own; an `optional` one may also be absent or null (None)."""
        obj = self(key, (dict, type(None)) if optional else (dict,), optional=optional)
        return None if obj is None else Reader(obj, self.name(key), self.problems)


# ------------------------------------------------------------------ records other parts write, carried whole
@dataclass(frozen=True)
class Record:
    """A record another part of tafl writes into metadata.json, carried whole: `fields` as written (None where the
    key is null or absent). Subclasses add properties for what tafl reads of it. A missing or empty record is
    false, as `metadata.get(key) or {}` was."""

    fields: Mapping[str, Any] | None = None

    def __bool__(self) -> bool:
        return bool(self.fields)

    def _get(self, key: str, default: Any = None) -> Any:
        return default if not self.fields else self.fields.get(key, default)

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self.fields.items() if self.fields else ())

    def to_json(self) -> dict[str, Any] | None:
        return None if self.fields is None else dict(self.fields)

    @classmethod
    def read(cls, r: Reader, key: str, *, optional: bool = True, nullable: bool = True):
        """The record at `key`: an object (or null where `nullable`; absent where `optional` and `nullable`)."""
        return cls(r(key, (dict, type(None)) if nullable else (dict,), optional=optional and nullable))

    @classmethod
    def of(cls, value: Any):
        """The record in a value that should be an object: anything else reads as a missing record."""
        return cls(value if isinstance(value, dict) else None)
