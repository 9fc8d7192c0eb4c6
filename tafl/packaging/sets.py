"""A package's conformal prediction sets as every answer gives them (issue 54; docs/design.md, "Prediction sets";
tafl.conformal for the method).

The graph answers the set at the coverage chosen at export (`prediction_set`, (N, C) booleans) and the scores it
is made from (`conformal_scores`, 1 − p of every class under the calibrated source-prior posterior); metadata
`sets` keeps the class thresholds of a few coverage levels, so a request can ask for another of them
(`coverage=0.95`) without another graph. An image outside the model's domain gets no set: the guarantee holds for
images like the calibration images, and the detector says this one is not.

Standard library and numpy only: the service, the listener and in-process scoring read it the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tafl.errors import BadRequest

SCORES, MASK = "conformal_scores", "prediction_set"  # the graph's outputs


def levels(meta: Any) -> list[float]:
    """The coverage levels a request may ask for (empty: the package has no sets)."""
    return sorted(meta.sets.thresholds) if meta.sets.fitted else []


def choose_coverage(meta: Any, value: Any) -> float | None:
    """A request's `coverage` option as one of the package's levels (None or "" → the export's); BadRequest naming
    the levels for anything else."""
    if value in (None, ""):
        return meta.sets.coverage if meta.sets.fitted else None
    if not meta.sets.fitted:
        raise BadRequest(f"coverage={str(value)[:20]!r}: this package has no prediction sets "
                         f"({meta.sets.why}); leave coverage out")
    try:
        c = float(value)
    except (TypeError, ValueError):
        c = float("nan")
    for level in levels(meta):
        if abs(level - c) < 1e-9 or abs(100 * level - c) < 1e-7:  # 0.9 or 90
            return level
    raise BadRequest(f"coverage={str(value)[:20]!r}: this package's prediction sets are calibrated at "
                     f"{', '.join(f'{v:g}' for v in levels(meta))} only (export chose {meta.sets.coverage:g})")


def choose_site(meta: Any, value: Any) -> str | None:
    """A request's `site` option (or the service's TAFL_SITE) as one of the package's training sites with thresholds
    of their own; None for none; BadRequest naming them for anything else."""
    if value in (None, ""):
        return None
    sites = meta.sets.sites if meta.sets.fitted else {}
    if str(value) in sites:
        return str(value)
    raise BadRequest(f"site={str(value)[:40]!r}: " + (
        f"this package's sets have thresholds of their own for {', '.join(sorted(sites))} only" if sites else
        "this package's sets have no site's own thresholds (a run without real sites, or under secure "
        "aggregation); leave site out"))


def set_answer(meta: Any, out: dict[str, np.ndarray], i: int, coverage: float | None = None,
               site: str | None = None) -> dict[str, Any] | None:
    """Row `i`'s prediction set at `coverage` (None: the export's level), calibrated for the federation or, with
    `site`, on that training site's own images: the classes in it, by name and index, its level and kind and what it
    promises; None for a package without sets."""
    spec = meta.sets
    if not spec.fitted or SCORES not in out:
        return None
    level = spec.coverage if coverage is None else coverage
    if site is None and level == spec.coverage and MASK in out:
        members = np.flatnonzero(out[MASK][i])
    else:
        thresholds = spec.sites[site][level] if site is not None else spec.thresholds[level]
        members = np.flatnonzero(np.asarray(out[SCORES][i], np.float64) <= np.asarray(thresholds))
    names = meta.class_names
    return {"coverage": level, "classes": [names[c] for c in members], "labels": [int(c) for c in members],
            "size": int(len(members)), "kind": spec.kind, "calibrated_for": site or "the federation",
            "meaning": _meaning(spec.kind, level, site) + ("" if len(members) else
                                                           "; empty: no class is plausible enough at this level")}


def _meaning(kind: str, level: float, site: str | None) -> str:
    if kind != "class-conditional":
        return f"the true class is in this set for {100 * level:g}% of images on average over the calibration mix"
    return (f"the true class is in this set for at least {100 * level:g}% of images of each class like the "
            f"calibration images{' of ' + site if site else ''}, whatever the case mix")
