"""Server-side SimCLR refinement of the shared feature extractor on unlabeled images.

Two augmented views of each pool image (random resized crop, horizontal flip, brightness and
contrast jitter, done batched on the normalised tensor with `grid_sample`), a projection head
(D → D → proj_dim, kept across rounds), and the NT-Xent loss with temperature τ. Every draw
comes from the caller's generator, so refinement is deterministic and resumable.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F


class ProjectionHead(nn.Module):
    def __init__(self, dim: int, proj_dim: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, proj_dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.5) -> torch.Tensor:
    """NT-Xent over 2N views: view i's positive is its pair, the other 2N − 2 views are negatives."""
    n = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2]), dim=1)  # (2N, P)
    sim = z @ z.t() / tau  # (2N, 2N)
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, target)


def augment_views(x: torch.Tensor, gen: torch.Generator, scale: tuple[float, float] = (0.4, 1.0),
                  jitter: float = 0.4) -> torch.Tensor:
    """One random view per image of x (B, C, H, W): resized crop + flip + brightness/contrast."""
    b = x.shape[0]
    area = torch.empty(b).uniform_(scale[0], scale[1], generator=gen)
    log_ratio = torch.empty(b).uniform_(math.log(3 / 4), math.log(4 / 3), generator=gen)
    ratio = torch.exp(log_ratio)
    sw = torch.sqrt(area * ratio).clamp(max=1.0)  # crop width / image width
    sh = torch.sqrt(area / ratio).clamp(max=1.0)
    tx = (torch.rand(b, generator=gen) * 2 - 1) * (1 - sw)
    ty = (torch.rand(b, generator=gen) * 2 - 1) * (1 - sh)
    flip = torch.where(torch.rand(b, generator=gen) < 0.5, -1.0, 1.0)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = sw * flip, tx
    theta[:, 1, 1], theta[:, 1, 2] = sh, ty
    grid = F.affine_grid(theta.to(x), list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    contrast = 1 + (torch.rand(b, 1, 1, 1, generator=gen) * 2 - 1) * jitter
    bright = (torch.rand(b, 1, 1, 1, generator=gen) * 2 - 1) * jitter
    mean = out.mean(dim=(1, 2, 3), keepdim=True)
    return (out - mean) * contrast.to(x) + mean + bright.to(x)


def simclr_refine(extractor: nn.Module, head: ProjectionHead, pool_u8: torch.Tensor,
                  normalize: Callable[[torch.Tensor], torch.Tensor], *, steps: int, batch: int, lr: float,
                  tau: float, gen: torch.Generator) -> float:
    """`steps` SGD steps (momentum 0.9) of NT-Xent on the extractor and head; returns the mean loss."""
    extractor.train()
    head.train()
    params = list(extractor.parameters()) + list(head.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    n = len(pool_u8)
    batch = min(batch, n)
    total = 0.0
    for _ in range(steps):
        idx = torch.randperm(n, generator=gen)[:batch]
        x = normalize(pool_u8[idx])
        v1, v2 = augment_views(x, gen), augment_views(x, gen)
        z = head(extractor(torch.cat([v1, v2])))
        loss = nt_xent(z[:batch], z[batch:], tau)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return total / max(steps, 1)
