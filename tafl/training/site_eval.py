"""Evaluation at real sites (--client-column): each site's own test rows at its own case mix, under the rules the
package can serve there."""

from __future__ import annotations

from typing import Any

import numpy as np

from tafl.training.contract import GlobalState, Method
from tafl.training.data import Dataset
from tafl.training.evaluate import balanced_accuracy


def site_evaluation(method: Method, state: GlobalState, test_out: dict[str, np.ndarray], ds: Dataset
                    ) -> dict[str, Any]:
    """Each site's own test rows, its real case mix (--client-column): accuracy and balanced accuracy at the
    model's own rule (`own`: what `prior=train` serves), at the site's own training mix (`site`: what `prior=site`
    serves there with `--site-mix`; no test image is used), adapted to the mix the package's estimator finds in
    that site's unlabeled test images (`adapted`: what `prior=adaptive` would serve there) and at that site's true
    mix (`oracle`); their mean over the sites; and the pooled test split's balanced accuracy at the model's own rule
    (the number Fed-ISIC2019/FLamby reports). A site without test rows is listed in `sites_without_test`."""
    from tafl.prior import Calibration, PriorEstimator, adapt, site_prior

    C = len(ds.class_names)
    calib = Calibration.from_dict(state.meta.get("calibration"), C)
    source = calib.source_prior if calib.source_prior is not None else method.default_source_prior(state)
    estimator = PriorEstimator.from_dict(state.meta.get("prior_estimator"))
    probs = calib.probs(method.posterior_logits(test_out))
    plain, labels = np.asarray(test_out["label"]), ds.test.labels

    def scores(preds: np.ndarray, truth: np.ndarray) -> dict[str, float]:
        return {"accuracy": float((preds == truth).mean()), "balanced_accuracy": balanced_accuracy(preds, truth, C)}

    own_mix = site_train_mixes(ds) or {}
    sites: dict[str, Any] = {}
    for k, name in enumerate(ds.site_names):
        idx = np.flatnonzero(ds.test.sites == k)
        if len(idx) == 0:
            continue
        truth, p = labels[idx], probs[idx]
        counts = np.bincount(truth, minlength=C)
        est = estimator.for_site(own_mix.get(k)).estimate(p, source)
        sites[name] = {"n_test": int(len(idx)), "test_class_counts": [int(c) for c in counts],
                       "own": scores(plain[idx], truth),
                       "adapted": scores(adapt(p, source, est.prior).argmax(1), truth),
                       "oracle": scores(adapt(p, source, counts / counts.sum()).argmax(1), truth),
                       "estimated_mix": [float(v) for v in est.prior],
                       "estimate_tv": float(0.5 * np.abs(est.prior - counts / counts.sum()).sum())}
        if k in own_mix and own_mix[k].sum() > 0:  # the site's own training mix, fixed: no test images used
            sites[name]["site"] = scores(adapt(p, source, site_prior(own_mix[k])).argmax(1), truth)
    rules = ("own", "site", "adapted", "oracle") if sites and all("site" in v for v in sites.values()) \
        else ("own", "adapted", "oracle")
    mean = {rule: {m: float(np.mean([v[rule][m] for v in sites.values()])) for m in ("accuracy", "balanced_accuracy")}
            for rule in rules} if sites else {}
    return {"sites": sites, "site_mean": mean,
            "sites_without_test": [n for n in ds.site_names if n not in sites],
            "pooled_balanced_accuracy": balanced_accuracy(plain, labels, C)}


def site_train_mixes(ds: Dataset) -> dict[int, np.ndarray] | None:
    """Each site's own training class counts (by site index): what a site knows of its case mix from its own
    labelled images, the `site` centre of the case-mix estimator there. None without sites."""
    if ds.site_names is None or ds.train.sites is None:
        return None
    C = len(ds.class_names)
    return {k: np.bincount(ds.train.labels[ds.train.sites == k], minlength=C).astype(np.float64)
            for k in range(len(ds.site_names)) if (ds.train.sites == k).any()}
