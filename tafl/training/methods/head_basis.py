"""The head basis and the feature cache a method composes for `train_scope: head` (docs/decisions.md, "The head under DP").

With `train_scope: head` the sites train only the classifier head, on the fixed extractor's features of their
images, as a step in a whitened basis the server computes from its unlabeled pool (`HeadBasis`, sent in the round's
payload under the `BASIS` keys; `BasisHead` is the step a site trains). `FeatureCache` keeps each client's features
while the extractor's weights stay the same, so a round re-reads no image.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from tafl.training.config import RunConfig
from tafl.training.contract import GlobalState, Tensors
from tafl.training.models import Classifier


def as_float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def weights_key(tensors: Tensors) -> str:
    """A digest of a set of weights: equal exactly when every tensor is bit for bit the same."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


BASIS = "head_basis."  # the payload keys of the server's head basis (train_scope head)


def split_basis(payload: Tensors) -> tuple[Tensors, Tensors | None]:
    """A round's payload without the head basis, and the basis (None when the run trains the whole network)."""
    basis = {k: v for k, v in payload.items() if k.startswith(BASIS)}
    return {k: v for k, v in payload.items() if not k.startswith(BASIS)}, (basis or None)


class BasisHead(nn.Module):
    """What a site trains with `train_scope: head`: a step (A, a) of the classifier head in the server's basis.

    The server sends the mean μ of its unlabeled pool's features and a whitening projection P (k × D, the pool's
    leading principal directions scaled to unit variance). The head becomes W + A·P, b + a − A·P·μ: the logits are
    the round's W·f + b plus A·P(f − μ) + a. A, a start at zero. Whitening makes plain SGD well conditioned (a
    fixed extractor's features share a mean far larger than their spread: 11.3 against 0.15 a dimension on
    DermaMNIST), and DP-SGD's noise grows with √(k·C), not √(D·C) (docs/decisions.md, "The head under DP"). The inputs are the
    rows [P(f − μ), W·f + b], computed once per round, so a step reads no image."""

    def __init__(self, k: int, num_classes: int, mean: torch.Tensor, proj: torch.Tensor):
        super().__init__()
        self.k = k
        self.delta = nn.Linear(k, num_classes)
        nn.init.zeros_(self.delta.weight)
        nn.init.zeros_(self.delta.bias)
        self.register_buffer("mean", mean)
        self.register_buffer("proj", proj)

    @classmethod
    def start(cls, head: nn.Linear, feats: torch.Tensor, basis: Tensors) -> tuple[BasisHead, torch.Tensor]:
        mean = basis[BASIS + "mean"].to(feats)
        proj = basis[BASIS + "proj"].to(feats)
        step = cls(proj.shape[0], head.out_features, mean, proj).to(feats.device)
        with torch.no_grad():
            rows = torch.cat([(feats - mean) @ proj.t(), head(feats)], 1)
        return step, rows

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.delta(rows[:, :self.k]) + rows[:, self.k:]

    def finish(self, head: nn.Linear) -> None:
        """Fold the step into `head` in place: W += A·P, b += a − A·P·μ."""
        with torch.no_grad():
            ap = self.delta.weight @ self.proj
            head.weight.add_(ap)
            head.bias.add_(self.delta.bias - ap @ self.mean)


class FeatureCache:
    """The fixed extractor's features of each client's training rows (eval mode, no augmentation), kept while the
    extractor's weights stay the same (GTAFL's SimCLR moves them every few rounds). Client id -1 is the server's
    pool."""

    def __init__(self, cfg: RunConfig, model: Classifier, normalize: Callable[[torch.Tensor], torch.Tensor]):
        self.cfg, self.model, self.normalize = cfg, model, normalize
        # client -> ((rows, extractor digest), the fixed extractor's features (n, D))
        self._features: dict[int, tuple[tuple[int, str], torch.Tensor]] = {}

    def __call__(self, client_id: int, images_u8: torch.Tensor) -> torch.Tensor:
        """images_u8: uint8 (n, H, W, C) -> features (n, D) on the model's device."""
        ext = self.model.extractor
        key = (len(images_u8), weights_key(ext.state_dict()))
        hit = self._features.get(client_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        was = ext.training
        ext.eval()
        with torch.no_grad():
            feats = torch.cat([ext(self.normalize(images_u8[i:i + self.cfg.eval_batch_size]))
                               for i in range(0, len(images_u8), self.cfg.eval_batch_size)])
        ext.train(was)
        self._features[client_id] = (key, feats)
        return feats


class HeadBasis:
    """The server's side of `train_scope: head`: what a training round's payload adds (`BasisHead`), the mean of the
    server pool's features under the round's extractor and the whitening projection onto their leading principal
    directions; computed once per extractor."""

    def __init__(self, cfg: RunConfig, model: Classifier, features: FeatureCache):
        self.cfg, self.model, self.features = cfg, model, features
        self._last: tuple[str, Tensors] | None = None  # (extractor digest, its basis)

    def payload(self, state: GlobalState, pool: torch.Tensor | None) -> Tensors:
        """{BASIS + "mean": (D,), BASIS + "proj": (k, D)} with `train_scope: head`; empty otherwise.
        pool: uint8 (N, H, W, C), the server's unlabeled images."""
        if self.cfg.train_scope != "head":
            return {}
        key = weights_key({k: v for k, v in state.weights.items() if k.startswith("extractor.")})
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        own = self.model.state_dict().keys()
        self.model.load_state_dict({k: v for k, v in state.weights.items() if k in own})
        feats = self.features(-1, pool).double()
        mean = feats.mean(0)
        _, sing, vt = torch.linalg.svd(feats - mean, full_matrices=False)
        spread = sing / math.sqrt(max(1, len(feats) - 1))
        k = int(min(self.cfg.head_basis_dim, int((spread > 1e-6 * spread[0]).sum())))
        basis = {BASIS + "mean": mean.float().cpu(), BASIS + "proj": (vt[:k] / spread[:k, None]).float().cpu()}
        self._last = (key, basis)
        return basis
