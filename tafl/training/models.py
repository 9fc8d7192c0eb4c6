"""Backbones by name, each split into a feature extractor and a linear head.

`resnet8` is CReFF's ResNet-8 (3×3 conv, one BasicBlock per stage at 64/128/256 channels times
`width`, global average pooling); `vit_tafl_tiny` is a small timm ViT that trains on 28×28 on a
CPU, with timm's patch embedding or (`tokenizer: conv`) a convolutional tokenizer; any other timm ViT is built with `timm.create_model(name, pretrained=False, img_size=...,
patch_size=..., in_chans=..., num_classes=0)`. The frozen `ModelConfig` travels in every
checkpoint and package, so a checkpoint alone rebuilds its model.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import nn

from tafl.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    backbone: str  # resnet8 | vit_tafl_tiny | a timm ViT name
    num_classes: int
    in_chans: int  # 1 or 3
    img_size: int  # square input side
    width: float = 1.0  # resnet8 channel multiplier (1.0 = 64-128-256)
    patch_size: int | None = None  # ViT patch side (None: chosen for img_size)
    embed_dim: int | None = None  # ViT overrides (None: the backbone's own)
    depth: int | None = None
    num_heads: int | None = None
    tokenizer: str = "patch"  # ViT tokens: patch (one linear patch embedding) | conv (a small conv stem)
    norm: str = "batch"  # resnet8 normalisation: batch | group (GroupNorm: what DP-SGD needs, no running statistics)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        try:
            return cls(**d)
        except TypeError as exc:
            raise CheckpointError(f"model config {d} does not describe a tafl model ({exc})") from exc

    @property
    def is_vit(self) -> bool:
        return self.backbone != "resnet8"


# ---------------------------------------------------------------- ResNet-8
def norm_layer(kind: str, channels: int) -> nn.Module:
    """BatchNorm, or GroupNorm with up to 16 groups (per-image statistics: DP-SGD's per-sample gradients need
    them, and nothing of one image's batch-mates leaks into its output)."""
    if kind == "group":
        return nn.GroupNorm(math.gcd(16, channels), channels)
    if kind != "batch":
        raise ConfigError(f"unknown normalisation {kind!r}: batch or group")
    return nn.BatchNorm2d(channels)


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm: str = "batch"):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = norm_layer(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(norm, planes)
        self.relu = nn.ReLU(inplace=norm == "batch")  # in place breaks per-sample gradient hooks (DP)
        self.downsample = (nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), norm_layer(norm, planes))
                           if stride != 1 or in_planes != planes else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class ResNet8(nn.Module):
    """Feature extractor: (B, C, H, W) -> (B, 256·width)."""

    def __init__(self, in_chans: int = 3, width: float = 1.0, norm: str = "batch"):
        super().__init__()
        c1, c2, c3 = (max(1, int(round(c * width))) for c in (64, 128, 256))
        self.conv1 = nn.Conv2d(in_chans, c1, 3, 1, 1, bias=False)
        self.bn1 = norm_layer(norm, c1)
        self.relu = nn.ReLU(inplace=norm == "batch")  # in place breaks per-sample gradient hooks (DP)
        self.layer1 = BasicBlock(c1, c1, norm=norm)
        self.layer2 = BasicBlock(c1, c2, stride=2, norm=norm)
        self.layer3 = BasicBlock(c2, c3, stride=2, norm=norm)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.num_features = c3
        for m in self.modules():  # CReFF's initialisation
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / n))
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward_maps(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        return self.layer3(self.layer2(self.layer1(x)))  # (B, D, H/4, W/4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.forward_maps(x)).flatten(1)  # (B, D)


# ---------------------------------------------------------------- ViT (timm)
class ConvTokenizer(nn.Module):
    """Patch tokens from a small convolutional stem (the compact-transformer tokenizer).

    log2(patch) stages of conv 3×3 (stride 1) → ReLU → max-pool 3×3 stride 2: a 28×28 image with
    patch 4 becomes a 7×7 grid, token (i, j) centred on the pixels the patch (i, j) covers, so the
    rollout's grid still maps onto image regions. A drop-in for timm's `PatchEmbed` (same
    attributes: img_size, patch_size, grid_size, num_patches, feat_ratio, output (B, N, D)).
    """

    def __init__(self, img_size: int | tuple[int, int] = 28, patch_size: int | tuple[int, int] = 4,
                 in_chans: int = 3, embed_dim: int = 96, bias: bool = True, hidden: int = 32, **_: Any):
        super().__init__()
        side = img_size if isinstance(img_size, int) else int(img_size[0])
        p = patch_size if isinstance(patch_size, int) else int(patch_size[0])
        stages = int(round(math.log2(p))) if p >= 1 else -1
        if stages < 1 or 2 ** stages != p:
            raise ConfigError(f"the conv tokenizer needs a patch size that is a power of two >= 2, got {p}")
        if side % p:
            raise ConfigError(f"the conv tokenizer needs img_size divisible by the patch size ({side} % {p})")
        layers: list[nn.Module] = []
        chans = in_chans
        for i in range(stages):
            out = embed_dim if i == stages - 1 else hidden
            layers += [nn.Conv2d(chans, out, 3, 1, 1, bias=bias and i == stages - 1), nn.ReLU(inplace=True),
                       nn.MaxPool2d(3, 2, 1)]
            chans = out
        self.proj = nn.Sequential(*layers)
        self.img_size = (side, side)
        self.patch_size = (p, p)
        self.grid_size = (side // p, side // p)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten = True
        self.dynamic_img_pad = False
        for m in self.proj:
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")

    def feat_ratio(self, as_scalar: bool = True) -> int | tuple[int, int]:
        return self.patch_size[0] if as_scalar else self.patch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, gh·gw, D)


TOKENIZERS = ("patch", "conv")


def _auto_patch(img_size: int) -> int:
    """Largest divisor p <= 16 of img_size leaving a grid of at least 7×7 patches."""
    best = 1
    for p in range(1, 17):
        if img_size % p == 0 and img_size // p >= 7:
            best = p
    return best


def _build_vit(cfg: ModelConfig, pretrained: bool) -> nn.Module:
    import timm

    kwargs: dict[str, Any] = {}
    name = cfg.backbone
    if name == "vit_tafl_tiny":
        name = "vit_tiny_patch16_224"
        kwargs.update(embed_dim=96, depth=4, num_heads=3, mlp_ratio=2.0)
        patch = cfg.patch_size or _auto_patch(cfg.img_size)
    else:
        patch = cfg.patch_size
    if patch is not None:
        kwargs["patch_size"] = patch
    for key in ("embed_dim", "depth", "num_heads"):
        if getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    if cfg.tokenizer not in TOKENIZERS:
        raise ConfigError(f"unknown tokenizer '{cfg.tokenizer}': choose {' or '.join(TOKENIZERS)}")
    if cfg.tokenizer == "conv":
        if pretrained:
            raise ConfigError("hub weights have a patch embedding: use tokenizer 'patch' with pretrained weights")
        kwargs["embed_layer"] = ConvTokenizer
    try:
        model = timm.create_model(name, pretrained=pretrained, img_size=cfg.img_size, in_chans=cfg.in_chans,
                                  num_classes=0, **kwargs)
    except RuntimeError as exc:
        raise ConfigError(f"cannot build timm model '{cfg.backbone}': {exc}") from exc
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot build timm model '{cfg.backbone}' at img_size {cfg.img_size} "
                          f"(patch {patch}): {exc}") from exc
    for blk in getattr(model, "blocks", []):
        if hasattr(blk, "attn") and hasattr(blk.attn, "fused_attn"):
            blk.attn.fused_attn = False  # attention probabilities must be observable for rollout
    if hasattr(model, "blocks"):
        install_taps(model)
    return model


# ---------------------------------------------------------------- attention taps (heatmaps)
class AttnTap(nn.Module):
    """Stands in for `attn_drop`: records the attention probabilities, then applies the dropout."""

    def __init__(self, drop: nn.Module):
        super().__init__()
        self.drop = drop
        self.maps: list[torch.Tensor] = []
        self.record = False

    def forward(self, attn: torch.Tensor) -> torch.Tensor:  # (B, heads, N, N)
        if self.record:
            self.maps.append(attn)
        return self.drop(attn)


def install_taps(vit: nn.Module) -> list[AttnTap]:
    taps = []
    for blk in vit.blocks:
        if not isinstance(blk.attn.attn_drop, AttnTap):
            blk.attn.attn_drop = AttnTap(blk.attn.attn_drop)
        taps.append(blk.attn.attn_drop)
    return taps


# ---------------------------------------------------------------- the split model
class Classifier(nn.Module):
    """A feature extractor and a linear head: `extractor.*` and `head.*` in the state dict."""

    def __init__(self, extractor: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.extractor = extractor
        self.head = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.extractor(x)  # (B, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, C)

    @property
    def domain_dim(self) -> int:
        """The width of `domain_features`."""
        return 2 * self.feature_dim if is_vit_extractor(self.extractor) else self.feature_dim

    def domain_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, domain_dim): what the in-domain detector scores (tafl.training.detector). A CNN's pooled features; a
        ViT's class token and mean patch token *before* its final LayerNorm, which would normalise away the contrast
        that tells a blank frame or a digit from skin (docs/results.md, "The in-domain detector")."""
        if not is_vit_extractor(self.extractor):
            return self.features(x)
        with PreNormTap(self.extractor) as tap:
            self.extractor(x)
        return tap.domain_features()


def is_vit_extractor(extractor: nn.Module) -> bool:
    return hasattr(extractor, "blocks") and hasattr(extractor, "norm")


class PreNormTap:
    """Records the tokens a timm ViT's final norm receives (a forward pre-hook on `extractor.norm`), while in use."""

    def __init__(self, extractor: nn.Module):
        self.extractor, self.tokens, self._hook = extractor, None, None

    def __enter__(self) -> PreNormTap:
        self._hook = self.extractor.norm.register_forward_pre_hook(self._record)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hook.remove()

    def _record(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.tokens = args[0]

    def domain_features(self) -> torch.Tensor:
        t = self.tokens  # (B, prefix + patches, D)
        n = int(getattr(self.extractor, "num_prefix_tokens", 1))
        first = t[:, 0] if n > 0 else t.mean(dim=1)
        return torch.cat([first, t[:, n:].mean(dim=1)], dim=1)


def _build_resnet8(cfg: ModelConfig, pretrained: bool) -> nn.Module:
    if pretrained:
        raise ConfigError("resnet8 has no hub weights; pass a local weights file to --pretrained")
    return ResNet8(cfg.in_chans, cfg.width, cfg.norm)


# extractor builders by name, (config, hub weights?) -> extractor with `num_features`; any other name is a timm ViT
BACKBONES: dict[str, Callable[[ModelConfig, bool], nn.Module]] = {"resnet8": _build_resnet8,
                                                                   "vit_tafl_tiny": _build_vit}


def _builder(name: str) -> Callable[[ModelConfig, bool], nn.Module]:
    if name in BACKBONES:
        return BACKBONES[name]
    import timm

    if not (name.startswith(("vit_", "deit", "eva", "beit")) and name in timm.list_models()):
        vits = ", ".join(timm.list_models("vit_tiny*")[:3])
        raise ConfigError(f"unknown backbone '{name}': use {', '.join(BACKBONES)} or a timm ViT name (e.g. {vits})")
    return _build_vit


def build_model(cfg: ModelConfig, pretrained: str | None = None) -> Classifier:
    """Build the model a config describes; `pretrained` is a weights file or 'hub'."""
    build = _builder(cfg.backbone)
    if cfg.in_chans not in (1, 3):
        raise ConfigError(f"in_chans must be 1 or 3, got {cfg.in_chans}")
    hub = pretrained == "hub"
    extractor = build(cfg, hub)
    model = Classifier(extractor, int(extractor.num_features), cfg.num_classes)
    if pretrained and not hub:
        load_pretrained(model, pretrained)
    return model


def load_pretrained(model: Classifier, path: str) -> None:
    """Load local weights into the extractor: a tafl checkpoint, or a state dict of the extractor or whole model."""
    from pathlib import Path

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"--pretrained {p}: file not found")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"--pretrained {p}: not a loadable weights file ({type(exc).__name__}: {exc})") from exc
    if isinstance(obj, dict) and "state" in obj and isinstance(obj["state"], dict):
        obj = obj["state"].get("weights", obj["state"])
    if isinstance(obj, dict) and "state_dict" in obj:
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CheckpointError(f"--pretrained {p}: expected a state dict")
    own = model.extractor.state_dict()
    mapped = {}
    for k, v in obj.items():
        key = k[len("extractor."):] if k.startswith("extractor.") else k
        if key in own and own[key].shape == v.shape:
            mapped[key] = v
    if not mapped:
        raise CheckpointError(f"--pretrained {p}: no tensor matches the {type(model.extractor).__name__} extractor")
    missing = [k for k in own if k not in mapped]
    model.extractor.load_state_dict(mapped, strict=False)
    log.info("loaded %d/%d extractor tensors from %s (%d left at initialisation)", len(mapped), len(own), p,
             len(missing))
