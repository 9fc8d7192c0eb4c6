"""tafl.conformal: the class-conditional guarantee itself on synthetic scores, federated histograms against the
pooled quantile, and the sets against crepes' Mondrian conformal classifier (a reference nobody here wrote)."""

from __future__ import annotations

import numpy as np
import pytest

from tafl import conformal
from tafl.conformal import (ALWAYS, GRID, class_thresholds, coverage, exact_thresholds, histogram_threshold,
                            histograms, marginal_threshold, prediction_sets, rank, true_class_scores)

C = 4
ALPHA = 0.1
# class 3 is hard (its images look like the others'): its true-class posteriors are low
MEANS = np.array([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0], [0.8, 0.8, 0.8, 1.2]])


def draw(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    """Posteriors of images of the given classes: softmax of a noisy class-dependent logit vector."""
    z = MEANS[labels] + rng.normal(0, 1.0, (len(labels), C))
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def per_class_rows(n: int) -> np.ndarray:
    return np.repeat(np.arange(C), n)


def test_the_class_conditional_guarantee_holds_for_every_class_over_many_draws():
    """Exchangeable calibration and test draws: each class's coverage over 3,000 repetitions is at least 1 − α (and
    not much more: k / (n + 1) plus the grid), with n = 48 per class, so (n + 1)(1 − α) = 44.1 is no integer."""
    rng = np.random.default_rng(0)
    reps, n, m = 3000, 48, 4
    hits = np.zeros(C)
    for _ in range(reps):
        y_cal = per_class_rows(n)
        q = class_thresholds(histograms(true_class_scores(draw(rng, y_cal), y_cal), y_cal, C), ALPHA)
        y_test = per_class_rows(m)
        sets = prediction_sets(draw(rng, y_test), q)
        hits += sets[np.arange(len(y_test)), y_test].reshape(C, m).sum(axis=1)
    cov = hits / (reps * m)
    se = np.sqrt(ALPHA * (1 - ALPHA) / (reps * m))
    exact = rank(n, ALPHA) / (n + 1)  # 45 / 49: the exact method's coverage
    assert (cov >= 1 - ALPHA - 3 * se).all(), cov
    assert (cov <= exact + 0.01 + 3 * se).all(), cov  # the grid adds at most a bin's worth of scores


def test_summed_site_histograms_give_the_pooled_thresholds_and_the_grid_costs_at_most_one_bin():
    rng = np.random.default_rng(1)
    y = rng.choice(C, 900, p=[0.5, 0.3, 0.15, 0.05])
    s = true_class_scores(draw(rng, y), y)
    site = rng.integers(0, 4, len(y))  # four sites, unequal and random
    summed = sum(histograms(s[site == k], y[site == k], C) for k in range(4))
    pooled = histograms(s, y, C)
    assert np.array_equal(summed, pooled)
    fed = class_thresholds(summed, ALPHA)
    assert np.array_equal(fed, class_thresholds(pooled, ALPHA))
    exact = exact_thresholds(s, y, C, ALPHA)
    assert (fed >= exact).all() and (fed <= exact + 1.0 / GRID + 1e-12).all(), (fed, exact)


def test_sets_equal_crepes_mondrian_conformal_classifier():
    """crepes' ConformalClassifier with the classes as Mondrian categories and unsmoothed p-values (c is in the set
    where its p-value is at least α) gives the exact thresholds' sets, image for image."""
    crepes = pytest.importorskip("crepes", reason="needs crepes: the reference extra (pip install -e '.[reference]')")
    rng = np.random.default_rng(2)
    y_cal = rng.permutation(np.repeat(np.arange(C), [281, 213, 134, 72]))
    for c in range(C):  # no class whose (n + 1)(1 − α) is an integer: there the two conventions differ by a rank
        assert abs((np.sum(y_cal == c) + 1) * (1 - ALPHA) - round((np.sum(y_cal == c) + 1) * (1 - ALPHA))) > 1e-6
    s_cal = true_class_scores(draw(rng, y_cal), y_cal)
    test = draw(rng, rng.choice(C, 500))
    ours = prediction_sets(test, exact_thresholds(s_cal, y_cal, C, ALPHA))
    cc = crepes.ConformalClassifier()
    cc.fit(s_cal, bins=y_cal)
    ref = np.zeros_like(ours)
    for c in range(C):  # class c's candidates are judged against class c's calibration scores
        p = cc.predict_p(1.0 - test[:, [c]], bins=np.full(len(test), c), smoothing=False)
        ref[:, c] = p[:, 0] >= ALPHA
    assert np.array_equal(ours, ref), np.argwhere(ours != ref)[:5]


def test_class_conditional_sets_keep_their_coverage_when_the_case_mix_moves_and_the_marginal_ones_do_not():
    """Calibrated on a mix where the hard class is rare (5 %), tested on one where it is common (60 %): the
    class-conditional sets cover every class and the shifted mix; one marginal threshold under-covers the hard class
    and so the whole shifted mix."""
    rng = np.random.default_rng(3)
    y_cal = rng.choice(C, 4000, p=[0.35, 0.35, 0.25, 0.05])
    s_cal = true_class_scores(draw(rng, y_cal), y_cal)
    hists = histograms(s_cal, y_cal, C)
    y_test = rng.choice(C, 20000, p=[0.15, 0.15, 0.1, 0.6])
    p_test = draw(rng, y_test)
    mondrian = prediction_sets(p_test, class_thresholds(hists, ALPHA))
    marginal = prediction_sets(p_test, marginal_threshold(hists, ALPHA))
    hard = y_test == 3
    assert coverage(mondrian[hard], y_test[hard]) >= 1 - ALPHA - 0.01
    assert coverage(mondrian, y_test) >= 1 - ALPHA - 0.01
    assert coverage(marginal[hard], y_test[hard]) < 1 - ALPHA - 0.1
    assert coverage(marginal, y_test) < 1 - ALPHA - 0.05
    # the marginal threshold is what a pooled mix of mostly easy images needs: its average sets are smaller
    assert marginal.sum(1).mean() < mondrian.sum(1).mean()


def test_too_few_images_or_noisy_counts_give_a_valid_threshold():
    """A class with fewer than ⌈(n + 1)(1 − α)⌉ images cannot have a finite threshold: every score is within
    (ALWAYS). Noisy counts can make bins negative: they count as empty, and the threshold stays on the grid (how
    far noise moves it depends on the grid and the noise: a private release needs its own measurement)."""
    few = histograms(np.array([0.1, 0.2, 0.3]), np.zeros(3, int), 1)[0]
    assert histogram_threshold(few, ALPHA) == ALWAYS
    assert histogram_threshold(np.zeros(GRID), ALPHA) == ALWAYS
    rng = np.random.default_rng(4)
    s = rng.uniform(0, 0.5, 400)
    clean = histograms(s, np.zeros(400, int), 1)[0]
    noisy = clean + rng.normal(0, 2.0, GRID)
    t = histogram_threshold(noisy, ALPHA)
    assert 0.0 < t <= ALWAYS and abs(t * GRID - round(t * GRID)) < 1e-9
    assert histogram_threshold(clean, ALPHA) <= 0.5  # the clean one lies within the scores' range
    sets = prediction_sets(np.array([[0.95, 0.05], [0.5, 0.5]]), np.array([0.2, ALWAYS]))
    assert sets.tolist() == [[True, True], [False, True]]


def test_a_noisy_histogram_gives_a_threshold_no_lower_than_the_noiseless_one_but_rarely():
    """tafl.conformal.noisy_threshold: without noise it is histogram_threshold; with Gaussian noise on every bin it
    stays at or above the noiseless threshold in nearly every draw (it fails only where a draw passes its margin),
    and it grows with the noise until the class is in every set."""
    rng = np.random.default_rng(3)
    scores = rng.beta(2, 5, 400)
    for bins in (20, 200):
        h = conformal.histograms(scores, np.zeros(400, np.int64), 1, bins)[0]
        exact = conformal.histogram_threshold(h, 0.1)
        assert conformal.noisy_threshold(h, 0.1, 0.0) == exact
        draws = [conformal.noisy_threshold(h + rng.normal(0, 1.0, bins), 0.1, 1.0) for _ in range(500)]
        assert np.mean(np.array(draws) >= exact) >= 0.97
        assert np.median([conformal.noisy_threshold(h + rng.normal(0, 8.0, bins), 0.1, 8.0)
                          for _ in range(50)]) >= np.median(draws)
    assert conformal.noisy_threshold(np.full(20, 0.5), 0.1, 5.0) == conformal.ALWAYS  # 10 images, σ 5: unbounded


def test_the_confidence_rank_is_the_smallest_whose_binomial_tail_is_within_delta():
    """rank(n, α, confidence): the smallest k with P(Binomial(n, 1 − α) ≥ k) ≤ 1 − confidence (scipy's binomial as
    the reference), n + 1 (no finite threshold) where even k = n is not enough; never below the average rule's."""
    binom = pytest.importorskip("scipy.stats").binom
    for alpha, conf in ((0.1, 0.9), (0.05, 0.9), (0.2, 0.95), (0.1, 0.5)):
        for n in list(range(0, 120)) + [450, 1003]:
            k = rank(n, alpha, conf)
            ok = [j for j in range(1, n + 1) if binom.sf(j - 1, n, 1 - alpha) <= 1 - conf]
            assert k == (min(ok) if ok else n + 1), (alpha, conf, n, k)
            assert k >= rank(n, alpha) or conf == 0.5, (alpha, conf, n)
    assert rank(21, 0.1, 0.9) == 22 and rank(22, 0.1, 0.9) == 22  # 0.9^22 = 0.098: the fewest rows for a bound


def test_the_confidence_rule_bounds_each_calibration_draws_coverage_and_the_average_rule_does_not():
    """Uniform scores: a threshold t covers a new image with probability t exactly. Over 4,000 calibration draws of
    n = 40 rows through the histograms, the confidence rule's coverage falls below 1 − α in at most δ of the draws
    (plus three standard errors); the average rule's mean coverage is ≥ 1 − α but falls below it in about 40 %."""
    rng = np.random.default_rng(5)
    reps, n = 4000, 40
    y = np.zeros(n, np.int64)
    conf_cov, avg_cov = np.empty(reps), np.empty(reps)
    for i in range(reps):
        h = histograms(rng.uniform(0, 1, n), y, 1)
        conf_cov[i] = class_thresholds(h, ALPHA, 0.9)[0]
        avg_cov[i] = class_thresholds(h, ALPHA)[0]
    delta, se = 0.1, np.sqrt(0.1 * 0.9 / reps)
    assert np.mean(conf_cov < 1 - ALPHA) <= delta + 3 * se
    assert np.mean(conf_cov < 1 - ALPHA) >= delta / 3  # not vacuous: the bound is near tight at n = 40
    assert avg_cov.mean() >= 1 - ALPHA - 3 * np.sqrt(0.1 * 0.9 / (n * reps))
    assert np.mean(avg_cov < 1 - ALPHA) > 0.3
