"""Evaluation over the eleven test distributions (docs/design.md, "Data and the evaluation protocol").

Inference runs once over the whole test split; everything else is derived from its outputs:
- per distribution, the prior-weighted accuracy Σ_c π_c·acc_c (acc_c on the whole test split,
  π the distribution's class proportions): the exact expected accuracy under that prior, the
  headline figure; the paper's sampled-subset accuracy beside it; head/middle/tail accuracy
  (thirds by training rank) under the same prior;
- macro F1, precision, recall, specificity and one-vs-rest AUC for the uniform distribution,
  computed on the whole test split with sample weights π_c/n_c (the uniform prior's expectation).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from tafl.training.longtail import (DISTRIBUTIONS, distribution_counts, distribution_prior, head_middle_tail,
                                    sample_distribution)


@torch.no_grad()
def predict(module: nn.Module, images_u8: np.ndarray | torch.Tensor, normalize, batch_size: int = 256,
            keys: tuple[str, ...] = ("probs", "label")) -> dict[str, np.ndarray]:
    """Run an inference module (batch -> dict of tensors) over uint8 (N, H, W, C) images."""
    module.eval()
    images = torch.as_tensor(images_u8)
    out: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for start in range(0, len(images), batch_size):
        res = module(normalize(images[start:start + batch_size]))
        for k in keys:
            out[k].append(res[k].detach().cpu().numpy())
    return {k: np.concatenate(v) if v else np.zeros((0,)) for k, v in out.items()}


def per_class_accuracy(preds: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    acc = np.full(num_classes, np.nan)
    for c in range(num_classes):
        m = labels == c
        if m.any():
            acc[c] = float((preds[m] == c).mean())
    return acc


def _weighted(acc: np.ndarray, prior: np.ndarray, classes: np.ndarray) -> float | None:
    classes = np.asarray([c for c in classes if not math.isnan(acc[c])], np.int64)
    if len(classes) == 0 or prior[classes].sum() <= 0:
        return None
    p = prior[classes] / prior[classes].sum()
    return float((p * acc[classes]).sum())


def balanced_accuracy(preds: np.ndarray, labels: np.ndarray, num_classes: int) -> float:
    acc = per_class_accuracy(preds, labels, num_classes)
    return float(np.nanmean(acc))


def evaluate_outputs(probs: np.ndarray, preds: np.ndarray, labels: np.ndarray, ranks: np.ndarray,
                     test_seed: int = 0) -> dict[str, Any]:
    """The eleven-distribution report section from one pass over the test split."""
    num_classes = len(ranks)
    acc = per_class_accuracy(preds, labels, num_classes)
    present = ~np.isnan(acc)
    test_counts = np.bincount(labels, minlength=num_classes)
    groups = head_middle_tail(ranks)
    all_classes = np.arange(num_classes)
    dists: dict[str, Any] = {}
    for i, (name, kind, imf) in enumerate(DISTRIBUTIONS):
        prior = distribution_prior(ranks, kind, imf)
        counts = distribution_counts(np.where(present, test_counts, test_counts.max()), ranks, kind, imf)
        counts = np.where(present, counts, 0)
        subset = sample_distribution(labels, counts, test_seed + i)
        sampled = float((preds[subset] == labels[subset]).mean()) if len(subset) else None
        dists[name] = {
            "accuracy": _weighted(acc, prior, all_classes),
            "sampled_accuracy": sampled,
            "head": _weighted(acc, prior, groups["head"]),
            "middle": _weighted(acc, prior, groups["middle"]),
            "tail": _weighted(acc, prior, groups["tail"]),
            "n": int(len(subset)),
        }
    accs = [d["accuracy"] for d in dists.values() if d["accuracy"] is not None]
    return {
        "test_distributions": dists,
        "average_accuracy": float(np.mean(accs)) if accs else None,
        "average_sampled_accuracy": float(np.mean([d["sampled_accuracy"] for d in dists.values()
                                                   if d["sampled_accuracy"] is not None] or [math.nan])),
        "uniform_metrics": uniform_metrics(probs, preds, labels, num_classes),
        "natural_metrics": natural_metrics(probs, preds, labels, num_classes),
        "per_class_accuracy": [None if math.isnan(a) else float(a) for a in acc],
        "groups": {k: [int(c) for c in v] for k, v in groups.items()},
        "test_class_counts": [int(c) for c in test_counts],
        "confusion_matrix": confusion(preds, labels, num_classes).tolist(),
        "absent_test_classes": [int(c) for c in np.flatnonzero(~present)],
    }


def confusion(preds: np.ndarray, labels: np.ndarray, num_classes: int, weights: np.ndarray | None = None) -> np.ndarray:
    cm = np.zeros((num_classes, num_classes), np.float64 if weights is not None else np.int64)
    np.add.at(cm, (labels, preds), 1 if weights is None else weights)
    return cm


def uniform_weights(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Per-sample weights 1/(C·n_c): every present class weighs the same (the uniform prior)."""
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    return 1.0 / (num_classes * counts.clip(1)[labels])


def uniform_metrics(probs: np.ndarray, preds: np.ndarray, labels: np.ndarray, num_classes: int) -> dict[str, Any]:
    """Macro metrics under the uniform prior: every sample weighted by 1/(C·n_c)."""
    return class_metrics(probs, preds, labels, num_classes, uniform_weights(labels, num_classes))


def natural_metrics(probs: np.ndarray, preds: np.ndarray, labels: np.ndarray, num_classes: int) -> dict[str, Any]:
    """The paper-style metrics on the test split as it comes (its own class mix), plus plain accuracy."""
    m = class_metrics(probs, preds, labels, num_classes, np.ones(len(labels)))
    return {"accuracy": float((preds == labels).mean()), **m}


def class_metrics(probs: np.ndarray, preds: np.ndarray, labels: np.ndarray, num_classes: int,
                  w: np.ndarray) -> dict[str, Any]:
    """Macro F1, precision, recall, specificity and one-vs-rest AUC with sample weights w."""
    from sklearn.metrics import precision_recall_fscore_support, roc_auc_score

    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    cls = np.arange(num_classes)
    prec, rec, f1, _ = precision_recall_fscore_support(labels, preds, labels=cls, sample_weight=w,
                                                       average=None, zero_division=0)
    cm = confusion(preds, labels, num_classes, w)
    tp = np.diag(cm)
    fp = cm.sum(0) - tp
    fn = cm.sum(1) - tp
    tn = cm.sum() - tp - fp - fn
    with np.errstate(invalid="ignore", divide="ignore"):
        spec = np.where(tn + fp > 0, tn / (tn + fp), np.nan)
    present = counts > 0
    auc: float | None
    try:
        if num_classes == 2:
            auc = float(roc_auc_score(labels, probs[:, 1], sample_weight=w))
        else:
            p = probs / np.clip(probs.sum(1, keepdims=True), 1e-12, None)
            auc = float(roc_auc_score(labels, p, multi_class="ovr", average="macro", labels=cls, sample_weight=w))
    except ValueError:
        auc = None  # a class absent from the test split
    return {
        "macro_f1": float(f1[present].mean()),
        "precision": float(prec[present].mean()),
        "recall": float(rec[present].mean()),
        "specificity": float(np.nanmean(spec[present])),
        "auc": auc,
        "per_class": {"precision": prec.tolist(), "recall": rec.tolist(), "f1": f1.tolist(),
                      "specificity": [None if math.isnan(s) else float(s) for s in spec]},
    }
