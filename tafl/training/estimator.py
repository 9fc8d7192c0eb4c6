"""What a run chooses on its validation split after training, recorded in the kept state's meta for the report, the
package and the service: the plain decision's operating point (tafl.training.decision) and the case-mix estimator's
smoothing (tafl.prior.PriorEstimator)."""

from __future__ import annotations

import logging

import numpy as np

from tafl.training.config import RunConfig
from tafl.training.contract import GlobalState, Method
from tafl.training.data import Dataset
from tafl.training.evaluate import predict
from tafl.training.prior_eval import adaptation_accuracies
from tafl.training.site_eval import site_train_mixes

log = logging.getLogger(__name__)


def choose_operating_point(method: Method, state: GlobalState, ds: Dataset, cfg: RunConfig) -> GlobalState:
    """The plain decision's τ (tafl.training.decision) on the validation split, recorded in the state's meta:
    the report, `tafl eval` and the package all decide with it."""
    state = method.choose_operating_point(state, ds.val.images, ds.val.labels, cfg.eval_batch_size)
    rec = state.meta["decision"]
    base = rec["scores"]["0.0"]
    log.info("operating point: tau %.1f on %d validation images (%s %.1f%% against %.1f%% at tau 0)",
             rec["tau"], rec["validation_images"], rec["criterion"], 100 * rec["scores"][f"{rec['tau']:.1f}"],
             100 * base)
    return state


def choose_prior_estimator(method: Method, state: GlobalState, ds: Dataset, cfg: RunConfig,
                           ranks: np.ndarray) -> GlobalState:
    """The case-mix estimator's smoothing (tafl.prior.PriorEstimator), recorded in the state's meta: the report, the
    package, the service and `tafl score --prior adaptive` all estimate with it. `prior_smoothing: auto` chooses the
    pseudo-count on the validation split (`select_prior_smoothing`); a number fixes it; without a validation split,
    auto is the maximum-likelihood EM (0). `ranks`: the training classes' frequency ranks (the eleven distributions)."""
    from tafl.prior import Calibration, PriorEstimator

    fixed = cfg.prior_smoothing_value()
    C = len(ds.class_names)
    if fixed is not None or len(ds.val.labels) == 0:
        why = "config" if fixed is not None else "no validation split"
        est = PriorEstimator(fixed or 0.0, "uniform", {"chosen": why})
    else:
        calib = Calibration.from_dict(state.meta.get("calibration"), C)
        source = calib.source_prior if calib.source_prior is not None else method.default_source_prior(state)
        module = method.inference_model(state).to(method.device)
        out = predict(module, ds.val.images, method.normalize, cfg.eval_batch_size, keys=method.output_keys)
        probs = calib.probs(method.posterior_logits(out))
        if ds.site_names is not None and ds.val.sites is not None:  # real sites: their own validation mixes
            counts = state.extras["global_counts"].numpy().astype(np.float64)
            est = select_prior_smoothing_sites(probs, ds.val.labels, ds.val.sites, source,
                                               train_mix=counts / counts.sum() if counts.sum() > 0 else None,
                                               site_mixes=site_train_mixes(ds))
            key = f"{est.center}:{est.pseudo_count:g}"
        else:
            est = select_prior_smoothing(probs, ds.val.labels, ranks, source, cfg.adapt_size_list(), cfg.adapt_draws,
                                         cfg.test_seed)
            key = ("" if est.kind == "em" else "confusion:") + f"{est.pseudo_count:g}"
        scores = est.record["scores"]
        log.info("case-mix estimator: %s, chosen on %d validation images (mean adapted accuracy %.1f%% against %.1f%% "
                 "for the maximum-likelihood EM)", est.describe(), len(ds.val.labels),
                 100 * scores[key], 100 * scores.get("0", scores.get("uniform:0", float("nan"))))
    return GlobalState(state.weights, state.extras, dict(state.meta, prior_estimator=est.to_dict()))


def select_prior_smoothing(probs: np.ndarray, labels: np.ndarray, ranks: np.ndarray, source: np.ndarray,
                           sizes: list[int], draws: int, seed: int, grid: tuple[float, ...] | None = None):
    """The pseudo-count (tafl.prior.SMOOTHING_GRID) whose uniform-centred estimator scores best on labelled rows:
    the mean over `sizes` of the eleven distributions' mean prior-weighted accuracy of the rule adapted to its
    estimate (`adaptation_accuracies`, the report's protocol, on these rows). Ties: the smaller pseudo-count,
    nearer the maximum-likelihood EM. Returns the tafl.prior.PriorEstimator, its record holding every score."""
    from tafl.prior import SMOOTHING_GRID, PriorEstimator, soft_confusion

    grid = SMOOTHING_GRID if grid is None else grid
    C = probs.shape[1]

    def score(est: PriorEstimator, rows: np.ndarray) -> float:
        avg = adaptation_accuracies(probs[rows], labels[rows], ranks, source, sizes, draws, seed,
                                    estimate=lambda p: est.estimate(p, source).prior)["average"]
        return float(np.mean([avg[f"adaptive_{n}"] for n in sizes]))

    every = np.arange(len(labels))
    scores = {f"{a:g}": score(PriorEstimator(float(a), "uniform"), every) for a in grid}
    # the confusion-matrix estimator (soft BBSE) fits M on labelled rows: scored cross-fitted (M from one half of
    # each class's validation rows, the adapted rule scored on the other, and back), never on the rows it fitted
    folds = confusion_folds(labels, seed)
    if folds is not None:
        for a in grid:
            scores[f"confusion:{a:g}"] = float(np.mean([
                score(PriorEstimator(float(a), "uniform", confusion=_matrix(soft_confusion(
                    probs[fit], labels[fit], C))), held) for fit, held in folds]))
    keys = list(scores)
    best = keys[int(np.argmax(np.round(np.array(list(scores.values())), 12)))]  # first maximum: EM, smaller count
    record = {"chosen": "validation", "criterion": f"the mean over n = {', '.join(map(str, sizes))} of the eleven "
              "distributions' prior-weighted accuracy, adapted to the estimate from n images (the confusion "
              "estimator's cross-fitted on two halves of the rows)", "validation_images": int(len(labels)),
              "scores": scores}
    if best.startswith("confusion:"):
        M = _matrix(soft_confusion(probs, labels, C))  # the shipped M: from every validation row
        return PriorEstimator(float(best.split(":")[1]), "uniform", record, confusion=M)
    return PriorEstimator(float(best), "uniform", record)


def _matrix(M: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(v) for v in row) for row in M)


def confusion_folds(labels: np.ndarray, seed: int, min_per_class: int = 2) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Two folds of the rows, each class's rows split in half at random: [(fit, held), (held, fit)]; None where a
    present class has fewer than `min_per_class` rows (its row of M could not be fitted on one half)."""
    y = np.asarray(labels, np.int64)
    rng = np.random.default_rng([seed, 4049])
    first = np.zeros(len(y), bool)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        if len(idx) < min_per_class:
            return None
        first[rng.permutation(idx)[: len(idx) // 2]] = True
    a, b = np.flatnonzero(first), np.flatnonzero(~first)
    return [(a, b), (b, a)]


def select_prior_smoothing_sites(probs: np.ndarray, labels: np.ndarray, sites: np.ndarray, source: np.ndarray,
                                 grid: tuple[float, ...] | None = None, min_rows: int = 20,
                                 train_mix: np.ndarray | None = None,
                                 site_mixes: dict[int, np.ndarray] | None = None):
    """With real sites (--client-column), the estimator is chosen for what it will meet: each site's validation
    rows at that site's own case mix. For each centre (the training images' mix `train_mix`, where it differs from
    the source prior; each site's own training mix, `site_mixes` by site index, where given for every site; the
    source prior; the uniform mix) and pseudo-count, the mean over sites of the accuracy on the site's validation
    rows, adapted to the mix estimated from those same rows (unlabeled). Sites with fewer than `min_rows`
    validation rows are left out (all, if none has that many). Ties: the first centre in that order, then the
    smaller pseudo-count. Returns the tafl.prior.PriorEstimator (a `site` centre keeps the federation's training
    mix, or the source prior, as its fallback where a deployment gives no site mix)."""
    from tafl.prior import SMOOTHING_GRID, PriorEstimator, adapt

    grid = SMOOTHING_GRID if grid is None else grid
    present = [k for k in np.unique(sites) if (sites == k).sum() >= min_rows] or list(np.unique(sites))
    src = np.asarray(source, np.float64) / np.sum(source)
    mix = None if train_mix is None else tuple(float(v) for v in np.asarray(train_mix, np.float64) / np.sum(train_mix))
    centers = (["train"] if mix is not None and np.abs(np.array(mix) - src).max() > 1e-6 else [])
    centers += ["site"] if site_mixes and all(k in site_mixes and site_mixes[k].sum() > 0 for k in present) else []
    centers += ["source", "uniform"]
    fallback = mix if mix is not None else tuple(float(v) for v in src)
    scores = {}
    for center in centers:
        for a in grid:
            est = PriorEstimator(float(a), center, center_mix=fallback if center in ("train", "site") else None)
            acc = []
            for k in present:
                idx = np.flatnonzero(sites == k)
                q = est.for_site(site_mixes[k] if center == "site" else None).estimate(probs[idx], source).prior
                acc.append(float((adapt(probs[idx], source, q).argmax(1) == labels[idx]).mean()))
            scores[f"{center}:{a:g}"] = float(np.mean(acc))
    keys = list(scores)
    best = keys[int(np.argmax(np.round(np.array(list(scores.values())), 12)))]  # first maximum
    center, a = best.split(":")
    return PriorEstimator(float(a), center, center_mix=fallback if center in ("train", "site") else None, record={
        "chosen": "validation", "criterion": "the mean over sites of the accuracy on each site's validation rows, "
        "adapted to the mix estimated from those rows", "validation_images": int(len(labels)),
        "sites": int(len(present)), "scores": scores})
