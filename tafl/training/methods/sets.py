"""The client side of the conformal sets' statistics round (tafl.training.sets drives it, once, after the
calibration and the in-domain detector): a part a method composes. A client scores its held-out rows with the run's
calibrated posteriors under the source prior (the calibration the round carries) and answers one histogram per
class of the true class's score 1 − p on tafl.conformal's fixed grid, nothing per image.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tafl.training.contract import ClientData, ClientResult, RoundConfig, Tensors
from tafl.training.secagg import SETS_KEY  # the secure sum's layout names the same key


class SetsClient:
    """The sets' statistics round of one method's clients; `method` is a ClassifierMethod."""

    def __init__(self, method: Any):
        self.method = method

    def update(self, payload: Tensors, data: ClientData, round_cfg: RoundConfig) -> ClientResult:
        """Extras conf_hist (C, GRID) float64: per class, the counts of its held-out rows' scores per grid bin."""
        from tafl import conformal
        from tafl.prior import Calibration

        m = self.method
        C = int(m.model_cfg.num_classes)
        rows = data.holdout if data.holdout is not None else torch.zeros(0, dtype=torch.int64)
        hist = np.zeros((C, conformal.GRID), np.float64)
        if len(rows):
            probs = Calibration.from_dict(round_cfg["conformal_stats"], C).probs(
                m.calibration.logits(payload, data.images[rows]))
            labels = data.labels[rows].numpy()
            hist = conformal.histograms(conformal.true_class_scores(probs, labels), labels, C)
        return ClientResult(data.client_id, len(rows), {}, {SETS_KEY: torch.from_numpy(hist)}, {"conformal_stats": 1.0})
