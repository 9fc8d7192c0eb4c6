"""Conformal prediction sets at export (tafl.packaging.sets; docs/design.md, "Prediction sets"): the thresholds of
the coverage levels a package keeps, computed from the run's summed calibration histograms (checkpoint extras
`conformal.hist`, tafl.training.sets), and the graph module that answers the set at the export's level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tafl import conformal
from tafl.errors import ConfigError

LEVELS = (0.8, 0.9, 0.95)  # the levels every package keeps, beside the export's own
DEFAULT_COVERAGE = 0.9


def check_coverage(coverage: float) -> float:
    c = float(coverage)
    if not 0.5 <= c < 1:
        raise ConfigError(f"--coverage {coverage}: expected a level between 0.5 and 1 (such as 0.9)")
    return round(c, 6)


class SetsHead(nn.Module):
    """(scores, mask) from the calibrated source-prior posteriors p (B, C): scores 1 − p, and the set — class c
    where its score is within the class's threshold at the export's coverage."""

    def __init__(self, thresholds: np.ndarray):
        super().__init__()
        self.register_buffer("thresholds", torch.as_tensor(np.asarray(thresholds), dtype=torch.float32))

    def forward(self, source_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = 1.0 - source_probs
        return scores, scores <= self.thresholds


def sets_spec(ck: dict[str, Any], ck_path: Path, coverage: float) -> dict[str, Any] | None:
    """metadata `sets` for the checkpoint at `coverage`: thresholds per level from its histograms, the calibration
    record and, where the run's report measured them at this level, the test split's coverage and sizes; `fitted`
    false with the reason where training fitted none; None for a checkpoint from before the sets."""
    state_meta, extras = ck["state"].get("meta") or {}, ck["state"].get("extras") or {}
    rec = state_meta.get("conformal")
    if rec is None:
        return None
    if not rec.get("fitted") or "conformal.hist" not in extras:
        return {"fitted": False, "why": rec.get("why", "the checkpoint has no calibration histograms")}
    hist = extras["conformal.hist"].double().numpy()
    levels = sorted(set(LEVELS) | {coverage})
    names = list(ck["class_names"])
    conf = rec.get("confidence")  # the rule training fitted with (absent: before the rule was a choice, on average)
    thr = {level: conformal.class_thresholds(hist, 1 - level, conf) for level in levels}
    out = {"fitted": True, "coverage": coverage, "kind": "class-conditional", "score": rec.get("score"),
           "confidence": conf,
           "levels": {f"{level:g}": [float(t) for t in thr[level]] for level in levels},
           "calibration_images": rec.get("calibration_images"), "per_class": rec.get("per_class"),
           "source": rec.get("source"),
           "always_in_set": [names[c] for c in np.flatnonzero(thr[coverage] >= conformal.ALWAYS)]}
    if "conformal.site_hist" in extras and rec.get("sites"):  # each site's own thresholds, for a service at that site
        site_hist = extras["conformal.site_hist"].double().numpy()
        out["sites"] = {name: {"calibration_images": int(site_hist[k].sum()),
                               "levels": {f"{level:g}": [float(t) for t in conformal.class_thresholds(
                                   site_hist[k], 1 - level, conf)] for level in levels}}
                        for k, name in enumerate(rec["sites"])}
    rep = ck_path.parent / "report.json"
    measured = ((json.loads(rep.read_text()).get("conformal") or {}).get("levels") or {}) if rep.is_file() else {}
    m = measured.get(str(coverage), {})
    cc, marginal = m.get("class_conditional"), m.get("marginal")
    if cc:
        out["test"] = {"coverage": cc["coverage"], "size": cc["size"], "empty": cc["empty"],
                       "lowest_mix_coverage": cc["lowest_mix_coverage"],
                       "uniform_size": (cc.get("mixes") or {}).get("uniform", {}).get("size"),
                       "per_class": {k: v["coverage"] for k, v in cc["per_class"].items()},
                       **({"sites": {k: v["coverage"] for k, v in cc["sites"].items()}} if cc.get("sites") else {}),
                       **({"marginal_lowest_mix_coverage": marginal["lowest_mix_coverage"]} if marginal else {}),
                       **({"site_aware": {k: v["coverage"] for k, v in m["site_aware"]["sites"].items()}}
                          if m.get("site_aware") else {})}
    return out


def sets_head(spec: dict[str, Any] | None) -> SetsHead | None:
    if not spec or not spec.get("fitted"):
        return None
    return SetsHead(np.asarray(spec["levels"][f"{spec['coverage']:g}"]))
