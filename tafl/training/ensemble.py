"""The class-wise expert ensemble: experts on shared features, combined by a vote.

Rules (docs/design.md, "GTAFL"): `hard` — each expert votes its argmax with weight w_e; the class with the
most weight wins; ties go to the uniform expert (a bonus smaller than any weight difference is
added to the uniform expert's class, so the rule is one argmax and exports as ONNX operators).
`soft` — argmax of the weighted mean of the experts' probabilities. `confidence` — each expert
votes its argmax with weight w_e times its top probability. `learned` — the soft rule with
per-expert weights the server learns from the GFF banks (`learn_vote_weights`): the point of a
grid on the weight simplex whose pooled prediction has the best mean prior-weighted accuracy on
the banks over the eleven test priors (the unknown-mix objective), ties going to equal weights.
The module returns the voted label,
each expert's label and probabilities, the vote totals and the mean probabilities, the same
outputs the ONNX graph of the packaging component has.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn

from tafl.training.evaluate import evaluate_outputs

VOTES = ("hard", "soft", "confidence", "learned")


class ExpertEnsemble(nn.Module):
    def __init__(self, extractor: nn.Module, W: torch.Tensor, b: torch.Tensor, names: tuple[str, ...],
                 vote: str = "hard", weights: tuple[float, ...] | None = None):
        super().__init__()
        if vote not in VOTES:
            raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
        if W.ndim != 3 or b.shape != W.shape[:2] or len(names) != W.shape[0]:
            raise ValueError(f"expert heads must be (E, C, D) and (E, C) with E names; got {tuple(W.shape)}, "
                             f"{tuple(b.shape)}, {names}")
        self.extractor = extractor
        self.register_buffer("W", W.detach().clone())  # (E, C, D)
        self.register_buffer("b", b.detach().clone())  # (E, C)
        w = torch.ones(len(names)) if weights is None else torch.tensor(weights, dtype=torch.float32)
        self.register_buffer("vote_weights", w)  # (E,)
        self.names = tuple(names)
        self.vote = vote
        self.tie_expert = names.index("uniform") if "uniform" in names else 0
        self.tie_bonus = float(w.min()) * 1e-3

    def expert_logits(self, feats: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bd,ecd->bec", feats, self.W) + self.b[None]  # (B, E, C)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.vote_on(self.extractor(x))

    def vote_on(self, feats: torch.Tensor) -> dict[str, torch.Tensor]:
        """The experts and the vote on features (B, D); every step is an ONNX operator."""
        return self.vote_from(torch.softmax(self.expert_logits(feats), dim=-1))

    def vote_from(self, probs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The vote on the experts' probabilities (B, E, C)."""
        labels = probs.argmax(dim=-1)  # (B, E)
        classes = torch.arange(probs.shape[-1], device=probs.device)
        onehot = (labels.unsqueeze(-1) == classes).to(probs.dtype)  # (B, E, C)
        w = self.vote_weights[None, :, None]
        if self.vote in ("soft", "learned"):
            votes = (probs * w).sum(1) / self.vote_weights.sum()
            score = votes
        else:
            if self.vote == "confidence":
                w = w * probs.max(dim=-1, keepdim=True).values
            votes = (onehot * w).sum(1)  # (B, C)
            score = votes + self.tie_bonus * onehot[:, self.tie_expert]
        return {"label": score.argmax(dim=-1), "probs": probs.mean(dim=1), "expert_labels": labels,
                "expert_probs": probs, "votes": votes}


def simplex_grid(num: int, step: float) -> torch.Tensor:
    """(K, num) all weight vectors with entries in {0, step, 2·step, …} that sum to 1."""
    n = round(1 / step)
    pts = [c for c in itertools.product(range(n + 1), repeat=num) if sum(c) == n]
    return torch.tensor(pts, dtype=torch.float32) / n


@torch.no_grad()
def learn_vote_weights(feats: torch.Tensor, labels: torch.Tensor, W: torch.Tensor, b: torch.Tensor,
                       priors: torch.Tensor, step: float = 0.1) -> torch.Tensor:
    """Per-expert weights (E,) for the `learned` rule, from labelled server-side features.

    feats (N, D), labels (N,), heads W (E, C, D), b (E, C), priors (P, C): the class priors the
    deployment may meet. Score of a candidate w: the mean over the priors of Σ_c π_c·acc_c, acc_c
    the accuracy of argmax Σ_e w_e p_e on the class-c rows. Ties go to the candidate nearest to
    equal weights, so an uninformative set of features keeps the plain soft vote.
    """
    E, C = W.shape[0], W.shape[1]
    probs = torch.softmax(torch.einsum("nd,ecd->nec", feats, W) + b[None], dim=-1)  # (N, E, C)
    cands = simplex_grid(E, step)  # (K, E)
    pred = torch.einsum("ke,nec->knc", cands, probs).argmax(-1)  # (K, N)
    onehot = torch.nn.functional.one_hot(labels, C).to(torch.float32)  # (N, C)
    per_class = ((pred == labels[None]).to(torch.float32) @ onehot) / onehot.sum(0).clamp_min(1)  # (K, C)
    present = onehot.sum(0) > 0
    pri = priors[:, present] / priors[:, present].sum(1, keepdim=True)  # priors over the classes present
    score = (per_class[:, present] @ pri.t()).mean(1)  # (K,)
    best = score >= score.max() - 1e-9
    dist = ((cands - 1.0 / E) ** 2).sum(1)
    return cands[torch.nonzero(best).squeeze(1)[dist[best].argmin()]]


def vote_weights(meta: dict) -> tuple[float, ...] | None:
    """The weights a saved model's vote uses: the learned ones for the `learned` rule, else equal."""
    if meta.get("vote") == "learned" and meta.get("vote_weights"):
        return tuple(float(w) for w in meta["vote_weights"])
    return None


def rule_labels(expert_probs: torch.Tensor, names: tuple[str, ...], meta: dict) -> dict[str, torch.Tensor]:
    """Every rule's voted labels from the experts' probabilities (N, E, C): the vote comparison a
    report shows beside the configured rule (`learned` only where the model learned its weights)."""
    E, C = expert_probs.shape[1], expert_probs.shape[2]
    out = {}
    for rule in VOTES:
        if rule == "learned" and not meta.get("vote_weights"):
            continue
        w = tuple(meta["vote_weights"]) if rule == "learned" else None
        ens = ExpertEnsemble(nn.Identity(), torch.zeros(E, C, 1), torch.zeros(E, C), names, rule, w)
        out[rule] = ens.vote_from(expert_probs)["label"]
    return out


def vote_rule_accuracies(outputs: dict[str, np.ndarray], names: list[str], meta: dict, labels: np.ndarray,
                         ranks: np.ndarray, test_seed: int) -> dict[str, dict[str, float]]:
    """Each vote rule's eleven-distribution accuracies from the experts' outputs of one pass."""
    probs = torch.as_tensor(outputs["expert_probs"])
    res = {}
    for rule, pred in rule_labels(probs, tuple(names), meta).items():
        ev = evaluate_outputs(probs.mean(1).numpy(), pred.numpy(), labels, ranks, test_seed)
        res[rule] = {"average_accuracy": ev["average_accuracy"],
                     **{k: d["accuracy"] for k, d in ev["test_distributions"].items()}}
    return res
