"""FedAvg's and FedProx's own settings (tafl.training.methods.fedavg); torch-free, so the command line and config
validation read them without the training stack."""

from __future__ import annotations

from dataclasses import dataclass

from tafl.training.contract import MethodConfig, register_config


@register_config("fedavg", "fedprox")
@dataclass
class FedAvgConfig(MethodConfig):
    """fedavg and fedprox"""

    mu: float = 0.01  # FedProx proximal coefficient
    # fedavg/fedprox: each client trains on logits + local_adjust·log(its own class shares), the logit-adjusted loss
    # (Menon et al. 2021) with the client's local mix, as FedLC (Zhang et al. 2022) calibrates label skew: a site
    # that never sees a class does not push it down, and the model learns balanced scores; 0: plain cross-entropy
    local_adjust: float = 0.0

    def check(self, run) -> None:
        for key in ("mu", "local_adjust"):
            if not getattr(self, key) >= 0:
                raise self.bad(key, "must be >= 0")

    def check_unused(self, run) -> None:
        if self.local_adjust:
            raise self.bad("local_adjust", f"applies to fedavg and fedprox, not {run.method}")

    def check_private(self, run) -> None:
        if self.local_adjust:
            raise self.bad("local_adjust", "the local logit adjustment reads the site's exact class counts: not "
                                           "with DP")
