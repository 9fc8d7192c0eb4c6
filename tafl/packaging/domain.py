"""The input domain a package records (metadata.json `domain`, tafl.packaging.metadata.InputDomain): what its
training data's DICOM headers said, what export was told (`tafl export --domain ...`), and, after a retrain, what
the parent package was told.

    --domain modality=XC,DMS                        DICOM Modality codes
    --domain sop-class="VL Photographic Image Storage"   SOP classes, by name or UID (comma-separated)
    --domain colour=colour                          colour | greyscale
    --domain modality=any                           drop a field: it decides nothing

A field the training data gives comes from the data (DICOM files in a folder dataset give the modalities and SOP
classes; every dataset gives colour or greyscale, when at least COLOUR_SHARE of its training images agree); a
declared field replaces it. Standard library, numpy and pydicom's UID table only.

The learned detector's verdict on a graph's `domain_distance` (`domain_verdict`, `in_domain_rows`) is here too: the
service, the listener and in-process scoring all read it the same way.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tafl.errors import ConfigError
from tafl.packaging.metadata import COLOURS, InputDomain

GREYSCALE_PHOTOMETRICS = ("MONOCHROME1", "MONOCHROME2")
COLOUR_PHOTOMETRICS = ("RGB", "YBR_FULL", "YBR_FULL_422", "YBR_ICT", "YBR_RCT", "YBR_PARTIAL_420", "PALETTE COLOR")

COLOUR_SHARE = 0.95  # the share of training images that must agree before the domain says colour or greyscale
KEYS = {"modality": "modalities", "modalities": "modalities", "sop-class": "sop_classes",
        "sop-classes": "sop_classes", "sop_class": "sop_classes", "colour": "colour", "color": "colour"}
FROM_DATA, DECLARED, FROM_PARENT = "training data", "declared at export", "declared at the parent's export"


def contradiction(domain: InputDomain, info: Mapping[str, Any]) -> str | None:
    """Why a decoded DICOM's header facts (`DecodedImage.info`: modality, sop_class, photometric) fall outside
    `domain`, in words a person can act on; None where nothing contradicts it."""
    modality, sop, photometric = info.get("modality"), info.get("sop_class"), info.get("photometric")
    src = domain.source
    if modality and domain.modalities and modality not in domain.modalities:
        return (f"its Modality is {modality}, and this model was trained on {_words(domain.modalities)} images "
                f"only ({src.get('modalities', 'declared')}): send it to a model for {modality} images")
    if sop and domain.sop_classes and sop not in domain.sop_classes:
        return (f"it is a {sop} object, and this model was trained on {_words(domain.sop_classes)} objects only "
                f"({src.get('sop_classes', 'declared')})")
    kind = ("greyscale" if photometric in GREYSCALE_PHOTOMETRICS else
            "colour" if photometric in COLOUR_PHOTOMETRICS else None)
    if kind and domain.colour and kind != domain.colour:
        return (f"it is a {kind} image ({photometric}), and this model was trained on {domain.colour} images "
                f"({src.get('colour', 'declared')})")
    return None


def describe(domain: InputDomain) -> str:
    """The domain's header rules in one line, each part with where it came from."""
    parts = [f"{what} ({domain.source.get(name, 'declared')})" for name, what in (
        ("colour", f"{domain.colour} images" if domain.colour else ""),
        ("modalities", f"Modality {_words(domain.modalities)}" if domain.modalities else ""),
        ("sop_classes", _words(domain.sop_classes) if domain.sop_classes else "")) if what]
    return "; ".join(parts) if parts else "none recorded: a DICOM header decides nothing"


def _words(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


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


def split_detector(items: Iterable[str]) -> tuple[bool, list[str]]:
    """(whether the package keeps its learned in-domain detector, the other declarations): `detector=off` exports
    the package without it (every image gets a label, as from a package made before it; the header rules still
    apply), `detector=on` (the default) keeps the one training fitted."""
    keep, rest = True, []
    for item in items:
        key, sep, value = item.partition("=")
        if key.strip().lower() != "detector":
            rest.append(item)
            continue
        v = value.strip().lower()
        if v not in ("on", "off"):
            raise ConfigError(f"--domain {item!r}: detector=on (the default: keep the learned in-domain detector) or "
                              "detector=off (export without it)")
        keep = v == "on"
    return keep, rest


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


# ------------------------------------------------------------------ the learned detector's verdict
def in_domain_rows(meta: Any, out: dict[str, np.ndarray]) -> np.ndarray | None:
    """(N,) bool: which rows of a package's graph outputs its detector keeps (`meta`: its PackageMetadata); None for
    a package without one (every row counts)."""
    threshold = meta.domain.detector.threshold
    if threshold is None or "domain_distance" not in out:
        return None
    return np.asarray(out["domain_distance"]) <= threshold


def domain_verdict(meta: Any, out: dict[str, np.ndarray], i: int) -> dict[str, Any] | None:
    """The learned in-domain detector's verdict on row `i` (docs/design.md, "The input domain"): its distance, the
    package's threshold, in or out, and why; None for a package without a detector."""
    det = meta.domain.detector
    threshold = det.threshold
    if threshold is None or "domain_distance" not in out:
        return None
    d = float(out["domain_distance"][i])
    inside = d <= threshold
    keep = det.keep
    what = "score" if det.kind == "mahalanobis+energy" else "distance"  # with the energy: the larger of the two
    why = (f"its features lie {'within' if inside else 'beyond'} the {what} that keeps {100 * keep:.0f}% of the "
           f"model's validation images ({d:.1f} {'≤' if inside else '>'} {threshold:.1f})")
    return {"in_domain": inside, "distance": d, "threshold": threshold, "reason": why}
