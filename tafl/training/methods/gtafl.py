"""GTAFL and CReFF (docs/design.md, "GTAFL"): expert heads retrained on the server from global federated features.

Client, every round: GI-GDS sampling weights from its local and the broadcast global class
counts; the mean CE gradient per local class w.r.t. every expert head, all experts from one
feature pass of the received extractor (eval mode); then FedAvg-style local training of the
extractor and the original head.
The same pass also gives per-class feature sums, sums of squares and counts (the class
statistics), which travel with the gradients.
Server, every round: FedAvg of extractor, original head and BatchNorm statistics; per-class
mean of the expert gradients over the clients holding the class; exact per-class feature mean
μ_c and spread σ_c from the statistics; the experts are retrained in a frame centred at κ, the
class-balanced mean of the μ_c (the clients' gradients are converted exactly), so heads trained
on zero-mean N(0, 1) GFF banks (m + λ·d_c features per class, persistent, gradient-matched)
meet the real features' common mean at test time (docs/decisions.md, "GTAFL's experts"); then SimCLR on the
unlabeled server pool every few rounds. After the last round a features-only finishing round
retrains the experts at the final extractor. Inference: the experts vote.
CReFF is this code with one uniform expert, the raw frame, no finishing round and neither
GI-GDS nor SimCLR (`--gff-centre --final-round-frac 1` makes it the "CReFF + statistics"
ablation; `bank_init: stats` draws banks from N(μ_c, diag σ_c²), measured worse). The switches `cr`,
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
from tafl.training.aggregate import check_results
from tafl.training.ensemble import ExpertEnsemble, learn_vote_weights, vote_rule_accuracies, vote_weights
from tafl.training.evaluate import evaluate_outputs, predict
from tafl.training.longtail import DISTRIBUTIONS, distribution_prior, ranks_from_counts
from tafl.training.contract import ClientData, ClientResult, GlobalState, RoundConfig, Tensors, register_method
from tafl.training.methods.base import SERVER, ClassifierMethod, ProbsAndLabel
from tafl.training.methods.gtafl_config import GTAFLConfig
from tafl.training.methods.head_basis import split_basis
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


@register_method("gtafl")
class GTAFL(ClassifierMethod):
    name = "gtafl"
    opts_type = GTAFLConfig
    opts: GTAFLConfig

    def __init__(self, cfg, model_cfg, preprocess, device="cpu"):
        super().__init__(cfg, model_cfg, preprocess, device)
        self.cr, self.en, self.cl, self.gs = self.opts.switches(self.name)
        self.names = gff.EXPERT_NAMES if self.en else ("uniform",)
        self.pool: torch.Tensor | None = None
        published = self.name == "creff"  # CReFF keeps the paper's setting: raw frame, 300 epochs, no finishing round
        self.bank_init = self.opts.bank_init
        self.retrain_epochs = self.opts.retrain_epochs or (300 if published else 100)
        self.centred = self.cr and (self.opts.gff_centre if self.opts.gff_centre is not None else not published)
        self.uses_stats = self.cr and (self.bank_init == "stats" or self.centred)
        self.bank_anchor = self.opts.bank_anchor if self.cr and self.bank_init == "stats" else "none"
        frac = self.opts.final_round_frac
        self.final_frac = (0.0 if published else 1.0) if frac is None else frac
        # under DP: one release of expert gradients (and class statistics) a round, and one in the finishing round
        self.privacy.releases = (1 if self.cr else 0), (1 if self.cr and self.final_frac > 0 else 0)

    @property
    def output_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("probs", "label", "expert_labels", "expert_probs") if self.cr else ("probs", "label")

    def attach_server_pool(self, images_u8: torch.Tensor | None) -> None:
        super().attach_server_pool(images_u8)
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
        if self.uses_stats:  # the latest per-class feature statistics; count 0 = never reported yet
            state.extras.update({"stats.mean": torch.zeros(num_classes, dim), "stats.std": torch.ones(num_classes, dim),
                                 "stats.count": torch.zeros(num_classes)})
        if self.cl:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            proj = ProjectionHead(dim, self.cfg.simclr_proj_dim)
            state.extras.update({f"proj.{k}": v.detach().clone() for k, v in proj.state_dict().items()})
        state.meta.update(experts=list(self.names) if self.cr else [], vote=self.opts.vote,
                          switches={"cr": self.cr, "en": self.en, "cl": self.cl, "gs": self.gs}, gff_history=[],
                          banks={"init": self.bank_init, "anchor": self.bank_anchor, "centred": self.centred}
                          if self.cr else None)
        return state

    # ------------------------------------------------------------ steps
    def round_config(self, state: GlobalState, stats: dict[int, Tensors], round_: int) -> RoundConfig:
        self.record_counts(state, stats)
        return {"round": round_, "seed": self.cfg.seed,
                "global_counts": [float(v) for v in state.extras["global_counts"].tolist()]}

    def broadcast(self, state: GlobalState) -> Tensors:
        payload = dict(state.weights)
        if self.cr:  # the expert heads travel down; the GFF banks and projection head stay on the server
            payload.update({k: state.extras[k] for k in ("expert.weight", "expert.bias")})
        return payload

    def client_update(self, payload: Tensors, data: ClientData, round_cfg: RoundConfig) -> ClientResult:
        if round_cfg.get("calibrate"):  # the calibration rounds after training: no local training
            return self.calibration.update(payload, data, round_cfg)
        if round_cfg.get("domain_stats"):  # the in-domain detector's statistics round: no local training
            return self.domain_stats.update(payload, data, round_cfg)
        if round_cfg.get("conformal_stats") is not None:  # the conformal sets' statistics round: no training
            return self.sets.update(payload, data, round_cfg)
        payload, basis = split_basis(payload)
        self.model.load_state_dict({k: v for k, v in payload.items() if not k.startswith("expert.")})
        gen = self.generator(round_cfg["round"], data.client_id)
        images, labels = data.images[data.indices], data.local_labels
        extras: Tensors = {}
        if self.cr:
            extras = self.expert_gradients(images, labels, payload["expert.weight"], payload["expert.bias"], gen)
        if round_cfg.get("features_only"):  # the finishing round: one feature pass, no local training
            return ClientResult(data.client_id, len(data), {}, extras,
                                {"features_only": 1.0, **({"dp_releases": 1.0} if self.dp else {})})
        weights = None
        metrics: dict[str, float] = {"dp_releases": 1.0} if self.dp and self.cr else {}
        if self.gs:
            cw, alpha = gigds_class_weights(data.class_counts(), torch.tensor(round_cfg["global_counts"]),
                                            self.opts.gs_tau)
            weights, metrics["gigds_alpha"] = cw[labels], alpha
        metrics.update(self.recipe.train(images, labels, data, round_cfg["round"], gen, basis, sample_weights=weights))
        return ClientResult(data.client_id, len(data), self.local_update(), extras, metrics)

    def gradient_sample(self, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Up to `grad_samples` local rows per class (indices into `labels`), drawn with `gen`."""
        pick = []
        for c in torch.unique(labels):
            idx = torch.nonzero(labels == c).squeeze(1)
            pick.append(idx[torch.randperm(len(idx), generator=gen)[: self.opts.grad_samples]])
        return torch.cat(pick)

    @torch.no_grad()
    def expert_gradients(self, images: torch.Tensor, labels: torch.Tensor, W: torch.Tensor, b: torch.Tensor,
                         gen: torch.Generator) -> Tensors:
        """Per local class, the mean CE gradient w.r.t. every expert on up to `grad_samples` samples,
        and (when the banks use them) the class statistics of the same features."""
        idx = self.gradient_sample(labels, gen)
        self.model.eval()
        feats = self.model.features(self.normalize(images[idx])).float().cpu()  # one pass for all experts
        if self.dp:
            return self.private_feature_extras(feats, labels[idx], W, b, len(labels))
        return self.feature_extras(feats, labels[idx], W, b)

    def private_feature_extras(self, feats: torch.Tensor, labels: torch.Tensor, W: torch.Tensor, b: torch.Tensor,
                               n: int) -> Tensors:
        """`feature_extras` under record-level DP (tafl.training.privacy): every feature clipped to norm F; per
        class (all C: which classes a site holds is private too) the sums of the per-image head gradients, of the
        features, of their squares and the count, released together as one Gaussian mechanism; then, on the noisy
        release only (post-processing), the classes whose noisy count stands MIN_COUNT_SIGMAS σ above zero are
        sent as means and whole counts, with the sum of squares raised to what the sum requires."""
        from tafl.training.privacy import MIN_COUNT_SIGMAS, clip_rows, gaussian_release

        plan = self.privacy.plan(n)
        F_ = plan.feature_clip * feats.shape[1] ** 0.5  # the bound is per √D
        feats = clip_rows(feats.double(), F_)
        C = self.model_cfg.num_classes
        Wm, bm = self.match_heads(W.double(), b.double())
        shared = self.opts.match_head == "uniform" and "uniform" in self.names  # E equal heads: release one
        heads = (Wm[:1], bm[:1]) if shared else (Wm, bm)
        E = heads[0].shape[0]
        classes = torch.arange(C)
        gW, gb = gff.class_head_gradients(feats, labels, *heads, classes, reduce="sum")
        S, Q, N = gff.class_feature_stats(feats, labels, classes)
        parts = {"g": (torch.cat([gW.reshape(C, -1), gb.reshape(C, -1)], 1), (2 * E * (F_ ** 2 + 1)) ** 0.5),
                 "n": (N, 1.0)}
        if self.uses_stats:
            parts.update(s=(S, F_), q=(Q, F_ ** 2))
        z = plan.stats_noise_multiplier
        noisy = gaussian_release(parts, z, self.privacy.noise)
        sigma_n = z * len(parts) ** 0.5  # the count's noise σ
        count = noisy["n"].round()
        keep = count >= max(1.0, MIN_COUNT_SIGMAS * sigma_n)
        if not bool(keep.any()):  # nothing stands out of the noise: send the largest count's class alone
            keep[int(noisy["n"].argmax())] = True
            count = count.clamp_min(1)
        cls, cnt = classes[keep], count[keep]
        g = noisy["g"][keep] / cnt[:, None]
        D = feats.shape[1]
        gW_out = g[:, :E * C * D].reshape(-1, E, C, D)
        gb_out = g[:, E * C * D:].reshape(-1, E, C)
        if shared:
            gW_out = gW_out.expand(-1, len(self.names), -1, -1)
            gb_out = gb_out.expand(-1, len(self.names), -1)
        out = {"grad_classes": cls.to(torch.int64), "grad_w": gW_out.float().contiguous(),
               "grad_b": gb_out.float().contiguous()}
        if self.uses_stats:
            s_, q_ = noisy["s"][keep], noisy["q"][keep].clamp_min(0)
            q_ = torch.maximum(q_, s_ * s_ / cnt[:, None])  # Cauchy-Schwarz: (Σx)² ≤ n·Σx²
            out["stat_sum"], out["stat_sumsq"], out["stat_count"] = s_, q_ * (1 + 1e-9), cnt
        return out

    def feature_extras(self, feats: torch.Tensor, labels: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> Tensors:
        """What a client sends from its feature pass: feats (n, D), labels (n,) -> gradients (+ statistics)."""
        classes = torch.unique(labels)
        gW, gb = gff.class_head_gradients(feats, labels, *self.match_heads(W.float(), b.float()), classes)
        out = {"grad_classes": classes.to(torch.int64), "grad_w": gW, "grad_b": gb}
        if self.uses_stats:
            out["stat_sum"], out["stat_sumsq"], out["stat_count"] = gff.class_feature_stats(feats, labels, classes)
        return out

    def match_heads(self, W: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads gradients are taken at: each expert's own, or the uniform expert's for all."""
        if self.opts.match_head == "own" or "uniform" not in self.names:
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
            return (f"expert gradients have shapes {tuple(gW.shape)}, {tuple(gb.shape)}; expected {(L, E, C, D)}, "
                    f"{(L, E, C)}")
        if not bool(torch.isfinite(gW).all() and torch.isfinite(gb).all()):
            return "expert gradients contain NaN or Inf"
        if self.uses_stats:
            if not all(k in e for k in ("stat_sum", "stat_sumsq", "stat_count")):
                return "class statistics are missing"
            return gff.stats_problem(cls, e["stat_sum"], e["stat_sumsq"], e["stat_count"], D)
        return None

    def server_update(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        timing: dict[str, float] = {}
        t0 = time.perf_counter()
        good = check_results(self.scoped(state.weights), results, extra_check=self._grads_problem)
        # a new round makes the experts lag the extractor again: the finishing round is due again
        meta = dict(state.meta, round=round_, dropped=[r.client_id for r in results if r not in good], finished=False)
        extras = dict(state.extras)
        if not good:
            log.warning("round %d: no usable client update; the global model is unchanged", round_)
            meta["round_timing"] = {}
            return GlobalState(state.weights, extras, meta)
        weights = self.aggregate_update(state, good)
        timing["aggregate_s"] = time.perf_counter() - t0
        if self.cr:
            self._retrain_experts(extras, meta, good, round_, timing)
        if self.cl and round_ % self.opts.simclr_every == 0 and self.opts.simclr_steps > 0:
            t0 = time.perf_counter()
            weights, meta["simclr_loss"] = self._simclr(weights, extras, round_)
            timing["simclr_s"] = time.perf_counter() - t0
        meta["round_timing"] = timing
        return GlobalState(weights, extras, meta)

    def finish_config(self, state: GlobalState) -> RoundConfig | None:
        """The finishing round: the experts are retrained once more from gradients and statistics taken
        at the final extractor, which removes the one-round lag between the heads and the features
        they are used on (the clients' gradients of round r describe the extractor of round r − 1)."""
        if not self.cr or self.final_frac <= 0:
            return None
        return {"round": int(state.meta.get("round", 0)) + 1, "seed": self.cfg.seed, "features_only": True,
                "clients_frac": self.final_frac,
                "global_counts": [float(v) for v in state.extras["global_counts"].tolist()]}

    def server_finish(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        t0 = time.perf_counter()
        good = [r for r in results if self._finish_problem(r) is None]
        meta = dict(state.meta, finished=True, finish_dropped=[r.client_id for r in results if r not in good])
        extras = dict(state.extras)
        timing: dict[str, float] = {}
        if good:
            self._retrain_experts(extras, meta, good, round_, timing)
        else:
            log.warning("finishing round: no usable client features; the experts stay as they are")
        meta["round_timing"] = {**timing, "finish_s": time.perf_counter() - t0}
        return GlobalState(state.weights, extras, meta)

    def _finish_problem(self, r: ClientResult) -> str | None:
        why = self._grads_problem(r)
        if why is not None:
            log.warning("finishing round: dropping client %s: %s", r.client_id, why)
        return why

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
        counts = gff.expert_counts(self.names, global_counts, ranks_from_counts(global_counts), self.opts.gff_m,
                                   self.gff_lambda(global_counts))
        gen = self.generator(round_, SERVER, 2)
        mean = std = None
        W, b = extras["expert.weight"], extras["expert.bias"]
        centre = torch.zeros(D)
        if self.uses_stats:
            mean, std, fresh, seen_now = self._update_stats(extras, good, C, D)
            if self.centred:
                # The heads are retrained on features minus the class-balanced mean of this round's class
                # means: real features are ReLU outputs sharing one large mean vector, which zero-mean
                # banks never carry (docs/decisions.md). Clients' gradients are exact in this frame:
                # ∂/∂W at (f − κ) = ∂/∂W at f − ∂/∂b ⊗ κ; the heads they used have bias b + W·κ here.
                centre = mean[seen_now].mean(0)
                gW_real = gW_real - gb_real[..., None] * centre
                b = b + W @ centre
                mean = mean - centre
        if "gff.features" in extras:
            banks = gff.GFFBanks(extras["gff.features"], extras["gff.counts"])
            if not torch.equal(banks.counts, torch.as_tensor(counts)):
                banks = banks.resized(counts, gen, *self._init_moments(mean, std))
        else:
            banks = gff.GFFBanks.create(counts, D, gen, *self._init_moments(mean, std))
        penalty = None
        if self.bank_init == "stats":
            # classes reported for the first time replace their placeholder banks with draws from their own stats
            gff.anchor(banks, "redraw", mean, std, fresh, gen)
            gff.anchor(banks, self.bank_anchor, mean, std, have, gen)
            if self.bank_anchor == "penalty":
                penalty = (mean, std, self.opts.bank_anchor_weight)
        timing["aggregate_s"] = timing.get("aggregate_s", 0.0) + time.perf_counter() - t0
        t0 = time.perf_counter()
        losses = gff.match(banks, *self.match_heads(W, b), gW_real, gb_real, have, self.opts.match_steps,
                           self.opts.match_lr, penalty)
        timing["gff_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.opts.expert_init == "fresh":
            W, b = gff.init_heads(E, C, D, gen)
        if self.opts.expert_form == "shifted" and E > 1:
            W, b, ce = gff.balanced_experts(banks, W, b, self.retrain_epochs, self.opts.retrain_lr,
                                            self.opts.retrain_batch, gen)
        else:
            W, b, ce = gff.retrain(banks, W, b, self.retrain_epochs, self.opts.retrain_lr, self.opts.retrain_batch, gen)
        timing["retrain_s"] = time.perf_counter() - t0
        if E > 1:  # the `learned` rule's weights, from the banks in the frame they live in
            meta["vote_weights"] = [round(float(v), 4) for v in self._learn_vote_weights(banks, W, b, global_counts)]
        b = b - W @ centre  # back to the frame of raw features: what clients, evaluation and export use
        extras.update({"expert.weight": W, "expert.bias": b, "gff.features": banks.features,
                       "gff.counts": banks.counts})
        if self.centred:
            extras["gff.centre"] = centre
        entry = {"round": round_, "match_before": losses[0], "match_after": losses[-1], "retrain_ce": ce,
                 "absent_classes": absent}
        if self.bank_init == "stats":  # how far matching moved each bank's mean from μ_c, in class-spread units
            drift = ((banks.class_means() - mean[None]) ** 2).sum(-1) / (std ** 2).sum(-1).clamp_min(1e-6)[None]
            entry["bank_mean_drift"] = [round(float(v), 4) for v in drift.sqrt().mean(1)]
        meta["gff_history"] = list(meta.get("gff_history", [])) + [entry]

    def _update_stats(self, extras: Tensors, good: list[ClientResult], C: int,
                      D: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This round's exact per-class μ and σ; classes nobody reported keep their last ones.

        Returns mean (C, D), std (C, D), fresh (C,): reported for the first time, and seen_now (C,). A class never
        reported by anyone gets the pooled statistics of the reported classes as a placeholder.
        """
        S, Q, N = gff.aggregate_stats([(r.extras["grad_classes"], r.extras["stat_sum"], r.extras["stat_sumsq"],
                                        r.extras["stat_count"]) for r in good], C, D)
        mean_now, std_now = gff.moments(S, Q, N)
        seen_now = N > 0
        seen_before = extras["stats.count"] > 0
        mean = torch.where(seen_now[:, None], mean_now, extras["stats.mean"])
        std = torch.where(seen_now[:, None], std_now, extras["stats.std"])
        count = torch.where(seen_now, N.float(), extras["stats.count"])
        known = seen_now | seen_before
        if bool(known.any()) and not bool(known.all()):
            tot = N.sum().clamp_min(1)
            pooled_mean, pooled_std = gff.moments(S.sum(0, keepdim=True), Q.sum(0, keepdim=True), tot.view(1))
            mean = torch.where(known[:, None], mean, pooled_mean)
            std = torch.where(known[:, None], std, pooled_std)
        extras.update({"stats.mean": mean, "stats.std": std, "stats.count": count})
        return mean, std, seen_now & ~seen_before, seen_now

    def gff_lambda(self, global_counts: np.ndarray) -> float:
        """The configured λ, or m / mean class count: the banks' shape then depends on the class
        distribution only, not on how many images the federation holds."""
        if self.opts.gff_lambda is not None:
            return self.opts.gff_lambda
        mean = float(np.mean(global_counts))
        return self.opts.gff_m / mean if mean > 0 else 0.0

    @staticmethod
    def _learn_vote_weights(banks: gff.GFFBanks, W: torch.Tensor, b: torch.Tensor,
                            global_counts: np.ndarray) -> torch.Tensor:
        """Expert weights that do best on all banks' rows over the eleven test priors of these counts."""
        E, C, M, D = banks.features.shape
        keep = banks.mask.reshape(-1).bool()
        feats = banks.features.reshape(-1, D)[keep]
        labels = torch.arange(C)[None, :, None].expand(E, C, M).reshape(-1)[keep]
        ranks = ranks_from_counts(global_counts)
        priors = torch.tensor(np.stack([distribution_prior(ranks, kind, f) for _, kind, f in DISTRIBUTIONS]),
                              dtype=torch.float32)
        return learn_vote_weights(feats, labels, W, b, priors)

    def _init_moments(self, mean: torch.Tensor | None, std: torch.Tensor | None):
        """Where new bank slots are drawn: N(μ_c, σ_c²) for `bank_init: stats`, else N(0, 1)."""
        return (mean, std) if self.bank_init == "stats" else (None, None)

    def _simclr(self, weights: Tensors, extras: Tensors, round_: int) -> tuple[Tensors, float]:
        self.model.load_state_dict(weights)
        proj = ProjectionHead(self.model.feature_dim, self.cfg.simclr_proj_dim).to(self.device)
        proj.load_state_dict({k[len("proj."):]: v for k, v in extras.items() if k.startswith("proj.")})
        loss = simclr_refine(self.model.extractor, proj, self.pool, self.normalize, steps=self.opts.simclr_steps,
                             batch=self.cfg.simclr_batch, lr=self.opts.simclr_lr, tau=self.cfg.simclr_tau,
                             gen=self.generator(round_, SERVER, 3))
        extras.update({f"proj.{k}": v.detach().cpu().clone() for k, v in proj.state_dict().items()})
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}, loss

    # ------------------------------------------------------------ calibration
    def posterior_module(self, payload: Tensors) -> nn.Module:
        if not self.cr:
            return super().posterior_module(payload)
        self.model.load_state_dict({k: v for k, v in payload.items() if not k.startswith("expert.")})
        return ExpertEnsemble(self.model.extractor, payload["expert.weight"], payload["expert.bias"], self.names).eval()

    def posterior_logits(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """`experts`: the mean of the experts' log-probabilities (their normalised geometric mean); `uniform`:
        the uniform expert's. Without retrained experts, the FedAvg head's."""
        if "expert_probs" not in outputs:
            return super().posterior_logits(outputs)
        lp = np.log(np.clip(np.asarray(outputs["expert_probs"], np.float64), 1e-12, None))  # (N, E, C)
        if self.opts.calib_source == "uniform" and "uniform" in self.names:
            return lp[:, self.names.index("uniform")]
        return lp.mean(1)

    def posterior_description(self) -> str:
        if not self.cr:
            return "the FedAvg head's softmax"
        if self.opts.calib_source == "uniform" and "uniform" in self.names:
            return "the uniform expert's softmax"
        return "the normalised geometric mean of the experts' softmax"

    def default_source_prior(self, state: GlobalState) -> np.ndarray:
        """The experts' banks average to a class-balanced set (forward and backward mirror each other around the
        uniform expert's), so their uncalibrated posteriors describe the uniform prior."""
        if not self.cr:
            return super().default_source_prior(state)
        C = self.model_cfg.num_classes
        return np.full(C, 1.0 / C)

    def choose_operating_point(self, state: GlobalState, images: np.ndarray, labels: np.ndarray,
                               batch_size: int) -> GlobalState:
        """The experts' common move, chosen on validation: every expert's bias + offset(τ) = −τ·log(training mix),
        τ in [−1, 1] maximising the vote's validation criterion (tafl.training.decision, `decision_criterion`). The move goes into the
        experts' biases, so the vote, the exported graph and the experts' probabilities all carry it; the experts
        keep their order (the same move for all). Their posteriors still aim at the uniform prior the move was
        chosen for, so calibration (fitted after this) and the source prior are unchanged in kind."""
        if not self.cr:
            return super().choose_operating_point(state, images, labels, batch_size)
        from tafl.training.decision import SIGNED_GRID, search_operating_point
        from tafl.training.evaluate import predict

        module = self.inference_model(state).to(self.device)
        out = predict(module, images, self.normalize, batch_size, keys=("expert_probs",))
        logp = torch.log(torch.as_tensor(np.asarray(out["expert_probs"]), dtype=torch.float64).clamp_min(1e-12))
        train_mix = ClassifierMethod.default_source_prior(self, state)  # the training mix (GTAFL's own says uniform)

        def vote(offset: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                moved = torch.softmax(logp + torch.as_tensor(offset), dim=-1).float()
                return module.vote_from(moved.to(module.vote_weights.device))["label"].cpu().numpy()

        rec = search_operating_point(vote, labels, train_mix, logp.shape[-1], SIGNED_GRID, kind="expert_shift",
                                     criterion=self.cfg.decision_criterion, ranks=self.training_ranks(state),
                                     subject="the experts' vote's ")
        offset = np.asarray(rec["offset"])
        extras = dict(state.extras)
        extras["expert.bias"] = (state.extras["expert.bias"] + torch.as_tensor(offset, dtype=torch.float32)).clone()
        return GlobalState(state.weights, extras, dict(state.meta, decision=rec))

    # ------------------------------------------------------------ inference and report
    def inference_model(self, state: GlobalState) -> nn.Module:
        model = build_model(self.model_cfg)
        model.load_state_dict(state.weights)
        if not self.cr:
            return ProbsAndLabel(model).eval()
        vote = state.meta.get("vote", self.opts.vote)
        return ExpertEnsemble(model.extractor, state.extras["expert.weight"], state.extras["expert.bias"],
                              tuple(state.meta.get("experts") or self.names), vote,
                              vote_weights(state.meta)).eval()

    def extra_report(self, state: GlobalState, outputs: dict[str, np.ndarray], test,
                     ranks: np.ndarray) -> dict[str, Any]:
        pool = self.cfg.simclr_pool + (" (transductive)" if self.cfg.simclr_pool == "test" else "")
        rep: dict[str, Any] = {"switches": state.meta.get("switches"), "vote": state.meta.get("vote"),
                               "simclr_pool": pool if self.cl else None,
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
            rep["vote_rules"] = vote_rule_accuracies(outputs, names, state.meta, test.labels, ranks, self.cfg.test_seed)
        rep["banks"] = state.meta.get("banks")
        rep["vote_weights"] = state.meta.get("vote_weights")
        return rep


@register_method("creff")
class CReFF(GTAFL):
    """CReFF (Shang et al., IJCAI 2022): one uniform expert, no GI-GDS, no SimCLR."""

    name = "creff"  # GTAFLConfig.switches fixes its switches: retraining on, the rest off
