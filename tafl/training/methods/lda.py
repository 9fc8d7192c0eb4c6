"""LDA: a linear-discriminant classifier head fitted on the server from the sites' class feature sums, one release
per site (docs/decisions.md, "Method lda").

The extractor is fixed (`train_scope: head`: its seeded initialisation, or `--pretrain-steps` of SimCLR on the
server's unlabeled pool), and the server sends the round's head basis: the pool's feature mean μ and the whitening
projection P onto its leading principal directions (`head_basis.HeadBasis`). A site trains nothing. The first time it
is selected it sends, per class, the sum of its images' whitened features x = P(f − μ); its class counts are the
census's. Under record-level DP every x is clipped to norm F = dp_feature_clip·√k and the sums carry Gaussian noise
of σ = z·F (sensitivity F), with the census's own noise on the counts: two Gaussian releases over the whole run, so
the noise is set for those two alone, not for hundreds of DP-SGD steps (docs/results.md, "Method lda"). A site selected again
re-sends the same release, which costs no budget.

The server keeps each site's latest sums, and after every round fits, over every site heard so far,
class means M_c = S_c / N_c, class shares p_c, and the within-class covariance Σ_w = I − Σ_c p_c (M_c − m)(M_c − m)ᵀ:
in the whitened basis the pool's total covariance is I by construction, so no site needs to send second moments.
Its eigenvalues are floored at SHRINK. The head is then Gaussian discriminant analysis with a shared covariance,
    z_c(x) = M_c Σ_w⁻¹ x − ½ M_c Σ_w⁻¹ M_c + log p_c,
folded back onto the raw features (W = M Σ_w⁻¹ P, b = z's constant − W μ), so the package is the plain classifier the
other single-head methods export: the operating point, calibration and the case-mix estimator apply unchanged.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tafl.training.contract import ClientData, ClientResult, GlobalState, RoundConfig, Tensors, register_method
from tafl.training.methods.base import ClassifierMethod
from tafl.training.methods.head_basis import BASIS, split_basis, weights_key
from tafl.training.methods.lda_config import LDAConfig

log = logging.getLogger(__name__)

SHRINK = 0.05  # the floor of Σ_w's eigenvalues: the pool's whitened total covariance is 1 in every direction
SUM, COUNT = "lda_sum.", "lda_count."  # state.extras: each site's class feature sums (C, k) and counts (C,)
SUM_ID = -1  # under secure aggregation the server holds only the sum over the round's sites (secagg.SUM_ID)


def fit_lda(sums: np.ndarray, counts: np.ndarray, shrink: float = SHRINK) -> tuple[np.ndarray, np.ndarray]:
    """The discriminant head in the whitened basis from the class feature sums (C, k) and counts (C,) over the
    federation: (W (C, k), b (C,)) with z = W·x + b. A class no site reports (count below 1) gets the common mean
    and the smallest share, so it is never preferred by its mean alone."""
    S = np.asarray(sums, np.float64)
    N = np.asarray(counts, np.float64)
    if S.ndim != 2 or N.shape != (S.shape[0],):
        raise ValueError(f"need (C, k) sums and (C,) counts, got {S.shape} and {N.shape}")
    have = N >= 1.0
    if not have.any():
        raise ValueError("no class has a count of at least 1: nothing to fit")
    Nc = np.where(have, N, 1.0)
    M = S / Nc[:, None]
    p = np.where(have, N, 1.0) / np.where(have, N, 1.0).sum()
    gm = (p[have, None] * M[have]).sum(0) / p[have].sum()
    M[~have] = gm
    d = M - gm
    within = np.eye(S.shape[1]) - (d.T * p) @ d
    vals, vecs = np.linalg.eigh((within + within.T) / 2)
    inv = (vecs / np.clip(vals, shrink, None)) @ vecs.T
    W = M @ inv
    b = -0.5 * np.einsum("ck,ck->c", W, M) + np.log(p)
    return W, b


@register_method("lda")
class LDA(ClassifierMethod):
    name = "lda"
    opts_type = LDAConfig
    trains = False

    def __init__(self, cfg, model_cfg, preprocess, device="cpu"):
        super().__init__(cfg, model_cfg, preprocess, device)
        self._released: dict[tuple[int, str], Tensors] = {}  # (client, basis digest) -> its one release
        # under DP: two Gaussian releases over the run (the census and the class sums), no DP-SGD step
        self.privacy.releases, self.privacy.dp_sgd = (0, 1), False

    def share_divisor(self) -> float:
        """√m_t: with secure aggregation and DP, the sums' noise is spread over the sites of each SecAgg+ sum (each
        adds 1/√m_t of it, m_t the fewest sites a completed sum holds), so any completed sum carries at least the
        planned noise; 1 otherwise (each site adds all of it)."""
        if not (self.dp and self.cfg.secure_aggregation):
            return 1.0
        from tafl.training.secagg import SecAggParams, min_in_sum

        return float(min_in_sum(self.cfg.clients, SecAggParams())) ** 0.5

    def secure_layout(self, payload: Tensors, n_max: int):
        """The SecAgg+ layout of the release (tafl.training.secagg.lda_layout) from public values."""
        from tafl.training.secagg import SecureBounds, lda_layout

        k = int(payload[BASIS + "proj"].shape[0])
        if not self.dp:
            return lda_layout(self.model_cfg.num_classes, k, n_max, SecureBounds().feature)
        plan = self.privacy.plan(n_max)
        F = plan.feature_clip * k ** 0.5
        z = plan.stats_noise_multiplier
        return lda_layout(self.model_cfg.num_classes, k, n_max, F * (1.0 + 10.0 * z / self.share_divisor()),
                          count_slack=10.0 * z)

    def client_update(self, payload: Tensors, data: ClientData, round_cfg: RoundConfig) -> ClientResult:
        if round_cfg.get("calibrate"):  # the calibration rounds after training: no local training
            return self.calibration.update(payload, data, round_cfg)
        if round_cfg.get("domain_stats"):  # the in-domain detector's statistics round: no local training
            return self.domain_stats.update(payload, data, round_cfg)
        if round_cfg.get("conformal_stats") is not None:  # the conformal sets' statistics round: no training
            return self.sets.update(payload, data, round_cfg)
        payload, basis = split_basis(payload)
        if basis is None:
            raise ValueError("LDA needs the server's head basis in the payload (train_scope head)")
        key = (int(data.client_id), _digest(basis))
        fresh = key not in self._released
        if fresh:
            own = self.model.state_dict().keys()
            self.model.load_state_dict({k: v for k, v in payload.items() if k in own})
            self._released[key] = self._class_sums(data, basis)
        metrics = {"dp_releases": 1.0} if self.dp and fresh else {}
        extras = {k: v.clone() for k, v in self._released[key].items()}
        return ClientResult(data.client_id, len(data), {}, extras, metrics)

    def _class_sums(self, data: ClientData, basis: Tensors) -> Tensors:
        """This site's per-class sums of whitened features, and its class counts (the census's release under DP)."""
        feats = self.features(data.client_id, data.images[data.indices]).double().cpu()
        x = (feats - basis[BASIS + "mean"].double()) @ basis[BASIS + "proj"].double().t()
        labels = data.local_labels
        C = self.model_cfg.num_classes
        if not self.dp:
            sums = torch.zeros(C, x.shape[1], dtype=torch.float64).index_add_(0, labels, x)
            return {"lda_sum": sums.float(), "lda_count": data.class_counts().float()}
        from tafl.training.privacy import clip_rows, gaussian_release

        plan = self.privacy.plan(len(data))
        F = plan.feature_clip * x.shape[1] ** 0.5
        sums = torch.zeros(C, x.shape[1], dtype=torch.float64).index_add_(0, labels, clip_rows(x, F))
        noisy = gaussian_release({"s": (sums, F)}, plan.stats_noise_multiplier / self.share_divisor(),
                                self.privacy.noise)["s"]
        return {"lda_sum": noisy.float(), "lda_count": self.client_stats(data)["class_counts"]}

    def server_update(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        C = self.model_cfg.num_classes
        extras = dict(state.extras)
        dropped = []
        if self.cfg.secure_aggregation and results:  # one result: the round's secure sum over every site in it
            extras = {k: v for k, v in extras.items() if not k.startswith((SUM, COUNT))}
        for r in results:
            s, n = r.extras.get("lda_sum"), r.extras.get("lda_count")
            if s is None or n is None or s.ndim != 2 or s.shape[0] != C or n.shape != (C,) or \
                    not (bool(torch.isfinite(s).all()) and bool(torch.isfinite(n).all())) or bool((n < 0).any()):
                log.warning("round %d: client %s sent unusable class sums; dropped", round_, r.client_id)
                dropped.append(r.client_id)
                continue
            cid = SUM_ID if self.cfg.secure_aggregation else r.client_id
            extras[f"{SUM}{cid}"] = s.float().clone()
            extras[f"{COUNT}{cid}"] = n.float().clone()
        sites = sorted(int(k[len(SUM):]) for k in extras if k.startswith(SUM))
        meta = dict(state.meta, round=round_, dropped=dropped, lda_sites=sites)
        if not sites:
            if round_ >= self.cfg.rounds:  # the model would be the untrained head: stop rather than export it
                from tafl.errors import TrainingDiverged

                raise TrainingDiverged(f"no site's class sums arrived by round {round_}: lda has nothing to fit its "
                                       "head from (see the log for each site's error); no model was written")
            log.warning("round %d: no usable class sums yet; the head is unchanged", round_)
            return GlobalState(state.weights, extras, meta)
        S = sum(extras[f"{SUM}{k}"].double() for k in sites).numpy()
        N = sum(extras[f"{COUNT}{k}"].double() for k in sites).numpy()
        Wk, bk = fit_lda(S, N)
        basis = self.head_basis(state)
        P, mu = basis[BASIS + "proj"].double().numpy(), basis[BASIS + "mean"].double().numpy()
        W = Wk @ P
        weights = dict(state.weights)
        weights["head.weight"] = torch.from_numpy(W).to(state.weights["head.weight"].dtype)
        weights["head.bias"] = torch.from_numpy(bk - W @ mu).to(state.weights["head.bias"].dtype)
        return GlobalState(weights, extras, meta)


def _digest(basis: Tensors) -> str:
    return weights_key(basis)
