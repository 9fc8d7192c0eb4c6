"""`ClassifierMethod`: the shared torch implementation of the contract's steps (tafl.training.contract) for a method
that trains one `Classifier`; FedAvg, FedProx, GTAFL, CReFF, ViT-DAFL and LDA extend it. It composes the parts the
methods share (tafl.training.methods.dp, head_basis, recipe, calibration) instead of inheriting them. `ProbsAndLabel`
is the plain inference module.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from tafl.errors import ConfigError
from tafl.imaging import Preprocess
from tafl.training.aggregate import weighted_average
from tafl.training.config import RunConfig
from tafl.training.contract import ClientData, ClientResult, GlobalState, Method, MethodConfig, RoundConfig, Tensors
from tafl.training.methods.calibration import CalibrationClient
from tafl.training.methods.detector import DomainStatsClient
from tafl.training.methods.sets import SetsClient
from tafl.training.methods.dp import ClientPrivacy
from tafl.training.methods.head_basis import FeatureCache, HeadBasis
from tafl.training.methods.recipe import LocalRecipe
from tafl.training.models import Classifier, ModelConfig, build_model

log = logging.getLogger(__name__)

SERVER = 1 << 20  # the id server-side random streams use in place of a client id


class ClassifierMethod(Method):
    """FedAvg-style training of one `Classifier`: the shared implementation of the contract's steps, composed of
    parts rather than inherited: `privacy` (record-level DP: plans, noise, the noisy census), `features` (the fixed
    extractor's cached features), `basis` (the server's head basis for `train_scope: head`), `recipe` (the local
    training: SGD or DP-SGD, whole model or head step), `calibration` (the client side of the calibration rounds) and
    `domain_stats` (the client side of the in-domain detector's statistics round), `sets` (the conformal
    sets' statistics round).
    Subclasses define `client_update` and `server_update` and override the steps they change."""

    name = "base"
    trains = True  # the sites train weights and report their local loss (lda: they only send class sums)
    opts_type: type[MethodConfig] = MethodConfig  # the method's own settings' class (`self.opts`, typed)

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, preprocess: Preprocess,
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.preprocess = preprocess
        self.opts = cfg.settings_of(self.opts_type)  # this run's values of the method's own settings
        self.device = torch.device(device)
        self.model: Classifier = build_model(model_cfg).to(self.device)  # the one working copy
        self.mean = torch.tensor(preprocess.mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(preprocess.std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.pool: torch.Tensor | None = None  # the server's unlabeled images (attach_server_pool)
        self.privacy = ClientPrivacy(cfg)
        self.dp = self.privacy.enabled  # record-level DP (tafl.training.privacy)
        self.features = FeatureCache(cfg, self.model, self.normalize)
        self.basis = HeadBasis(cfg, self.model, self.features)
        self.recipe = LocalRecipe(cfg, model_cfg, self.model, self.normalize, self.privacy, self.features)
        self.calibration = CalibrationClient(self)
        self.domain_stats = DomainStatsClient(self)
        self.sets = SetsClient(self)

    # ---- state ----
    def init_state(self, train_counts: np.ndarray) -> GlobalState:
        torch.manual_seed(self.cfg.seed)
        model = build_model(self.model_cfg, pretrained=self.cfg.pretrained)
        pretraining = self.pretrain(model)
        meta: dict[str, Any] = {"round": 0, "client_counts": {}}
        if pretraining:
            meta["pretraining"] = pretraining
        return GlobalState(weights={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                           extras={"global_counts": torch.zeros(len(train_counts))}, meta=meta)

    # ---- the steps ----
    def client_stats(self, data: ClientData) -> Tensors:
        """The client's class counts (C,): exact, or under DP its one noisy census release (`ClientPrivacy.census`),
        the same each time the server asks."""
        if not self.dp:
            return {"class_counts": data.class_counts().to(torch.float32)}
        return {"class_counts": self.privacy.census(data)}

    def round_config(self, state: GlobalState, stats: dict[int, Tensors], round_: int) -> RoundConfig:
        self.record_counts(state, stats)
        return {"round": round_, "seed": self.cfg.seed}

    def record_counts(self, state: GlobalState, stats: dict[int, Tensors]) -> None:
        """Keep each client's latest class counts; the global counts are their sum.

        Round 0 is the census every transport runs before training: all clients report.
        """
        table = state.meta.setdefault("client_counts", {})
        for k, s in stats.items():
            counts = s.get("class_counts")
            if counts is None or counts.shape != state.extras["global_counts"].shape or \
                    not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
                log.warning("client %s sent unusable class counts; ignored", k)
                continue
            table[str(k)] = [float(v) for v in counts.tolist()]
        if table:
            state.extras["global_counts"] = torch.tensor(np.sum(list(table.values()), axis=0), dtype=torch.float32)

    def broadcast(self, state: GlobalState) -> Tensors:
        return state.weights

    def head_basis(self, state: GlobalState) -> Tensors:
        """With `train_scope: head`, what a training round's payload adds (`HeadBasis.payload`); empty otherwise."""
        return self.basis.payload(state, self.pool)

    def scoped(self, weights: Tensors) -> Tensors:
        """The tensors a site's model update carries: all of them, or with `train_scope: head` only the classifier
        head's (the rest is the server's own, unchanged by the site: sending it would only cost the uplink)."""
        if self.cfg.train_scope != "head":
            return weights
        return {k: v for k, v in weights.items() if k.startswith("head.")}

    def local_update(self) -> Tensors:
        """The trained model's tensors this site sends (`scoped`), copied off the training device."""
        return {k: v.detach().cpu().clone() for k, v in self.scoped(self.model.state_dict()).items()}

    def aggregate_update(self, state: GlobalState, good: list[ClientResult]) -> Tensors:
        """FedAvg's weighted mean of the sites' updates over the tensors they send; the rest stays the server's."""
        avg = weighted_average([self.scoped(r.weights) for r in good], [r.num_samples for r in good])
        return {k: avg.get(k, v) for k, v in state.weights.items()}

    # ---- inference ----
    def inference_model(self, state: GlobalState) -> nn.Module:
        """A module mapping a normalised batch to {"probs": (B, C), "label": (B,)}; the label at the run's
        operating point where one was chosen on validation (tafl.training.decision)."""
        from tafl.errors import CheckpointError
        from tafl.training.decision import check_record

        try:
            offset = check_record(state.meta.get("decision"), self.model_cfg.num_classes)
        except ValueError as exc:
            raise CheckpointError(f"the checkpoint's operating point is unusable: {exc}") from None
        model = build_model(self.model_cfg)
        model.load_state_dict(state.weights)
        return ProbsAndLabel(model, offset).eval()

    def choose_operating_point(self, state: GlobalState, images: np.ndarray, labels: np.ndarray,
                               batch_size: int) -> GlobalState:
        """The plain decision's τ (tafl.training.decision) on the validation split, recorded in the state's meta:
        the report, `tafl eval` and the package all decide with it."""
        from tafl.training.decision import select_operating_point
        from tafl.training.evaluate import predict

        module = self.inference_model(state).to(self.device)
        out = predict(module, images, self.normalize, batch_size, keys=("logits",))
        rec = select_operating_point(out["logits"], labels, self.default_source_prior(state),
                                     criterion=self.cfg.decision_criterion, ranks=self.training_ranks(state))
        return GlobalState(state.weights, state.extras, dict(state.meta, decision=rec))

    def attach_server_pool(self, images_u8: torch.Tensor | None) -> None:
        """Unlabeled server-side images: the extractor's pre-training (`pretrain_steps`) and GTAFL's SimCLR."""
        self.pool = images_u8
        if self.cfg.pretrain_steps and (images_u8 is None or len(images_u8) < 2):
            raise ConfigError("--pretrain-steps needs an unlabeled server pool of at least 2 images (simclr_pool)")

    def pretrain(self, model: Classifier) -> dict[str, Any]:
        """`pretrain_steps` of SimCLR on the server's unlabeled pool, before round 1, on `model`'s extractor in
        place: data that spend no site's privacy budget (docs/decisions.md, "The head under DP"). Returns what the report records."""
        from tafl.training.simclr import ProjectionHead, simclr_refine

        cfg = self.cfg
        if not cfg.pretrain_steps:
            return {}
        gen = self.generator(0, SERVER, 4)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # the projection head's init
        proj = ProjectionHead(model.feature_dim, cfg.simclr_proj_dim).to(self.device)
        model.to(self.device)
        t0 = time.perf_counter()
        loss = simclr_refine(model.extractor, proj, self.pool, self.normalize, steps=cfg.pretrain_steps,
                             batch=cfg.simclr_batch, lr=cfg.pretrain_lr, tau=cfg.simclr_tau, gen=gen)
        log.info("pre-trained the extractor on the server's %d unlabeled images: %d SimCLR steps, loss %.3f, %.0f s",
                 len(self.pool), cfg.pretrain_steps, loss, time.perf_counter() - t0)
        return {"steps": int(cfg.pretrain_steps), "pool": cfg.simclr_pool, "images": int(len(self.pool)),
                "loss": float(loss), "seconds": round(time.perf_counter() - t0, 1)}

    # ---- calibration and prior adaptation (tafl.prior) ----
    # ---- calibration and prior adaptation (tafl.prior) ----
    def posterior_module(self, payload: Tensors) -> nn.Module:
        """The module whose outputs `posterior_logits` turns into the logits calibration works on."""
        keys = set(self.model.state_dict())
        self.model.load_state_dict({k: v for k, v in payload.items() if k in keys})
        return ProbsAndLabel(self.model).eval()

    def default_source_prior(self, state: GlobalState) -> np.ndarray:
        """The prior the uncalibrated posteriors describe: the training data's class mix."""
        counts = state.extras["global_counts"].numpy().astype(np.float64)
        return counts / counts.sum() if counts.sum() > 0 else np.full(len(counts), 1.0 / len(counts))

    def training_ranks(self, state: GlobalState) -> np.ndarray:
        """(C,) the training classes' frequency ranks (0 the most frequent): how the eleven case mixes are ranked."""
        from tafl.training.longtail import ranks_from_counts

        return ranks_from_counts(state.extras["global_counts"].numpy().astype(np.float64))

    # ---- helpers ----
    def normalize(self, batch_u8: torch.Tensor) -> torch.Tensor:
        """uint8 (B, H, W, C) -> float (B, C, H, W), the same formula as Preprocess.normalize."""
        x = batch_u8.to(self.device).permute(0, 3, 1, 2).to(torch.float32) / 255.0
        return (x - self.mean) / self.std

    def generator(self, round_: int, client_id: int, stream: int = 0) -> torch.Generator:
        seed = int(np.random.SeedSequence([self.cfg.seed, round_, client_id, stream]).generate_state(1)[0])
        return torch.Generator().manual_seed(seed)


class ProbsAndLabel(nn.Module):
    """logits, softmax probabilities and the label: argmax(logits + offset), offset the operating point's
    (tafl.training.decision; None: the plain argmax). The probabilities never carry the offset."""

    def __init__(self, model: nn.Module, offset: np.ndarray | None = None):
        super().__init__()
        self.model = model
        self.offset = None if offset is None else torch.as_tensor(np.asarray(offset), dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(x)  # (B, C)
        decide = logits if self.offset is None else logits + self.offset.to(logits.device)
        return {"logits": logits, "probs": torch.softmax(logits, dim=1), "label": decide.argmax(dim=1)}
