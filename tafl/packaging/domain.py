"""The input domain a package records (metadata.json `domain`, tafl.packaging.metadata.InputDomain): what its
training data's DICOM headers said, what export was told (`tafl export --domain ...`), and, after a retrain, what
the parent package was told.

    --domain modality=XC,DMS                        DICOM Modality codes
    --domain sop-class="VL Photographic Image Storage"   SOP classes, by name or UID (comma-separated)
    --domain colour=colour                          colour | greyscale
    --domain modality=any                           drop a field: it decides nothing

A field the training data gives comes from the data (DICOM files in a folder dataset give the modalities and SOP
classes; every dataset gives colour or greyscale, when at least COLOUR_SHARE of its training images agree); a
declared field replaces it. Standard library and pydicom's UID table only.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tafl.errors import ConfigError
from tafl.packaging.metadata import COLOURS, InputDomain

COLOUR_SHARE = 0.95  # the share of training images that must agree before the domain says colour or greyscale
KEYS = {"modality": "modalities", "modalities": "modalities", "sop-class": "sop_classes",
        "sop-classes": "sop_classes", "sop_class": "sop_classes", "colour": "colour", "color": "colour"}
FROM_DATA, DECLARED, FROM_PARENT = "training data", "declared at export", "declared at the parent's export"


def from_training(provenance: Mapping[str, Any]) -> InputDomain:
    """The domain the training data state: the DICOM files' modalities and SOP classes, and colour or greyscale."""
    dicom = provenance.get("dicom") or {}
    mods = tuple(sorted(dicom.get("modalities") or {}))
    sops = tuple(sorted(dicom.get("sop_classes") or {}))
    counts = provenance.get("colour") or {}
    n = sum(int(v) for v in counts.values())
    colour = next((k for k in COLOURS if n and int(counts.get(k, 0)) >= COLOUR_SHARE * n), None)
    source = {k: FROM_DATA for k, v in (("modalities", mods), ("sop_classes", sops), ("colour", colour)) if v}
    return InputDomain(mods, sops, colour, source)


def parse_declarations(items: Iterable[str]) -> dict[str, Any]:
    """`--domain KEY=VALUE[,VALUE]` items as {field: value}: a tuple of codes or names, a colour, or None (any)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        field = KEYS.get(key.strip().lower())
        if not sep or field is None:
            raise ConfigError(f"--domain {item!r}: expected KEY=VALUE with KEY one of modality, sop-class, colour "
                              "(e.g. --domain modality=XC)")
        values = [v.strip() for v in value.split(",") if v.strip()]
        if not values:
            raise ConfigError(f"--domain {item!r}: no value (use {key}=any to let it decide nothing)")
        if [v.lower() for v in values] == ["any"]:
            out[field] = None
        elif field == "modalities":
            bad = [v for v in values if not re.fullmatch(r"[A-Z0-9_]{1,16}", v)]
            if bad:
                raise ConfigError(f"--domain modality: {bad[0]!r} is no DICOM Modality code (upper-case, such as XC, "
                                  "DMS, CT, CR, DX, MR, US, SM, OP)")
            out[field] = tuple(dict.fromkeys(values))
        elif field == "sop_classes":
            out[field] = tuple(dict.fromkeys(_sop_class(v) for v in values))
        else:
            if len(values) != 1 or values[0].lower() not in COLOURS:
                raise ConfigError(f"--domain colour: {value!r}; expected colour, greyscale or any")
            out[field] = values[0].lower()
    return out


def resolve(provenance: Mapping[str, Any], declared: Iterable[str] = (),
            parent: InputDomain | None = None) -> InputDomain:
    """The package's domain: the training data's, then what the parent was told at its export, then this export's
    declarations, each field replacing the one before."""
    base = from_training(provenance)
    fields = {"modalities": base.modalities, "sop_classes": base.sop_classes, "colour": base.colour}
    source = dict(base.source)
    for name in fields:
        if parent is not None and parent.source.get(name) in (DECLARED, FROM_PARENT):
            fields[name] = getattr(parent, name)
            source[name] = FROM_PARENT
    for name, value in parse_declarations(declared).items():
        fields[name] = () if value is None and name != "colour" else value
        source.pop(name, None)
        if value:
            source[name] = DECLARED
    return InputDomain(fields["modalities"], fields["sop_classes"], fields["colour"],
                       {k: v for k, v in source.items() if fields[k]})


def _sop_class(value: str) -> str:
    """A storage SOP class's name, from its name or UID (pydicom's table); ConfigError naming close names."""
    from pydicom._uid_dict import UID_dictionary

    if re.fullmatch(r"[0-9.]{1,64}", value):
        entry = UID_dictionary.get(value)
        if entry is None or entry[1] != "SOP Class":
            raise ConfigError(f"--domain sop-class: {value} is no SOP class UID that pydicom knows")
        return str(entry[0])
    names = {str(e[0]) for e in UID_dictionary.values() if e[1] == "SOP Class"}
    if value not in names:
        close = difflib.get_close_matches(value, sorted(names), n=2)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(f"--domain sop-class: {value!r} is no SOP class name{hint}")
    return value
