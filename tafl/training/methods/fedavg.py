"""FedAvg and FedProx: local SGD, sample-count-weighted averaging of the whole model state.

FedProx adds μ/2·‖w − w_global‖² to each client's local loss (`mu` in the config). The
BatchNorm running statistics are averaged with the same weights as the parameters.
"""

from __future__ import annotations

import logging
from typing import Any

from tafl.training.aggregate import check_results, weighted_average
from tafl.training.local import local_sgd
from tafl.training.methods.base import ClientData, ClientResult, GlobalState, Method, Tensors

log = logging.getLogger(__name__)


class FedAvg(Method):
    name = "fedavg"
    prox_mu = 0.0

    def client_update(self, payload: Tensors, data: ClientData, round_cfg: dict[str, Any]) -> ClientResult:
        if round_cfg.get("calibrate"):  # the calibration rounds after training: no local training
            return self.calibration_update(payload, data, round_cfg)
        self.model.load_state_dict(payload)
        gen = self.generator(round_cfg["round"], data.client_id)
        cfg = self.cfg
        metrics = local_sgd(self.model, data.images[data.indices], data.local_labels, normalize=self.normalize,
                            epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=self.local_lr(round_cfg["round"]),
                            momentum=cfg.momentum, weight_decay=cfg.weight_decay, gen=gen, augment=cfg.augment,
                            policy=self.policy, prox_mu=self.prox_mu,
                            prox_ref=payload if self.prox_mu > 0 else None, optimizer=cfg.optimizer)
        weights = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return ClientResult(data.client_id, len(data), weights, {}, metrics)

    def server_update(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        good = check_results(state.weights, results)
        meta = dict(state.meta, round=round_, dropped=[r.client_id for r in results if r not in good])
        if not good:
            log.warning("round %d: no usable client update; the global model is unchanged", round_)
            return GlobalState(state.weights, state.extras, meta)
        weights = weighted_average([r.weights for r in good], [r.num_samples for r in good])
        return GlobalState(weights, state.extras, meta)


class FedProx(FedAvg):
    name = "fedprox"

    @property
    def prox_mu(self) -> float:  # type: ignore[override]
        return self.cfg.mu
