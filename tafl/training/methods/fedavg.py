"""FedAvg and FedProx: local SGD, sample-count-weighted averaging of the model state the sites send (all of it; the
classifier head alone with `train_scope: head`, `ClassifierMethod.scoped`).

FedProx adds μ/2·‖w − w_global‖² to each client's local loss (`mu` in the config). The
BatchNorm running statistics are averaged with the same weights as the parameters. With `local_adjust` τ
each client trains on the logit-adjusted loss with its own class mix (`local.logit_adjusted_loss`), so the
global model's softmax describes the training mix raised to 1 − τ (uniform at τ = 1), which is the source
prior calibration, the operating point and the case-mix estimator work from.
"""

from __future__ import annotations

import logging

import numpy as np

from tafl.training.aggregate import check_results
from tafl.training.local import logit_adjusted_loss
from tafl.training.contract import ClientData, ClientResult, GlobalState, RoundConfig, Tensors, register_method
from tafl.training.methods.base import ClassifierMethod
from tafl.training.methods.fedavg_config import FedAvgConfig
from tafl.training.methods.head_basis import split_basis

log = logging.getLogger(__name__)


@register_method("fedavg")
class FedAvg(ClassifierMethod):
    name = "fedavg"
    opts_type = FedAvgConfig
    opts: FedAvgConfig
    prox_mu = 0.0

    def client_update(self, payload: Tensors, data: ClientData, round_cfg: RoundConfig) -> ClientResult:
        if round_cfg.get("calibrate"):  # the calibration rounds after training: no local training
            return self.calibration.update(payload, data, round_cfg)
        if round_cfg.get("domain_stats"):  # the in-domain detector's statistics round: no local training
            return self.domain_stats.update(payload, data, round_cfg)
        if round_cfg.get("conformal_stats") is not None:  # the conformal sets' statistics round: no training
            return self.sets.update(payload, data, round_cfg)
        payload, basis = split_basis(payload)
        self.model.load_state_dict(payload)
        gen = self.generator(round_cfg["round"], data.client_id)
        adjust = self.opts.local_adjust
        metrics = self.recipe.train(data.images[data.indices], data.local_labels, data, round_cfg["round"], gen, basis,
                                    prox_mu=self.prox_mu, prox_ref=payload if self.prox_mu > 0 else None,
                                    loss_fn=logit_adjusted_loss(data.class_counts(), adjust) if adjust else None)
        return ClientResult(data.client_id, len(data), self.local_update(), {}, metrics)

    def default_source_prior(self, state: GlobalState) -> np.ndarray:
        """The mix the softmax describes: the training mix, raised to 1 − local_adjust and renormalised."""
        prior = super().default_source_prior(state)
        if not self.opts.local_adjust:
            return prior
        shaped = np.clip(prior, 1e-6, None) ** max(0.0, 1.0 - self.opts.local_adjust)
        return shaped / shaped.sum()

    def server_update(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        good = check_results(self.scoped(state.weights), results)
        meta = dict(state.meta, round=round_, dropped=[r.client_id for r in results if r not in good])
        if not good:
            log.warning("round %d: no usable client update; the global model is unchanged", round_)
            return GlobalState(state.weights, state.extras, meta)
        return GlobalState(self.aggregate_update(state, good), state.extras, meta)


@register_method("fedprox")
class FedProx(FedAvg):
    name = "fedprox"

    @property
    def prox_mu(self) -> float:  # type: ignore[override]
        return self.opts.mu
