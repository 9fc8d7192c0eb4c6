"""ViT-DAFL: the imbalance statistics, the loss, γ's clamp, aggregation weights, rollout, end to end."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")
from torch.nn import functional as F  # noqa: E402

from tafl.training.explain import attention_rollout, grad_rollout, rollout_from, vit_with_attention  # noqa: E402
from tafl.training.contract import ClientData  # noqa: E402
from tafl.training.methods.dafl import DAFLLoss, aggregation_weights, class_imbalance, client_imbalance  # noqa: E402
from tafl.training.models import ModelConfig, build_model  # noqa: E402
from tafl.training.simulator import make_method, prepare, train  # noqa: E402


def test_client_imbalance_by_hand():
    # N = 10: (10−6)/6, (10−3)/3, (10−1)/1 -> mean
    assert client_imbalance(torch.tensor([6, 3, 1])) == pytest.approx((4 / 6 + 7 / 3 + 9 / 1) / 3)


def test_missing_class_guard():
    # a missing class counts (N − 0)/1 = N, not N/ε = 10⁶·N
    c = client_imbalance(torch.tensor([5, 5, 0]))
    assert c == pytest.approx((1 + 1 + 10) / 3)
    assert c < 100


def test_class_imbalance_by_hand():
    counts = torch.tensor([[6.0, 3.0, 1.0], [2.0, 0.0, 8.0]])
    # totals per class 8, 3, 9; N = 20
    assert class_imbalance(counts).tolist() == pytest.approx([12 / 8, 17 / 3, 11 / 9])
    assert class_imbalance(torch.tensor([[4.0, 0.0]])).tolist() == pytest.approx([0.0, 4.0])  # guard: /max(0, 1)


def test_aggregation_weights_sum_to_one_and_favour_balanced_clients():
    w = aggregation_weights([0.5, 2.0, 10.0])
    assert sum(w) == pytest.approx(1.0)
    assert w[0] > w[1] > w[2]
    assert w[0] / w[1] == pytest.approx(4.0, rel=1e-4)


def test_loss_equals_cross_entropy_when_gamma_and_c_are_zero():
    torch.manual_seed(0)
    logits, y = torch.randn(16, 5), torch.randint(0, 5, (16,))
    loss = DAFLLoss(torch.zeros(5), gamma=0.0, learnable=False)
    assert torch.allclose(loss(logits, y), F.cross_entropy(logits, y), atol=1e-6)


def test_loss_by_hand_with_coefficients():
    logits, y = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    coef = torch.tensor([3.0, 0.5])
    p = logits.softmax(1)[torch.arange(2), y]
    expected = -((1 + coef[y]) * (1 - p) ** 2 * p.log()).mean()
    assert torch.allclose(DAFLLoss(coef, 2.0, False)(logits, y), expected)


def test_gamma_stays_inside_its_clamp():
    torch.manual_seed(0)
    loss = DAFLLoss(torch.ones(3), gamma=2.0, learnable=True, gamma_max=5.0)
    opt = torch.optim.SGD([loss.gamma], lr=100.0)  # a step size that would throw γ far out
    for _ in range(20):
        logits, y = torch.randn(8, 3), torch.randint(0, 3, (8,))
        opt.zero_grad()
        loss(logits, y).backward()
        opt.step()
        loss.clamp_()
        assert 0.0 <= float(loss.gamma) <= 5.0
    assert float(loss.gamma) == 5.0  # ∂L/∂γ ≤ 0: unclamped, γ only grows


def test_rollout_of_identity_attention_is_uniform():
    n, grid = 1 + 16, (4, 4)
    attns = [torch.eye(n).expand(2, 3, n, n) for _ in range(4)]
    heat = rollout_from(attns, 1, grid, (28, 28))
    assert heat.shape == (2, 28, 28)
    assert torch.allclose(heat, torch.ones_like(heat))


def test_rollout_shape_range_and_taps_do_not_change_the_model():
    import timm

    cfg = ModelConfig("vit_tafl_tiny", 4, 3, 28)
    model = build_model(cfg).eval()
    x = torch.randn(3, 3, 28, 28)
    feats, attns = vit_with_attention(model.extractor, x)
    assert len(attns) == 4 and attns[0].shape == (3, 3, 50, 50)  # 7×7 patches + class token
    assert torch.allclose(attns[0].sum(-1), torch.ones(3, 3, 50), atol=1e-5)
    fused = timm.create_model("vit_tiny_patch16_224", img_size=28, patch_size=4, in_chans=3, num_classes=0,
                              embed_dim=96, depth=4, num_heads=3, mlp_ratio=2.0).eval()
    fused.load_state_dict(model.extractor.state_dict())
    assert torch.allclose(fused(x), feats, atol=1e-5)
    for heat in (attention_rollout(model.extractor, x), grad_rollout(model.extractor, model.head, x)):
        assert heat.shape == (3, 28, 28)
        assert float(heat.min()) >= 0 and float(heat.max()) == pytest.approx(1.0)


def _dafl(cfg, **kw):
    cfg.method, cfg.backbone, cfg.optimizer, cfg.lr, cfg.img_size = "dafl", "vit_tafl_tiny", "adam", 0.002, 16
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.slow
def test_dafl_two_rounds_end_to_end_and_explain(tmp_path, smoke_cfg):
    out = tmp_path / "run"
    report = train(_dafl(smoke_cfg), out, progress=False)
    assert report["method"] == "dafl" and report["loss"] == "dafl"
    assert 0 <= report["gamma"] <= 5 and len(report["gamma_history"]) == 2
    assert report["uniform_metrics"]["auc"] is not None and report["natural_metrics"]["accuracy"] > 0
    assert (out / "confusion.png").stat().st_size > 1000 and (out / "roc.png").stat().st_size > 1000
    from PIL import Image

    img = tmp_path / "digit.png"
    Image.fromarray((torch.rand(40, 30) * 255).byte().numpy(), "L").save(img)
    from tafl.cli import main

    assert main(["explain", str(out / "final.pt"), str(img), "--out", str(tmp_path / "ov.png")]) == 0
    ov = Image.open(tmp_path / "ov.png")
    assert ov.size == (30, 40) and ov.mode == "RGB"
    assert main(["explain", str(out / "final.pt"), str(img), "--out", str(tmp_path / "g.png"), "--kind", "grad"]) == 0


@pytest.mark.parametrize("loss,agg", [("ce", "size"), ("focal", "imbalance")])
def test_loss_and_aggregation_options_run_one_round(tmp_path, smoke_cfg, loss, agg):
    report = train(_dafl(smoke_cfg, rounds=1, loss=loss, aggregation=agg), tmp_path / "r", progress=False)
    assert report["loss"] == loss and report["aggregation"] == agg
    if loss == "ce":
        assert report["gamma"] == 0.0


def test_nan_loss_client_is_dropped_and_single_class_client_trains(smoke_cfg, caplog):
    cfg = _dafl(smoke_cfg)
    prep = prepare(cfg)
    m = make_method(cfg, prep.model_cfg, prep.dataset.preprocess)
    images, labels = torch.from_numpy(prep.train.images), torch.from_numpy(prep.train.labels)
    clients = [ClientData(k, images, labels, torch.from_numpy(p), 10) for k, p in enumerate(prep.parts)]
    state = m.init_state(prep.train_counts)
    single = ClientData(99, images, labels, torch.nonzero(labels == int(labels[0])).squeeze(1)[:20], 10)
    stats = {c.client_id: m.client_stats(c) for c in clients + [single]}
    rcfg = m.round_config(state, stats, 1)
    payload = m.broadcast(state)
    ok = m.client_update(payload, clients[0], rcfg)
    one = m.client_update(payload, single, rcfg)
    assert one.metrics["steps"] > 0 and torch.isfinite(one.extras["gamma"]).all()
    poisoned = dict(payload)
    poisoned["head.weight"] = torch.full_like(payload["head.weight"], float("nan"))  # every loss is NaN
    with caplog.at_level(logging.WARNING):
        bad = m.client_update(poisoned, clients[1], rcfg)
        assert bad.metrics["steps"] == 0
        new = m.server_update(state, [ok, one, bad], 1)
    assert "non-finite loss" in caplog.text and "dropping client 1" in caplog.text
    assert new.meta["dropped"] == [1]
    assert sum(new.meta["aggregation_weights"].values()) == pytest.approx(1.0)
    assert all(torch.isfinite(v).all() for v in new.weights.values() if v.is_floating_point())
