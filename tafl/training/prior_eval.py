"""Prior-aware evaluation: the prior-weighted accuracies of the calibrated, adapted and oracle rules over the eleven
test distributions (`adaptation_accuracies`) and the report's `prior_adaptation` section built from them."""

from __future__ import annotations

from typing import Any

import numpy as np

from tafl.training.config import RunConfig
from tafl.training.contract import GlobalState, Method
from tafl.training.data import Dataset


GAP_BOOT = 200  # bootstrap replicates of the test report's gap to the oracle (docs/decisions.md, "The test split's resolution")


def prior_adaptation(report: dict[str, Any], method: Method, state: GlobalState, cfg: RunConfig,
                     test_out: dict[str, np.ndarray], val_out: dict[str, np.ndarray], ds: Dataset,
                     ranks: np.ndarray) -> None:
    """Prior-aware inference in the report: per test distribution, the rule adapted to a prior estimated from
    n unlabeled images drawn with that distribution's prior (`adaptive`, per n), to the true prior (`oracle`),
    the calibrated argmax (`calibrated`) and the model's own label (`plain`: what `prior=train` and a blocked
    `prior=adaptive` serve); the same means on the validation split."""
    from tafl.prior import Calibration, PriorEstimator

    C = len(ds.class_names)
    calib = Calibration.from_dict(state.meta.get("calibration"), C)
    source = calib.source_prior if calib.source_prior is not None else method.default_source_prior(state)
    sizes = cfg.adapt_size_list()
    estimator = PriorEstimator.from_dict(state.meta.get("prior_estimator"))
    sec = {"calibration": calib.to_dict(), "source_prior": [float(v) for v in source],
           "calibrated": calib.kind != "none", "sizes": sizes, "draws": cfg.adapt_draws,
           "posteriors": method.posterior_description(), "estimator": estimator.to_dict()}
    for split, out, labels, target in (("test", test_out, ds.test.labels, report),
                                       ("validation", val_out, ds.val.labels, None)):
        probs = calib.probs(method.posterior_logits(out))
        res = adaptation_accuracies(probs, labels, ranks, source, sizes, cfg.adapt_draws, cfg.test_seed,
                                    estimate=lambda p: estimator.estimate(p, source).prior, plain=out["label"],
                                    boot=GAP_BOOT if split == "test" else 0)
        res["nll"] = float(-np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-12, None)).mean())
        if len(labels):  # the calibration check's comparison (tafl.training.calibrate), on this split's rows
            from tafl.training.calibrate import nll_at_mix

            z = method.posterior_logits(out)
            mix = np.bincount(labels, minlength=C) / len(labels)
            res["nll_at_mix"] = nll_at_mix(calib, z, labels, mix, source)
            res["nll_uncalibrated_at_mix"] = nll_at_mix(Calibration(), z, labels, mix,
                                                        method.default_source_prior(state))
        if target is not None:
            for name, d in res["distributions"].items():
                target["test_distributions"][name].update(d)
        sec[split] = {k: v for k, v in res.items() if k != "distributions"}
        if split == "validation":
            sec[split]["distributions"] = res["distributions"]
    report["prior_adaptation"] = sec


def adaptation_accuracies(probs: np.ndarray, labels: np.ndarray, ranks: np.ndarray, source: np.ndarray,
                          sizes: list[int], draws: int, seed: int, estimate=None,
                          plain: np.ndarray | None = None, boot: int = 0) -> dict[str, Any]:
    """Prior-weighted accuracies of the calibrated, adapted and oracle rules over the eleven distributions.

    `estimate(probs_of_the_drawn_images) -> prior` is the prior estimator (default: EM, `em_prior`). `plain`, the
    model's own labels for the same rows (an operating point, a vote), adds their accuracy as `plain`.

    Every distribution also gets `one_image`: the most one of these rows can move its prior-weighted accuracy
    (π_c over the rows of class c, at its largest), the finest difference the rows can show. With `boot` > 0 it
    gets `gap`: oracle − adapted at the largest n, with a paired bootstrap 90 % interval over the rows (resampled
    within each class, `boot` replicates; the same rows score both rules, so the interval is how sure these rows
    are of the difference, not of either accuracy)."""
    from tafl.prior import adapt, em_prior, total_variation
    from tafl.training.longtail import DISTRIBUTIONS, distribution_prior

    C = probs.shape[1]
    counts = np.bincount(labels, minlength=C)
    present = counts > 0
    rows = [np.flatnonzero(labels == c) for c in range(C)]

    def by_class(score: np.ndarray, sel: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Per-class mean of a per-row score over the rows `sel` (0 for a class without rows)."""
        lab = labels[sel]
        return np.bincount(lab, weights=score[sel], minlength=C) / np.maximum(np.bincount(lab, minlength=C), 1)

    def correct(preds: np.ndarray) -> np.ndarray:
        return (np.asarray(preds) == labels).astype(np.float64)

    resamples = []
    if boot > 0:  # one resampling of the rows per replicate, shared by every distribution
        rng_boot = np.random.default_rng([seed, 997])
        resamples = [np.concatenate([rng_boot.choice(r, len(r), replace=True) for r in rows if len(r)])
                     for _ in range(boot)]
    big = max(sizes) if sizes else None
    out: dict[str, Any] = {"distributions": {}}
    avg: dict[str, list[float]] = {"calibrated": [], "oracle": [], **{f"adaptive_{n}": [] for n in sizes},
                                   **{f"tv_{n}": [] for n in sizes}, **({"plain": []} if plain is not None else {})}
    for i, (name, kind, imf) in enumerate(DISTRIBUTIONS):
        prior = distribution_prior(ranks, kind, imf)
        target = np.where(present, prior, 0.0)
        target = target / target.sum()
        oracle_ok = correct(adapt(probs, source, target).argmax(1))
        d: dict[str, Any] = {"calibrated": float((target * by_class(correct(probs.argmax(1)))).sum()),
                             "oracle": float((target * by_class(oracle_ok)).sum()), "adaptive": {},
                             "one_image": float((target / np.maximum(counts, 1)).max())}
        if plain is not None:
            d["plain"] = float((target * by_class(correct(plain))).sum())
            avg["plain"].append(d["plain"])
        for n in sizes:
            accs, tvs, oks = [], [], []
            for k in range(draws):
                rng = np.random.default_rng([seed, 313, i, n, k])
                per_class = rng.multinomial(n, target)
                idx = np.concatenate([rng.choice(rows[c], m, replace=True) for c, m in enumerate(per_class) if m])
                q = em_prior(probs[idx], source).prior if estimate is None else estimate(probs[idx])
                ok = correct(adapt(probs, source, q).argmax(1))
                oks.append(ok)
                accs.append(float((target * by_class(ok)).sum()))
                tvs.append(total_variation(q, target))
            d["adaptive"][str(n)] = {"accuracy": float(np.mean(accs)), "accuracy_sd": float(np.std(accs)),
                                     "tv": float(np.mean(tvs))}
            avg[f"adaptive_{n}"].append(float(np.mean(accs)))
            avg[f"tv_{n}"].append(float(np.mean(tvs)))
            if n == big and resamples:
                diff = oracle_ok - np.mean(oks, axis=0)  # per row: oracle right minus the draws' share right
                reps = [float((target * by_class(diff, sel)).sum()) for sel in resamples]
                d["gap"] = {"n": int(n), "value": float((target * by_class(diff)).sum()),
                            "lo": float(np.percentile(reps, 5)), "hi": float(np.percentile(reps, 95)),
                            "replicates": int(boot)}
        avg["calibrated"].append(d["calibrated"])
        avg["oracle"].append(d["oracle"])
        out["distributions"][name] = d
    out["average"] = {k: float(np.mean(v)) for k, v in avg.items()}
    return out
