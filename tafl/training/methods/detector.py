"""The client side of the in-domain detector's statistics round (tafl.training.detector drives it, once, after the
calibration): a part a method composes. A client runs the final model's feature extractor over its training rows
and answers three sums, nothing per image: per class the features' sum (C, D) and count (C,), and the sum of the
features' outer products (D, D). From them the server has the class means and the shared covariance of the pooled
training features, exactly as if it had pooled them (Lee et al. 2018's class-conditional Gaussian).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tafl.training.contract import ClientData, ClientResult, RoundConfig, Tensors

DOMAIN_KEYS = ("dom_sum", "dom_outer", "dom_counts")


class DomainStatsClient:
    """The statistics round of one method's clients; `method` is a ClassifierMethod (its working model)."""

    def __init__(self, method: Any):
        self.method = method

    def update(self, payload: Tensors, data: ClientData, round_cfg: RoundConfig) -> ClientResult:
        """Extras dom_sum (C, D), dom_outer (D, D), dom_counts (C,), float64, over the client's training rows.

        Under record-level DP every feature vector is clipped to norm F = dp_feature_clip·√D, the sums (sensitivity
        F) and the outer products' sum (sensitivity F²) are one Gaussian release at the plan's statistics noise
        multiplier, and the counts are the site's census (already released): one release, which the plan counted
        from the start (tafl.training.privacy.detector_releases). With secure aggregation alone the features are
        clipped to the round's public `domain_clip` (SecAgg+'s layout needs a bound), which the server sets well
        above any norm it sees on its own validation images."""
        m = self.method
        C = int(m.model_cfg.num_classes)
        feats = self.features(payload, data.images[data.indices])
        labels = data.local_labels.numpy()
        metrics = {"domain_stats": 1.0}
        F = round_cfg.get("domain_clip")  # with secure aggregation: the server's public bound on a feature's norm
        if m.dp:
            plan = m.privacy.plan(len(data))
            F = plan.feature_clip * feats.shape[1] ** 0.5
        if F is not None:
            from tafl.training.privacy import clip_rows

            feats = clip_rows(torch.from_numpy(feats), float(F)).numpy()
        sums = np.zeros((C, feats.shape[1]), np.float64)
        np.add.at(sums, labels, feats)
        extras = {"dom_sum": torch.from_numpy(sums), "dom_outer": torch.from_numpy(feats.T @ feats),
                  "dom_counts": torch.from_numpy(np.bincount(labels, minlength=C).astype(np.float64))}
        if m.dp:
            from tafl.training.privacy import gaussian_release

            noisy = gaussian_release({"dom_sum": (extras["dom_sum"], F), "dom_outer": (extras["dom_outer"], F * F)},
                                     plan.stats_noise_multiplier, m.privacy.noise)
            extras.update(noisy, dom_counts=m.privacy.census(data).double())
            metrics["dp_releases"] = 1.0
        return ClientResult(data.client_id, len(data), {}, extras, metrics)

    def features(self, payload: Tensors, images_u8: torch.Tensor) -> np.ndarray:
        """(N, D) float64: the payload model's detector features (`Classifier.domain_features`, what the package's
        graph scores)."""
        m = self.method
        keys = set(m.model.state_dict())
        m.model.load_state_dict({k: v for k, v in payload.items() if k in keys})
        return extract_features(m.model, images_u8, m.normalize, m.cfg.eval_batch_size)


@torch.no_grad()
def extract_features(model: Any, images_u8: torch.Tensor, normalize: Any, batch_size: int) -> np.ndarray:
    """(N, D) float64 detector features (`Classifier.domain_features`) of uint8 (N, H, W, C) images, in eval mode,
    batch by batch."""
    was_training = model.training
    model.eval()
    out = [model.domain_features(normalize(images_u8[i:i + batch_size])).double().cpu()
           for i in range(0, len(images_u8), batch_size)]
    model.train(was_training)
    dim = int(model.domain_dim)
    return torch.cat(out).numpy() if out else np.zeros((0, dim), np.float64)
