"""Global federated features (GFF): class-wise head gradients, matching and expert retraining.

All experts are handled as one tensor program, never as a loop over experts:
- `class_head_gradients`: a client's mean cross-entropy gradient per local class with respect to
  every expert head, in closed form from one feature pass: for a linear head (W, b) and
  softmax p, ∂CE/∂W = (p − e_y) fᵀ and ∂CE/∂b = p − e_y.
- `class_feature_stats` / `aggregate_stats`: per-class feature sums, sums of squares and counts
  from the same feature pass, summed exactly over clients into μ_c and σ_c (the features' real
  per-class mean and spread, which the gradients alone do not carry).
- `GFFBanks`: one persistent bank per expert, m̃_c features per class (padded to the largest
  count and masked), drawn from N(μ_c, diag σ_c²), or N(0, 1) as CReFF published it.
- `anchor`: keeps each bank's class mean at μ_c across rounds (re-centring, or re-drawing).
- `match`: SGD on the banks to minimise Σ_rows (1 − cos) between the banks' gradients and the
  aggregated client gradients (CReFF's distance: every row of ∂W, and ∂b as one row), with an
  optional penalty keeping each bank's mean near μ_c.
- `retrain`: mini-batch SGD of every expert head on its own bank, all experts in one batch.
Shapes: E experts, C classes, D feature dim, M bank slots per class, L local classes.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch.nn import functional as F

EXPERT_NAMES = ("forward", "uniform", "backward")


@contextlib.contextmanager
def single_thread():
    """Small tensor programs run far faster on one thread; with a busy second core, two threads
    spin-wait on each other (measured: 0.07 s vs 32 s for the same 30 retraining epochs)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def expert_counts(names: tuple[str, ...], global_counts: np.ndarray, ranks: np.ndarray, m: int,
                  lam: float) -> np.ndarray:
    """(E, C) synthetic features per class: forward m + λ·d_c, uniform m, backward m + λ·d_(reversed rank)."""
    d = np.asarray(global_counts, np.float64)
    num_classes = len(d)
    by_rank = np.empty(num_classes)
    by_rank[ranks] = d  # by_rank[r] = count of the class of rank r
    reversed_d = by_rank[num_classes - 1 - ranks]  # the class of rank r gets the count of rank C-1-r
    rows = []
    for name in names:
        if name == "forward":
            rows.append(m + lam * d)
        elif name == "uniform":
            rows.append(np.full(num_classes, float(m)))
        elif name == "backward":
            rows.append(m + lam * reversed_d)
        else:
            raise ValueError(f"unknown expert '{name}'; experts are {EXPERT_NAMES}")
    return np.maximum(1, np.rint(np.stack(rows))).astype(np.int64)


def class_head_gradients(features: torch.Tensor, labels: torch.Tensor, W: torch.Tensor, b: torch.Tensor,
                         classes: torch.Tensor, reduce: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (or, with reduce="sum", summed) CE gradient per class in `classes` w.r.t. every expert head.

    features (n, D), labels (n,), W (E, C, D), b (E, C), classes (L,) -> gW (L, E, C, D), gb (L, E, C).
    """
    num_classes = W.shape[1]
    probs = torch.softmax(torch.einsum("nd,ecd->enc", features, W) + b[:, None, :], dim=-1)  # (E, n, C)
    resid = probs - F.one_hot(labels, num_classes).to(probs.dtype)[None]  # (E, n, C)
    sel = (labels[:, None] == classes[None, :]).to(features.dtype)  # (n, L)
    if reduce == "mean":
        sel = sel / sel.sum(0, keepdim=True).clamp_min(1)  # mean over each class's samples
    gW = torch.einsum("nl,enc,nd->lecd", sel, resid, features)
    gb = torch.einsum("nl,enc->lec", sel, resid)
    return gW, gb


def class_feature_stats(features: torch.Tensor, labels: torch.Tensor,
                        classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per class in `classes`: feature sum (L, D), sum of squares (L, D), count (L,), in float64.

    Sums, not means, so the server aggregates them exactly: Σ over clients, then divide once.
    """
    f = features.to(torch.float64)
    sel = (labels[:, None] == classes[None, :]).to(torch.float64)  # (n, L)
    return sel.t() @ f, sel.t() @ (f * f), sel.sum(0)


def stats_problem(classes: torch.Tensor, s: torch.Tensor, q: torch.Tensor, n: torch.Tensor, dim: int) -> str | None:
    """Why a client's class statistics cannot be aggregated, or None."""
    L = len(classes)
    if tuple(s.shape) != (L, dim) or tuple(q.shape) != (L, dim) or tuple(n.shape) != (L,):
        return (f"class statistics have shapes {tuple(s.shape)}, {tuple(q.shape)}, {tuple(n.shape)}; "
                f"expected {(L, dim)}, {(L, dim)}, {(L,)}")
    if not all(t.is_floating_point() for t in (s, q, n)):
        return "class statistics are not floating-point tensors"
    if not bool(torch.isfinite(s).all() and torch.isfinite(q).all() and torch.isfinite(n).all()):
        return "class statistics contain NaN or Inf"
    if bool((n <= 0).any()) or not bool(torch.equal(n, n.round())):
        return f"class statistics report counts {n.tolist()[:10]}; expected positive whole numbers"
    if bool((q < 0).any()):
        return "class statistics report a negative sum of squares"
    # Cauchy-Schwarz: (Σx)² ≤ n·Σx² for every class and dimension, up to rounding
    s64, q64, n64 = s.double(), q.double(), n.double()
    if bool((s64 * s64 > n64[:, None] * q64 * (1 + 1e-6) + 1e-6).any()):
        return "class statistics are inconsistent (a sum exceeds what its sum of squares allows)"
    return None


def aggregate_stats(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], num_classes: int,
                    dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact per-class totals over clients: parts of (classes, sum, sumsq, count) -> (C, D), (C, D), (C,)."""
    S = torch.zeros(num_classes, dim, dtype=torch.float64)
    Q = torch.zeros(num_classes, dim, dtype=torch.float64)
    N = torch.zeros(num_classes, dtype=torch.float64)
    for cls, s, q, n in parts:
        S[cls] += s.double()
        Q[cls] += q.double()
        N[cls] += n.double()
    return S, Q, N


def moments(S: torch.Tensor, Q: torch.Tensor, N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """μ (C, D) and σ (C, D) from totals; classes with no samples get zeros (callers mask them)."""
    n = N.clamp_min(1)[:, None]
    mean = S / n
    var = (Q / n - mean * mean).clamp_min(0)  # population variance; rounding can dip below 0
    return mean.float(), var.sqrt().float()


class GFFBanks:
    """Persistent synthetic features: features (E, C, M, D), mask (E, C, M), counts (E, C)."""

    def __init__(self, features: torch.Tensor, counts: torch.Tensor):
        self.features = features
        self.counts = counts.to(torch.int64)
        slots = torch.arange(features.shape[2])
        self.mask = (slots[None, None, :] < self.counts[..., None]).to(features.dtype)

    @classmethod
    def create(cls, counts: np.ndarray, dim: int, gen: torch.Generator, mean: torch.Tensor | None = None,
               std: torch.Tensor | None = None) -> GFFBanks:
        """N(μ_c, diag σ_c²) per class when `mean` (C, D) and `std` (C, D) are given, else N(0, 1)."""
        counts_t = torch.as_tensor(counts, dtype=torch.int64)
        E, C = counts_t.shape
        feats = torch.randn(E, C, int(counts_t.max()), dim, generator=gen)
        if mean is not None:
            feats = feats * std[None, :, None, :] + mean[None, :, None, :]
        return cls(feats, counts_t)

    def resized(self, counts: np.ndarray, gen: torch.Generator, mean: torch.Tensor | None = None,
                std: torch.Tensor | None = None) -> GFFBanks:
        """Keep existing features where the new counts allow; new slots are drawn as in `create`."""
        new = GFFBanks.create(counts, self.features.shape[-1], gen, mean, std)
        m = min(new.features.shape[2], self.features.shape[2])
        keep = (new.mask[..., :m] * self.mask[..., :m]).bool()
        new.features[..., :m, :][keep] = self.features[..., :m, :][keep]
        return new

    def class_means(self) -> torch.Tensor:
        """(E, C, D) mean of each bank's valid rows."""
        return (self.features * self.mask[..., None]).sum(2) / self.counts.clamp_min(1)[..., None].to(self.features.dtype)

    def class_stds(self) -> torch.Tensor:
        """(E, C, D) per-dimension standard deviation of each bank's valid rows."""
        dev = (self.features - self.class_means()[:, :, None, :]) * self.mask[..., None]
        return ((dev * dev).sum(2) / self.counts.clamp_min(1)[..., None].to(self.features.dtype)).sqrt()


ANCHORS = ("none", "recentre", "standardise", "penalty", "redraw")


def anchor(banks: GFFBanks, mode: str, mean: torch.Tensor, std: torch.Tensor, have: torch.Tensor,
           gen: torch.Generator) -> None:
    """Move the banks of the classes in `have` to where this round's real features live, in place.

    recentre: shift each bank so its class mean is μ_c (its spread and matched shape stay);
    standardise: also rescale each dimension to σ_c; redraw: fresh N(μ_c, diag σ_c²) features
    (no persistence); none / penalty: nothing here (penalty acts inside `match`).
    """
    if mode in ("none", "penalty"):
        return
    if mode not in ANCHORS:
        raise ValueError(f"unknown bank anchor '{mode}'; choose one of {ANCHORS}")
    keep = have[None, :, None, None].to(banks.features.dtype)
    if mode == "redraw":
        fresh = GFFBanks.create(banks.counts.numpy(), banks.features.shape[-1], gen, mean, std).features
        new = fresh[:, :, :banks.features.shape[2]]
    else:
        m = banks.class_means()[:, :, None, :]  # (E, C, 1, D)
        centred = banks.features - m
        if mode == "standardise":
            scale = std[None, :, None, :] / banks.class_stds()[:, :, None, :].clamp_min(1e-6)
            centred = centred * torch.where(std[None, :, None, :] > 0, scale, torch.zeros_like(scale))
        new = centred + mean[None, :, None, :]
    banks.features = (new * keep + banks.features * (1 - keep)) * banks.mask[..., None]


def synthetic_gradients(feats: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor, W: torch.Tensor,
                        b: torch.Tensor, classes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean CE gradient of each bank's class w.r.t. its expert: gW (E, G, C, D), gb (E, G, C).

    feats (E, G, M, D) hold the banks of the G classes `classes` (default: all C, in order).
    """
    C = W.shape[1]
    if classes is None:
        classes = torch.arange(C)
    logits = torch.einsum("ecmd,ekd->ecmk", feats, W) + b[:, None, None, :]  # (E, G, M, C)
    target = F.one_hot(classes, C).to(feats.dtype)[None, :, None, :]  # a class's one-hot on its own bank rows
    resid = (torch.softmax(logits, dim=-1) - target) * mask[..., None]
    denom = counts.to(feats.dtype).clamp_min(1)
    gW = torch.einsum("ecmk,ecmd->eckd", resid, feats) / denom[..., None, None]
    gb = resid.sum(2) / denom[..., None]
    return gW, gb


def _cos_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 − cos along the last dim, CReFF's epsilon in the denominator."""
    return 1 - (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + 1e-6)


def match_loss(gW_syn: torch.Tensor, gb_syn: torch.Tensor, gW_real: torch.Tensor, gb_real: torch.Tensor,
               have: torch.Tensor) -> torch.Tensor:
    """Σ over experts and present classes of Σ_rows(1 − cos) for ∂W plus (1 − cos) for ∂b."""
    per = _cos_dist(gW_syn, gW_real).sum(-1) + _cos_dist(gb_syn, gb_real)  # (E, C)
    return (per * have.to(per.dtype)[None, :]).sum()


def mean_penalty(feats: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor, mean: torch.Tensor,
                 std: torch.Tensor, have: torch.Tensor) -> torch.Tensor:
    """Σ over experts and present classes of ‖bank mean − μ_c‖² / Σ_d σ_c,d²: the drift of a bank's
    mean in units of its class's total spread (1 = one standard deviation's worth)."""
    m = (feats * mask[..., None]).sum(2) / counts.clamp_min(1)[..., None].to(feats.dtype)  # (E, C, D)
    d2 = ((m - mean[None]) ** 2).sum(-1) / (std ** 2).sum(-1).clamp_min(1e-6)[None]  # (E, C)
    return (d2 * have.to(d2.dtype)[None, :]).sum()


def match(banks: GFFBanks, W: torch.Tensor, b: torch.Tensor, gW_real: torch.Tensor, gb_real: torch.Tensor,
          have: torch.Tensor, steps: int, lr: float,
          penalty: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> list[float]:
    """Optimise the banks in place; returns the matching loss before and after (per present class).

    `penalty` = (μ (C, D), σ (C, D), weight) adds weight · `mean_penalty` to the loss.
    """
    with single_thread():
        return _match(banks, W, b, gW_real, gb_real, have, steps, lr, penalty)


def _match(banks, W, b, gW_real, gb_real, have, steps, lr, penalty=None) -> list[float]:
    # The loss splits by class (a class's bank rows enter only its own gradients). Where the experts'
    # counts differ a lot (forward/backward banks of a long tail), the padded (E, C, M, D) tensor is
    # mostly padding: then each present class is its own leaf (E, M_c, D), cut to its largest count
    # over the experts, and absent classes cost nothing. Plain SGD on the pieces = SGD on the whole.
    W, b = W.detach(), b.detach()
    E, C = banks.counts.shape
    present = [c for c in range(C) if bool(have[c])]
    cut = {c: int(banks.counts[:, c].max()) for c in present}
    if sum(cut.values()) < 0.6 * C * banks.features.shape[2]:
        groups = [[c] for c in present]
    else:
        groups = [list(range(C))]
        cut = {c: banks.features.shape[2] for c in range(C)}
    leaves = [banks.features[:, g, :cut[g[0]] if len(g) == 1 else None].clone().requires_grad_(True) for g in groups]
    masks = [banks.mask[:, g, :cut[g[0]] if len(g) == 1 else None] for g in groups]
    keep = have.to(banks.features.dtype)
    opt = torch.optim.SGD(leaves, lr=lr)
    n_terms = max(1, len(present) * E)
    losses = []
    for step in range(steps + 1):
        loss = torch.zeros(())
        pen = torch.zeros(())
        for g, x, mask in zip(groups, leaves, masks):  # x (E, G, M_g, D)
            cls = torch.tensor(g)
            gW, gb = synthetic_gradients(x, mask, banks.counts[:, g], W, b, cls)
            per = _cos_dist(gW, gW_real[:, g]).sum(-1) + _cos_dist(gb, gb_real[:, g])  # (E, G)
            loss = loss + (per * keep[g][None, :]).sum()
            if penalty is not None:
                pen = pen + mean_penalty(x, mask, banks.counts[:, g], penalty[0][g], penalty[1][g], have[g])
        if step == 0 or step == steps:
            losses.append(float(loss.detach()) / n_terms)
        if step == steps:
            break
        if penalty is not None:
            loss = loss + penalty[2] * pen
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        feats = banks.features.clone()  # absent classes keep their bank
        for g, x in zip(groups, leaves):
            m = x.shape[2]
            for j, c in enumerate(g):
                if bool(have[c]):
                    feats[:, c, :m] = x[:, j].detach()
        banks.features = feats
    return losses


def retrain(banks: GFFBanks, W: torch.Tensor, b: torch.Tensor, epochs: int, lr: float, batch: int,
            gen: torch.Generator, adjust: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mini-batch SGD of all experts on their banks at once; returns new (W, b) and the last loss.

    adjust (E, C): added to expert e's logits inside the loss only: with log(bank e's class shares) this is the
    logit-adjusted loss (Menon et al. 2021), whose minimiser W·f + b scores classes as under a uniform prior
    whatever the bank's mix (`balanced_experts`)."""
    with single_thread():
        return _retrain(banks, W, b, epochs, lr, batch, gen, adjust)


def bank_log_mix(banks: GFFBanks) -> torch.Tensor:
    """(E, C) log of each bank's class shares, centred per expert (softmax and argmax ignore a constant)."""
    q = banks.counts.double()
    lq = torch.log(q / q.sum(1, keepdim=True))
    return (lq - lq.mean(1, keepdim=True)).float()


def balanced_experts(banks: GFFBanks, W: torch.Tensor, b: torch.Tensor, epochs: int, lr: float, batch: int,
                     gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Experts that specialise by construction (`expert_form: shifted`, docs/decisions.md, "Shifted experts").

    Each bank trains a head on the logit-adjusted loss, so each estimates the same class-balanced scorer; their
    mean is the shared head, and expert e is that head plus log(bank e's class shares): the forward expert's
    decisions lean to the head classes and the backward expert's to the tail, in its bank's proportions, on any
    features. W, b come in and go out in that shifted form (the shift is taken off before training)."""
    shift = bank_log_mix(banks)
    W, b, loss = retrain(banks, W, b - shift, epochs, lr, batch, gen, adjust=shift)
    W_bar, b_bar = W.mean(0, keepdim=True), b.mean(0, keepdim=True)
    return W_bar.expand_as(W).clone(), b_bar + shift, loss


def _retrain(banks, W, b, epochs, lr, batch, gen, adjust=None):
    E, C, M, D = banks.features.shape
    flat = banks.features.reshape(E, C * M, D)
    labels = torch.arange(C).repeat_interleave(M)  # (C·M,)
    valid = [torch.nonzero(banks.mask[e].reshape(-1)).squeeze(1) for e in range(E)]
    n_max = max(len(v) for v in valid)
    steps_per_epoch = max(1, math.ceil(n_max / batch))
    span = steps_per_epoch * batch
    W, b = W.detach().clone(), b.detach().clone()
    eidx = torch.arange(E)[:, None]
    last = float("nan")
    # plain SGD with the closed-form CE gradient of a linear head: no autograd on this hot loop
    for _ in range(epochs):
        # per expert: a permutation of its own rows, cycled to the epoch's length
        order = torch.stack([v[torch.randperm(len(v), generator=gen)].repeat(math.ceil(span / len(v)))[:span]
                             for v in valid])  # (E, span)
        for s in range(steps_per_epoch):
            idx = order[:, s * batch:(s + 1) * batch]  # (E, B)
            x = flat[eidx, idx]  # (E, B, D)
            y = labels[idx]  # (E, B)
            logits = torch.baddbmm(b[:, None, :], x, W.transpose(1, 2))  # (E, B, C)
            if adjust is not None:
                logits = logits + adjust[:, None, :]
            probs = torch.softmax(logits, dim=-1)
            resid = probs.scatter_add(-1, y[..., None], -torch.ones_like(y, dtype=probs.dtype)[..., None])
            n = idx.shape[1]
            W -= lr * torch.bmm(resid.transpose(1, 2), x) / n
            b -= lr * resid.sum(1) / n
        last = float(-torch.log(probs.gather(-1, y[..., None]).clamp_min(1e-12)).mean())
    return W, b, last


def init_heads(num_experts: int, num_classes: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear's default initialisation, U(−1/√D, 1/√D), for every expert."""
    bound = 1.0 / math.sqrt(dim)
    W = (torch.rand(num_experts, num_classes, dim, generator=gen) * 2 - 1) * bound
    b = (torch.rand(num_experts, num_classes, generator=gen) * 2 - 1) * bound
    return W, b
