"""ViT-DAFL's own settings (tafl.training.methods.dafl, docs/design.md, "ViT-DAFL") and what it needs of the shared ones;
torch-free, so the command line and config validation read them without the training stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tafl.training.contract import MethodConfig, register_config


@register_config("dafl")
@dataclass
class DAFLConfig(MethodConfig):
    """dafl"""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "loss": ("dafl", "focal", "ce"),
        "dafl_scale": ("mean", "paper"),
        "aggregation": ("imbalance", "size"),
    }

    loss: str = "dafl"  # dafl | focal | ce (the loss ablation)
    gamma_init: float = 2.0  # focusing parameter γ at the start (learnable for dafl unless gamma_fixed)
    gamma_fixed: bool = False  # keep γ at gamma_init instead of learning it
    gamma_max: float = 5.0  # learnable γ is clamped to [0, gamma_max] (unclamped it grows without bound)
    dafl_lambda: float = 0.5  # λ in c_{f,t} = λ·c_k + (1 − λ)·c_{f,t}
    # scale of the two DAFL terms: mean (c_k over the mean of the round's clients' c_k, c_{f,t} over its mean
    # across classes: both near 1, docs/design.md, "A ViT that trains from scratch") | paper (the literal counts ratios, c ≈ 100 on DermaMNIST)
    dafl_scale: str = "mean"
    aggregation: str = "imbalance"  # imbalance: ω_k ∝ 1/(c_k + ε); size: FedAvg's sample-count weights

    def check(self, run) -> None:
        if not 0 <= self.dafl_lambda <= 1:
            raise self.bad("dafl_lambda", "must be in [0, 1]")
        if not 0 <= self.gamma_init <= self.gamma_max:
            raise self.bad("gamma_init", f"must be in [0, gamma_max={self.gamma_max}]")

    def default_train_scope(self, private: bool) -> str:
        return "all"  # ViT-DAFL trains its whole network with its own loss, private or not (check_private refuses DP)

    def check_run(self, run) -> None:
        if run.train_scope == "head":
            raise run.bad("train_scope", "ViT-DAFL trains its whole network with its own loss; the head-only scope "
                                         "is for fedavg, fedprox, creff and gtafl")
        if run.secure_aggregation:
            raise run.bad("secure_aggregation", "ViT-DAFL weights each site by its own class counts, which a sum "
                                                "cannot give: use fedavg, fedprox, creff or gtafl")

    def check_private(self, run) -> None:
        raise run.bad("dp_epsilon", f"differential privacy is not supported for method '{run.method}': ViT-DAFL's "
                                    "learnable focal loss and per-client class weights have no per-image bound here; "
                                    "use fedavg, fedprox, creff or gtafl")

    def divergence_hint(self, run) -> str:
        if self.dafl_scale == "paper" and self.loss == "dafl":
            return " (with --dafl-scale paper the loss is ~100x cross-entropy: try --dafl-scale mean)"
        return ""
