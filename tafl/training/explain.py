"""Heatmaps: attention rollout and gradient-weighted rollout for ViTs, class activation maps for CNNs.

Attention probabilities are observed through `models.AttnTap`, a module that replaces each timm block's
`attn.attn_drop` (fused attention is off), stores what it sees and passes it on; the rollout is
then plain tensor algebra inside `forward`, so it exports to ONNX with the rest of the graph.
Rollout (Abnar & Zuidema 2020): per layer, mean over heads, add the identity, renormalise rows,
multiply the layers in order; the class token's row over the patch tokens is the map. The
gradient-weighted variant (Chefer et al. 2021) first weighs each head's attention by the
positive part of its gradient for the explained class. Maps come back at the input's resolution,
scaled to [0, 1].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from tafl.training.models import AttnTap, install_taps  # noqa: F401  (install_taps: the exported graph's taps too)


def vit_with_attention(vit: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Pooled features (B, D) and each layer's attention probabilities [(B, heads, N, N)]."""
    taps = install_taps(vit)
    for t in taps:
        t.maps, t.record = [], True
    try:
        feats = vit(x)
        attns = [t.maps[-1] for t in taps]
    finally:
        for t in taps:
            t.maps, t.record = [], False
    return feats, attns


def rollout_from(attns: list[torch.Tensor], num_prefix: int, grid: tuple[int, int], size: tuple[int, int],
                 weights: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Rollout of per-layer attention (B, heads, N, N) -> heatmap (B, H, W) in [0, 1]."""
    n = attns[0].shape[-1]
    eye = torch.eye(n, dtype=attns[0].dtype, device=attns[0].device)
    result = eye.expand(attns[0].shape[0], n, n)
    for i, a in enumerate(attns):
        if weights is not None:
            a = (weights[i] * a).clamp_min(0)  # gradient-weighted: positive contributions only
        a = a.mean(dim=1) + eye  # (B, N, N)
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    cls = result[:, 0, num_prefix:]  # (B, gh·gw): how much each patch flows into the class token
    total = cls.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(cls, 1.0 / cls.shape[-1])
    cls = torch.where(total > 1e-12, cls / total.clamp_min(1e-12), uniform)
    return maps_to_image(cls.reshape(-1, 1, grid[0], grid[1]), size)


def maps_to_image(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(B, 1, h, w) -> (B, H, W) scaled so each map's maximum is 1."""
    up = F.interpolate(maps, size=size, mode="bilinear", align_corners=False)[:, 0]
    peak = up.amax(dim=(1, 2), keepdim=True)
    return torch.where(peak > 1e-12, up / peak.clamp_min(1e-12), torch.ones_like(up))


def vit_grid(vit: nn.Module) -> tuple[int, int]:
    return tuple(int(g) for g in vit.patch_embed.grid_size)  # type: ignore[return-value]


def attention_rollout(vit: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Attention rollout of a timm ViT for a normalised batch x (B, C, H, W) -> (B, H, W)."""
    with torch.no_grad():
        _, attns = vit_with_attention(vit, x)
    return rollout_from(attns, int(vit.num_prefix_tokens), vit_grid(vit), tuple(x.shape[-2:]))


def grad_rollout(vit: nn.Module, head: nn.Module, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient-weighted rollout for the `target` class (default: the predicted class)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(False)
        feats, attns = vit_with_attention(vit, x)
        logits = head(feats)
        if target is None:
            target = logits.argmax(dim=1)
        score = logits.gather(1, target.view(-1, 1)).sum()
        grads = torch.autograd.grad(score, attns)
    return rollout_from([a.detach() for a in attns], int(vit.num_prefix_tokens), vit_grid(vit), tuple(x.shape[-2:]),
                        weights=[g.detach() for g in grads])


def class_activation_map(cnn: nn.Module, weight: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CAM of a CNN extractor with `forward_maps`: Σ_d W[target, d]·maps_d, ReLU, at input size."""
    maps = cnn.forward_maps(x)  # (B, D, h, w)
    w = weight[target]  # (B, D)
    cam = torch.relu(torch.einsum("bd,bdhw->bhw", w, maps))[:, None]
    return maps_to_image(cam, tuple(x.shape[-2:]))


def explain_checkpoint(checkpoint: str | Path, image: str | Path, out: str | Path, kind: str = "rollout") -> dict:
    """`tafl explain`: a heatmap of one image under a saved model, written as an overlay PNG."""
    from PIL import Image

    from tafl.errors import ConfigError
    from tafl.imaging.heatmap import overlay
    from tafl.imaging import Preprocess, decode_file
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.contract import GlobalState
    from tafl.training.models import ModelConfig, build_model

    ck = load_checkpoint(checkpoint)
    mcfg = ModelConfig.from_dict(ck["model_config"])
    pre = Preprocess.from_dict(ck["preprocess"])
    frame = decode_file(image).frames[0]  # the service's decoder: DICOM, EXIF, alpha as served (a DataError else)
    model = build_model(mcfg).eval()
    state = GlobalState.from_dict(ck["state"])
    model.load_state_dict(state.weights)
    x = torch.from_numpy(pre([frame]))
    experts = state.extras.get("expert.weight")
    with torch.no_grad():
        feats = model.features(x)
        if experts is not None:  # GTAFL: explain the class the uniform-broken hard vote would pick
            from tafl.training.ensemble import ExpertEnsemble

            ens = ExpertEnsemble(model.extractor, experts, state.extras["expert.bias"],
                                 tuple(state.meta.get("experts", ())), state.meta.get("vote", "hard")).eval()
            voted = ens(x)  # not `out`: that is the overlay's path
            label, probs = voted["label"], voted["probs"]
            head_w = experts.mean(0)
        else:
            logits = model.head(feats)
            label, probs = logits.argmax(1), logits.softmax(1)
            head_w = model.head.weight
    if mcfg.is_vit:
        if kind == "grad":
            if experts is not None:
                raise ConfigError("gradient-weighted rollout needs a single head; use --kind rollout for GTAFL")
            heat = grad_rollout(model.extractor, model.head, x, label)
        else:
            heat = attention_rollout(model.extractor, x)
    else:
        with torch.no_grad():  # the CAM is plain inference: no graph to keep (numpy refuses a tensor that has one)
            heat = class_activation_map(model.extractor, head_w, x, label)
    rgb = np.stack([frame] * 3, -1) if frame.ndim == 2 else frame
    Image.fromarray(overlay(rgb, heat[0].detach().numpy())).save(out)
    c = int(label[0])
    return {"label": c, "class_name": ck["class_names"][c], "probability": float(probs[0, c]),
            "heatmap": "attention rollout" if mcfg.is_vit and kind != "grad" else
            "gradient-weighted rollout" if mcfg.is_vit else "class activation map", "out": str(out)}
