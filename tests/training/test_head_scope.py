"""What a site trains (`train_scope`, docs/decisions.md, "The head under DP"): with 'head' the extractor never moves on a site, the
head's step lives in the server's whitened basis and folds back exactly, DP defaults to it, and the server can
pre-train the extractor by SimCLR on its own unlabeled images."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")
pytest.importorskip("opacus", reason="needs opacus and dp-accounting: the train extra")

from tafl.errors import ConfigError  # noqa: E402
from tafl.training.checkpoint import load_checkpoint  # noqa: E402
from tafl.training.config import load_config  # noqa: E402
from tafl.training.methods.head_basis import BASIS, BasisHead, split_basis  # noqa: E402
from tafl.training.models import ModelConfig, build_model  # noqa: E402
from tests.conftest import CONFIGS, SMOKE_GTAFL  # noqa: E402


def test_the_step_folds_into_the_head_exactly():
    """W + A·P and b + a − A·P·μ give, for any feature vector, the logits the step trained on."""
    g = torch.Generator().manual_seed(0)
    d, k, c = 12, 5, 4
    head = torch.nn.Linear(d, c)
    feats = torch.randn(30, d, generator=g) * 3 + 7
    basis = {BASIS + "mean": torch.randn(d, generator=g), BASIS + "proj": torch.randn(k, d, generator=g)}
    step, rows = BasisHead.start(head, feats, basis)
    assert torch.allclose(step(rows), head(feats), atol=1e-5)  # a step starts at zero
    with torch.no_grad():
        step.delta.weight.normal_(generator=g)
        step.delta.bias.normal_(generator=g)
        trained = step(rows)
    step.finish(head)
    with torch.no_grad():
        assert torch.allclose(head(feats), trained, atol=1e-4)


def test_payload_keys_of_the_basis_are_split_off():
    w, basis = split_basis({"head.weight": torch.zeros(1), BASIS + "mean": torch.ones(2)})
    assert list(w) == ["head.weight"] and list(basis) == [BASIS + "mean"]
    assert split_basis({"head.weight": torch.zeros(1)})[1] is None


def test_dp_trains_the_head_unless_told_otherwise():
    assert load_config(CONFIGS / "smoke.yaml", {"dp_epsilon": 8.0}).train_scope == "head"
    assert load_config(CONFIGS / "smoke.yaml", {"dp_epsilon": 8.0, "train_scope": "all"}).train_scope == "all"
    assert load_config(CONFIGS / "smoke.yaml", {"dp_epsilon": float("inf")}).train_scope == "all"
    assert load_config(CONFIGS / "smoke.yaml", {}).train_scope == "all"


def test_a_package_trained_before_the_scope_existed_says_the_whole_network():
    from types import SimpleNamespace

    from tafl.privacy_text import privacy_lines
    from tafl.training.privacy import privacy_section

    old = SimpleNamespace(dp_epsilon=8.0, dp_delta=1e-5, dp_stats_ratio=3.0, dp_clip=1.0, dp_feature_clip=0.8)
    p = privacy_section(old, None)
    assert p["dp_sgd_trains"] == "the whole network"
    assert "| DP-SGD trains | the whole network |" in privacy_lines({**p, "epsilon": 8.0})


@pytest.mark.parametrize("overrides,key,why", [
    ({"train_scope": "head", "method": "dafl", "backbone": "vit_tafl_tiny"}, "train_scope", "ViT-DAFL"),
    ({"train_scope": "head", "simclr_pool": "train"}, "simclr_pool", "sites' training images"),
    ({"dp_epsilon": 8.0, "pretrain_steps": 5, "simclr_pool": "train"}, "simclr_pool", "sites' training images"),
    ({"train_scope": "everything"}, "train_scope", "choose one of all, head"),
    ({"pretrain_steps": -1}, "pretrain_steps", "must be >= 0"),
    ({"head_basis_dim": 0}, "head_basis_dim", "must be >= 1"),
])
def test_scopes_that_cannot_hold_are_refused_before_training(overrides, key, why):
    with pytest.raises(ConfigError) as exc:
        load_config(CONFIGS / "smoke.yaml", overrides)
    assert f"config '{key}'" in str(exc.value) and why in str(exc.value)


def _extractor(state):
    return {k: v for k, v in state["weights"].items() if k.startswith("extractor.")}


def _initial_extractor(cfg):
    torch.manual_seed(cfg.seed)
    model = build_model(ModelConfig(backbone="resnet8", num_classes=10, in_chans=1, img_size=cfg.img_size,
                                    width=cfg.width, norm="group"))
    return {f"extractor.{k}": v for k, v in model.extractor.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("private", [False, True])
def test_sites_never_move_the_extractor_and_the_head_learns(tmp_path, private):
    """Two rounds on the smoke data: the extractor is bit for bit its seeded initialisation (the server pre-trained
    nothing), the head moved, and the model decides better than chance on validation (ten classes: 10 %)."""
    from tafl.training.simulator import train

    over = {"train_scope": "head", "decision": "validation", **({"dp_epsilon": 8.0} if private else {})}
    cfg = load_config(CONFIGS / "smoke.yaml", over)
    rep = train(cfg, tmp_path / "run", progress=False)
    state = load_checkpoint(tmp_path / "run" / "final.pt")["state"]
    init = _initial_extractor(cfg)
    ext = _extractor(state)
    assert ext.keys() == init.keys() and all(torch.equal(ext[k], init[k]) for k in init)
    assert float(state["weights"]["head.weight"].abs().sum()) > 0
    assert rep["validation"]["balanced_accuracy"] > (0.2 if private else 0.4), rep["validation"]
    # a site's update carries the head only: the whole run's uplink is less than one copy of the model
    model_bytes = sum(t.numel() * t.element_size() for t in state["weights"].values())
    assert 0 < rep["communication"]["uplink_bytes"] < model_bytes, (rep["communication"], model_bytes)
    if private:
        assert rep["privacy"]["dp_sgd_trains"].startswith("the classifier head only")


@pytest.mark.slow
def test_the_server_pretrains_the_extractor_on_its_own_images(tmp_path):
    """--pretrain-steps: SimCLR on the server pool before round 1 moves the extractor away from its seeded
    initialisation, and the report says on what (GTAFL under DP, its own SimCLR off)."""
    from tafl.training.simulator import train

    over = {**SMOKE_GTAFL, "gs": False, "cl": False, "dp_epsilon": 8.0, "pretrain_steps": 3, "rounds": 1}
    cfg = load_config(CONFIGS / "smoke.yaml", over)
    rep = train(cfg, tmp_path / "run", progress=False)
    assert rep["pretraining"]["steps"] == 3 and rep["pretraining"]["pool"] == "val"
    assert rep["pretraining"]["images"] > 0
    state = load_checkpoint(tmp_path / "run" / "final.pt")["state"]
    init = _initial_extractor(cfg)
    ext = _extractor(state)
    assert any(not torch.equal(ext[k], init[k]) for k in init)
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["config"]["train_scope"] == "head"
