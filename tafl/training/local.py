"""Local training on one client: batches, augmentation and the SGD loop every method shares.

`local_sgd` runs E epochs over a client's data (uniform shuffling, or weighted sampling with
replacement for GI-GDS), with an optional proximal term (FedProx) and a pluggable loss (DAFL);
`scheduled_lr` gives a round's learning rate (warm-up, cosine) and `PolicyAugment` timm's
RandAugment / TrivialAugment policies.
Augmentation (random crop after padding by 1/8 of the side, horizontal flip) is done on whole
uint8 batches in torch, drawn from the client's own generator, so a run is deterministic.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def augment_batch(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random crop with zero padding of side/8 and a random horizontal flip; x is float (B, C, H, W)."""
    b, _, h, w = x.shape
    pad = max(1, h // 8)
    xp = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    flip = torch.rand(b, generator=gen) < 0.5
    # (B, H, W) gather indices for a per-sample crop
    rows = (dy.view(b, 1) + torch.arange(h).view(1, h)).to(x.device)  # (B, H)
    cols = (dx.view(b, 1) + torch.arange(w).view(1, w)).to(x.device)  # (B, W)
    cols = torch.where(flip.view(b, 1).to(x.device), cols.flip(1), cols)
    out = xp[torch.arange(b, device=x.device).view(b, 1, 1), :, rows.view(b, h, 1), cols.view(b, 1, w)]
    return out.permute(0, 3, 1, 2).contiguous()  # advanced indexing puts C last: (B, H, W, C) -> (B, C, H, W)


POLICIES = {"trivial": "rand-n1-m10-mstd101-inc1", "randaugment": "rand-n2-m9-mstd0.5-inc1"}


class PolicyAugment:
    """timm's RandAugment ops on whole uint8 batches (B, H, W, C), one image at a time through PIL.

    `trivial` is TrivialAugment's recipe in timm's terms (one op, magnitude drawn uniformly from
    [0, 10]); `randaugment` is RandAugment (two ops, magnitude 9 ± 0.5). timm's ops draw from
    Python's `random` and NumPy's global generator; both are seeded from the client's torch generator per batch, so a run stays
    deterministic.
    """

    def __init__(self, policy: str, channels: int):
        from timm.data.auto_augment import rand_augment_transform

        fill = (128,) * 3 if channels == 3 else 128
        self.op = rand_augment_transform(POLICIES[policy], {"img_mean": fill})
        self.channels = channels

    def __call__(self, batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        import random

        import numpy as np
        from PIL import Image

        state, np_state = random.getstate(), np.random.get_state()
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        random.seed(seed)
        np.random.seed(seed)
        try:
            arr = batch.numpy()
            out = np.empty_like(arr)
            for i, img in enumerate(arr):
                pil = Image.fromarray(img[..., 0] if self.channels == 1 else img)
                res = np.asarray(self.op(pil))
                out[i] = res[..., None] if self.channels == 1 else res
        finally:
            random.setstate(state)
            np.random.set_state(np_state)
        return torch.from_numpy(out)


def scheduled_lr(lr: float, round_: int, rounds: int, schedule: str = "constant", warmup: int = 0) -> float:
    """The local learning rate of round `round_` (1-based): linear warm-up, then constant or cosine to 0."""
    if warmup and round_ <= warmup:
        return lr * round_ / warmup
    if schedule == "cosine":
        span = max(rounds - warmup, 1)
        t = min(max(round_ - warmup - 1, 0) / span, 1.0)
        return lr * 0.5 * (1 + math.cos(math.pi * t))
    return lr


def epoch_order(n: int, gen: torch.Generator, weights: torch.Tensor | None = None) -> torch.Tensor:
    """One epoch of row positions: a permutation, or n weighted draws with replacement."""
    if weights is None:
        return torch.randperm(n, generator=gen)
    return torch.multinomial(weights, n, replacement=True, generator=gen)


def training_batch(images: torch.Tensor, idx: torch.Tensor, normalize: Callable[[torch.Tensor], torch.Tensor],
                   augment: bool, policy: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None,
                   gen: torch.Generator) -> torch.Tensor:
    """The rows `idx` of uint8 `images` as a normalised, augmented float batch (policy, then crop and flip)."""
    raw = images[idx]
    if policy is not None:
        raw = policy(raw, gen)
    x = normalize(raw)
    return augment_batch(x, gen) if augment else x


def local_sgd(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *,
              normalize: Callable[[torch.Tensor], torch.Tensor], epochs: int, batch_size: int, lr: float,
              momentum: float, weight_decay: float, gen: torch.Generator, augment: bool,
              sample_weights: torch.Tensor | None = None, prox_mu: float = 0.0,
              prox_ref: dict[str, torch.Tensor] | None = None, loss_fn: LossFn | None = None,
              extra_params: list[torch.Tensor] | None = None, optimizer: str = "sgd",
              after_step: Callable[[], None] | None = None,
              policy: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None) -> dict[str, float]:
    """Train `model` in place on (images uint8 (n,H,W,C), labels (n,)); returns mean loss and step count."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad] + list(extra_params or [])
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    loss_fn = loss_fn or F.cross_entropy
    ref = None
    if prox_mu > 0 and prox_ref is not None:
        ref = [(p, prox_ref[name].to(p.device)) for name, p in model.named_parameters() if name in prox_ref]
    n = len(labels)
    total, steps, nonfinite = 0.0, 0, 0
    for _ in range(epochs):
        order = epoch_order(n, gen, sample_weights)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            if len(idx) < 2 and n >= 2:
                continue  # BatchNorm cannot train on a single sample
            x = training_batch(images, idx, normalize, augment, policy, gen)
            y = labels[idx].to(x.device)
            loss = loss_fn(model(x), y)
            if ref is not None:
                loss = loss + 0.5 * prox_mu * sum(((p - r) ** 2).sum() for p, r in ref)
            if not torch.isfinite(loss):
                nonfinite += 1
                continue  # the update is dropped; the server also rejects non-finite weights
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if after_step is not None:
                after_step()  # e.g. clamp a learnable loss parameter
            total += float(loss.detach())
            steps += 1
    return {"loss": total / steps if steps else math.nan, "steps": float(steps), "nonfinite_steps": float(nonfinite)}


def logit_adjusted_loss(class_counts: torch.Tensor, tau: float, floor: float = 1e-6) -> LossFn:
    """Cross-entropy on z + τ·log π with π a client's own class shares (the logit-adjusted loss of Menon et al.
    2021, computed with the local mix as FedLC does): the scores z learn p(x|y), not the site's mix, and a class
    the site never sees (π floored at `floor`) gets no push down from it."""
    counts = class_counts.to(torch.float64)
    offset = (tau * torch.log((counts / counts.sum()).clamp_min(floor))).to(torch.float32)

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits + offset.to(logits.device), y)

    return loss


def generator_on(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """`gen` where `device` is its device, else a generator on `device` seeded from a draw of `gen` (Opacus adds its
    noise on the parameters' device, and torch refuses a CPU generator for a CUDA tensor): as unpredictable as
    `gen`, and still reproducible from it where `gen` is seeded."""
    if torch.device(device).type == gen.device.type:
        return gen
    out = torch.Generator(device=device)
    out.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    return out


def dp_local_sgd(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *,
                 normalize: Callable[[torch.Tensor], torch.Tensor], epochs: int, batch_size: int, lr: float,
                 momentum: float, weight_decay: float, gen: torch.Generator, noise_gen: torch.Generator,
                 augment: bool, noise_multiplier: float, max_grad_norm: float, sample_rate: float,
                 prox_mu: float = 0.0, prox_ref: dict[str, torch.Tensor] | None = None, optimizer: str = "sgd",
                 policy: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None) -> dict[str, float]:
    """DP-SGD on one client (Opacus): E epochs of ⌈1/q⌉ steps, each on a Poisson sample of the rows (every row in
    with probability q, drawn from `noise_gen`, which the coordinator cannot reproduce); each image's gradient
    clipped to `max_grad_norm`, Gaussian noise of σ = noise_multiplier·max_grad_norm added to their sum, divided by
    the expected batch q·n. The model must have no BatchNorm (GroupNorm: tafl.training.models.norm_layer).

    A step whose Poisson sample is empty is skipped (probability (1 − q)^n, e^−batch_size at most); FedProx's
    proximal pull is applied after each noisy step, as a decoupled step that reads no data. `gen` still draws the
    augmentation. Returns mean loss, steps taken and steps counted for the accountant (`dp_steps`)."""
    import warnings

    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model.train()
    n = len(labels)
    # the first layer's input needs no gradient, so PyTorch notes that its backward hook fires on outputs: expected
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    gsm = GradSampleModule(model)
    params = [p for p in model.parameters() if p.requires_grad]
    base: torch.optim.Optimizer = (torch.optim.Adam(params, lr=lr, weight_decay=weight_decay) if optimizer == "adam"
                                   else torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay))
    opt = DPOptimizer(base, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                      expected_batch_size=max(1, int(round(sample_rate * n))),
                      generator=generator_on(noise_gen, params[0].device))
    ref = None
    if prox_mu > 0 and prox_ref is not None:
        ref = [(p, prox_ref[name].to(p.device)) for name, p in model.named_parameters() if name in prox_ref]
    total, steps, counted, nonfinite = 0.0, 0, 0, 0
    try:
        for _ in range(epochs):
            for _ in range(math.ceil(1.0 / sample_rate)):
                counted += 1
                idx = torch.nonzero(torch.rand(n, generator=noise_gen) < sample_rate).squeeze(1)
                if len(idx) == 0:
                    continue
                x = training_batch(images, idx, normalize, augment, policy, gen)
                loss = F.cross_entropy(gsm(x), labels[idx].to(x.device))
                opt.zero_grad(set_to_none=True)
                if not torch.isfinite(loss):
                    nonfinite += 1
                    continue
                loss.backward()
                opt.step()
                if ref is not None:
                    with torch.no_grad():
                        for p, r in ref:
                            p.sub_(lr * prox_mu * (p - r))
                total += float(loss.detach())
                steps += 1
    finally:
        gsm._close()  # removes Opacus's hooks and grad_sample attributes: the model is plain again
    return {"loss": total / steps if steps else math.nan, "steps": float(steps), "nonfinite_steps": float(nonfinite),
            "dp_steps": float(counted)}
