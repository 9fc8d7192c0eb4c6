"""The local training recipe the methods share, as a part a method composes: the round's learning rate, the
augmentation policy, and local SGD, or DP-SGD under record-level DP, on the whole model or, with `train_scope: head`,
on a `BasisHead` step in the server's basis over the fixed extractor's cached features."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tafl.training.config import RunConfig
from tafl.training.contract import ClientData, Tensors
from tafl.training.methods.dp import ClientPrivacy
from tafl.training.methods.head_basis import BasisHead, FeatureCache, as_float
from tafl.training.models import Classifier, ModelConfig


class LocalRecipe:
    """One method's local training; `model` is the method's working copy, trained in place."""

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, model: Classifier,
                 normalize: Callable[[torch.Tensor], torch.Tensor], privacy: ClientPrivacy, features: FeatureCache):
        self.cfg, self.model_cfg, self.model, self.normalize = cfg, model_cfg, model, normalize
        self.privacy, self.features = privacy, features
        self._policy = None

    def lr(self, round_: int) -> float:
        """This round's local learning rate (cfg.lr under cfg.lr_schedule and cfg.warmup_rounds)."""
        from tafl.training.local import scheduled_lr

        return scheduled_lr(self.cfg.lr, int(round_), self.cfg.rounds, self.cfg.lr_schedule, self.cfg.warmup_rounds)

    @property
    def policy(self):
        """The augmentation policy applied to uint8 batches before normalising, or None."""
        if self.cfg.augment_policy == "none":
            return None
        if self._policy is None:
            from tafl.training.local import PolicyAugment

            self._policy = PolicyAugment(self.cfg.augment_policy, self.model_cfg.in_chans)
        return self._policy

    def train(self, images: torch.Tensor, labels: torch.Tensor, data: ClientData, round_: int,
              gen: torch.Generator, basis: Tensors | None = None, **kw: Any) -> dict[str, float]:
        """Local SGD, or DP-SGD when the run is private (its noise multiplier from this client's plan), on the whole
        model or, with `train_scope: head`, on a `BasisHead` step in the server's `basis` (from the round's payload:
        `split_basis`). images: uint8 (n, H, W, C), labels: int64 (n,). `kw`: sample_weights, prox_mu, prox_ref,
        loss_fn. Returns the step counts and (without DP) the mean loss."""
        from tafl.training.local import dp_local_sgd, local_sgd

        cfg = self.cfg
        common = dict(normalize=self.normalize, epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                      lr=self.lr(round_), momentum=cfg.momentum, weight_decay=cfg.weight_decay, gen=gen,
                      augment=cfg.augment, optimizer=cfg.optimizer, policy=self.policy)
        model: nn.Module = self.model
        if cfg.train_scope == "head":
            if basis is None:
                raise ValueError("train_scope 'head' needs the server's head basis in the payload")
            model, images = BasisHead.start(self.model.head, self.features(data.client_id, images), basis)
            common.update(normalize=as_float, augment=False, policy=None)
            if kw.get("prox_ref") is not None:  # FedProx pulls the head toward the round's: the step toward zero
                kw["prox_ref"] = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        dp = self.privacy.enabled
        if not dp:
            out = local_sgd(model, images, labels, **common, **kw)
        else:
            if kw.get("sample_weights") is not None or kw.get("loss_fn") is not None:
                raise ValueError("DP-SGD samples uniformly with the plain cross-entropy (the config refuses the rest)")
            plan = self.privacy.plan(len(data))
            out = dp_local_sgd(model, images, labels, **common, noise_gen=self.privacy.noise,
                               noise_multiplier=plan.noise_multiplier, max_grad_norm=plan.clip,
                               sample_rate=plan.sample_rate, prox_mu=kw.get("prox_mu", 0.0),
                               prox_ref=kw.get("prox_ref"))
        if isinstance(model, BasisHead):
            model.finish(self.model.head)
        if not dp:
            return out
        out.pop("loss", None)  # the site's training loss is not covered by the accountant: it stays on the site
        return out
