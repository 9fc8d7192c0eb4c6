"""ViT-DAFL (docs/design.md, "ViT-DAFL"): dynamic adaptive focal loss and imbalance-aware aggregation.

Client k sends its class counts and c_k = mean_i (N_k − n_{k,i}) / max(n_{k,i}, 1) (the guard
keeps a missing class from weighing 10⁶). The server computes, from the round's participants,
c_{f,i} = (Σ_k N_k − Σ_k n_{k,i}) / max(Σ_k n_{k,i}, 1) and broadcasts it. Local loss per sample
of class t: −(1 + c_{f,t})·(1 − p_t)^γ·log p_t with c_{f,t} = λ·c_k + (1 − λ)·c_{f,t}; γ is
learnable from 2.0, clamped to [0, γ_max], and averaged with the model. Aggregation weights
ω_k ∝ 1/(c_k + ε), normalised over the round's clients (`aggregation: size` gives FedAvg's).
`loss: focal` (c = 0, γ fixed) and `loss: ce` are the ablation options.

`dafl_scale: paper` uses those count ratios as they are: on DermaMNIST c_k is about 130 and the
same for every sample of a client, so the loss is 50-77× cross-entropy (SGD at lr 0.1 diverges) and
the class term moves the relative class weights about 2×. `dafl_scale: mean` (the default) writes
the weight as the λ-mixture of (1 + c_k) and (1 + c_{f,t}) and divides each part by its mean (over
the round's clients, over the round's samples): both average 1, the loss stays at cross-entropy's
scale, and the class part is the balanced class weight N/(C·n_t) (docs/design.md, "A ViT that trains from scratch").
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from tafl.training.aggregate import check_results, weighted_average
from tafl.training.local import local_sgd
from tafl.training.contract import ClientData, ClientResult, GlobalState, RoundConfig, Tensors, register_method
from tafl.training.methods.base import ClassifierMethod
from tafl.training.methods.dafl_config import DAFLConfig

log = logging.getLogger(__name__)
EPS = 1e-6


def client_imbalance(counts: torch.Tensor) -> float:
    """c_k = mean over classes of (N_k − n_{k,i}) / max(n_{k,i}, 1)."""
    n = counts.to(torch.float64)
    return float(((n.sum() - n) / n.clamp_min(1)).mean())


def class_imbalance(counts: torch.Tensor) -> torch.Tensor:
    """c_{f,i} = (Σ N_k − Σ n_{k,i}) / max(Σ n_{k,i}, 1) from a (K, C) count matrix."""
    n = counts.to(torch.float64).sum(0)
    return ((n.sum() - n) / n.clamp_min(1)).to(torch.float32)


def aggregation_weights(c_k: list[float]) -> list[float]:
    """ω_k = (1/(c_k + ε)) / Σ_j 1/(c_j + ε)."""
    w = [1.0 / (c + EPS) for c in c_k]
    total = sum(w)
    return [x / total for x in w]


def loss_coefficients(c_k: float, c_f: torch.Tensor, lam: float, scale: str, c_k_mean: float | None = None,
                      class_norm: float | None = None) -> torch.Tensor:
    """The per-class coefficient c_t of the loss's (1 + c_t), as configured.

    paper: c_t = λ·c_k + (1 − λ)·c_{f,t}. The literal weight is the λ-mixture
    λ·(1 + c_k) + (1 − λ)·(1 + c_{f,t}); mean divides each part by its mean, (1 + c_k) over the
    round's clients (1 + `c_k_mean`) and (1 + c_{f,t}) over the round's samples (`class_norm` =
    Σ_t π_t·(1 + c_{f,t}) with π the round's class shares, which is the number of classes present:
    (1 + c_{f,t})/class_norm = N/(C·n_t), the balanced class weight). Both parts then average 1.
    """
    c_f = c_f.to(torch.float32)
    if scale != "mean":
        return lam * c_k + (1 - lam) * c_f
    client = (1 + c_k) / (1 + max(float(c_k_mean if c_k_mean is not None else c_k), 0.0))
    norm = float(class_norm) if class_norm is not None else float((1 + c_f).mean())
    weight = lam * client + (1 - lam) * (1 + c_f) / max(norm, EPS)
    return weight - 1


def class_normaliser(counts: torch.Tensor) -> float:
    """Σ_t π_t·(1 + c_{f,t}) over a (K, C) count matrix: the mean of the class part over the samples."""
    n = counts.to(torch.float64).sum(0)
    if float(n.sum()) <= 0:
        return 1.0
    return float(((n / n.sum()) * (1 + class_imbalance(counts).to(torch.float64))).sum())


class DAFLLoss(nn.Module):
    """−(1 + c_t)·(1 − p_t)^γ·log p_t, averaged over the batch."""

    def __init__(self, coef: torch.Tensor, gamma: float, learnable: bool, gamma_max: float = 5.0):
        super().__init__()
        self.register_buffer("coef", coef.to(torch.float32))  # (C,) the c_{f,t} per class
        self.gamma = nn.Parameter(torch.tensor(float(gamma)), requires_grad=learnable)
        self.gamma_max = gamma_max

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=1).gather(1, y[:, None]).squeeze(1)  # (B,)
        # the base is kept off 0 so ∂/∂γ of 0^γ·log 0 stays finite for confident samples
        focal = (1 - logp.exp()).clamp_min(1e-12) ** self.gamma
        return -((1 + self.coef[y]) * focal * logp).mean()

    @torch.no_grad()
    def clamp_(self) -> None:
        self.gamma.clamp_(0.0, self.gamma_max)


@register_method("dafl")
class DAFL(ClassifierMethod):
    name = "dafl"
    opts_type = DAFLConfig
    opts: DAFLConfig

    def init_state(self, train_counts: np.ndarray) -> GlobalState:
        state = super().init_state(train_counts)
        state.extras["dafl.gamma"] = torch.tensor([self.opts.gamma_init if self.opts.loss != "ce" else 0.0])
        state.meta.update(loss=self.opts.loss, aggregation=self.opts.aggregation, gamma_history=[])
        return state

    def client_stats(self, data: ClientData) -> Tensors:
        counts = data.class_counts()
        return {"class_counts": counts.to(torch.float32),
                "c_k": torch.tensor([client_imbalance(counts)], dtype=torch.float32)}

    def round_config(self, state: GlobalState, stats: dict[int, Tensors], round_: int) -> RoundConfig:
        self.record_counts(state, stats)
        good = [s["class_counts"] for s in stats.values()
                if s.get("class_counts") is not None and bool(torch.isfinite(s["class_counts"]).all())]
        c_f = class_imbalance(torch.stack(good)) if good else torch.zeros(self.model_cfg.num_classes)
        c_ks = [float(s["c_k"].reshape(-1)[0]) for s in stats.values()
                if s.get("c_k") is not None and s["c_k"].numel() == 1 and bool(torch.isfinite(s["c_k"]).all())
                and float(s["c_k"].reshape(-1)[0]) >= 0]
        out = {"round": round_, "seed": self.cfg.seed, "c_f": [float(v) for v in c_f.tolist()],
               "c_k_mean": float(np.mean(c_ks)) if c_ks else None,
               "class_norm": class_normaliser(torch.stack(good)) if good else None}
        state.meta["last_round_cfg"] = {k: out[k] for k in ("c_f", "c_k_mean", "class_norm")}
        return out

    def broadcast(self, state: GlobalState) -> Tensors:
        return {**state.weights, "dafl.gamma": state.extras["dafl.gamma"]}

    def client_update(self, payload: Tensors, data: ClientData, round_cfg: RoundConfig) -> ClientResult:
        if round_cfg.get("calibrate"):  # the calibration rounds after training: no local training
            return self.calibration.update(payload, data, round_cfg)
        if round_cfg.get("domain_stats"):  # the in-domain detector's statistics round: no local training
            return self.domain_stats.update(payload, data, round_cfg)
        if round_cfg.get("conformal_stats") is not None:  # the conformal sets' statistics round: no training
            return self.sets.update(payload, data, round_cfg)
        cfg = self.cfg
        self.model.load_state_dict({k: v for k, v in payload.items() if k != "dafl.gamma"})
        counts = data.class_counts()
        c_k = client_imbalance(counts)
        if int((counts > 0).sum()) == 1:
            log.info("client %d holds a single class; its focal loss sees no negatives", data.client_id)
        loss_fn: nn.Module | None = None
        extra: list[torch.Tensor] = []
        gamma = float(payload["dafl.gamma"].reshape(-1)[0])
        if self.opts.loss != "ce":
            if self.opts.loss == "dafl":
                coef = loss_coefficients(c_k, torch.tensor(round_cfg["c_f"]), self.opts.dafl_lambda,
                                         self.opts.dafl_scale, round_cfg.get("c_k_mean"), round_cfg.get("class_norm"))
                learn = not self.opts.gamma_fixed
            else:  # plain focal loss: no imbalance coefficient, γ fixed
                coef, learn = torch.zeros(self.model_cfg.num_classes), False
            gamma_max = self.opts.gamma_max
            loss_fn = DAFLLoss(coef, min(max(gamma, 0.0), gamma_max), learn, gamma_max).to(self.device)
            extra = [loss_fn.gamma] if learn else []
        metrics = local_sgd(self.model, data.images[data.indices], data.local_labels, normalize=self.normalize,
                            epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=self.recipe.lr(round_cfg["round"]),
                            momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                            gen=self.generator(round_cfg["round"], data.client_id), augment=cfg.augment,
                            loss_fn=loss_fn, extra_params=extra, optimizer=cfg.optimizer,
                            after_step=loss_fn.clamp_ if extra else None, policy=self.recipe.policy)
        if metrics["nonfinite_steps"]:
            log.warning("client %d: %d local step(s) had a non-finite loss and were skipped", data.client_id,
                        int(metrics["nonfinite_steps"]))
        g = float(loss_fn.gamma.detach()) if loss_fn is not None else 0.0
        weights = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        extras = {"c_k": torch.tensor([c_k], dtype=torch.float32), "gamma": torch.tensor([g], dtype=torch.float32)}
        return ClientResult(data.client_id, len(data), weights, extras, dict(metrics, c_k=c_k, gamma=g))

    def _extras_problem(self, r: ClientResult) -> str | None:
        for key in ("c_k", "gamma"):
            t = r.extras.get(key)
            if t is None or t.numel() != 1 or not bool(torch.isfinite(t).all()):
                return f"'{key}' is missing or not a finite number"
        if float(r.extras["c_k"]) < 0:
            return "c_k is negative"
        return None

    def _applied_weights(self, good: list[ClientResult], round_cfg: RoundConfig | None) -> dict[str, Any] | None:
        """The per-class weights 1 + c_t the loss applied this round, for the clients of lowest, median and
        highest c_k (recomputed from what the server knows: c_f, the round's mean c_k and each c_k)."""
        if self.opts.loss != "dafl" or not round_cfg or "c_f" not in round_cfg:
            return None
        c_f = torch.tensor(round_cfg["c_f"])
        ranked = sorted(good, key=lambda r: float(r.extras["c_k"]))
        out: dict[str, Any] = {}
        for tag, r in (("min_c_k", ranked[0]), ("median_c_k", ranked[len(ranked) // 2]), ("max_c_k", ranked[-1])):
            c_k = float(r.extras["c_k"])
            w = 1 + loss_coefficients(c_k, c_f, self.opts.dafl_lambda, self.opts.dafl_scale, round_cfg.get("c_k_mean"),
                                      round_cfg.get("class_norm"))
            out[tag] = {"client": r.client_id, "c_k": c_k, "weights": [round(float(v), 4) for v in w],
                        "max_over_min": float(w.max() / w.min())}
        return out

    def server_update(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        good = check_results(state.weights, results, extra_check=self._extras_problem)
        meta = dict(state.meta, round=round_, dropped=[r.client_id for r in results if r not in good])
        if not good:
            log.warning("round %d: no usable client update; the global model is unchanged", round_)
            return GlobalState(state.weights, state.extras, meta)
        if self.opts.aggregation == "imbalance":
            omega = aggregation_weights([float(r.extras["c_k"]) for r in good])
        else:
            total = sum(r.num_samples for r in good)
            omega = [r.num_samples / total for r in good]
        weights = weighted_average([r.weights for r in good], omega)
        gamma = sum(w * float(r.extras["gamma"]) for w, r in zip(omega, good))
        gamma = min(max(gamma, 0.0), self.opts.gamma_max)
        extras = dict(state.extras, **{"dafl.gamma": torch.tensor([gamma], dtype=torch.float32)})
        meta["aggregation_weights"] = {str(r.client_id): w for r, w in zip(good, omega)}
        meta["class_weights"] = self._applied_weights(good, state.meta.get("last_round_cfg"))
        meta["gamma_history"] = list(meta.get("gamma_history", [])) + [gamma]
        return GlobalState(weights, extras, meta)

    def default_source_prior(self, state: GlobalState) -> np.ndarray:
        """The prior the uncalibrated posteriors describe. A class-weighted loss trains the model as if class t
        were w_t times as frequent, so its softmax describes the loss-weighted class mix Σ_k n_{k,t}·w_{k,t}
        (for the balanced weights, the uniform prior), not the training counts; focal and CE keep the counts."""
        table = state.meta.get("client_counts") or {}
        if self.opts.loss != "dafl" or not table:
            return super().default_source_prior(state)
        counts = torch.tensor([table[k] for k in sorted(table, key=int)], dtype=torch.float32)  # (K, C)
        c_f = class_imbalance(counts)
        c_ks = [client_imbalance(row) for row in counts]
        mean_c_k, norm = float(np.mean(c_ks)), class_normaliser(counts)
        mass = torch.zeros(counts.shape[1], dtype=torch.float64)
        for row, c_k in zip(counts, c_ks):
            w = 1 + loss_coefficients(c_k, c_f, self.opts.dafl_lambda, self.opts.dafl_scale, mean_c_k, norm)
            mass += row.to(torch.float64) * w.clamp_min(0).to(torch.float64)
        if not float(mass.sum()) > 0:
            return super().default_source_prior(state)
        return (mass / mass.sum()).numpy()

    def extra_report(self, state: GlobalState, outputs: dict[str, np.ndarray], test,
                     ranks: np.ndarray) -> dict[str, Any]:
        return {"loss": self.opts.loss, "aggregation": self.opts.aggregation, "dafl_scale": self.opts.dafl_scale,
                "class_weights_last_round": state.meta.get("class_weights"),
                "gamma": float(state.extras["dafl.gamma"].reshape(-1)[0]),
                "gamma_history": state.meta.get("gamma_history", [])}
