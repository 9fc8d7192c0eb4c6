"""Prior-weighted accuracy, head/middle/tail and the uniform-prior metrics."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.training.evaluate import evaluate_outputs, per_class_accuracy, uniform_metrics  # noqa: E402
from tafl.training.longtail import DISTRIBUTION_NAMES, distribution_prior  # noqa: E402


def _fake(acc_per_class, counts, seed=0):
    """Labels and predictions with exactly the given per-class accuracy."""
    rng = np.random.default_rng(seed)
    labels, preds = [], []
    C = len(counts)
    for c, (a, n) in enumerate(zip(acc_per_class, counts)):
        k = int(round(a * n))
        labels += [c] * n
        preds += [c] * k + [int((c + 1) % C)] * (n - k)
    labels, preds = np.array(labels), np.array(preds)
    probs = np.full((len(labels), C), 0.1 / (C - 1))
    probs[np.arange(len(labels)), preds] = 0.9
    perm = rng.permutation(len(labels))
    return probs[perm], preds[perm], labels[perm]


def test_prior_weighted_accuracy_is_exact_expectation():
    acc = [1.0, 0.5, 0.0, 0.25]
    probs, preds, labels = _fake(acc, [40, 40, 40, 40])
    ranks = np.array([0, 1, 2, 3])
    rep = evaluate_outputs(probs, preds, labels, ranks)
    assert set(rep["test_distributions"]) == set(DISTRIBUTION_NAMES)
    for name, kind, imf in [("forward50", "forward", 50), ("uniform", "uniform", 1), ("backward10", "backward", 10)]:
        pi = distribution_prior(ranks, kind, imf)
        assert rep["test_distributions"][name]["accuracy"] == pytest.approx(float((pi * np.array(acc)).sum()))
    assert rep["test_distributions"]["uniform"]["accuracy"] == pytest.approx(np.mean(acc))
    assert rep["average_accuracy"] == pytest.approx(np.mean([d["accuracy"] for d in rep["test_distributions"].values()]))
    # a model right only on the head is good forward and bad backward
    assert rep["test_distributions"]["forward50"]["accuracy"] > rep["test_distributions"]["backward50"]["accuracy"]


def test_head_middle_tail_use_training_rank():
    acc = [0.0, 1.0, 0.5]  # class 1 is the head by rank
    probs, preds, labels = _fake(acc, [30, 30, 30])
    rep = evaluate_outputs(probs, preds, labels, np.array([2, 0, 1]))
    u = rep["test_distributions"]["uniform"]
    assert (u["head"], u["middle"], u["tail"]) == (1.0, 0.5, 0.0)


def test_sampled_subset_sizes_follow_counts():
    probs, preds, labels = _fake([1, 1, 1], [23, 50, 80])
    rep = evaluate_outputs(probs, preds, labels, np.array([2, 1, 0]))
    assert rep["test_distributions"]["uniform"]["n"] == 69
    assert rep["test_distributions"]["uniform"]["sampled_accuracy"] == 1.0
    assert rep["test_distributions"]["forward50"]["n"] == 23 + int(23 * 50 ** -0.5) + 0


def test_uniform_metrics_are_class_balanced():
    # heavily imbalanced test split; a perfect model on the big class, bad on the small
    probs, preds, labels = _fake([1.0, 0.0], [1000, 10])
    m = uniform_metrics(probs, preds, labels, 2)
    assert m["recall"] == pytest.approx(0.5)
    assert m["specificity"] == pytest.approx(0.5)
    assert 0 <= m["macro_f1"] <= 1 and 0 <= m["auc"] <= 1
    acc = per_class_accuracy(preds, labels, 2)
    assert acc.tolist() == [1.0, 0.0]


def test_perfect_model_scores_one_everywhere():
    probs, preds, labels = _fake([1, 1, 1, 1, 1], [5, 9, 30, 12, 7])
    rep = evaluate_outputs(probs, preds, labels, np.arange(5))
    assert all(d["accuracy"] == pytest.approx(1.0) for d in rep["test_distributions"].values())
    m = rep["uniform_metrics"]
    assert m["macro_f1"] == pytest.approx(1) and m["auc"] == pytest.approx(1) and m["specificity"] == pytest.approx(1)
