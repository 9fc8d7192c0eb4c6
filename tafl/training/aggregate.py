"""Server-side aggregation: checking client updates and weighted averaging.

`check_results` drops any client whose update has missing keys, wrong shapes or non-finite
values, with a warning naming the client, so one broken site never poisons a round.
`weighted_average` is FedAvg's rule applied to every floating tensor, BatchNorm running
statistics included; integer buffers (BatchNorm's `num_batches_tracked`) take the maximum.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from tafl.training.contract import ClientResult

Tensors = dict[str, torch.Tensor]

log = logging.getLogger(__name__)


def problem_with(reference: Tensors, update: Tensors, what: str) -> str | None:
    """Why `update` cannot be aggregated against `reference`, or None."""
    missing = [k for k in reference if k not in update]
    if missing:
        return f"{what} lacks {len(missing)} tensor(s), e.g. '{missing[0]}'"
    for k, ref in reference.items():
        t = update[k]
        if not isinstance(t, torch.Tensor):
            return f"{what} '{k}' is {type(t).__name__}, not a tensor"
        if t.shape != ref.shape:
            return f"{what} '{k}' has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{what} '{k}' contains NaN or Inf"
    return None


def check_results(reference: Tensors, results: Sequence[ClientResult],
                  extra_check=None) -> list["ClientResult"]:
    """The results that are safe to aggregate; the others are dropped with a warning."""
    good = []
    for r in results:
        why = problem_with(reference, r.weights, "model update")
        if why is None and r.num_samples <= 0:
            why = f"reports {r.num_samples} samples"
        if why is None and r.metrics.get("steps") == 0:
            why = "no local step had a finite loss"
        if why is None and extra_check is not None:
            why = extra_check(r)
        if why is not None:
            log.warning("round: dropping client %s: %s", r.client_id, why)
            continue
        good.append(r)
    return good


def weighted_average(states: Sequence[Tensors], weights: Sequence[float]) -> Tensors:
    """Σ_k w_k · state_k / Σ_k w_k for floating tensors; max for integer tensors."""
    if not states:
        raise ValueError("weighted_average needs at least one state")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if not bool((w >= 0).all()) or float(w.sum()) <= 0:
        raise ValueError(f"aggregation weights must be non-negative with a positive sum, got {weights}")
    w = w / w.sum()
    out: Tensors = {}
    for k, ref in states[0].items():
        if ref.is_floating_point():
            acc = torch.zeros(ref.shape, dtype=torch.float64)
            for wk, s in zip(w, states):
                acc += wk * s[k].to(torch.float64)
            out[k] = acc.to(ref.dtype)
        else:
            out[k] = torch.stack([s[k] for s in states]).max(dim=0).values.clone()
    return out
