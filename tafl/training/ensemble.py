"""The class-wise expert ensemble: experts on shared features, combined by a vote.

Rules (DESIGN.md §4): `hard` — each expert votes its argmax with weight w_e; the class with the
most weight wins; ties go to the uniform expert (a bonus smaller than any weight difference is
added to the uniform expert's class, so the rule is one argmax and exports as ONNX operators).
`soft` — argmax of the weighted mean of the experts' probabilities. `confidence` — each expert
votes its argmax with weight w_e times its top probability. The module returns the voted label,
each expert's label and probabilities, the vote totals and the mean probabilities, the same
outputs the ONNX graph of the packaging component has.
"""

from __future__ import annotations

import torch
from torch import nn

VOTES = ("hard", "soft", "confidence")


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
        probs = torch.softmax(self.expert_logits(feats), dim=-1)  # (B, E, C)
        labels = probs.argmax(dim=-1)  # (B, E)
        classes = torch.arange(probs.shape[-1], device=probs.device)
        onehot = (labels.unsqueeze(-1) == classes).to(probs.dtype)  # (B, E, C)
        w = self.vote_weights[None, :, None]
        if self.vote == "soft":
            votes = (probs * w).sum(1) / self.vote_weights.sum()
            score = votes
        else:
            if self.vote == "confidence":
                w = w * probs.max(dim=-1, keepdim=True).values
            votes = (onehot * w).sum(1)  # (B, C)
            score = votes + self.tie_bonus * onehot[:, self.tie_expert]
        return {"label": score.argmax(dim=-1), "probs": probs.mean(dim=1), "expert_labels": labels,
                "expert_probs": probs, "votes": votes}
