"""The operating point of a single-head model's plain decision, chosen on the validation split.

A long-tailed model's argmax favours the classes it saw most: its rare classes' recall stays low even
where their probabilities rank them well. Post-hoc logit adjustment (Menon et al., "Long-tail learning
via logit adjustment", ICLR 2021) moves the decision, not the model: label = argmax_c (z_c − τ·log π_c),
with π the class mix the model's posteriors describe (`Method.default_source_prior`: the training
mix; for DAFL's class-weighted loss, the loss-weighted mix). τ = 0 is the argmax; τ = 1 the balanced (uniform-prior) Bayes rule for
calibrated logits. τ is chosen on the validation split, never on test, by one of two criteria (`decision_criterion`):
- `macro_f1` (the default): the macro F1 under a uniform class prior;
- `mixes`: what the product promises, the mean over the eleven case mixes (forward50 … backward50,
  tafl.training.longtail.DISTRIBUTIONS) of the validation rows' prior-weighted accuracy, each mix's class prior
  times the rows' per-class recall: the report's "mean of the eleven", on validation rows. Measured on the same
  weights it chose the same τ in most runs and a worse one where they differed (docs/decisions.md, "The operating
  point for the whole range of mixes"), so it is not the default.

Only the label moves: the probabilities stay the model's posteriors under the training mix, which is
what calibration, prior estimation and an explicit prior work on (an explicit or estimated prior
decides by the Bayes rule, without this offset). docs/decisions.md, "The plain decision's operating point".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

KINDS = ("argmax", "validation")
CRITERIA = ("macro_f1", "mixes")
CRITERION_TEXT = {"mixes": "the mean over the eleven case mixes of the prior-weighted accuracy",
                  "macro_f1": "the macro F1 under a uniform class prior"}
GRID = tuple(round(0.1 * i, 1) for i in range(11))  # τ from 0 (argmax) to 1 (balanced)
# τ from −1 to 1, nearest 0 first (ties keep the smaller move): for the experts' vote, whose posteriors already aim
# at the uniform prior and may lean either way on real features
SIGNED_GRID = (0.0,) + tuple(v for i in range(1, 11) for v in (round(-0.1 * i, 1), round(0.1 * i, 1)))


def offset_for(tau: float, train_prior: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """(C,) −τ·log π, centred (argmax is unchanged by a constant)."""
    lp = np.log(np.clip(np.asarray(train_prior, np.float64), floor, None))
    o = -float(tau) * lp
    return o - o.mean()


def uniform_macro_f1(preds: np.ndarray, labels: np.ndarray, num_classes: int) -> float:
    """The report's macro F1 under a uniform class prior (tafl.training.evaluate.uniform_metrics), without its
    AUC and per-class tables: the same weights, the same F1, over the present classes."""
    from sklearn.metrics import f1_score

    from tafl.training.evaluate import uniform_weights  # imported here: this module stays torch-free for the config

    present = np.flatnonzero(np.bincount(labels, minlength=num_classes) > 0)
    f1 = f1_score(labels, preds, labels=np.arange(num_classes), sample_weight=uniform_weights(labels, num_classes),
                  average=None, zero_division=0)
    return float(f1[present].mean()) if len(present) else 0.0


def mixes_accuracy(preds: np.ndarray, labels: np.ndarray, ranks: np.ndarray) -> float:
    """The mean over the eleven case mixes (tafl.training.longtail.DISTRIBUTIONS, ranked by `ranks`, the training
    classes' frequency ranks) of these rows' prior-weighted accuracy: Σ_c π(c)·recall_c over the classes present in
    the rows, π renormalised over them. The report's "mean of the eleven" (tafl.training.evaluate), on any rows."""
    from tafl.training.longtail import DISTRIBUTIONS, distribution_prior

    y = np.asarray(labels, np.int64)
    C = len(ranks)
    counts = np.bincount(y, minlength=C)
    present = counts > 0
    recall = np.bincount(y, weights=(np.asarray(preds) == y).astype(np.float64), minlength=C) / np.maximum(counts, 1)
    accs = []
    for _, kind, imf in DISTRIBUTIONS:
        prior = np.where(present, distribution_prior(np.asarray(ranks), kind, imf), 0.0)
        accs.append(float((prior * recall).sum() / prior.sum()))
    return float(np.mean(accs))


def search_operating_point(decide: Callable[[np.ndarray], np.ndarray], labels: np.ndarray, train_prior: np.ndarray,
                           num_classes: int, grid: tuple[float, ...] = GRID, kind: str = "logit_adjustment",
                           criterion: str = "macro_f1", ranks: np.ndarray | None = None,
                           subject: str = "") -> dict[str, Any]:
    """The grid search every operating point shares: `decide(offset)` gives the validation labels the rule makes
    with the (C,) offset −τ·log π added; τ maximises the criterion (CRITERIA: `macro_f1`; `mixes`, over the eleven
    mixes ranked by `ranks`, by default those of `train_prior`), the first maximum winning (the grid lists the
    smaller move first, so ties keep the decision nearer the model's own). `subject` names what decides ("the
    experts' vote's ") in the record. Returns the record a checkpoint, a report and a package carry: kind, tau,
    offset, the criterion and every τ's score."""
    if criterion not in CRITERIA:
        raise ValueError(f"unknown operating-point criterion {criterion!r}: one of {', '.join(CRITERIA)}")
    y = np.asarray(labels, np.int64)
    if y.ndim != 1 or len(y) == 0:
        raise ValueError(f"need N > 0 validation labels, got shape {y.shape}")
    if criterion == "mixes":
        from tafl.training.longtail import ranks_from_counts

        r = ranks_from_counts(np.asarray(train_prior, np.float64)) if ranks is None else np.asarray(ranks)

        def score(p: np.ndarray) -> float:
            return mixes_accuracy(p, y, r)
    else:
        def score(p: np.ndarray) -> float:
            return uniform_macro_f1(p, y, num_classes)
    scores = [score(np.asarray(decide(offset_for(t, train_prior)))) for t in grid]
    tau = float(grid[int(np.argmax(np.round(scores, 12)))])
    return {"kind": kind, "tau": tau, "offset": [float(v) for v in offset_for(tau, train_prior)],
            "train_prior": [float(v) for v in np.asarray(train_prior, np.float64)],
            "criterion": subject + CRITERION_TEXT[criterion], "criterion_key": criterion,
            "validation_images": int(len(y)), "scores": {f"{t:.1f}": float(s) for t, s in zip(grid, scores)}}


def select_operating_point(logits: np.ndarray, labels: np.ndarray, train_prior: np.ndarray,
                           grid: tuple[float, ...] = GRID, criterion: str = "macro_f1",
                           ranks: np.ndarray | None = None) -> dict[str, Any]:
    """τ maximising the validation split's criterion (`search_operating_point`) for a single head's
    argmax(z + offset(τ)).

    logits (N, C) of the validation split (log-probabilities do as well), labels (N,)."""
    z = np.asarray(logits, np.float64)
    if z.ndim != 2 or len(z) != len(np.asarray(labels)) or len(z) == 0:
        raise ValueError(f"need (N, C) validation logits and N labels, got {z.shape} and {np.shape(labels)}")
    return search_operating_point(lambda o: (z + o).argmax(1), labels, train_prior, z.shape[1], grid,
                                  criterion=criterion, ranks=ranks)


def check_record(rec: Any, num_classes: int) -> np.ndarray | None:
    """The offset of a checkpoint's or package's decision record, validated; None for the plain argmax."""
    if rec is None:
        return None
    if not isinstance(rec, dict) or "offset" not in rec:
        raise ValueError("the decision record needs an 'offset'")
    o = np.asarray(rec["offset"], np.float64)
    if o.shape != (num_classes,) or not np.isfinite(o).all():
        raise ValueError(f"the decision offset must be {num_classes} finite numbers, got {rec['offset']!r}")
    return o
