"""Class-conditional (Mondrian) split conformal prediction sets, computable from per-class score histograms that
sites can sum (issue 54; docs/design.md, "Prediction sets").

The nonconformity score of class c for an image is s_c = 1 − p_c, p the model's calibrated posterior under its
source prior (the least-ambiguous-set score of Sadinle et al. 2019: the smallest sets on average for a given
coverage). Calibrated on held-out images whose true class is c, the class's threshold q_c is the
⌈(n_c + 1)(1 − α)⌉-th smallest of their scores (the finite-sample correction); the set of an image is every class c
with s_c ≤ q_c. For an image of class c drawn exchangeably with class c's calibration images,
P(c ∈ set) ≥ 1 − α, whatever the mix of classes: each class's guarantee uses only that class's images, so a shift
of the case mix (p(y) moves, p(x | y) stays) leaves every class's coverage in place. The score is fixed at the
source prior; a request that adapts the label to another prior does not move the set.

A federation cannot pool the scores, but the quantile needs only each class's score distribution: every site sends
a histogram of its held-out scores per class on a fixed grid of GRID bins over [0, 1], the server sums them (a sum:
SecAgg+ and a Gaussian release fit it) and takes the upper edge of the bin that holds the k-th smallest score. That
threshold is never below the exact one and at most one bin width (1 / GRID) above it, so its coverage is at least
the exact method's; summed histograms give the same threshold as one histogram of the pooled scores.

`exact_thresholds` computes the pooled quantile from the scores themselves (the central ceiling a report compares
with); `marginal_threshold` the one-threshold variant, whose guarantee holds only on average over the calibration
mix and can fail a rare class.

Numpy only: the serving core imports it.
"""

from __future__ import annotations

import math

import numpy as np

GRID = 2000  # histogram bins over the score range [0, 1]: a threshold is at most 1 / GRID above the exact one
ALWAYS = 1.0  # the threshold of a class with too few calibration images for its level: every score is within


def nonconformity(probs: np.ndarray) -> np.ndarray:
    """(N, C) scores 1 − p of every class for every image."""
    return 1.0 - np.asarray(probs, np.float64)


def true_class_scores(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N,) the score of each image's true class."""
    p = np.asarray(probs, np.float64)
    return 1.0 - p[np.arange(len(p)), np.asarray(labels, np.int64)]


def histograms(scores: np.ndarray, labels: np.ndarray, num_classes: int, bins: int = GRID) -> np.ndarray:
    """(num_classes, bins) counts of the true-class scores per class on the fixed grid over [0, 1]: what a site
    sends. A score of exactly 1 falls in the last bin."""
    s = np.clip(np.asarray(scores, np.float64), 0.0, 1.0)
    idx = np.minimum((s * bins).astype(np.int64), bins - 1)
    out = np.zeros((num_classes, bins), np.float64)
    np.add.at(out, (np.asarray(labels, np.int64), idx), 1.0)
    return out


def rank(n: float, alpha: float, confidence: float | None = None) -> int:
    """The rank k of the calibration score that is the threshold (k > n: no finite one).

    `confidence` None: k = ⌈(n + 1)(1 − α)⌉, coverage ≥ 1 − α on average over the calibration draw (the split
    conformal guarantee). `confidence` 1 − δ: the smallest k with P(Binomial(n, 1 − α) ≥ k) ≤ δ, so that the
    coverage of this very calibration is ≥ 1 − α with probability ≥ 1 − δ over its draw (training-conditional
    validity, Vovk 2012, Proposition 2a: the k-th smallest of n exchangeable scores covers a new one with
    probability F(s_(k)) ~ Beta(k, n − k + 1), and P(Beta(k, n − k + 1) < t) = P(Binomial(n, t) ≥ k)). A
    fractional n (a noisy count) counts its whole images only."""
    if confidence is None:
        return int(math.ceil((n + 1) * (1 - alpha) - 1e-9))
    m, p, delta = int(math.floor(n + 1e-9)), 1.0 - alpha, 1.0 - confidence
    if m < 1 or not 0 < p < 1:
        return m + 1
    k, tail = m + 1, 0.0  # tail = P(Binomial(m, p) >= k)
    while k > 0:
        j = k - 1
        pmf = math.exp(math.lgamma(m + 1) - math.lgamma(j + 1) - math.lgamma(m - j + 1)
                       + j * math.log(p) + (m - j) * math.log1p(-p))
        if tail + pmf > delta:
            break
        tail, k = tail + pmf, j
    return k


def histogram_threshold(hist: np.ndarray, alpha: float, confidence: float | None = None) -> float:
    """The threshold from one histogram (bins,) of calibration scores: the upper edge of the bin holding the k-th
    smallest; ALWAYS when the histogram holds fewer than k. Counts may be fractional, or negative after a noisy
    release: negative bins count as empty and n is the sum of what is left."""
    h = np.clip(np.asarray(hist, np.float64), 0.0, None)
    n = float(h.sum())
    k = rank(n, alpha, confidence)
    if n <= 0 or k > n + 1e-9:
        return ALWAYS
    b = int(np.searchsorted(np.cumsum(h), k - 1e-9, side="left"))
    return min((b + 1) / len(h), ALWAYS)


def noisy_threshold(hist: np.ndarray, alpha: float, sigma: float, margin: float = 2.0) -> float:
    """The threshold from a histogram (bins,) released with Gaussian noise of standard deviation `sigma` per bin,
    chosen so that it is at least the noiseless one unless a noise draw exceeds `margin` standard deviations: the
    upper edge of the first bin b whose noisy cumulative count, less margin·σ·√(b + 1), reaches (1 − α)(ñ + 1) with ñ
    the noisy total plus margin·σ·√bins; ALWAYS where no bin does."""
    h = np.asarray(hist, np.float64)
    bins = len(h)
    cum = np.cumsum(h)
    n_hi = cum[-1] + margin * sigma * np.sqrt(bins)
    low = cum - margin * sigma * np.sqrt(np.arange(1, bins + 1))
    ok = np.flatnonzero(low >= (1 - alpha) * (n_hi + 1))
    return ALWAYS if sigma < 0 or not len(ok) else min((int(ok[0]) + 1) / bins, ALWAYS)


def class_thresholds(hists: np.ndarray, alpha: float, confidence: float | None = None) -> np.ndarray:
    """(C,) one threshold per class from the (summed) per-class histograms (C, bins); `confidence` as in `rank`."""
    return np.array([histogram_threshold(h, alpha, confidence) for h in np.asarray(hists)], np.float64)


def marginal_threshold(hists: np.ndarray, alpha: float, confidence: float | None = None) -> float:
    """One threshold for every class, from the classes' histograms pooled: the marginal variant."""
    return histogram_threshold(np.asarray(hists).sum(axis=0), alpha, confidence)


def exact_thresholds(scores: np.ndarray, labels: np.ndarray, num_classes: int, alpha: float,
                     confidence: float | None = None) -> np.ndarray:
    """(C,) the class-conditional thresholds from the pooled scores themselves, no grid: the k-th smallest of each
    class's scores (ALWAYS where the class has fewer than k)."""
    s, y = np.asarray(scores, np.float64), np.asarray(labels, np.int64)
    out = np.full(num_classes, ALWAYS)
    for c in range(num_classes):
        sc = np.sort(s[y == c])
        k = rank(len(sc), alpha, confidence)
        if 1 <= k <= len(sc):
            out[c] = sc[k - 1]
    return out


def prediction_sets(probs: np.ndarray, thresholds: np.ndarray | float) -> np.ndarray:
    """(N, C) bool: class c is in an image's set where its score 1 − p_c is within the class's threshold."""
    return nonconformity(probs) <= np.asarray(thresholds, np.float64)


def coverage(sets: np.ndarray, labels: np.ndarray) -> float:
    """The share of images whose true class is in their set."""
    y = np.asarray(labels, np.int64)
    return float(np.asarray(sets)[np.arange(len(y)), y].mean()) if len(y) else float("nan")
