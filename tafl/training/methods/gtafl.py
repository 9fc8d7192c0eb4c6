"""GTAFL and CReFF (DESIGN.md §4): expert heads retrained on the server from global federated features.

Client, every round: GI-GDS sampling weights from its local and the broadcast global class
counts; the mean CE gradient per local class w.r.t. every expert head, all experts from one
feature pass of the received extractor (eval mode); then FedAvg-style local training of the
extractor and the original head.
Server, every round: FedAvg of extractor, original head and BatchNorm statistics; per-class
mean of the expert gradients over the clients holding the class; gradient matching of each
expert's persistent GFF bank (m + λ·d_c features per class); retraining of every expert on its
bank; then SimCLR on the unlabeled server pool, refining the extractor the next round starts
from. Inference: the experts vote (hard, ties to the uniform expert).
CReFF is this code with one uniform expert and neither GI-GDS nor SimCLR. The switches `cr`,
`en`, `cl`, `gs` turn each part off for the ablation (the paper's Table IV).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from tafl.errors import ConfigError
from tafl.training import gff
from tafl.training.aggregate import check_results, weighted_average
from tafl.training.ensemble import ExpertEnsemble
from tafl.training.evaluate import evaluate_outputs, predict
from tafl.training.local import local_sgd
from tafl.training.longtail import ranks_from_counts
from tafl.training.methods.base import (SERVER, ClientData, ClientResult, GlobalState, Method, ProbsAndLabel,
                                        Tensors)
from tafl.training.models import build_model
from tafl.training.simclr import ProjectionHead, simclr_refine

log = logging.getLogger(__name__)


def gigds_class_weights(local_counts: torch.Tensor, global_counts: torch.Tensor, tau: float = 0.9,
                        eps: float = 1e-6) -> tuple[torch.Tensor, float]:
    """GI-GDS: w_c = α/(m_c+ε) + (1−α)/(M_c+ε), α = 1 if cos(local, global) < τ else 0."""
    m = local_counts.to(torch.float64)
    M = global_counts.to(torch.float64)
    s = float((m @ M) / (m.norm() * M.norm() + 1e-12))
    alpha = 1.0 if s < tau else 0.0
    return (alpha / (m + eps) + (1 - alpha) / (M + eps)).to(torch.float32), alpha


class GTAFL(Method):
    name = "gtafl"

    def __init__(self, cfg, model_cfg, preprocess, device="cpu"):
        super().__init__(cfg, model_cfg, preprocess, device)
        self.cr, self.en, self.cl, self.gs = self.switches(cfg)
        self.names = gff.EXPERT_NAMES if self.en else ("uniform",)
        self.pool: torch.Tensor | None = None

    @staticmethod
    def switches(cfg) -> tuple[bool, bool, bool, bool]:
        return cfg.cr, cfg.cr and cfg.en, cfg.cl, cfg.gs

    @property
    def output_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("probs", "label", "expert_labels", "expert_probs") if self.cr else ("probs", "label")

    def attach_server_pool(self, images_u8: torch.Tensor | None) -> None:
        self.pool = images_u8
        if self.cl and (images_u8 is None or len(images_u8) < 2):
            raise ConfigError("SimCLR (cl) needs an unlabeled server pool of at least 2 images")

    # ------------------------------------------------------------ state
    def init_state(self, train_counts: np.ndarray) -> GlobalState:
        state = super().init_state(train_counts)
        dim, num_classes = self.model.feature_dim, self.model_cfg.num_classes
        gen = self.generator(0, SERVER, 1)
        if self.cr:
            W, b = gff.init_heads(len(self.names), num_classes, dim, gen)
            state.extras.update({"expert.weight": W, "expert.bias": b})
        if self.cl:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            proj = ProjectionHead(dim, self.cfg.simclr_proj_dim)
            state.extras.update({f"proj.{k}": v.detach().clone() for k, v in proj.state_dict().items()})
        state.meta.update(experts=list(self.names) if self.cr else [], vote=self.cfg.vote,
                          switches={"cr": self.cr, "en": self.en, "cl": self.cl, "gs": self.gs}, gff_history=[])
        return state

    # ------------------------------------------------------------ steps
    def round_config(self, state: GlobalState, stats: dict[int, Tensors], round_: int) -> dict[str, Any]:
        self.record_counts(state, stats)
        return {"round": round_, "seed": self.cfg.seed,
                "global_counts": [float(v) for v in state.extras["global_counts"].tolist()]}

    def broadcast(self, state: GlobalState) -> Tensors:
        payload = dict(state.weights)
        if self.cr:  # the expert heads travel down; the GFF banks and projection head stay on the server
            payload.update({k: state.extras[k] for k in ("expert.weight", "expert.bias")})
        return payload

    def client_update(self, payload: Tensors, data: ClientData, round_cfg: dict[str, Any]) -> ClientResult:
        self.model.load_state_dict({k: v for k, v in payload.items() if not k.startswith("expert.")})
        gen = self.generator(round_cfg["round"], data.client_id)
        images, labels = data.images[data.indices], data.local_labels
        extras: Tensors = {}
        if self.cr:
            extras = self.expert_gradients(images, labels, payload["expert.weight"], payload["expert.bias"], gen)
        weights = None
        metrics: dict[str, float] = {}
        if self.gs:
            cw, alpha = gigds_class_weights(data.class_counts(), torch.tensor(round_cfg["global_counts"]),
                                            self.cfg.gs_tau)
            weights, metrics["gigds_alpha"] = cw[labels], alpha
        cfg = self.cfg
        metrics.update(local_sgd(self.model, images, labels, normalize=self.normalize, epochs=cfg.local_epochs,
                                 batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
                                 weight_decay=cfg.weight_decay, gen=gen, augment=cfg.augment,
                                 sample_weights=weights, optimizer=cfg.optimizer))
        state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return ClientResult(data.client_id, len(data), state, extras, metrics)

    @torch.no_grad()
    def expert_gradients(self, images: torch.Tensor, labels: torch.Tensor, W: torch.Tensor, b: torch.Tensor,
                         gen: torch.Generator) -> Tensors:
        """Per local class, the mean CE gradient w.r.t. every expert on up to `grad_samples` samples."""
        classes = torch.unique(labels)
        pick = []
        for c in classes:
            idx = torch.nonzero(labels == c).squeeze(1)
            pick.append(idx[torch.randperm(len(idx), generator=gen)[: self.cfg.grad_samples]])
        idx = torch.cat(pick)
        self.model.eval()
        feats = self.model.features(self.normalize(images[idx])).float().cpu()  # one pass for all experts
        W, b = self.match_heads(W.float(), b.float())
        gW, gb = gff.class_head_gradients(feats, labels[idx], W, b, classes)
        return {"grad_classes": classes.to(torch.int64), "grad_w": gW, "grad_b": gb}

    def match_heads(self, W: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads gradients are taken at: each expert's own, or the uniform expert's for all."""
        if self.cfg.match_head == "own" or "uniform" not in self.names:
            return W, b
        u = self.names.index("uniform")
        return W[u:u + 1].expand_as(W).contiguous(), b[u:u + 1].expand_as(b).contiguous()

    def _grads_problem(self, r: ClientResult) -> str | None:
        if not self.cr:
            return None
        e = r.extras
        if not all(k in e for k in ("grad_classes", "grad_w", "grad_b")):
            return "expert gradients are missing"
        cls, gW, gb = e["grad_classes"], e["grad_w"], e["grad_b"]
        E, C, D = len(self.names), self.model_cfg.num_classes, self.model.feature_dim
        L = len(cls)
        if cls.dtype != torch.int64 or cls.ndim != 1 or L == 0 or int(cls.min()) < 0 or int(cls.max()) >= C \
                or len(torch.unique(cls)) != L:
            return f"grad_classes {cls.tolist()[:10]} are not distinct class indices in [0, {C})"
        if tuple(gW.shape) != (L, E, C, D) or tuple(gb.shape) != (L, E, C):
            return f"expert gradients have shapes {tuple(gW.shape)}, {tuple(gb.shape)}; expected {(L, E, C, D)}, {(L, E, C)}"
        if not bool(torch.isfinite(gW).all() and torch.isfinite(gb).all()):
            return "expert gradients contain NaN or Inf"
        return None

    def server_update(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        timing: dict[str, float] = {}
        t0 = time.perf_counter()
        good = check_results(state.weights, results, extra_check=self._grads_problem)
        meta = dict(state.meta, round=round_, dropped=[r.client_id for r in results if r not in good])
        extras = dict(state.extras)
        if not good:
            log.warning("round %d: no usable client update; the global model is unchanged", round_)
            meta["round_timing"] = {}
            return GlobalState(state.weights, extras, meta)
        weights = weighted_average([r.weights for r in good], [r.num_samples for r in good])
        timing["aggregate_s"] = time.perf_counter() - t0
        if self.cr:
            self._retrain_experts(extras, meta, good, round_, timing)
        if self.cl and round_ % self.cfg.simclr_every == 0 and self.cfg.simclr_steps > 0:
            t0 = time.perf_counter()
            weights, meta["simclr_loss"] = self._simclr(weights, extras, round_)
            timing["simclr_s"] = time.perf_counter() - t0
        meta["round_timing"] = timing
        return GlobalState(weights, extras, meta)

    def _retrain_experts(self, extras: Tensors, meta: dict[str, Any], good: list[ClientResult], round_: int,
                         timing: dict[str, float]) -> None:
        t0 = time.perf_counter()
        C, E, D = self.model_cfg.num_classes, len(self.names), self.model.feature_dim
        sum_w, sum_b, n = torch.zeros(C, E, C, D), torch.zeros(C, E, C), torch.zeros(C)
        for r in good:  # per class, the plain mean over the clients holding it
            cls = r.extras["grad_classes"]
            sum_w[cls] += r.extras["grad_w"].float()
            sum_b[cls] += r.extras["grad_b"].float()
            n[cls] += 1
        have = n > 0
        gW_real = (sum_w / n.clamp_min(1)[:, None, None, None]).permute(1, 0, 2, 3)  # (E, C, C, D)
        gb_real = (sum_b / n.clamp_min(1)[:, None, None]).permute(1, 0, 2)  # (E, C, C)
        absent = torch.nonzero(~have).squeeze(1).tolist()
        if absent:
            log.info("round %d: class(es) %s held by no participating client; their GFF banks are kept", round_, absent)
        global_counts = extras["global_counts"].numpy()
        counts = gff.expert_counts(self.names, global_counts, ranks_from_counts(global_counts), self.cfg.gff_m,
                                   self.cfg.gff_lambda)
        gen = self.generator(round_, SERVER, 2)
        if "gff.features" in extras:
            banks = gff.GFFBanks(extras["gff.features"], extras["gff.counts"])
            if not torch.equal(banks.counts, torch.as_tensor(counts)):
                banks = banks.resized(counts, gen)
        else:
            banks = gff.GFFBanks.create(counts, D, gen)
        W, b = extras["expert.weight"], extras["expert.bias"]
        timing["aggregate_s"] = timing.get("aggregate_s", 0.0) + time.perf_counter() - t0
        t0 = time.perf_counter()
        losses = gff.match(banks, *self.match_heads(W, b), gW_real, gb_real, have, self.cfg.match_steps,
                           self.cfg.match_lr)
        timing["gff_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.cfg.expert_init == "fresh":
            W, b = gff.init_heads(E, C, D, gen)
        W, b, ce = gff.retrain(banks, W, b, self.cfg.retrain_epochs, self.cfg.retrain_lr, self.cfg.retrain_batch, gen)
        timing["retrain_s"] = time.perf_counter() - t0
        extras.update({"expert.weight": W, "expert.bias": b, "gff.features": banks.features, "gff.counts": banks.counts})
        meta["gff_history"] = list(meta.get("gff_history", [])) + [
            {"round": round_, "match_before": losses[0], "match_after": losses[-1], "retrain_ce": ce,
             "absent_classes": absent}]

    def _simclr(self, weights: Tensors, extras: Tensors, round_: int) -> tuple[Tensors, float]:
        self.model.load_state_dict(weights)
        proj = ProjectionHead(self.model.feature_dim, self.cfg.simclr_proj_dim).to(self.device)
        proj.load_state_dict({k[len("proj."):]: v for k, v in extras.items() if k.startswith("proj.")})
        loss = simclr_refine(self.model.extractor, proj, self.pool, self.normalize, steps=self.cfg.simclr_steps,
                             batch=self.cfg.simclr_batch, lr=self.cfg.simclr_lr, tau=self.cfg.simclr_tau,
                             gen=self.generator(round_, SERVER, 3))
        extras.update({f"proj.{k}": v.detach().cpu().clone() for k, v in proj.state_dict().items()})
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}, loss

    # ------------------------------------------------------------ inference and report
    def inference_model(self, state: GlobalState) -> nn.Module:
        model = build_model(self.model_cfg)
        model.load_state_dict(state.weights)
        if not self.cr:
            return ProbsAndLabel(model).eval()
        return ExpertEnsemble(model.extractor, state.extras["expert.weight"], state.extras["expert.bias"],
                              tuple(state.meta.get("experts") or self.names), state.meta.get("vote", self.cfg.vote)).eval()

    def extra_report(self, state: GlobalState, outputs: dict[str, np.ndarray], test, ranks: np.ndarray) -> dict[str, Any]:
        rep: dict[str, Any] = {"switches": state.meta.get("switches"), "vote": state.meta.get("vote"),
                               "simclr_pool": (self.cfg.simclr_pool + (" (transductive)" if self.cfg.simclr_pool == "test"
                                                                        else "")) if self.cl else None,
                               "gff_history": state.meta.get("gff_history", [])}
        if self.cr and "expert_labels" in outputs:
            names = list(state.meta.get("experts") or self.names)
            rep["experts"] = {}
            for e, name in enumerate(names):
                ev = evaluate_outputs(outputs["expert_probs"][:, e], outputs["expert_labels"][:, e], test.labels, ranks,
                                      self.cfg.test_seed)
                rep["experts"][name] = ev["test_distributions"]
            model = build_model(self.model_cfg)
            model.load_state_dict(state.weights)
            head = predict(ProbsAndLabel(model).to(self.device), test.images, self.normalize, self.cfg.eval_batch_size)
            rep["experts"]["original_head"] = evaluate_outputs(head["probs"], head["label"], test.labels, ranks,
                                                               self.cfg.test_seed)["test_distributions"]
        return rep


class CReFF(GTAFL):
    """CReFF (Shang et al., IJCAI 2022): one uniform expert, no GI-GDS, no SimCLR."""

    name = "creff"

    @staticmethod
    def switches(cfg) -> tuple[bool, bool, bool, bool]:
        return True, False, False, False
