"""Long-tail counts, partitions, participation and the eleven test distributions."""

from __future__ import annotations

import numpy as np
import pytest

from tafl.errors import ConfigError
from tafl.training import longtail as lt


def test_class_ranks_by_frequency_ties_by_index():
    labels = np.array([2, 2, 2, 0, 0, 1, 1, 3])
    # counts: 0->2, 1->2, 2->3, 3->1
    assert lt.class_ranks(labels, 4).tolist() == [1, 2, 0, 3]


def test_longtail_counts_follow_the_exponential_formula():
    ranks = np.arange(10)
    counts = lt.longtail_counts(5000, 10, 50, ranks)
    expected = [int(np.floor(5000 * 50 ** (-r / 9) + 1e-9)) for r in range(10)]
    assert counts.tolist() == expected
    assert counts[0] == 5000 and counts[-1] == 100  # the largest class keeps its size; IF = 50


def test_longtail_counts_follow_rank_not_index():
    counts = lt.longtail_counts(100, 3, 10, np.array([2, 0, 1]))
    assert counts.tolist() == [10, 100, int(100 * 10 ** -0.5)]


def test_make_longtail_subsamples_to_counts_and_is_deterministic():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 2000)
    a = lt.make_longtail(labels, 5, 20, seed=3)
    b = lt.make_longtail(labels, 5, 20, seed=3)
    c = lt.make_longtail(labels, 5, 20, seed=4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    ranks = lt.class_ranks(labels, 5)
    target = lt.longtail_counts(np.bincount(labels).max(), 5, 20, ranks)
    assert np.bincount(labels[a], minlength=5).tolist() == target.tolist()
    assert lt.make_longtail(labels, 5, None, 0).tolist() == list(range(2000))


def test_imbalance_factor_below_one_is_an_error():
    with pytest.raises(ConfigError, match=">= 1"):
        lt.longtail_counts(10, 3, 0.5, np.arange(3))


@pytest.mark.parametrize("equal", [True, False])
def test_partition_uses_every_sample_once_and_is_deterministic(equal):
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 7, 3000)
    parts = lt.dirichlet_partition(labels, 20, 0.5, seed=7, equal=equal)
    again = lt.dirichlet_partition(labels, 20, 0.5, seed=7, equal=equal)
    other = lt.dirichlet_partition(labels, 20, 0.5, seed=8, equal=equal)
    assert len(parts) == 20
    allidx = np.concatenate(parts)
    assert np.array_equal(np.sort(allidx), np.arange(3000))  # each sample exactly once
    assert all(np.array_equal(p, q) for p, q in zip(parts, again))
    assert not all(np.array_equal(p, q) for p, q in zip(parts, other))
    sizes = [len(p) for p in parts]
    if equal:
        assert max(sizes) - min(sizes) <= 1  # CReFF's equal-size clients
    else:
        assert min(sizes) >= int(0.5 * 3000 / 20 * 0.5)  # each group's clients hold at least half the mean


def test_partition_is_heterogeneous_for_small_alpha():
    labels = np.repeat(np.arange(5), 400)
    counts = lt.client_class_counts(labels, lt.dirichlet_partition(labels, 10, 0.1, seed=0, equal=False), 5)
    share = counts.max(1) / counts.sum(1)
    assert share.mean() > 0.5  # most clients are dominated by one class
    iid = lt.client_class_counts(labels, lt.dirichlet_partition(labels, 10, 1000.0, seed=0, equal=False), 5)
    assert (iid.max(1) / iid.sum(1)).mean() < 0.35


def test_more_clients_than_samples_is_an_error():
    with pytest.raises(ConfigError, match="only 5 training samples"):
        lt.dirichlet_partition(np.arange(5) % 2, 6, 0.5, seed=0)


def test_alpha_must_be_positive():
    with pytest.raises(ConfigError, match="alpha"):
        lt.dirichlet_partition(np.arange(50) % 2, 2, 0.0, seed=0)


def test_select_clients_is_a_function_of_seed_and_round():
    a = lt.select_clients(20, 0.4, 7, 3)
    assert a == lt.select_clients(20, 0.4, 7, 3)
    assert len(a) == 8 and len(set(a)) == 8 and all(0 <= k < 20 for k in a)
    assert any(lt.select_clients(20, 0.4, 7, r) != a for r in range(4, 10))
    assert len(lt.select_clients(3, 0.1, 7, 1)) == 1


def test_eleven_distributions_counts_match_the_formula():
    test_counts = np.array([500, 300, 120, 23, 400, 1341, 29])
    ranks = np.array([3, 2, 1, 6, 0, 4, 5])  # any ranking
    img_max = 23
    assert len(lt.DISTRIBUTIONS) == 11
    for name, kind, imf in lt.DISTRIBUTIONS:
        counts = lt.distribution_counts(test_counts, ranks, kind, imf)
        r = ranks if kind == "forward" else 6 - ranks
        if kind == "uniform":
            assert counts.tolist() == [img_max] * 7
        else:
            assert counts.tolist() == [int(np.floor(img_max * imf ** (-ri / 6) + 1e-9)) for ri in r], name
    fwd = lt.distribution_counts(test_counts, ranks, "forward", 50)
    assert fwd[np.argmin(ranks)] == img_max  # the training head keeps img_max under forward
    bwd = lt.distribution_counts(test_counts, ranks, "backward", 50)
    assert bwd[np.argmax(ranks)] == img_max  # the training tail gets img_max under backward


def test_prior_sums_to_one_and_reverses():
    ranks = np.array([0, 1, 2, 3])
    f, b = lt.distribution_prior(ranks, "forward", 10), lt.distribution_prior(ranks, "backward", 10)
    assert f.sum() == pytest.approx(1) and b.sum() == pytest.approx(1)
    assert np.allclose(f, b[::-1]) and f[0] / f[3] == pytest.approx(10)


def test_sample_distribution_draws_exact_counts():
    labels = np.repeat(np.arange(3), [10, 20, 30])
    idx = lt.sample_distribution(labels, np.array([5, 2, 0]), seed=1)
    assert np.bincount(labels[idx], minlength=3).tolist() == [5, 2, 0]
    assert np.array_equal(idx, lt.sample_distribution(labels, np.array([5, 2, 0]), seed=1))


@pytest.mark.parametrize("c,sizes", [(7, (3, 2, 2)), (10, (4, 3, 3)), (3, (1, 1, 1))])
def test_head_middle_tail_by_training_rank(c, sizes):
    rng = np.random.default_rng(c)
    ranks = rng.permutation(c)
    g = lt.head_middle_tail(ranks)
    assert (len(g["head"]), len(g["middle"]), len(g["tail"])) == sizes
    assert max(ranks[g["head"]]) < min(ranks[g["middle"]]) and max(ranks[g["middle"]]) < min(ranks[g["tail"]])
