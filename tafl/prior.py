"""Prior-aware decisions: calibration, the case mix estimated from unlabeled images, the adapted rule.

A model's calibrated posterior p(y|x) describes the class mix π of the data it was calibrated on
(the source prior). A deployment whose mix is q is served best by the Bayes rule for q:

    p_q(y|x) ∝ p(y|x) · q_y / π_y            (a shift of the logits by log q − log π)

q is unknown but can be estimated from unlabeled images by maximum likelihood, with the EM
algorithm of Saerens, Latinne & Decaestecker (2002): alternate the adapted posteriors of every
image (E) and their mean as the new prior (M). EM assumes calibrated posteriors; a miscalibrated
model makes the estimate drift, hence `Calibration` (temperature, and per-class biases: "bias-
corrected temperature scaling", BCTS), fitted federatedly at the end of training (the simulator's
calibration round; the statistics a client sends are `nll_stats`).

This module is numpy only and imports nothing of tafl but `tafl.errors`: training, packaging,
serving and the clients all use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tafl.errors import ConfigError

PRIOR_TOL = 1e-3  # an explicit prior must sum to 1 within this
CALIBRATIONS = ("none", "temperature", "bcts", "vector")


# ------------------------------------------------------------------ calibration
@dataclass
class Calibration:
    """Calibrated logits a·s∘z + b of a model's logits z (a = 1/T; s the per-class scales of vector scaling,
    mean 1, None for the other kinds), and the prior they describe.

    `source_prior` is the class mix of the data the calibration was fitted on (for the identity
    calibration, the training prior). `fit` records how it was fitted (iterations, NLL before and
    after, number of images), for the report and the model card.
    """

    scale: float = 1.0  # 1 / temperature
    bias: np.ndarray | None = None  # (C,), zero-sum; None = no per-class bias
    source_prior: np.ndarray | None = None  # (C,)
    kind: str = "none"
    fit: dict[str, Any] = field(default_factory=dict)
    class_scale: np.ndarray | None = None  # (C,), mean 1: vector scaling's per-class scales; None = one scale

    @property
    def scales(self) -> np.ndarray | float:
        """The multiplier of z: a scalar, or (C,) for vector scaling."""
        return self.scale if self.class_scale is None else self.scale * self.class_scale

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    def logits(self, z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, np.float64) * self.scales
        return z if self.bias is None else z + self.bias

    def probs(self, z: np.ndarray) -> np.ndarray:
        return softmax(self.logits(z))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "temperature": self.temperature, "scale": self.scale,
                "bias": None if self.bias is None else [float(v) for v in self.bias],
                "source_prior": None if self.source_prior is None else [float(v) for v in self.source_prior],
                "class_scale": None if self.class_scale is None else [float(v) for v in self.class_scale],
                "fit": dict(self.fit)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, num_classes: int | None = None) -> Calibration:
        if not d:
            return cls()
        bias = None if d.get("bias") is None else np.asarray(d["bias"], np.float64)
        src = None if d.get("source_prior") is None else np.asarray(d["source_prior"], np.float64)
        cs = None if d.get("class_scale") is None else np.asarray(d["class_scale"], np.float64)
        for name, v in (("bias", bias), ("source_prior", src), ("class_scale", cs)):
            if v is not None and ((num_classes is not None and v.shape != (num_classes,)) or not np.isfinite(v).all()):
                raise ConfigError(f"calibration {name} must be {num_classes} finite numbers, got {v.tolist()}")
        scale = float(d.get("scale", 1.0 / float(d.get("temperature", 1.0))))
        if not math.isfinite(scale) or scale <= 0:
            raise ConfigError("calibration temperature must be positive and finite, got "
                              f"{1 / scale if scale else scale}")
        if cs is not None and not (cs > 0).all():
            raise ConfigError(f"calibration class_scale must be positive, got {cs.tolist()}")
        return cls(scale, bias, src, str(d.get("kind", "none")), dict(d.get("fit", {})), cs)


def softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def n_params(kind: str, num_classes: int) -> int:
    """θ's length: the scale (temperature); the scale and C biases (BCTS); C scales and C biases (vector)."""
    return {"temperature": 1, "bcts": 1 + num_classes, "vector": 2 * num_classes}[kind]


def nll_stats(z: np.ndarray, labels: np.ndarray, scale: float | np.ndarray, bias: np.ndarray | None,
              kind: str) -> dict[str, np.ndarray]:
    """What one client sends for a Newton step of the calibration: sums over its held-out images of
    the NLL of softmax(a·z + b) (a a scalar, or one per class for vector scaling), its gradient and
    Hessian in θ (temperature: a; BCTS: a, b; vector: a_1..a_C, b), and the class counts. Sums, so
    the server's totals are exactly those of the pooled images."""
    z = np.asarray(z, np.float64)
    labels = np.asarray(labels, np.int64)
    n, C = z.shape
    b = np.zeros(C) if bias is None else np.asarray(bias, np.float64)
    u = np.asarray(scale, np.float64) * z + b
    p = softmax(u)
    logp = u - u.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    onehot = np.eye(C)[labels]
    r = p - onehot  # (n, C): ∂NLL/∂u
    # J_i = ∂u_i/∂θ: the scale's column is z_i (vector: diag(z_i)), then the identity (the biases)
    if kind == "temperature":
        J = z[:, :, None]
    elif kind == "bcts":
        J = np.concatenate([z[:, :, None], np.broadcast_to(np.eye(C), (n, C, C))], 2)
    elif kind == "vector":
        J = np.concatenate([z[:, :, None] * np.eye(C)[None], np.broadcast_to(np.eye(C), (n, C, C))], 2)
    else:
        raise ConfigError(f"calibration must be one of {CALIBRATIONS[1:]}, got {kind!r}")
    grad = np.einsum("nc,nck->k", r, J)
    cov = p[:, :, None] * (np.eye(C)[None] - p[:, None, :])  # diag(p) − p pᵀ, (n, C, C)
    hess = np.einsum("nck,ncd,ndl->kl", J, cov, J)
    return {"nll": np.array([-(logp * onehot).sum()]), "grad": grad, "hess": hess,
            "counts": onehot.sum(0), "n": np.array([float(n)])}


def sum_stats(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    keys = ("nll", "grad", "hess", "counts", "n")
    return {k: np.sum([np.asarray(p[k], np.float64) for p in parts], axis=0) for k in keys}


class NewtonCalibrator:
    """The server's side of the federated calibration: damped Newton on the pooled NLL.

    Each call of `step(totals)` takes the clients' summed statistics at the current θ and returns
    the next θ to evaluate (or None when converged). A step that raised the NLL is taken back and
    the damping raised (Levenberg–Marquardt), so the loop never ends worse than it started.

    Penalties, added on the server: (bias_l2/2)·‖b‖² on the biases and, for vector scaling,
    (scale_l2/2)·‖a − mean(a)‖² on the per-class scales' spread. With few held-out images of a
    class its unpenalised bias runs off to where EM later drifts (seen with 72 images of 10 classes).
    """

    def __init__(self, num_classes: int, kind: str, max_iter: int = 25, tol: float = 1e-6, ridge: float = 1e-4,
                 bias_l2: float = 1.0, scale_l2: float = 1.0):
        if kind not in CALIBRATIONS[1:]:
            raise ConfigError(f"calibration must be one of {CALIBRATIONS}, got {kind!r}")
        self.C, self.kind, self.max_iter, self.tol, self.ridge = num_classes, kind, max_iter, tol, ridge
        self.bias_l2 = bias_l2 if kind != "temperature" else 0.0
        self.scale_l2 = scale_l2 if kind == "vector" else 0.0
        self.n_scales = num_classes if kind == "vector" else 1
        self.theta = np.zeros(n_params(kind, num_classes))
        self.theta[: self.n_scales] = 1.0
        self.best: tuple[float, np.ndarray, dict[str, np.ndarray]] | None = None
        self.damping = 1e-3
        self.noise = 0.0  # the largest error of the summed NLL (set per round by the caller; 0: exact sums)
        self.iterations = 0
        self.nll_start: float | None = None

    def params(self, theta: np.ndarray | None = None) -> tuple[float | np.ndarray, np.ndarray | None]:
        """(scale, bias) for `nll_stats`: the scale is one number, or C for vector scaling."""
        t = self.theta if theta is None else theta
        k = self.n_scales
        scale = float(t[0]) if k == 1 else t[:k].copy()
        return scale, None if self.kind == "temperature" else t[k:] - t[k:].mean()

    def _penalised(self, totals: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not (self.bias_l2 or self.scale_l2):
            return totals
        k = self.n_scales
        g, H, nll = totals["grad"].copy(), totals["hess"].copy(), float(totals["nll"][0])
        if self.bias_l2:
            b = self.theta[k:]
            g[k:] += self.bias_l2 * b
            H[k:, k:] += self.bias_l2 * np.eye(self.C)
            nll += 0.5 * self.bias_l2 * float(b @ b)
        if self.scale_l2:
            d = self.theta[:k] - self.theta[:k].mean()
            P = np.eye(k) - np.ones((k, k)) / k  # the gradient of ½‖a − ā‖² is P·a
            g[:k] += self.scale_l2 * d
            H[:k, :k] += self.scale_l2 * P
            nll += 0.5 * self.scale_l2 * float(d @ d)
        return dict(totals, nll=np.array([nll]), grad=g, hess=H)

    def step(self, totals: dict[str, np.ndarray]) -> tuple[float | np.ndarray, np.ndarray | None] | None:
        self.iterations += 1
        totals = self._penalised(totals)
        nll = float(totals["nll"][0])
        if self.nll_start is None:
            self.nll_start = nll
        if not math.isfinite(nll):
            raise ValueError("calibration: the clients' NLL is not finite")
        # `noise`: how far the summed NLL may be off (a secure sum's quantisation error): a change within it is no
        # change; worse than that: back to the best, damp harder
        if self.best is not None and nll > self.best[0] + max(1e-12, self.noise):
            self.damping *= 10
            self.theta = self.best[1].copy()
            totals = self.best[2]
        else:
            improved = self.best is None or self.best[0] - nll > max(self.tol * max(1.0, abs(nll)), self.noise)
            self.best = (nll, self.theta.copy(), totals)
            self.damping = max(self.damping / 10, 1e-9)
            if not improved:
                return None
        if self.iterations >= self.max_iter:
            return None
        g, H = totals["grad"], totals["hess"]
        n = max(float(totals["n"][0]), 1.0)
        A = H / n + (self.damping + self.ridge) * np.eye(len(g))
        k = self.n_scales
        if self.kind != "temperature":  # the biases are defined up to a common shift: keep them zero-sum
            A[k:, k:] += np.ones((self.C, self.C)) / self.C
        delta = np.linalg.solve(A, -g / n)
        new = self.theta + delta
        new[:k] = np.maximum(new[:k], 1e-3)  # positive scales
        self.theta = new
        if float(np.abs(delta).max()) < 1e-7:
            return None
        return self.params()

    def result(self, source_prior: np.ndarray) -> Calibration:
        assert self.best is not None
        nll, theta, totals = self.best
        scale, bias = self.params(theta)
        class_scale = None
        if self.kind == "vector":
            a = np.asarray(scale, np.float64)
            scale, class_scale = float(a.mean()), a / a.mean()
        n = float(totals["n"][0])
        return Calibration(float(scale), bias, np.asarray(source_prior, np.float64), self.kind,
                           {"iterations": self.iterations, "images": int(n),
                            "nll_before": (self.nll_start or nll) / max(n, 1), "nll_after": nll / max(n, 1)},
                           class_scale)


def fit_calibration(z: np.ndarray, labels: np.ndarray, kind: str = "bcts", max_iter: int = 25,
                    bias_l2: float = 1.0, scale_l2: float = 1.0) -> Calibration:
    """The same fit on pooled logits (one 'client'): what the federated fit must equal."""
    num_classes = z.shape[1]
    if kind == "none":
        return Calibration(source_prior=np.bincount(labels, minlength=num_classes) / max(len(labels), 1))
    cal = NewtonCalibrator(num_classes, kind, max_iter, bias_l2=bias_l2, scale_l2=scale_l2)
    params = cal.params()
    while params is not None:
        params = cal.step(nll_stats(z, labels, *params, kind))
    stats = nll_stats(z, labels, 1.0, None, kind)
    return cal.result(stats["counts"] / stats["counts"].sum())


# ------------------------------------------------------------------ priors
def check_prior(q: Any, num_classes: int, name: str = "prior") -> np.ndarray:
    """An explicit prior: C finite non-negative numbers summing to 1 (within PRIOR_TOL); else ConfigError."""
    try:
        arr = np.asarray(q, np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a list of {num_classes} numbers, got {q!r}") from None
    if arr.shape != (num_classes,):
        raise ConfigError(f"{name} must have one value per class ({num_classes}), got {arr.size}")
    if not np.isfinite(arr).all():
        raise ConfigError(f"{name} must be finite numbers, got {arr.tolist()}")
    if (arr < 0).any():
        raise ConfigError(f"{name} must not be negative, got {arr.tolist()}")
    if abs(arr.sum() - 1.0) > PRIOR_TOL:
        raise ConfigError(f"{name} must sum to 1 (within {PRIOR_TOL}), got {arr.sum():.6g}")
    return arr / arr.sum()


SITE_MIX_MAX_BYTES = 1 << 20  # a site-mix JSON file is read whole: larger is refused before it is read


def parse_site_mix(spec: str, class_names: list[str], name: str = "site mix") -> np.ndarray:
    """A site's own class mix for the case-mix estimator's `site` centre: `CLASS=COUNT` pairs separated by commas
    (e.g. `nv=2977,mel=20,bkl=120`; a class left out counts 0), or the path of a JSON object of the same pairs.
    Counts or shares alike. Returns the counts in `class_names` order; ConfigError naming `name` otherwise."""
    import os

    text = spec.strip()
    if text.endswith(".json") or os.path.isfile(text):
        try:
            if os.path.getsize(text) > SITE_MIX_MAX_BYTES:  # one count per class: a big file is the wrong file
                raise ConfigError(f"{name}: {text} is larger than {SITE_MIX_MAX_BYTES // 1024} KiB; it should hold "
                                  "one count per class")
            with open(text, encoding="utf-8") as fh:
                pairs = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{name}: cannot read {text} as a JSON object of class counts: {exc}") from None
        if not isinstance(pairs, dict):
            raise ConfigError(f"{name}: {text} must hold a JSON object of class counts, e.g. {{\"nv\": 2977}}")
        items = list(pairs.items())
    else:
        items = []
        for part in filter(None, (t.strip() for t in text.split(","))):
            if "=" not in part:
                raise ConfigError(f"{name} must be CLASS=COUNT pairs separated by commas (or a JSON file), got "
                                  f"{part!r}")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    counts = np.zeros(len(class_names), np.float64)
    for k, v in items:
        if k not in class_names:
            raise ConfigError(f"{name}: no class {k!r} in this model (classes: {', '.join(class_names)})")
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: the count of {k!r} must be a number, got {v!r}") from None
        if not (math.isfinite(x) and x >= 0):
            raise ConfigError(f"{name}: the count of {k!r} must be a finite number >= 0, got {v!r}")
        counts[class_names.index(k)] += x
    if counts.sum() <= 0:
        raise ConfigError(f"{name}: at least one class needs a count above 0, got {spec!r}")
    return counts


SITE_RULE_UNIFORM = 0.01  # the site rule's share of the uniform mix: a class the site never saw is not ruled out


def site_prior(mix: Any, uniform: float = SITE_RULE_UNIFORM) -> np.ndarray:
    """The `site` rule's prior: a site's own class mix (counts or shares, e.g. from `parse_site_mix`), normalised
    and mixed with `uniform` of the uniform mix. A site that knows its case mix from its own labelled images
    decides every image for it at once, with no images to wait for (docs/decisions.md, "prior=site"). The uniform share
    keeps a class the site has not seen (vidir_molemax has no akiec) possible, at about 1/(100·C)."""
    arr = np.asarray(mix, np.float64)
    if arr.ndim != 1 or arr.size < 2 or not np.isfinite(arr).all() or (arr < 0).any() or arr.sum() <= 0:
        raise ConfigError(f"a site mix must be one non-negative count per class, not all zero, got {arr.tolist()}")
    if not 0.0 <= uniform <= 1.0:
        raise ConfigError(f"the site rule's uniform share must be in [0, 1], got {uniform}")
    return (1.0 - uniform) * arr / arr.sum() + uniform / arr.size


PRIOR_WORDS = ("train", "site", "adaptive")  # the `prior` values that are not class probabilities


@dataclass(frozen=True)
class PriorOption:
    """The `prior` option of a request (/predict, /predict/batch) or a scoring job (`tafl score --prior`): `mode` is
    train (the model's own rule), site (this site's own mix), adaptive (the estimated served mix) or explicit (the
    class probabilities in `text`)."""

    mode: str
    text: str = ""

    def values(self) -> list[Any]:
        """The explicit prior's values as given: a JSON list, or numbers separated by commas; ValueError for text
        that is neither. `check_prior` then checks them against the model's classes."""
        return json.loads(self.text) if self.text.startswith("[") else [float(v) for v in self.text.split(",")]


def parse_prior_option(value: Any) -> PriorOption:
    """The `prior` option, for serving and the clients alike: one of PRIOR_WORDS (any case; missing or blank is
    train), else an explicit prior whose values `PriorOption.values` reads."""
    text = str("train" if value is None else value).strip()
    word = text.lower()
    if word in ("", "train"):
        return PriorOption("train", text)
    return PriorOption(word, text) if word in PRIOR_WORDS else PriorOption("explicit", text)


def log_prior_ratio(target: np.ndarray, source: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """log q − log π, the logit shift of the adapted rule (a class with q = 0 gets log(floor))."""
    t = np.clip(np.asarray(target, np.float64), floor, None)
    s = np.clip(np.asarray(source, np.float64), floor, None)
    return np.log(t / t.sum()) - np.log(s / s.sum())


def adapt(probs: np.ndarray, source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Posteriors under the target prior: p·q/π, renormalised (rows of `probs`)."""
    w = np.exp(log_prior_ratio(target, source))
    p = np.asarray(probs, np.float64) * w
    return p / np.clip(p.sum(-1, keepdims=True), 1e-300, None)


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).sum())


@dataclass
class PriorEstimate:
    prior: np.ndarray  # (C,)
    images: int
    iterations: int
    converged: bool
    shift: float  # total variation from the source prior

    def to_dict(self) -> dict[str, Any]:
        return {"prior": [float(v) for v in self.prior], "images": self.images, "iterations": self.iterations,
                "converged": self.converged, "shift_from_source": self.shift}


def em_prior(probs: np.ndarray, source: np.ndarray, tol: float = 1e-6, max_iter: int = 200,
             floor: float = 1e-8, pseudo_count: float = 0.0, center: np.ndarray | None = None) -> PriorEstimate:
    """Saerens et al.'s EM: the maximum-likelihood class prior of unlabeled images.

    probs (N, C) calibrated posteriors under `source` (C,). Vectorised over images; stops when
    no class's prior moves by more than `tol` or after `max_iter` iterations. `pseudo_count` adds
    that many images' worth of `center` (default: the source prior) to every M-step: the MAP estimate
    under a Dirichlet prior of mean `center` (`PriorEstimator`). With no images the estimate is the
    source prior.
    """
    p = np.asarray(probs, np.float64)
    src = np.clip(np.asarray(source, np.float64), floor, None)
    src = src / src.sum()
    if p.ndim != 2 or p.shape[1] != len(src):
        raise ValueError(f"probs must be (N, {len(src)}), got {p.shape}")
    if center is None:
        mid = src
    else:
        mid = np.asarray(center, np.float64)
        if mid.shape != src.shape or not np.isfinite(mid).all() or (mid < 0).any() or mid.sum() <= 0:
            raise ValueError(f"center must be {len(src)} non-negative numbers, got {mid.tolist()}")
        mid = mid / mid.sum()
    if len(p) == 0:
        return PriorEstimate(src.copy(), 0, 0, False, 0.0)
    ratio = p / src  # p(y|x)/π_y; the E-step posterior of image i is ratio_i·q / (ratio_i · q)
    ratio_t = np.ascontiguousarray(ratio.T)
    n = len(p)
    q = src.copy()
    converged = False
    it = 0
    for it in range(1, max_iter + 1):
        # M-step without forming the (N, C) posteriors: q'_c = q_c · mean_i ratio_ic / (ratio_i · q)
        inv = 1.0 / np.maximum(ratio @ q, 1e-300)
        new = np.maximum((q * (ratio_t @ inv) + pseudo_count * mid) / (n + pseudo_count), floor)
        new /= new.sum()
        if float(np.abs(new - q).max()) < tol:
            q = new
            converged = True
            break
        q = new
    return PriorEstimate(q, len(p), it, converged, total_variation(q, src))


# pseudo-images, chosen among on validation
SMOOTHING_GRID = (0.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0)
CENTERS = ("uniform", "source", "train", "site")
ESTIMATOR_KINDS = ("em", "confusion")


@dataclass
class PriorEstimator:
    """How a deployment's class mix is estimated from its calibrated posteriors: EM, with `pseudo_count` images'
    worth of a Dirichlet prior of mean `center` added to every M-step. The centre is the uniform mix, the source
    prior (the mix the posteriors describe), the training images' class mix (`train`, stored in `center_mix`:
    it differs from the source prior where the model learned balanced scores, e.g. `local_adjust`), or the
    deploying site's own class mix (`site`: the counts of its own labelled images, which it knows and which never
    leave it; given at deployment with `for_site`, e.g. `tafl serve --site-mix`; without one it is `center_mix`,
    the federation's training mix).

    pseudo_count 0 is the maximum-likelihood estimate of Saerens et al. That estimate runs to the simplex's edge:
    with a few hundred images and posteriors calibrated on a few dozen images of a rare class, EM gives that class
    a prior of ~0, and the Bayes rule then never predicts it. The symmetric Dirichlet (center uniform) keeps every
    class in play and, more than that, shrinks an estimate that is noisy and biased in every class toward the
    centre (a floor alone recovers little: docs/decisions.md, "The smoothed estimator"). It fades as images accumulate: at n images the
    estimate weighs the data's n against the prior's pseudo_count. Training chooses pseudo_count (and, with real
    sites, the centre) on the validation split (`tafl.training.simulator.choose_prior_estimator`); `record` keeps
    how.
    """

    pseudo_count: float = 0.0
    center: str = "uniform"
    record: dict[str, Any] = field(default_factory=dict)
    center_mix: tuple[float, ...] | None = None  # center "train" (and "site" without a site mix): the training mix
    site_mix: tuple[float, ...] | None = None  # center "site": the deploying site's own mix (`for_site`, at deployment)
    # kind "confusion": the served posteriors' mean seen through M (C, C), M[y, j] the mean probability of j over
    # validation images of class y (`soft_confusion`): soft BBSE (Lipton et al. 2018, `confusion_prior`), which stays
    # consistent however the posteriors are calibrated; None: EM on the posteriors themselves
    confusion: tuple[tuple[float, ...], ...] | None = None

    @property
    def kind(self) -> str:
        return "em" if self.confusion is None else "confusion"

    def for_site(self, mix: Any) -> PriorEstimator:
        """This estimator at a site that knows its own class mix (counts or shares, one per class). Only a `site`
        centre uses it; another centre returns itself."""
        if self.center != "site" or mix is None:
            return self
        arr = np.asarray(mix, np.float64)
        if arr.ndim != 1 or arr.size < 2 or not np.isfinite(arr).all() or (arr < 0).any() or arr.sum() <= 0:
            raise ConfigError(f"a site mix must be one non-negative count per class, not all zero, got {arr.tolist()}")
        return PriorEstimator(self.pseudo_count, self.center, self.record, self.center_mix,
                              tuple(float(v) for v in arr / arr.sum()), self.confusion)

    def center_prior(self, source: np.ndarray) -> np.ndarray:
        src = np.asarray(source, np.float64)
        if self.center == "uniform":
            return np.full(len(src), 1.0 / len(src))
        if self.center in ("train", "site"):
            mix = np.asarray(self.site_mix if self.site_mix is not None else self.center_mix, np.float64)
            if mix.shape != src.shape:
                raise ValueError(f"the estimator's {'site' if self.site_mix is not None else 'training'} mix has "
                                 f"{mix.size} classes, the posteriors {src.size}")
            return mix
        return src / src.sum()

    def estimate(self, probs: np.ndarray, source: np.ndarray, **kw: Any) -> PriorEstimate:
        if self.confusion is not None:
            return confusion_prior(probs, np.asarray(self.confusion, np.float64), source,
                                   pseudo_count=self.pseudo_count, center=self.center_prior(source), **kw)
        return em_prior(probs, source, pseudo_count=self.pseudo_count, center=self.center_prior(source), **kw)

    def to_dict(self) -> dict[str, Any]:
        mix = {"center_mix": [float(v) for v in self.center_mix]} if self.center in ("train", "site") else {}
        if self.site_mix is not None:
            mix["site_mix"] = [float(v) for v in self.site_mix]
        if self.confusion is not None:
            mix["confusion"] = [list(row) for row in self.confusion]
        return {"kind": self.kind, "pseudo_count": float(self.pseudo_count), "center": self.center, **mix,
                **self.record}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> PriorEstimator:
        """A checkpoint's or package's record; None (older ones) is the maximum-likelihood EM they were built with."""
        if not d:
            return cls(0.0, "source")
        try:
            a = float(d.get("pseudo_count", 0.0))
        except (TypeError, ValueError):
            raise ConfigError(f"prior estimator pseudo_count must be a number, got {d.get('pseudo_count')!r}") from None
        center = str(d.get("center", "uniform"))
        if not (math.isfinite(a) and a >= 0):
            raise ConfigError(f"prior estimator pseudo_count must be a finite number >= 0, got {a}")
        if center not in CENTERS:
            raise ConfigError(f"prior estimator center must be one of {', '.join(CENTERS)}, got {center!r}")
        mix = None
        if center in ("train", "site"):
            try:
                mix = np.asarray(d.get("center_mix"), np.float64)
            except (TypeError, ValueError):
                mix = np.zeros(0)
            if mix.ndim != 1 or mix.size < 2 or not np.isfinite(mix).all() or (mix < 0).any() or mix.sum() <= 0:
                raise ConfigError(f"prior estimator center '{center}' needs center_mix: the training class shares, "
                                  f"got {d.get('center_mix')!r}")
            mix = tuple(float(v) for v in mix / mix.sum())
        kind = str(d.get("kind", "em"))
        if kind not in ESTIMATOR_KINDS:
            raise ConfigError(f"prior estimator kind must be one of {', '.join(ESTIMATOR_KINDS)}, got {kind!r}")
        confusion = None
        if kind == "confusion":
            try:
                M = np.asarray(d.get("confusion"), np.float64)
            except (TypeError, ValueError):
                M = np.zeros(0)
            if M.ndim != 2 or M.shape[0] != M.shape[1] or M.shape[0] < 2 or not np.isfinite(M).all() or \
                    (M < 0).any() or not np.allclose(M.sum(1), 1.0, atol=1e-6):
                raise ConfigError("prior estimator kind 'confusion' needs `confusion`: a square matrix whose rows "
                                  f"are probability vectors, got {d.get('confusion')!r}")
            confusion = tuple(tuple(float(v) for v in row) for row in M)
        est = cls(a, center, {k: v for k, v in d.items()
                              if k not in ("kind", "pseudo_count", "center", "center_mix", "site_mix", "confusion")},
                  mix, None, confusion)
        return est.for_site(d["site_mix"]) if d.get("site_mix") is not None else est

    def describe(self) -> str:
        if self.confusion is not None:
            base = "the confusion-matrix estimator (soft BBSE"
            return base + (f", with a Dirichlet prior of {self.pseudo_count:g} images toward {self._toward()})"
                           if self.pseudo_count else ", maximum likelihood)")
        if not self.pseudo_count:
            return "EM (maximum likelihood)"
        return f"EM with a Dirichlet prior of {self.pseudo_count:g} images toward {self._toward()}"

    def _toward(self) -> str:
        toward = {"uniform": "the uniform mix", "source": "the mix the model's probabilities assume",
                  "train": "the training images' mix",
                  "site": "the site's own mix" if self.site_mix is not None else
                  "the site's own mix (none given: the training images' mix)"}[self.center]
        return toward


# ------------------------------------------------------------------ confusion-based estimation
def soft_confusion(probs: np.ndarray, labels: np.ndarray, num_classes: int, floor: float = 1e-4) -> np.ndarray:
    """M[y, j] = the mean predicted probability of class j over labelled images of class y (rows sum to 1).

    Under label shift p(x|y) does not change, so M holds for every class mix: it is what makes the
    confusion-based estimate consistent whatever the posteriors' calibration. Classes without an
    image get the identity row. The sums behind it (`confusion_stats`) are what a client sends.
    """
    s = confusion_stats(probs, labels, num_classes)
    return confusion_from_stats(s["confusion_sum"], s["confusion_count"], floor)


def confusion_stats(probs: np.ndarray, labels: np.ndarray, num_classes: int) -> dict[str, np.ndarray]:
    """Per true class, the sum of predicted probability vectors and the image count (aggregates only)."""
    p = np.asarray(probs, np.float64)
    y = np.asarray(labels, np.int64)
    total = np.zeros((num_classes, num_classes))
    np.add.at(total, y, p)
    return {"confusion_sum": total, "confusion_count": np.bincount(y, minlength=num_classes).astype(np.float64)}


def confusion_from_stats(total: np.ndarray, count: np.ndarray, floor: float = 1e-4) -> np.ndarray:
    total, count = np.asarray(total, np.float64), np.asarray(count, np.float64)
    C = len(count)
    M = np.where(count[:, None] > 0, total / np.maximum(count, 1.0)[:, None], np.eye(C))
    M = np.maximum(M, floor)
    return M / M.sum(1, keepdims=True)


def confusion_prior(probs: np.ndarray, confusion: np.ndarray, source: np.ndarray, tol: float = 1e-6,
                    max_iter: int = 500, pseudo_count: float = 0.0, floor: float = 1e-8,
                    center: np.ndarray | None = None) -> PriorEstimate:
    """The maximum-likelihood prior q of the target's predictions seen through the channel M: the mean
    predicted distribution of the N images is modelled as q·M (soft BBSE solved by EM, which keeps q on
    the simplex). `pseudo_count` adds that many images' worth of `center` (default the source prior: a Dirichlet
    MAP estimate that shrinks small samples toward it). With no images: the source prior."""
    p = np.asarray(probs, np.float64)
    M = np.asarray(confusion, np.float64)
    src = np.clip(np.asarray(source, np.float64), floor, None)
    src = src / src.sum()
    C = len(src)
    if p.ndim != 2 or p.shape[1] != C or M.shape != (C, C):
        raise ValueError(f"probs must be (N, {C}) and the confusion ({C}, {C}), got {p.shape} and {M.shape}")
    n = len(p)
    if n == 0:
        return PriorEstimate(src.copy(), 0, 0, False, 0.0)
    counts = p.sum(0)  # soft counts per predicted class
    mid = src if center is None else np.asarray(center, np.float64) / np.sum(center)
    q = src.copy()
    converged, it = False, 0
    for it in range(1, max_iter + 1):
        joint = q[:, None] * M  # (true y, predicted j)
        resp = joint / np.maximum(joint.sum(0, keepdims=True), 1e-300)
        new = np.maximum((resp @ counts + pseudo_count * mid) / (n + pseudo_count), floor)
        new /= new.sum()
        if float(np.abs(new - q).max()) < tol:
            q, converged = new, True
            break
        q = new
    return PriorEstimate(q, n, it, converged, total_variation(q, src))


# ------------------------------------------------------------------ whether estimation helps this model
ADAPTIVE_TOLERANCE = 0.01  # the adapted rule may lose this much (1 point) to the plain one on validation


def adaptive_check(validation: dict[str, Any] | None) -> dict[str, Any] | None:
    """Whether `prior=adaptive` should be used for a model, from its training report's validation split
    (report.json prior_adaptation.validation.average: the rule adapted to EM's estimate from n images against
    the rule the package falls back to, means of the eleven distributions). That fallback is `plain`, the
    model's own label (the operating point of `decision: validation`, GTAFL's vote), where the report has it;
    older reports only hold `calibrated`, the calibrated argmax. A model whose posteriors are not calibrated
    for estimation (an uncalibrated class-weighted ViT-DAFL: EM's estimate ends 0.6 TV from the truth and the
    adapted rule loses 20 points) would be served worse by adapting; then `recommended` is False and `why`
    says so. None when the report holds no validation numbers (older runs): nothing is known, nothing is
    blocked."""
    if not validation:
        return None
    sizes = sorted(int(k.split("_")[1]) for k in validation if k.startswith("adaptive_"))
    against = "plain" if validation.get("plain") is not None else "calibrated"
    if not sizes or validation.get(against) is None:
        return None
    n = sizes[-1]
    plain, adapted = float(validation[against]), float(validation[f"adaptive_{n}"])
    ok = adapted >= plain - ADAPTIVE_TOLERANCE
    out: dict[str, Any] = {"recommended": ok, "images": n, "plain": plain, "against": against,
                           "adaptive": adapted, "oracle": validation.get("oracle")}
    if not ok:
        rule = "model's own decision" if against == "plain" else "calibrated argmax"
        out["why"] = (f"on its validation split the rule adapted to an estimate from {n} images lost to the {rule} "
                      f"({100 * adapted:.1f} % against {100 * plain:.1f} %, mean of the eleven distributions): "
                      "its posteriors are not calibrated well enough for estimation; retrain with --calibration "
                      "vector --calib-holdout 0.1 if it has none, or give the prior explicitly")
    return out


def validation_average(report: dict[str, Any]) -> dict[str, Any] | None:
    """A training report's prior-adaptation means on the validation split (what `adaptive_check` reads), with the
    model's own label (`plain`) taken from the report's validation section where an older report lacks it."""
    avg = ((report.get("prior_adaptation") or {}).get("validation") or {}).get("average")
    if not avg:
        return None
    own = (report.get("validation") or {}).get("average_accuracy")
    return dict(avg, plain=own) if avg.get("plain") is None and own is not None else avg


ADAPTIVE_MODES = ("checked", "always")  # TAFL_PRIOR_ADAPTIVE, read by tafl.settings.prior_adaptive_mode


def adaptive_blocked(check: Any, mode: str) -> str | None:
    """Why `prior=adaptive` must fall back to the source prior for a package, or None. `check`: the package's
    validation check (its metadata's prior.adaptive_check: `recommended`, `why`; None or false where it has none);
    `mode`: checked follows that check, always adapts anyway (TAFL_PRIOR_ADAPTIVE, which the caller reads)."""
    if mode not in ADAPTIVE_MODES:
        raise ConfigError(f"TAFL_PRIOR_ADAPTIVE must be checked or always, got {mode!r}")
    if mode == "always" or not check or check.recommended:
        return None
    return check.why or "the package's validation check advises against prior=adaptive"
