"""Long-tailed training sets, client partitions and the eleven test distributions (docs/design.md, "Data and the evaluation protocol").

- `class_ranks`: classes ranked by training frequency (rank 0 = most frequent; ties by index).
- `longtail_counts` / `make_longtail`: exponential decay n_c = n_max · IF^(−rank/(C−1)).
- `dirichlet_partition`: Dirichlet(α) over classes across K clients; `equal=True` is CReFF's
  `clients_indices` (Dirichlet allocation in groups of at most ten clients, concatenated, then
  cut into K equal contiguous parts), `equal=False` the free split.
- `select_clients`: the round's participants, a pure function of (seed, round).
- `test_distributions`: forward/uniform/backward class priors and the sampled subsets.
All are deterministic under their seed.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from tafl.errors import ConfigError, DataError

log = logging.getLogger(__name__)

DISTRIBUTIONS: tuple[tuple[str, str, float], ...] = (
    ("forward50", "forward", 50), ("forward25", "forward", 25), ("forward10", "forward", 10),
    ("forward5", "forward", 5), ("forward2", "forward", 2), ("uniform", "uniform", 1),
    ("backward2", "backward", 2), ("backward5", "backward", 5), ("backward10", "backward", 10),
    ("backward25", "backward", 25), ("backward50", "backward", 50),
)
DISTRIBUTION_NAMES = tuple(d[0] for d in DISTRIBUTIONS)


def class_ranks(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """rank[c] of every class by descending frequency; ties keep class-index order."""
    return ranks_from_counts(np.bincount(labels, minlength=num_classes))


def ranks_from_counts(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts)
    num_classes = len(counts)
    order = np.lexsort((np.arange(num_classes), -counts))  # most frequent first
    ranks = np.empty(num_classes, np.int64)
    ranks[order] = np.arange(num_classes)
    return ranks


def longtail_counts(n_max: int, num_classes: int, imbalance_factor: float, ranks: np.ndarray) -> np.ndarray:
    """Target count per class: n_max · IF^(−rank/(C−1)), at least 1."""
    if imbalance_factor < 1:
        raise ConfigError(f"imbalance factor must be >= 1, got {imbalance_factor}")
    if num_classes == 1:
        return np.array([n_max])
    exp = -ranks.astype(np.float64) / (num_classes - 1)
    return np.maximum(1, np.floor(n_max * imbalance_factor ** exp + 1e-9)).astype(np.int64)


def make_longtail(labels: np.ndarray, num_classes: int, imbalance_factor: float | None, seed: int) -> np.ndarray:
    """Indices of a long-tailed subset of `labels` (sorted); None keeps everything."""
    if imbalance_factor is None:
        return np.arange(len(labels))
    counts = np.bincount(labels, minlength=num_classes)
    ranks = class_ranks(labels, num_classes)
    target = longtail_counts(int(counts.max()), num_classes, imbalance_factor, ranks)
    rng = np.random.default_rng([seed, 101])
    keep = []
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        n = int(min(target[c], len(idx)))
        if n < target[c]:
            log.warning("class %d has %d images, fewer than the long tail's %d; keeping all", c, len(idx), target[c])
        keep.append(rng.permutation(idx)[:n])
    return np.sort(np.concatenate(keep))


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int, *,
                        equal: bool = True, num_classes: int | None = None,
                        group_size: int = 10, max_tries: int = 1000) -> list[np.ndarray]:
    """Split sample indices over clients with Dirichlet(alpha) class proportions.

    Every index is used exactly once. Within each group of at most `group_size` clients, a
    class's samples are dealt by Dirichlet proportions, skipping clients already above the
    group's mean size, and redrawn until every client holds at least half the mean.
    `equal=True` then concatenates the clients in order and cuts the sequence into
    `num_clients` equal parts (sizes differ by at most one), as CReFF does.
    """
    n = len(labels)
    if alpha <= 0:
        raise ConfigError(f"Dirichlet alpha must be > 0, got {alpha}")
    if num_clients < 1:
        raise ConfigError(f"need at least one client, got {num_clients}")
    if num_clients > n:
        raise ConfigError(f"{num_clients} clients but only {n} training samples: every client needs at least one")
    num_classes = num_classes or int(labels.max()) + 1
    rng = np.random.RandomState(seed)
    order = rng.permutation(n)
    num_groups = math.ceil(num_clients / group_size)
    group_clients = [min(group_size, num_clients - g * group_size) for g in range(num_groups)]
    bounds = np.cumsum([0] + [round(n * k / num_clients) for k in group_clients])
    bounds[-1] = n
    parts: list[np.ndarray] = []
    for g, k in enumerate(group_clients):
        chunk = order[bounds[g]:bounds[g + 1]]
        parts.extend(_dirichlet_group(chunk, labels[chunk], k, alpha, num_classes, rng, max_tries))
    if equal:
        seq = np.concatenate(parts)
        parts = [np.asarray(p) for p in np.array_split(seq, num_clients)]
    return [np.sort(p.astype(np.int64)) for p in parts]


def _dirichlet_group(idx: np.ndarray, labels: np.ndarray, k: int, alpha: float, num_classes: int,
                     rng: np.random.RandomState, max_tries: int) -> list[np.ndarray]:
    size = len(idx)
    if k == 1:
        return [idx]
    min_needed = int(0.5 * size / k)
    for _ in range(max_tries):
        buckets: list[list[int]] = [[] for _ in range(k)]
        for c in range(num_classes):
            members = idx[labels == c]
            p = rng.dirichlet(np.repeat(alpha, k))
            open_ = np.array([len(b) < size / k for b in buckets], np.float64)
            p = p * open_
            if p.sum() <= 0:
                p = open_ if open_.sum() > 0 else np.ones(k)
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(members)).astype(int)[:-1]
            for b, piece in zip(buckets, np.split(members, cuts)):
                b.extend(piece.tolist())
        if min(len(b) for b in buckets) >= min_needed:
            return [np.asarray(b, np.int64) for b in buckets]
    raise DataError(f"could not deal {size} samples to {k} clients with alpha={alpha} so that each holds at least "
                    f"{min_needed} after {max_tries} tries; use fewer clients or a larger alpha")


HOLDOUT_MODES = ("rows", "classes")
HOLDOUT_CLASS_CAP = 0.3  # `classes` mode: at most this share of a client's rows of one class is held out


def holdout_split(parts: list[np.ndarray], frac: float, seed: int, labels: np.ndarray | None = None,
                  mode: str = "rows", first_client: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's rows split into training rows and held-out rows for the calibration round; a client keeps at
    least one training row. frac 0 returns the parts unchanged.

    `rows`: `frac` of the client's rows, drawn at random (the held-out mix follows the client's).
    `classes` (needs `labels`): the same number, frac·n, shared evenly among the classes the client holds, each class
    giving at most HOLDOUT_CLASS_CAP of its rows; what a capped class cannot give is not made up by the others. The
    rare classes, whose calibration rests on a handful of images under `rows`, get several times more; the common
    ones give fewer (docs/decisions.md, "Class-balanced hold-out"). Only the client's own labels are read, so a Flower site can do it:
    `first_client` is the id of parts[0] (a site holding only its own rows draws what the simulator draws for it)."""
    if frac <= 0:
        return parts, [np.zeros(0, np.int64) for _ in parts]
    if mode not in HOLDOUT_MODES:
        raise ConfigError(f"calib_holdout_mode must be one of {', '.join(HOLDOUT_MODES)}, got {mode!r}")
    if mode == "classes" and labels is None:
        raise ValueError("holdout_split: mode 'classes' needs the labels")
    train, held = [], []
    for k, p in enumerate(parts):
        perm = np.random.default_rng([seed, 211, first_client + k]).permutation(p)
        if mode == "rows":
            n = min(int(round(frac * len(p))), max(len(p) - 1, 0))
            take = perm[:n]
        else:
            lab = np.asarray(labels)[perm]
            classes = np.unique(lab)
            share = frac * len(p) / max(len(classes), 1)
            quota = {c: min(int(round(share)), int(round(HOLDOUT_CLASS_CAP * (lab == c).sum()))) for c in classes}
            take = np.concatenate([perm[lab == c][:quota[c]] for c in classes]) if len(p) else perm[:0]
            take = take[:max(len(p) - 1, 0)]
        keep = np.setdiff1d(p, take)
        held.append(np.sort(take).astype(np.int64))
        train.append(np.sort(keep).astype(np.int64))
    return train, held


def client_class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(K, C) count matrix."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def select_clients(num_clients: int, frac: float, seed: int, round_: int) -> list[int]:
    """The round's participants: max(1, round(frac·K)) clients, a function of (seed, round) alone."""
    m = max(1, int(round(frac * num_clients)))
    rng = np.random.default_rng([seed, 7919, round_])
    return sorted(rng.choice(num_clients, size=m, replace=False).tolist())


def distribution_counts(test_counts: np.ndarray, ranks: np.ndarray, kind: str, imbalance_factor: float) -> np.ndarray:
    """Per-class counts of one test distribution: img_max · IF^(−r/(C−1)), img_max = smallest test class."""
    num_classes = len(ranks)
    img_max = int(test_counts.min())
    if kind == "uniform" or imbalance_factor == 1:
        return np.full(num_classes, img_max, np.int64)
    r = ranks if kind == "forward" else (num_classes - 1 - ranks)
    exp = -r.astype(np.float64) / max(num_classes - 1, 1)
    return np.floor(img_max * imbalance_factor ** exp + 1e-9).astype(np.int64)


def distribution_prior(ranks: np.ndarray, kind: str, imbalance_factor: float) -> np.ndarray:
    """The exact class prior π of a distribution (its proportions before rounding to counts)."""
    num_classes = len(ranks)
    if kind == "uniform" or imbalance_factor == 1:
        return np.full(num_classes, 1.0 / num_classes)
    r = ranks if kind == "forward" else (num_classes - 1 - ranks)
    w = imbalance_factor ** (-r.astype(np.float64) / max(num_classes - 1, 1))
    return w / w.sum()


def sample_distribution(test_labels: np.ndarray, counts: np.ndarray, seed: int) -> np.ndarray:
    """Indices of a test subset with the given per-class counts, drawn without replacement."""
    rng = np.random.default_rng(seed)
    out = []
    for c, n in enumerate(counts):
        idx = np.flatnonzero(test_labels == c)
        out.append(rng.permutation(idx)[: int(n)])
    return np.sort(np.concatenate(out)) if out else np.array([], np.int64)


def head_middle_tail(ranks: np.ndarray) -> dict[str, np.ndarray]:
    """Classes split into thirds by training rank (head gets the remainder first)."""
    order = np.argsort(ranks)
    groups = np.array_split(order, 3)
    return {"head": groups[0], "middle": groups[1], "tail": groups[2]}
