"""What method lda (tafl.training.methods.lda) needs of the shared settings; it has no settings of its own.
Torch-free, so config validation reads it without the training stack."""

from __future__ import annotations

from dataclasses import dataclass

from tafl.training.contract import MethodConfig, register_config


@register_config("lda")
@dataclass
class LDAConfig(MethodConfig):
    """lda"""

    def default_train_scope(self, private: bool) -> str:
        return "head"  # the head is fitted from the fixed extractor's features, private or not

    def check_run(self, run) -> None:
        if run.train_scope != "head":
            raise run.bad("train_scope", "lda fits the head from class sums of the fixed extractor's features: it "
                                         "needs train_scope head (leave it unset)")
        if run.secure_aggregation and run.frac < 1:
            raise run.bad("frac", "lda under SecAgg+ fits from one secure sum, which must hold every site: use "
                                  "--frac 1 --rounds 1")
        if run.secure_aggregation and run.rounds != 1:
            raise run.bad("rounds", "lda under SecAgg+ sums each site's one release once: a second sum over a "
                                    "different set of sites would give a site's share away by differencing; use "
                                    "--rounds 1")
