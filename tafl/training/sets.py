"""Class-conditional conformal prediction sets, fitted after training (tafl.conformal; docs/design.md, "Prediction
sets"): one statistics round in which every client sends, per class, a histogram of its held-out rows' scores
(tafl.training.methods.sets); the server sums them with its validation split's (`conformal_rows: pooled`, the
default; `held_out`: the sites' alone) and keeps the sum, from which any coverage level's thresholds follow. A run
without held-out rows (`calib_holdout` 0) calibrates on the server's validation split alone. Pooling gives the rare
classes, whose thresholds are loosest, more rows; the validation rows fitted no calibration, where the held-out
rows fitted the calibration whose posteriors the scores are made of (docs/decisions.md, "The sets' calibration
rows").

Each class's threshold holds its level with probability `set_confidence` (0.9 by default) over the draw of its
calibration rows (tafl.conformal.rank), not only on average over draws: one package's coverage is what a site relies
on, and with a rare class's few rows the average guarantee leaves that package's coverage of the class below the
level about half the time (docs/decisions.md, "One package's coverage, not the average over packages").

With secure aggregation the histograms are one SecAgg+ sum over every site (tafl.training.secagg.sets_layout): whole
counts, so the thresholds are those of the plaintext sum. Under record-level DP (`--dp-epsilon`) the sets are
calibrated on the server's validation split, the coordinator's own images, which the DP statement does not cover and
which costs no budget: a noisy release of the sites' histograms leaves every class of a DermaMNIST-sized federation
too uncertain to bound at ε = 8 (docs/design.md, "Prediction sets"), so its sets would hold every class.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from tafl import conformal
from tafl.training.config import RunConfig
from tafl.training.contract import GlobalState, Method
from tafl.training.methods.sets import SETS_KEY
from tafl.training.rounds import charge
from tafl.training.transport import Transport

log = logging.getLogger(__name__)

LEVELS = (0.8, 0.9, 0.95)  # the coverage levels the report states (the package keeps their thresholds)
REPORT_LEVEL = 0.9


def problem(r: Any, num_classes: int) -> str | None:
    """Why a client's histograms cannot be summed, or None."""
    t = r.extras.get(SETS_KEY)
    shape = (num_classes, conformal.GRID)
    if t is None or tuple(t.shape) != shape:
        return f"{SETS_KEY} is missing or not of shape {shape}"
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        return f"{SETS_KEY} contains NaN, Inf or negative counts"
    return None


def not_fitted(state: GlobalState, why: str) -> GlobalState:
    log.info("conformal sets: none fitted: %s", why)
    return GlobalState(state.weights, state.extras, dict(state.meta, conformal={"fitted": False, "why": why}))


def fit_sets(method: Method, state: GlobalState, transport: Transport, cfg: RunConfig, val: Any,
             book: dict[str, Any], site_names: list[str] | None = None) -> GlobalState:
    """The sets' statistics round (or the validation split's histograms) and their sum in the state: extras
    `conformal.hist` (C, GRID), meta `conformal`. Where the clients are real sites (`site_names`, one client each) and
    each site's histograms reach the server on their own (not under secure aggregation), each site's are kept too
    (extras `conformal.site_hist` (S, C, GRID), meta `conformal.sites`): its own thresholds cover its own images, which
    the federation's need not (docs/design.md, "Prediction sets")."""
    if not cfg.conformal:
        return not_fitted(state, "turned off (--no-conformal)")
    t0 = time.perf_counter()
    C = int(method.model_cfg.num_classes)
    calibration = state.meta.get("calibration") or {}
    private = cfg.dp_epsilon is not None  # the sites' rows would need noise: the server's own split instead
    held = cfg.calib_holdout > 0 and not private
    if held:
        round_cfg = {"round": cfg.rounds + 4, "seed": cfg.seed, "conformal_stats": calibration}
        results, cost = transport.train(list(range(transport.num_clients)), method.broadcast(state), round_cfg)
        charge(book, cost)
        good = []
        for r in results:
            why = problem(r, C)
            if why is None:
                good.append(r)
            else:
                log.warning("conformal sets: dropping client %s: %s", r.client_id, why)
        if not good:
            return not_fitted(state, "no client sent its histograms")
        hist = sum(r.extras[SETS_KEY].double().numpy() for r in good)
        held_images = int(hist.sum())
        per_site = None
        if site_names and not cfg.secure_aggregation and transport.num_clients == len(site_names):
            per_site = np.zeros((len(site_names), C, conformal.GRID))
            for r in good:
                per_site[int(r.client_id)] = r.extras[SETS_KEY].double().numpy()
        # a secure sum is one combined result: the transport lists the clients in it
        clients = sorted(int(c) for c in (cost.get("answered") or [r.client_id for r in good]))
        source = "the clients' held-out rows" + (", one SecAgg+ sum" if cfg.secure_aggregation else "")
        if cfg.conformal_rows == "pooled":  # and the server's own validation rows, which no calibration was fitted on
            val_hist, val_site = validation_histograms(method, state, cfg, val, C, site_names)
            hist = hist + val_hist
            if per_site is not None and val_site is not None:
                per_site = per_site + val_site
            source += " and the server's validation split"
    else:
        hist, per_site = validation_histograms(method, state, cfg, val, C, site_names)
        held_images, clients = 0, []
        source = "the server's validation split" + (
            " (under DP: the coordinator's own images, no budget spent)" if private else "")
    counts = hist.sum(axis=1)
    conf = cfg.set_confidence
    rec = {"fitted": True, "score": "1 - p (calibrated, source prior)", "grid": conformal.GRID, "source": source,
           "confidence": conf,
           "clients": clients, "calibration_images": int(counts.sum()), "held_out_images": held_images,
           "validation_images": int(counts.sum()) - held_images,
           "per_class": [int(c) for c in counts],
           "thresholds": {str(level): [float(t) for t in conformal.class_thresholds(hist, 1 - level, conf)]
                          for level in LEVELS},
           "marginal_thresholds": {str(level): conformal.marginal_threshold(hist, 1 - level, conf)
                                   for level in LEVELS},
           "seconds": round(time.perf_counter() - t0, 2)}
    if per_site is not None:
        rec["sites"] = {name: {"calibration_images": int(per_site[k].sum()),
                               "thresholds": {str(level): [float(t) for t in conformal.class_thresholds(
                                   per_site[k], 1 - level, conf)] for level in LEVELS}}
                        for k, name in enumerate(site_names)}
    log.info("conformal sets: %d calibration images from %s; per class %s; coverage %s", rec["calibration_images"],
             source, rec["per_class"], "on average" if conf is None else f"with probability {conf:g}")
    extras = {**state.extras, "conformal.hist": torch.from_numpy(hist.astype(np.float32))}
    if per_site is not None:
        extras["conformal.site_hist"] = torch.from_numpy(per_site.astype(np.float32))
    return GlobalState(state.weights, extras, dict(state.meta, conformal=rec))


def validation_histograms(method: Method, state: GlobalState, cfg: RunConfig, val: Any, C: int,
                          site_names: list[str] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The server's validation split's histograms (C, GRID), on the run's calibrated posteriors as the clients score
    theirs, and each site's part (S, C, GRID) where the split knows its rows' sites, else None."""
    from tafl.prior import Calibration
    from tafl.training.evaluate import predict

    module = method.inference_model(state).to(method.device)
    out = predict(module, val.images, method.normalize, cfg.eval_batch_size, keys=method.output_keys)
    probs = Calibration.from_dict(state.meta.get("calibration") or {}, C).probs(method.posterior_logits(out))
    scores = conformal.true_class_scores(probs, val.labels)
    hist = conformal.histograms(scores, val.labels, C)
    per_site = None
    if site_names and getattr(val, "sites", None) is not None:  # the validation split's rows of each site
        per_site = np.stack([conformal.histograms(scores[val.sites == k], val.labels[val.sites == k], C)
                             for k in range(len(site_names))])
    return hist, per_site


def by_class_and_mix(sets: np.ndarray, labels: np.ndarray, ranks: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, dict[str, dict[str, float]]]:
    """Per class, the coverage and mean size of the sets (N, C) on images of that class (NaN where none), and per mix
    of the eleven the prior-weighted coverage Σ_c π(c)·coverage_c and size, over the classes present (as the report
    weights accuracy)."""
    from tafl.training.longtail import DISTRIBUTIONS, distribution_prior

    y = np.asarray(labels, np.int64)
    C = sets.shape[1]
    hit, size = sets[np.arange(len(y)), y], sets.sum(axis=1)
    cov_c = np.array([hit[y == c].mean() if (y == c).any() else np.nan for c in range(C)])
    size_c = np.array([size[y == c].mean() if (y == c).any() else np.nan for c in range(C)])
    present = ~np.isnan(cov_c)
    mixes = {}
    for name, kind, imf in DISTRIBUTIONS:
        prior = distribution_prior(ranks, kind, imf) * present
        prior = prior / prior.sum()
        mixes[name] = {"coverage": float(np.nansum(prior * cov_c)), "size": float(np.nansum(prior * size_c))}
    return cov_c, size_c, mixes


def sets_report(state: GlobalState, probs: np.ndarray, labels: np.ndarray, ranks: np.ndarray,
                class_names: list[str], sites: np.ndarray | None = None,
                site_names: list[str] | None = None) -> dict[str, Any] | None:
    """The report's `conformal`: the fit's record and, on the test split's calibrated posteriors (`probs`, source
    prior), per level the class-conditional sets' and the marginal variant's coverage and mean size over all test
    images, per class, per mix of the eleven (Σ_c π(c)·coverage_c, as accuracy is weighted) and per site."""
    rec = state.meta.get("conformal")
    if not rec or not rec.get("fitted"):
        return dict(rec) if rec else None
    C = len(class_names)
    y = np.asarray(labels, np.int64)
    out: dict[str, Any] = {k: v for k, v in rec.items() if k not in ("thresholds", "marginal_thresholds", "sites")}
    if rec.get("sites"):
        out["sites"] = {n: {"calibration_images": v["calibration_images"]} for n, v in rec["sites"].items()}
    levels: dict[str, Any] = {}
    for level in LEVELS:
        key = str(level)
        entry = {}
        for variant, thr in (("class_conditional", np.asarray(rec["thresholds"][key])),
                             ("marginal", float(rec["marginal_thresholds"][key]))):
            sets = conformal.prediction_sets(probs, thr)
            hit, size = sets[np.arange(len(y)), y], sets.sum(axis=1)
            cov_c, size_c, mixes = by_class_and_mix(sets, y, ranks)
            v: dict[str, Any] = {
                "coverage": float(hit.mean()), "size": float(size.mean()), "empty": float((size == 0).mean()),
                "per_class": {class_names[c]: {"coverage": None if np.isnan(cov_c[c]) else float(cov_c[c]),
                                               "size": None if np.isnan(size_c[c]) else float(size_c[c]),
                                               "test_images": int((y == c).sum())} for c in range(C)},
                "mixes": mixes, "lowest_mix_coverage": min(m["coverage"] for m in mixes.values())}
            if sites is not None and site_names:
                s = np.asarray(sites)
                v["sites"] = {n: {"coverage": float(hit[s == k].mean()), "size": float(size[s == k].mean()),
                                  "images": int((s == k).sum())} for k, n in enumerate(site_names) if (s == k).any()}
            entry[variant] = v
        if rec.get("sites") and sites is not None and site_names:  # each test image under its own site's thresholds
            s = np.asarray(sites)
            own = np.stack([np.asarray(rec["sites"][site_names[int(k)]]["thresholds"][key]) for k in s])
            sets = conformal.prediction_sets(probs, own)
            hit, size = sets[np.arange(len(y)), y], sets.sum(axis=1)
            entry["site_aware"] = {"sites": {n: {"coverage": float(hit[s == k].mean()),
                                                 "size": float(size[s == k].mean()), "images": int((s == k).sum())}
                                             for k, n in enumerate(site_names) if (s == k).any()}}
        levels[key] = entry
    out["levels"] = levels
    return out
