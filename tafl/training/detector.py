"""The in-domain detector, fitted after training (docs/design.md, "The input domain"): a class-conditional Gaussian
on the final model's features (`Classifier.domain_features`) with one covariance shared by the classes (Lee et al. 2018), whose score is the
squared Mahalanobis distance to the nearest class mean, combined with the energy score of the model's own logits
(Liu et al. 2020) where the features are the head's (a CNN's; a ViT's detector scores other features): the energy
is put on the distance's scale by matching the two on the validation split (log distance and energy standardised
there), and the score is the larger of the distance and the energy's equivalent, so an image either measure puts
far out is far out (docs/design.md, "The input domain"). The clients send feature sums in one statistics round
(tafl.training.methods.detector); the server turns them into the means and the covariance, and picks the threshold
on its validation split alone: the score that keeps KEEP of the in-domain validation images. No test image and
no out-of-domain image chooses anything.

Under record-level DP (`--dp-epsilon`) the sums are one Gaussian release of clipped features that the accountant
counts (tafl.training.methods.detector), and the server floors the noisy covariance's eigenvalues so its inverse
stays a precision. With secure aggregation the three sums are one SecAgg+ sum over every site
(tafl.training.secagg.domain_layout), the features clipped to a public bound (DP's clip, or CLIP_HEADROOM times the
largest feature norm of the server's validation images). `--no-domain-detector` fits none.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tafl.training.config import RunConfig
from tafl.training.contract import GlobalState, Method
from tafl.training.methods.detector import DOMAIN_KEYS, extract_features
from tafl.training.rounds import charge, privacy_ledger
from tafl.training.transport import Transport

log = logging.getLogger(__name__)

KEEP = 0.95  # the share of in-domain validation images the threshold keeps
CLIP_HEADROOM = 4.0  # secure aggregation alone: features are clipped at this times the largest validation norm
SHRINKAGE = 0.01  # covariance + SHRINKAGE · (trace / D) · I: the precision stays finite where D nears the images
ENERGY_CAP = 80.0  # the energy's distance equivalent is exp(at most this): finite in float32, far beyond any threshold


def fit_gaussian(sums: np.ndarray, outer: np.ndarray, counts: np.ndarray,
                 shrinkage: float = SHRINKAGE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From pooled sums: the means (K, D) of the K classes with images, their class indices (K,), and the precision
    (D, D) of the shared within-class covariance, shrunk toward its mean variance."""
    present = np.flatnonzero(counts >= 1)  # a DP census's noise can leave a class a fraction of an image
    n = float(counts[present].sum())
    means = sums[present] / counts[present, None]
    between = (means * counts[present, None]).T @ means  # Σ_c n_c μ_c μ_cᵀ
    cov = (outer - between) / max(n - len(present), 1.0)
    cov = (cov + cov.T) / 2
    vals, vecs = np.linalg.eigh(cov)
    mean_var = max(float(np.clip(vals, 0, None).mean()), 1e-12)
    floor = max(shrinkage, 1e-12) * mean_var
    # + shrinkage · mean variance, and no eigenvalue below that (a noisy DP release can make the sum indefinite)
    vals = np.maximum(vals + floor, floor)
    return means, present, (vecs / vals) @ vecs.T


def distances(feats: np.ndarray, means: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """(N,) squared Mahalanobis distance of each feature row to its nearest class mean."""
    fp = feats @ precision
    quad = np.einsum("nd,nd->n", fp, feats)[:, None] - 2 * fp @ means.T + np.einsum("kd,kd->k", means @ precision,
                                                                                    means)[None]
    return quad.min(axis=1)


def energies(logits: np.ndarray) -> np.ndarray:
    """(N,) the energy score −logsumexp of each row of logits (Liu et al. 2020, temperature 1): larger is further
    out."""
    m = logits.max(axis=1, keepdims=True)
    return -(m[:, 0] + np.log(np.exp(logits - m).sum(axis=1)))


def energy_match(dist: np.ndarray, energy: np.ndarray) -> dict[str, list[float]]:
    """The matching of the energy to the distance's scale, from in-domain validation scores: the mean and standard
    deviation of the log distance and of the energy."""
    log_d = np.log(np.maximum(dist, 1e-12))
    return {"log_distance": [float(log_d.mean()), max(float(log_d.std()), 1e-6)],
            "energy": [float(energy.mean()), max(float(energy.std()), 1e-6)]}


def combine(dist: np.ndarray, energy: np.ndarray | None, match: dict[str, list[float]] | None) -> np.ndarray:
    """The detector's score: the distance, or the energy's distance equivalent exp(μ_L + σ_L (E − μ_E) / σ_E) where
    that is larger; the distance alone without a matching (a ViT's detector)."""
    if match is None or energy is None:
        return dist
    (mu_l, sd_l), (mu_e, sd_e) = match["log_distance"], match["energy"]
    return np.maximum(dist, np.exp(np.minimum(mu_l + sd_l * (energy - mu_e) / sd_e, ENERGY_CAP)))


def head_energies(model: Any, feats: np.ndarray) -> np.ndarray | None:
    """The energy of the model's head on its detector features, where those are the head's input (a CNN's pooled
    features), else None."""
    from tafl.training.models import is_vit_extractor

    if is_vit_extractor(model.extractor):
        return None
    w = model.head.weight.detach().double().cpu().numpy()
    b = model.head.bias.detach().double().cpu().numpy()
    return energies(feats.astype(np.float64) @ w.T + b)


def threshold_record(model: Any, means: np.ndarray, precision: np.ndarray, val_feats: np.ndarray) -> dict[str, Any]:
    """What the server decides on its validation split alone: the energy's matching (a CNN's) and the threshold
    that keeps KEEP of the images; recorded in the state's `domain_detector`."""
    dist = distances(val_feats, means.astype(np.float64), precision.astype(np.float64))
    energy = head_energies(model, val_feats)
    match = energy_match(dist, energy) if energy is not None else None
    score = combine(dist, energy, match)
    threshold = float(np.quantile(score, KEEP))
    return {"kind": "mahalanobis+energy" if match else "mahalanobis", "threshold": threshold, "energy_match": match,
            "val_images": int(len(score)), "val_refused": float((score > threshold).mean())}


def problem(r: Any, num_classes: int, dim: int) -> str | None:
    """Why a client's statistics cannot be summed, or None."""
    shapes = {"dom_sum": (num_classes, dim), "dom_outer": (dim, dim), "dom_counts": (num_classes,)}
    for k, shape in shapes.items():
        t = r.extras.get(k)
        if t is None or tuple(t.shape) != shape:
            return f"{k} is missing or not of shape {shape}"
        if not bool(torch.isfinite(t).all()):
            return f"{k} contains NaN or Inf"
    if bool((r.extras["dom_counts"] < 0).any()):
        return "dom_counts are negative"
    return None


def fit_detector(method: Method, state: GlobalState, transport: Transport, cfg: RunConfig, val_images: np.ndarray,
                 book: dict[str, Any]) -> GlobalState:
    """One statistics round over every client, the Gaussian, and the threshold on the validation split; recorded in
    the state (extras domain.means, domain.classes, domain.precision; meta domain_detector)."""
    if not cfg.domain_detector:
        why = "turned off (--no-domain-detector)"
        log.info("in-domain detector: %s", why)
        return GlobalState(state.weights, state.extras, dict(state.meta, domain_detector={"fitted": False,
                                                                                         "why": why}))
    t0 = time.perf_counter()
    C, dim = int(method.model_cfg.num_classes), int(method.model.domain_dim)
    from tafl.training.models import build_model

    model = build_model(method.model_cfg).to(method.device)
    model.load_state_dict(state.weights)
    val_feats = extract_features(model, torch.from_numpy(val_images), method.normalize, cfg.eval_batch_size)
    round_cfg = {"round": cfg.rounds + 3, "seed": cfg.seed, "domain_stats": True}
    if cfg.dp_epsilon is not None:  # the DP release's clip, which SecAgg+'s layout also needs
        round_cfg["domain_clip"] = float(cfg.dp_feature_clip) * dim ** 0.5
    elif cfg.secure_aggregation:  # a public bound from the server's own images, with room to spare
        round_cfg["domain_clip"] = CLIP_HEADROOM * max(float(np.linalg.norm(val_feats, axis=1).max()), 1e-6)
    results, cost = transport.train(list(range(transport.num_clients)), method.broadcast(state), round_cfg)
    charge(book, cost)
    privacy_ledger(method, book, results, cost)  # under DP: the release each site made, for the accountant
    good = []
    for r in results:
        why = problem(r, C, dim)
        if why is None:
            good.append(r)
        else:
            log.warning("in-domain detector: dropping client %s: %s", r.client_id, why)
    if not good:
        log.warning("in-domain detector: no client sent statistics; none is fitted")
        return state
    sums, outer, counts = (sum(r.extras[k].double().numpy() for r in good) for k in DOMAIN_KEYS)
    means, classes, precision = fit_gaussian(sums, outer, counts)
    means, precision = means.astype(np.float32), precision.astype(np.float32)  # as the package's graph holds them
    decided = threshold_record(model, means, precision, val_feats)
    rec = {"fitted": True, **decided, "keep": KEEP, "shrinkage": SHRINKAGE,
           "private": ", ".join(p for p, on in (("differential privacy", cfg.dp_epsilon is not None),
                                                ("secure aggregation", cfg.secure_aggregation)) if on) or None,
           "clip": round_cfg.get("domain_clip"),
           "features": dim, "classes": [int(c) for c in classes], "train_images": int(round(float(counts.sum()))),
           # a secure sum is one combined result: the transport lists the clients in it
           "clients": sorted(int(c) for c in (cost.get("answered") or [r.client_id for r in good])),
           "seconds": round(time.perf_counter() - t0, 2)}
    log.info("in-domain detector: %s on %d features from %d training images of %d clients; threshold "
             "%.1f keeps %.0f%% of %d validation images", rec["kind"], dim, rec["train_images"], len(good),
             rec["threshold"], 100 * (1 - rec["val_refused"]), rec["val_images"])
    extras = {**state.extras, "domain.means": torch.from_numpy(means), "domain.precision": torch.from_numpy(precision)}
    return GlobalState(state.weights, extras, dict(state.meta, domain_detector=rec))


def detector_report(method: Method, state: GlobalState, ds: Any, test_labels_pred: np.ndarray, batch_size: int,
                    seed: int = 0, dicom_dir: str | None = None) -> dict[str, Any] | None:
    """The report's `domain_detector`: the fit's record; on the test split, the share of in-domain images it refuses
    (overall and per class) and the balanced accuracy on the images it accepts beside that on all; and its detection
    of the far-out-of-domain sets (tafl.training.ood) and, with --open-set-class, of the class left out: AUROC, FPR
    at 95 % TPR and the share the threshold accepts for the package's score, and beside it AUROC and FPR for each of
    its parts, the Mahalanobis distance and the energy score of the model's own logits (Liu et al. 2020)."""
    from tafl.training.evaluate import balanced_accuracy
    from tafl.training.models import build_model

    rec = state.meta.get("domain_detector")
    if not rec or not rec.get("fitted"):
        return dict(rec) if rec else None
    model = build_model(method.model_cfg).to(method.device)
    model.load_state_dict(state.weights)
    means, precision = (state.extras[k].double().numpy() for k in ("domain.means", "domain.precision"))

    def scores(images: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        feats = extract_features(model, torch.from_numpy(images), method.normalize, batch_size)
        u8 = torch.from_numpy(images)
        with torch.no_grad():
            model.eval()
            logits = torch.cat([model(method.normalize(u8[i:i + batch_size])).double().cpu()
                                for i in range(0, len(u8), batch_size)])
        dist, energy = distances(feats, means, precision), energies(logits.numpy())
        return combine(dist, energy, rec.get("energy_match")), dist, energy

    score, dist, energy = scores(ds.test.images)
    refused = score > rec["threshold"]
    labels, C = ds.test.labels, len(ds.class_names)
    keep = ~refused
    per_class = {ds.class_names[c]: float(refused[labels == c].mean()) if (labels == c).any() else None
                 for c in range(C)}
    from tafl.training.ood import detection, far_sets

    _, size, _, channels = ds.test.images.shape
    sets = far_sets(ds.name, size, channels, seed, [Path(dicom_dir).expanduser()] if dicom_dir else [])
    if getattr(ds, "open_set", None) is not None and len(ds.open_set):
        sets["unseen_class"] = ds.open_set
    measured = {}
    for name, images in sets.items():
        s_out, d_out, e_out = scores(images)
        measured[name] = {"score": detection(score, s_out, rec["threshold"]), "mahalanobis": detection(dist, d_out),
                          "energy": detection(energy, e_out)}
    return {**rec, "test": {"images": int(len(labels)), "refused": float(refused.mean()),
                            "refused_per_class": per_class,
                            "balanced_accuracy_all": balanced_accuracy(test_labels_pred, labels, C),
                            "balanced_accuracy_accepted": balanced_accuracy(test_labels_pred[keep], labels[keep], C)
                            if keep.any() else None},
            "detection": measured}
