"""The client side of the federated calibration rounds (tafl.training.calibrate drives them; tafl.prior fits): a
part a method composes. Each round a client answers the NLL statistics of its held-out rows at the round's (scale,
bias); only sums leave it (tafl.prior.nll_stats). Its held-out posteriors come from the method's own posteriors
(`posterior_module`, `posterior_logits`), computed once per calibration and kept for the following Newton rounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tafl.training.contract import ClientData, ClientResult, RoundConfig, Tensors


class CalibrationClient:
    """The calibration rounds of one method's clients; `method` gives the posteriors (a ClassifierMethod)."""

    def __init__(self, method: Any):
        self.method = method
        self._logits: dict[tuple[int, int], np.ndarray] = {}  # (client, round) -> held-out logits (h, C)

    def update(self, payload: Tensors, data: ClientData, round_cfg: RoundConfig) -> ClientResult:
        """A calibration round on a client: extras calib_nll (1,), calib_grad (P,), calib_hess (P, P),
        calib_counts (C,), calib_n (1,), P the calibration's parameter count."""
        from tafl import prior

        rows = data.holdout if data.holdout is not None else torch.zeros(0, dtype=torch.int64)
        key = (int(data.client_id), int(round_cfg["round"]))
        z = self._logits.get(key)
        if z is None:
            z = self.logits(payload, data.images[rows]) if len(rows) else \
                np.zeros((0, self.method.model_cfg.num_classes))
            self._logits = {k: v for k, v in self._logits.items() if k[1] == key[1]}
            self._logits[key] = z
        bias = round_cfg.get("bias")
        stats = prior.nll_stats(z, data.labels[rows].numpy(), np.asarray(round_cfg["scale"], np.float64),
                                None if bias is None else np.asarray(bias, np.float64), round_cfg["calibrate"])
        return ClientResult(data.client_id, len(rows), {}, {f"calib_{k}": torch.from_numpy(np.asarray(v, np.float64))
                                                            for k, v in stats.items()}, {"calibration": 1.0})

    def logits(self, payload: Tensors, images_u8: torch.Tensor) -> np.ndarray:
        """(N, C) the method's posterior logits of uint8 (N, H, W, C) images under the payload's weights."""
        from tafl.training.evaluate import predict

        m = self.method
        out = predict(m.posterior_module(payload), images_u8, m.normalize, m.cfg.eval_batch_size, keys=m.output_keys)
        return m.posterior_logits(out)
