"""Backbones by name: shapes, the extractor/head split, widths, local weights."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.errors import CheckpointError, ConfigError  # noqa: E402
from tafl.training.models import ModelConfig, ResNet8, build_model  # noqa: E402


@pytest.mark.parametrize("backbone,size,chans", [("resnet8", 28, 3), ("resnet8", 16, 1), ("vit_tafl_tiny", 28, 3),
                                                 ("vit_tafl_tiny", 32, 1), ("vit_tiny_patch16_224", 32, 3)])
def test_backbones_split_into_extractor_and_head(backbone, size, chans):
    cfg = ModelConfig(backbone, num_classes=7, in_chans=chans, img_size=size, width=0.25,
                      patch_size=8 if backbone == "vit_tiny_patch16_224" else None)
    m = build_model(cfg).eval()
    x = torch.randn(2, chans, size, size)
    feats = m.features(x)
    assert feats.shape == (2, m.feature_dim)
    assert torch.allclose(m(x), m.head(feats), atol=1e-6)
    keys = m.state_dict().keys()
    assert all(k.startswith(("extractor.", "head.")) for k in keys)
    assert m.head.weight.shape == (7, m.feature_dim)


def test_resnet8_width_sets_channels():
    assert ResNet8(3, 1.0).num_features == 256
    assert ResNet8(3, 0.25).num_features == 64
    full = sum(p.numel() for p in ResNet8(3, 1.0).parameters())
    quarter = sum(p.numel() for p in ResNet8(3, 0.25).parameters())
    assert full > 10 * quarter


def test_vit_attention_is_not_fused():
    m = build_model(ModelConfig("vit_tafl_tiny", 3, 3, 28))
    assert all(blk.attn.fused_attn is False for blk in m.extractor.blocks)


def test_unknown_backbone_and_hub_resnet():
    with pytest.raises(ConfigError, match="unknown backbone"):
        build_model(ModelConfig("resnet9000", 3, 3, 28))
    with pytest.raises(ConfigError, match="no hub weights"):
        build_model(ModelConfig("resnet8", 3, 3, 28), pretrained="hub")


def test_pretrained_local_weights_load_into_extractor(tmp_path):
    cfg = ModelConfig("resnet8", 5, 3, 16, width=0.25)
    src = build_model(cfg)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    dst = build_model(cfg, pretrained=str(tmp_path / "w.pt"))
    for k, v in src.extractor.state_dict().items():
        assert torch.equal(v, dst.extractor.state_dict()[k])
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        build_model(cfg, pretrained=str(tmp_path / "bad.pt"))
    with pytest.raises(ConfigError, match="not found"):
        build_model(cfg, pretrained=str(tmp_path / "missing.pt"))


def test_build_model_builds_from_the_backbone_registry(monkeypatch):
    from torch import nn

    from tafl.training import models

    assert set(models.BACKBONES) == {"resnet8", "vit_tafl_tiny"}

    class Tiny(nn.Module):
        num_features = 4

        def __init__(self, cfg):
            super().__init__()
            self.lin = nn.Linear(cfg.in_chans * cfg.img_size ** 2, 4)

        def forward(self, x):
            return self.lin(x.flatten(1))

    monkeypatch.setitem(models.BACKBONES, "tiny_mlp", lambda cfg, hub: Tiny(cfg))
    m = build_model(ModelConfig("tiny_mlp", num_classes=3, in_chans=1, img_size=8))
    assert isinstance(m.extractor, Tiny) and m(torch.randn(2, 1, 8, 8)).shape == (2, 3)
    with pytest.raises(ConfigError, match="use resnet8, vit_tafl_tiny, tiny_mlp or a timm ViT"):
        build_model(ModelConfig("resnet9000", 3, 3, 28))
