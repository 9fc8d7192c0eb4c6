"""Issue 16: the conv-tokenizer ViT, the DAFL term scales, the local recipe (lr schedule, timm
policies) and the divergence guard."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")
from torch.nn import functional as F  # noqa: E402

from tafl.errors import ConfigError, TrainingDiverged  # noqa: E402
from tafl.training.config import RunConfig  # noqa: E402
from tafl.training.explain import attention_rollout  # noqa: E402
from tafl.training.local import PolicyAugment, scheduled_lr  # noqa: E402
from tafl.training.contract import GlobalState  # noqa: E402
from tafl.training.methods.dafl import class_imbalance, class_normaliser, loss_coefficients  # noqa: E402
from tafl.training.models import ConvTokenizer, ModelConfig, build_model  # noqa: E402
from tafl.training.simulator import check_divergence, train  # noqa: E402


# ---------------------------------------------------------------- the conv tokenizer
def test_conv_tokenizer_is_a_drop_in_patch_embedding():
    m = build_model(ModelConfig("vit_tafl_tiny", 7, 3, 28, tokenizer="conv"))
    pe = m.extractor.patch_embed
    assert isinstance(pe, ConvTokenizer) and pe.grid_size == (7, 7) and pe.num_patches == 49
    assert m.extractor.pos_embed.shape[1] == 49 + m.extractor.num_prefix_tokens
    assert m(torch.randn(2, 3, 28, 28)).shape == (2, 7)
    assert build_model(ModelConfig("vit_tafl_tiny", 7, 3, 64, tokenizer="conv")).extractor.patch_embed.grid_size == (8, 8)
    with pytest.raises(ConfigError, match="power of two"):
        build_model(ModelConfig("vit_tafl_tiny", 7, 3, 30, patch_size=3, tokenizer="conv"))
    with pytest.raises(ConfigError, match="unknown tokenizer"):
        build_model(ModelConfig("vit_tafl_tiny", 7, 3, 28, tokenizer="pixels"))
    # an old checkpoint's model config (no tokenizer key) still builds the patch ViT
    assert ModelConfig.from_dict({"backbone": "vit_tafl_tiny", "num_classes": 7, "in_chans": 3,
                                  "img_size": 28}).tokenizer == "patch"


def test_conv_tokens_map_to_their_image_region():
    """A change inside patch (0, 0) moves the tokens near it, never the far corner's."""
    torch.manual_seed(0)
    tok = ConvTokenizer(img_size=32, patch_size=4, in_chans=3, embed_dim=16).eval()
    x = torch.randn(1, 3, 32, 32)
    y = x.clone()
    y[..., :4, :4] += 5.0
    with torch.no_grad():
        d = (tok(y) - tok(x)).abs().sum(-1).reshape(8, 8)
    assert d[0, 0] > 0
    assert float(d[3:, 3:].max()) == 0.0  # the receptive field of two 3x3 conv + pool stages stays local


def _squares(n: int, side: int, gen: torch.Generator):
    """Noise with one 3x3 square whose colour (red or green) is the class; returns images, labels, corners."""
    x = torch.rand(n, 3, side, side, generator=gen) * 0.3
    y = torch.randint(0, 2, (n,), generator=gen)
    pos = torch.randint(0, side - 3 + 1, (n, 2), generator=gen)
    for i in range(n):
        r, c = int(pos[i, 0]), int(pos[i, 1])
        x[i, :, r:r + 3, c:c + 3] = 0.0
        x[i, int(y[i]), r:r + 3, c:c + 3] = 1.0
    return x, y, pos


def test_rollout_of_a_trained_conv_vit_follows_the_object():
    """Trained to tell the square's colour, the model's rollout puts its mass around the square."""
    torch.manual_seed(0)
    gen, side = torch.Generator().manual_seed(0), 12
    cfg = ModelConfig("vit_tafl_tiny", 2, 3, side, patch_size=2, tokenizer="conv", embed_dim=32, depth=2, num_heads=2)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    for _ in range(100):
        x, y, _ = _squares(32, side, gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    x, y, pos = _squares(48, side, gen)
    with torch.no_grad():
        assert float((model(x).argmax(1) == y).float().mean()) >= 0.9
        heat = attention_rollout(model.extractor, x)
    ratios = []
    for i in range(len(x)):
        r, c = int(pos[i, 0]), int(pos[i, 1])
        mask = torch.zeros(side, side)
        mask[max(r - 1, 0):r + 4, max(c - 1, 0):c + 4] = 1  # the square and a one-pixel margin
        ratios.append(float((heat[i] * mask).sum() / heat[i].sum() / mask.mean()))
    # rollout mass per pixel around the square, over its uniform share: 1.0 means no preference
    assert np.median(ratios) > 1.5 and np.mean(np.asarray(ratios) > 1.0) > 0.9, ratios


# ---------------------------------------------------------------- DAFL's term scales
DERMA = torch.tensor([228.0, 359, 769, 80, 779, 4693, 99])  # DermaMNIST's training counts


def test_mean_scale_by_hand():
    c_f = torch.tensor([1.0, 3.0, 8.0])
    got = loss_coefficients(50.0, c_f, 0.5, "mean", c_k_mean=100.0, class_norm=4.0)
    client = 51 / 101  # (1 + c_k) over the round's mean (1 + c_k)
    expected = [0.5 * client + 0.5 * (1 + c) / 4.0 - 1 for c in (1.0, 3.0, 8.0)]
    assert got.tolist() == pytest.approx(expected)
    paper = loss_coefficients(50.0, c_f, 0.5, "paper")
    assert paper.tolist() == pytest.approx([25.5, 26.5, 29.0])
    # the class part's normaliser is the number of classes present: (1 + c_f,t) = N / n_t
    assert class_normaliser(torch.tensor([[6.0, 3.0, 1.0], [2.0, 0.0, 8.0]])) == pytest.approx(3.0)


def test_mean_scale_keeps_the_loss_at_cross_entropy_scale_and_lets_the_class_term_work():
    counts = DERMA[None]
    c_f, norm = class_imbalance(counts), class_normaliser(counts)
    share = DERMA / DERMA.sum()
    paper = 1 + loss_coefficients(133.0, c_f, 0.5, "paper")
    mean = 1 + loss_coefficients(133.0, c_f, 0.5, "mean", c_k_mean=133.0, class_norm=norm)
    # the literal formula: the loss is ~70-110x cross-entropy and the classes' weights differ under 2x
    assert float((share * paper).sum()) > 60 and float(paper.max() / paper.min()) < 2
    # mean scale: the loss averages cross-entropy's scale over the samples, the rarest class weighs 10x+ the
    # majority, in the same order (the rarer, the heavier)
    assert float((share * mean).sum()) == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(mean.argsort(), paper.argsort()) and int(mean.argmax()) == 3
    assert float(mean[3] / mean[5]) > 10
    # λ = 0: the balanced class weight N / (C n_t) exactly
    lam0 = 1 + loss_coefficients(133.0, c_f, 0.0, "mean", c_k_mean=133.0, class_norm=norm)
    assert lam0.tolist() == pytest.approx((DERMA.sum() / (7 * DERMA)).tolist(), rel=1e-5)


# ---------------------------------------------------------------- the local recipe
def test_scheduled_lr_warms_up_then_follows_a_cosine():
    assert [scheduled_lr(1.0, r, 10) for r in (1, 5, 10)] == [1.0, 1.0, 1.0]
    assert [scheduled_lr(1.0, r, 10, "constant", 4) for r in (1, 2, 4, 5)] == [0.25, 0.5, 1.0, 1.0]
    cos = [scheduled_lr(1.0, r, 12, "cosine", 2) for r in range(1, 13)]
    assert cos[:3] == [0.5, 1.0, 1.0] and all(a >= b for a, b in zip(cos[2:], cos[3:]))
    assert cos[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 9 / 10))) and cos[-1] < 0.05


@pytest.mark.parametrize("policy,channels", [("trivial", 3), ("randaugment", 1)])
def test_policy_augment_changes_images_deterministically(policy, channels):
    batch = (torch.rand(16, 20, 20, channels) * 255).to(torch.uint8)
    aug = PolicyAugment(policy, channels)
    a = aug(batch, torch.Generator().manual_seed(3))
    b = aug(batch, torch.Generator().manual_seed(3))
    assert a.shape == batch.shape and a.dtype == torch.uint8 and torch.equal(a, b)
    assert (a != batch).flatten(1).any(1).float().mean() > 0.5


def test_recipe_keys_are_validated():
    for key, value in (("tokenizer", "pixels"), ("dafl_scale", "log"), ("augment_policy", "mixup"),
                       ("lr_schedule", "step"), ("warmup_rounds", 99)):
        with pytest.raises(ConfigError, match=key):
            RunConfig.from_dict({key: value}).validate()


# ---------------------------------------------------------------- the divergence guard
def _state(finite: bool = True) -> GlobalState:
    w = torch.zeros(3) if finite else torch.tensor([0.0, float("nan"), 1.0])
    return GlobalState({"head.weight": w, "n": torch.tensor(3)}, {}, {})


def _h(r, loss, dropped=(), share=0.0):
    return {"round": r, "clients": [0, 1], "loss": loss, "dropped": list(dropped), "nonfinite_share": share}


def test_divergence_rules():
    cfg = RunConfig.from_dict({"method": "dafl", "dafl_scale": "paper"}).validate()
    check_divergence([_h(1, 2.0), _h(2, 1.5, dropped=[1])], _state(), cfg)  # one client dropped: fine
    check_divergence([_h(1, 2.0), _h(2, float("nan"))], _state(), cfg)  # one bad round: not yet
    with pytest.raises(TrainingDiverged, match="NaN or Inf"):
        check_divergence([_h(1, 2.0)], _state(finite=False), cfg)
    with pytest.raises(TrainingDiverged, match="exploded from 2 .* to 2.5e\\+04.*dafl-scale mean"):
        check_divergence([_h(1, 2.0), _h(2, 2.5e4)], _state(), cfg)
    with pytest.raises(TrainingDiverged, match="2 rounds in a row"):
        check_divergence([_h(1, 2.0), _h(2, 3.0, dropped=[0, 1]), _h(3, float("nan"))], _state(), cfg)
    with pytest.raises(TrainingDiverged, match="2 rounds in a row"):
        check_divergence([_h(1, 2.0, share=0.9), _h(2, 2.0, share=0.8)], _state(), cfg)


def test_a_diverging_run_stops_with_a_clear_error_and_writes_no_model(tmp_path, smoke_cfg):
    smoke_cfg.lr, smoke_cfg.rounds = 1e8, 4  # SGD at 1e8: the weights overflow within a round or two
    with pytest.raises(TrainingDiverged, match="training diverged in round [12].*lower --lr"):
        train(smoke_cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "final.pt").exists()
    assert not (tmp_path / "run" / "report.json").exists()


# ---------------------------------------------------------------- the prior a class-weighted model describes
def test_dafl_posteriors_describe_the_loss_weighted_prior(smoke_cfg):
    from tafl.training.simulator import make_method, prepare

    smoke_cfg.method, smoke_cfg.dafl_scale = "dafl", "mean"
    prep = prepare(smoke_cfg)
    counts = {str(k): [float(v) for v in row] for k, row in enumerate(prep.client_counts)}
    state = GlobalState({}, {"global_counts": torch.tensor(prep.train_counts, dtype=torch.float32)},
                        {"client_counts": counts})
    train_mix = prep.train_counts / prep.train_counts.sum()
    for lam, loss in ((0.0, "dafl"), (0.5, "dafl"), (0.5, "ce")):
        smoke_cfg.dafl_lambda, smoke_cfg.loss = lam, loss
        src = make_method(smoke_cfg, prep.model_cfg, prep.dataset.preprocess).default_source_prior(state)
        assert src.sum() == pytest.approx(1.0)
        if loss == "ce":
            assert src == pytest.approx(train_mix)  # an unweighted loss: the training mix
        elif lam == 0.0:
            assert src == pytest.approx(np.full(len(src), 1 / len(src)), abs=1e-6)  # balanced weights: uniform
        else:  # between the two, and flatter than the training mix
            assert src.max() < train_mix.max() and src.min() > train_mix.min()
