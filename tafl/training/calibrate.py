"""Federated calibration after training (tafl.prior): damped Newton rounds on the NLL of every client's held-out
rows, of which only sums leave a client."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from tafl.training.config import RunConfig
from tafl.training.contract import GlobalState, Method
from tafl.training.rounds import charge
from tafl.training.transport import Transport

log = logging.getLogger(__name__)


CALIB_KEYS = ("nll", "grad", "hess", "counts", "n")


def calibration_problem(r, num_classes: int, params: int) -> str | None:
    """Why a client's calibration statistics cannot be summed, or None."""
    e = r.extras
    shapes = {"nll": (1,), "grad": (params,), "hess": (params, params), "counts": (num_classes,), "n": (1,)}
    for k, shape in shapes.items():
        t = e.get(f"calib_{k}")
        if t is None or tuple(t.shape) != shape:
            return f"calib_{k} is missing or not of shape {shape}"
        if not bool(torch.isfinite(t).all()):
            return f"calib_{k} contains NaN or Inf"
    counts, n = e["calib_counts"], float(e["calib_n"][0])
    if bool((counts < 0).any()) or abs(float(counts.sum()) - n) > 1e-6 or n < 0:
        return "calibration counts are negative or do not add up to the number of images"
    return None


def calibrate(method: Method, state: GlobalState, transport: Transport, cfg: RunConfig,
              book: dict[str, Any]) -> GlobalState:
    """The federated calibration (tafl.prior): damped Newton rounds on the NLL of every client's held-out rows.

    Each round sends the current (scale, bias); each client answers sums over its held-out rows (NLL, gradient,
    Hessian, class counts), so the fit equals one on the pooled held-out rows without pooling them. The clients
    that answer the first round are the calibration set; a later round missing one of them ends the fit at the
    best point so far. The source prior is the pooled held-out rows' class mix."""
    from tafl.prior import NewtonCalibrator, sum_stats
    from tafl.prior import n_params as prior_n_params

    t_start = time.perf_counter()
    C = int(method.model_cfg.num_classes)
    cal = NewtonCalibrator(C, cfg.calibration, cfg.calib_rounds, bias_l2=cfg.calib_l2, scale_l2=cfg.calib_l2)
    n_params = prior_n_params(cfg.calibration, C)
    ids = list(range(transport.num_clients))
    payload = method.broadcast(state)
    round_id = cfg.rounds + 2  # after the finishing round's rounds + 1
    members: set[int] | None = None
    cover: frozenset[int] = frozenset()
    counts = None
    params = cal.params()
    dropped: set[int] = set()
    while params is not None:
        scale, bias = params
        scale = float(scale) if np.ndim(scale) == 0 else [float(v) for v in scale]  # JSON for Flower
        round_cfg = {"round": round_id, "seed": cfg.seed, "calibrate": cfg.calibration, "scale": scale,
                     "bias": None if bias is None else [float(v) for v in bias]}
        results, cost = transport.train(ids, payload, round_cfg)
        charge(book, cost)
        good = {}
        for r in results:
            why = calibration_problem(r, C, n_params)
            if why is None:
                good[r.client_id] = r
            elif r.client_id not in dropped:
                dropped.add(r.client_id)
                log.warning("calibration: dropping client %s: %s", r.client_id, why)
        # under secure aggregation one result stands for the sum over the clients the cost lists as answered
        covered = frozenset(cost.get("answered") or ())
        if members is None:
            members = {k for k, r in good.items() if float(r.extras["calib_n"][0]) > 0}
            cover = covered
            if not members:
                log.warning("calibration: no client sent held-out statistics; the model stays uncalibrated")
                return state
        if not members <= set(good) or covered != cover:
            log.warning("calibration: client(s) %s did not answer round %d; keeping the best fit so far",
                        sorted((members - set(good)) | (cover ^ covered)), cal.iterations + 1)
            break
        totals = sum_stats([{k: good[c].extras[f"calib_{k}"].numpy() for k in CALIB_KEYS} for c in sorted(members)])
        cal.noise = sum(float(good[c].metrics.get("calib_nll_error", 0.0)) for c in members)  # secure sums' error
        counts = totals["counts"]
        params = cal.step(totals)
    if cal.best is None or counts is None:
        return state
    calibration = cal.result(counts / counts.sum())
    calibration.fit.update(clients=sorted(cover or members or []), dropped=sorted(dropped),
                           seconds=time.perf_counter() - t_start)
    book["calibration"] = calibration.to_dict()
    log.info("calibration (%s): T %.3f on %d held-out images of %d clients, NLL %.4f -> %.4f in %d rounds",
             cfg.calibration, calibration.temperature, calibration.fit["images"], len(cover or members or []),
             calibration.fit["nll_before"], calibration.fit["nll_after"], calibration.fit["iterations"])
    return GlobalState(state.weights, state.extras, dict(state.meta, calibration=calibration.to_dict()))


def nll_rows(cal, z: np.ndarray, labels: np.ndarray, mix: np.ndarray, source: np.ndarray | None = None) -> np.ndarray:
    """(N,) each row's NLL of its label under the posteriors of calibration `cal` (a tafl.prior.Calibration) on logits
    z, moved by Bayes' rule from the prior they describe (`source`, default the calibration's source prior) to `mix`;
    in log space, so a confidently wrong posterior costs what it should (no clipping)."""
    src = np.asarray(cal.source_prior if source is None else source, np.float64)
    with np.errstate(divide="ignore"):
        u = cal.logits(z) + np.log(np.asarray(mix, np.float64)) - np.log(np.clip(src, 1e-300, None))
    m = u.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(u - m).sum(axis=1, keepdims=True)))[:, 0]
    y = np.asarray(labels, np.int64)
    return lse - u[np.arange(len(y)), y]


def nll_at_mix(cal, z: np.ndarray, labels: np.ndarray, mix: np.ndarray, source: np.ndarray | None = None) -> float:
    """The mean of `nll_rows`: the NLL of the rows under `cal`'s posteriors moved to `mix`."""
    return float(nll_rows(cal, z, labels, mix, source).mean())


CHECK_Z = 1.645  # the check's one-sided 95 % bound on the mean NLL change (normal approximation, paired rows)


def verdict(calibrated: np.ndarray, uncalibrated: np.ndarray, kind: str) -> dict[str, Any]:
    """The check's record from the validation rows' NLLs under the fitted calibration and without it (the same rows,
    paired): shipped only where the one-sided 95 % upper bound of the mean change lies below zero; otherwise `why`
    says whether the fit raised the NLL or lowered it by less than the rows' noise."""
    change = np.asarray(calibrated, np.float64) - np.asarray(uncalibrated, np.float64)
    n = len(change)
    se = float(change.std(ddof=1) / np.sqrt(n)) if n > 1 else float("inf")
    mean = float(change.mean())
    bound = mean + CHECK_Z * se
    nll = {"calibrated": float(np.mean(calibrated)), "uncalibrated": float(np.mean(uncalibrated))}
    check = {"checked": True, "shipped": bool(bound < 0), "images": int(n), "split": "validation",
             "at": "the validation rows' class mix", "nll_calibrated": nll["calibrated"],
             "nll_uncalibrated": nll["uncalibrated"], "nll_change": mean, "nll_change_se": se,
             "nll_change_bound": bound, "confidence": 0.95, "kind": kind}
    if not check["shipped"]:
        what = ("raised the NLL of" if mean >= 0 else
                f"did not lower beyond their noise (change {mean:+.4f}, one-sided 95 % bound {bound:+.4f}) the NLL of")
        check["why"] = (f"the fitted {kind} calibration {what} {n} validation images it was not fitted on "
                        f"({nll['uncalibrated']:.4f} uncalibrated, {nll['calibrated']:.4f} calibrated): the "
                        "uncalibrated posteriors ship")
    return check


def check_calibration(method: Method, state: GlobalState, images: np.ndarray, labels: np.ndarray,
                      batch_size: int) -> GlobalState:
    """Ship the fitted calibration only where it lowers the NLL of rows it was not fitted on, the server's validation
    split (the calibration is fitted on the clients' held-out rows), by more than those rows' noise: the one-sided 95 %
    upper bound of the mean per-row change (calibrated minus uncalibrated, the same rows) must lie below zero. A fit
    whose gain is within the noise does not ship: the promise is posteriors never worse than the model's own
    (docs/decisions.md, "A calibration that can say no"). Both posteriors, the calibrated
    and the method's own (under `default_source_prior`), are first moved to the validation rows' class mix by Bayes'
    rule, so the comparison is of what every prior-aware rule uses, the likelihood ratios, not of which prior each
    describes. Where the calibrated NLL is not lower the state carries the identity calibration instead, its `fit`
    recording the check (the report and the card say so); without validation rows nothing is checked and
    `fit.check` says that."""
    from tafl.prior import Calibration
    from tafl.training.evaluate import predict

    C = int(method.model_cfg.num_classes)
    fitted = Calibration.from_dict(state.meta.get("calibration"), C)
    if fitted.kind == "none":
        return state
    y = np.asarray(labels, np.int64)
    if len(y) == 0:
        fitted.fit["check"] = {"checked": False, "shipped": True, "why": "no validation rows to check it on"}
        return GlobalState(state.weights, state.extras, dict(state.meta, calibration=fitted.to_dict()))
    module = method.inference_model(state).to(method.device)
    z = method.posterior_logits(predict(module, images, method.normalize, batch_size, keys=method.output_keys))
    mix = np.bincount(y, minlength=C) / len(y)
    own = np.asarray(method.default_source_prior(state), np.float64)
    check = verdict(nll_rows(fitted, z, y, mix), nll_rows(Calibration(), z, y, mix, own), fitted.kind)
    if check["shipped"]:
        fitted.fit["check"] = check
        keep = fitted
        log.info("calibration check: validation NLL %.4f calibrated against %.4f uncalibrated on %d images (change "
                 "%+.4f, one-sided 95%% bound %+.4f): shipped", check["nll_calibrated"], check["nll_uncalibrated"],
                 len(y), check["nll_change"], check["nll_change_bound"])
    else:
        keep = Calibration(source_prior=own, fit={"check": check, "rejected": fitted.to_dict()})
        log.warning("calibration check: %s", check["why"])
    return GlobalState(state.weights, state.extras, dict(state.meta, calibration=keep.to_dict()))
