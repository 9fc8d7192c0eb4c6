"""Record-level differential privacy (tafl.training.privacy, issue 34): the accountant's bound, the noise each release
carries, DP-SGD's per-image clipping (Opacus), GTAFL's noisy statistics passing the server's checks, the refusals
before training, and the `privacy` object in the report, the package, its card and `tafl compare`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")
pytest.importorskip("opacus", reason="needs opacus and dp-accounting: the train extra")

from tafl.errors import ConfigError  # noqa: E402
from tafl.training import privacy  # noqa: E402
from tafl.training.config import load_config  # noqa: E402
from tests.conftest import CONFIGS, SMOKE_GTAFL  # noqa: E402

CFG = SimpleNamespace(batch_size=32, rounds=10, local_epochs=1, dp_epsilon=3.0, dp_delta=1e-5, dp_clip=1.0,
                      dp_feature_clip=0.8, dp_stats_ratio=3.0)


def test_the_calibrated_plan_spends_its_budget_and_no_more():
    plan = privacy.plan_client(CFG, 400, releases_per_round=1, finishing_releases=1)
    assert plan.steps == 10 * math.ceil(400 / 32) and plan.releases == 11
    assert 0.97 * 3.0 <= plan.epsilon() <= 3.0 + 1e-3  # the whole run, at the bound
    assert plan.stats_noise_multiplier == pytest.approx(3.0 * plan.noise_multiplier)
    assert plan.epsilon(steps=0, releases=0) < plan.epsilon(steps=plan.steps // 2) < plan.epsilon()
    # a statistics release costs budget: the same target with ten more of them needs more noise everywhere
    more = privacy.plan_client(CFG, 400, releases_per_round=2, finishing_releases=1)
    assert more.noise_multiplier > plan.noise_multiplier
    # a smaller target needs more noise; no statistics (FedAvg) need less
    assert privacy.plan_client(SimpleNamespace(**{**vars(CFG), "dp_epsilon": 1.0}), 400, 1, 1).noise_multiplier > \
        plan.noise_multiplier > privacy.plan_client(CFG, 400, 0, 0).noise_multiplier


def test_a_release_carries_the_noise_of_its_sensitivity():
    gen = torch.Generator().manual_seed(0)
    zero = torch.zeros(20000)
    out = privacy.gaussian_release({"a": (zero, 1.0), "b": (zero, 5.0)}, 2.0, gen)
    for name, sens in (("a", 1.0), ("b", 5.0)):  # σ_i = z·√k·Δ_i, k = 2 parts
        assert float(out[name].std()) == pytest.approx(2.0 * math.sqrt(2) * sens, rel=0.03)
    rows = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    assert torch.allclose(privacy.clip_rows(rows, 1.0), torch.tensor([[0.6, 0.8], [0.3, 0.4]]))


def test_the_noise_is_not_the_run_seed_s():
    a, b = privacy.noise_generator(), privacy.noise_generator()
    assert not torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))


def _tiny(norm="group"):
    from tafl.training.models import ModelConfig, build_model

    torch.manual_seed(0)
    return build_model(ModelConfig("resnet8", 3, 1, 8, 0.25, norm=norm))


def _normalize(b):
    return b.permute(0, 3, 1, 2).float() / 255.0


def test_dp_sgd_clips_each_image_and_leaves_a_plain_model():
    from tafl.training.local import dp_local_sgd, local_sgd

    images = torch.randint(0, 255, (64, 8, 8, 1), dtype=torch.uint8)
    labels = torch.randint(0, 3, (64,))
    kw = dict(normalize=_normalize, epochs=1, batch_size=16, lr=0.5, momentum=0.0, weight_decay=0.0, augment=False)
    plain = _tiny()
    before = [p.detach().clone() for p in plain.parameters()]
    local_sgd(plain, images, labels, gen=torch.Generator().manual_seed(1), **kw)
    moved_plain = sum(float((p.detach() - q).norm()) for p, q in zip(plain.parameters(), before))
    dp = _tiny()
    m = dp_local_sgd(dp, images, labels, gen=torch.Generator().manual_seed(1), noise_gen=torch.Generator().manual_seed(2),
                     noise_multiplier=0.0, max_grad_norm=1e-6, sample_rate=0.25, **kw)
    moved_dp = sum(float((p.detach() - q).norm()) for p, q in zip(dp.parameters(), before))
    assert m["dp_steps"] == 4 and m["steps"] >= 1
    # every image's gradient is clipped to 1e-6: 4 steps of lr 0.5 move the weights by at most ~2e-6·(batch/expected)
    assert moved_dp < 1e-4 < moved_plain
    # Opacus's hooks are gone: the model is an ordinary module again (export and evaluation see no grad samples)
    assert not any(hasattr(p, "grad_sample") for p in dp.parameters())
    assert dp(torch.zeros(2, 1, 8, 8)).shape == (2, 3)


def test_dp_sgd_refuses_batchnorm():
    from tafl.training.local import dp_local_sgd

    with pytest.raises(Exception, match="(?i)batchnorm|BatchNorm"):
        dp_local_sgd(_tiny("batch"), torch.zeros(8, 8, 8, 1, dtype=torch.uint8), torch.zeros(8, dtype=torch.int64),
                     normalize=_normalize, epochs=1, batch_size=4, lr=0.1, momentum=0.0, weight_decay=0.0,
                     augment=False, gen=torch.Generator(), noise_gen=torch.Generator(), noise_multiplier=1.0,
                     max_grad_norm=1.0, sample_rate=0.5)


def _gtafl(overrides=None):
    from tafl.imaging import Preprocess
    from tafl.training.methods import method_class
    from tafl.training.models import ModelConfig

    cfg = load_config(CONFIGS / "smoke.yaml", {**SMOKE_GTAFL, "gs": False, "dp_epsilon": 4.0, **(overrides or {})})
    mc = ModelConfig("resnet8", 4, 1, 8, 0.25, norm="group")
    m = method_class("gtafl")(cfg, mc, Preprocess(size=8, channels=1, mean=(0.5,), std=(0.25,)))
    m.privacy.noise = torch.Generator().manual_seed(0)  # a fixed draw for the test (runs seed it from the OS)
    return m


def test_gtafl_s_noisy_statistics_pass_the_server_s_checks_and_hide_a_two_image_class():
    from tafl.training.contract import ClientResult

    m = _gtafl()
    D = m.model.feature_dim
    gen = torch.Generator().manual_seed(3)
    labels = torch.tensor([0] * 300 + [1] * 2 + [2] * 150)  # class 1: two images; class 3: none
    feats = torch.rand(len(labels), D, generator=gen)
    W, b = torch.zeros(3, 4, D), torch.zeros(3, 4)
    exact = m.feature_extras(feats, labels, W, b)
    assert exact["grad_classes"].tolist() == [0, 1, 2] and exact["stat_count"].tolist() == [300, 2, 150]
    noisy = m.private_feature_extras(feats, labels, W, b, n=len(labels))
    # only what stands out of the count's noise is sent: the two-image class and the absent one are not
    assert noisy["grad_classes"].tolist() == [0, 2]
    assert noisy["stat_count"].tolist() != [300.0, 150.0]  # noisy counts, rounded
    assert np.allclose(noisy["stat_count"].numpy(), [300, 150], atol=40)
    res = ClientResult(0, len(labels), {k: v.clone() for k, v in m.model.state_dict().items()}, noisy, {"steps": 1.0})
    assert m._grads_problem(res) is None  # the server's checks accept the noisy release as it is
    # the class means the server would form are near the clipped features' means: noise, not garbage
    mean0 = noisy["stat_sum"][0] / noisy["stat_count"][0]
    assert float((mean0 - feats[labels == 0].mean(0)).abs().mean()) < 0.2


@pytest.mark.parametrize("overrides,key,why", [
    ({"dp_epsilon": 0.0}, "dp_epsilon", "must be a number > 0"),
    ({"dp_epsilon": -1.0}, "dp_epsilon", "must be a number > 0"),
    ({"dp_epsilon": 8.0, "dp_delta": 1.0}, "dp_delta", "must be in (0, 1)"),
    ({"dp_epsilon": 8.0, "method": "dafl", "backbone": "vit_tafl_tiny"}, "dp_epsilon", "not supported for method 'dafl'"),
    ({"dp_epsilon": 8.0, "backbone": "vit_tafl_tiny"}, "dp_epsilon", "trains the ResNet-8"),
    ({"dp_epsilon": 8.0, "calibration": "vector", "calib_holdout": 0.1}, "calibration", "--calibration none"),
    ({"dp_epsilon": 8.0, "method": "gtafl"}, "gs", "--no-gs"),
    ({"dp_epsilon": 8.0, "local_adjust": 1.0}, "local_adjust", "exact class counts"),
    ({"secure_aggregation": True}, "secure_aggregation", "--engine flower"),
])
def test_privacy_settings_that_cannot_hold_are_refused_before_training(overrides, key, why):
    with pytest.raises(ConfigError) as exc:
        load_config(CONFIGS / "smoke.yaml", overrides)
    assert f"config '{key}'" in str(exc.value) and why in str(exc.value)


def test_epsilon_infinity_means_no_dp():
    assert load_config(CONFIGS / "smoke.yaml", {"dp_epsilon": float("inf")}).dp_epsilon is None


def test_delta_must_be_below_one_over_the_smallest_site_before_training(tmp_path):
    from tafl.training.simulator import train

    cfg = load_config(CONFIGS / "smoke.yaml", {"dp_epsilon": 8.0, "dp_delta": 0.05})
    with pytest.raises(ConfigError, match=r"dp_delta.*below 1/n .*smallest site"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "final.pt").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_private_gtafl_run_states_its_guarantee_everywhere(tmp_path):
    """Two rounds of GTAFL at ε = 4 on the smoke data: the accountant's ε per client within the target, every step
    and release counted, a GroupNorm model exported with the privacy object in its metadata and card, and
    `tafl compare` showing ε beside a non-private run."""
    from tafl.packaging.export import export_checkpoint
    from tafl.training.simulator import train

    run = tmp_path / "dp"
    cfg = load_config(CONFIGS / "smoke.yaml", {**SMOKE_GTAFL, "gs": False, "dp_epsilon": 4.0})
    train(cfg, run, progress=False)
    rep = json.loads((run / "report.json").read_text())
    p = rep["privacy"]
    assert p["unit"].startswith("record") and p["delta"] == 1e-5 and p["secure_aggregation"] is False
    assert 0 < p["epsilon"] <= 4.0 + 1e-3
    n_clients = sum(1 for h in rep["history"] for _ in h["clients"])
    assert sum(c["releases"] for c in p["clients"].values()) >= n_clients  # one release per participation (+ finish)
    for c in p["clients"].values():
        assert c["steps"] % math.ceil(1 / c["sample_rate"]) == 0 and c["epsilon"] <= 4.0 + 1e-3
    # the federation's class mix in the checkpoint is the noisy census, not the exact counts
    assert rep["client_class_counts"] is None
    assert "## Privacy" in (run / "report.md").read_text()
    pkg = tmp_path / "pkg"
    export_checkpoint(run / "final.pt", pkg)
    meta = json.loads((pkg / "metadata.json").read_text())
    assert meta["model_config"]["norm"] == "group" and meta["privacy"]["epsilon"] == p["epsilon"]
    card = (pkg / "README.md").read_text()
    assert "## Privacy" in card and f"ε = {p['epsilon']:.3g}" in card
    assert "| DP-SGD trains | the classifier head only" in card  # the default scope under DP
    # compare: the private run is its own row, with ε; a run without DP reads ∞
    plain = tmp_path / "plain"
    plain.mkdir()
    rep_plain = dict(rep, config={**rep["config"], "dp_epsilon": None},
                     privacy=privacy.privacy_section(SimpleNamespace(dp_epsilon=None), None))
    (plain / "report.json").write_text(json.dumps(rep_plain))
    out = subprocess.run([sys.executable, "-m", "tafl.cli", "compare", str(run), str(plain)], capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("## Privacy", 1)[1]
    assert "[DP ε=4]" in table and "| ∞ | ∞ |" in table and f"{p['epsilon']:.2f}" in table


@pytest.mark.slow
def test_the_leakage_check_finds_the_counts_and_an_image_in_plaintext_and_neither_under_dp(tmp_path):
    """benchmarks/leakage.py on the smoke data split over 20 sites (many rare cells, single images among them): the
    census gives every site's counts exactly and a rare class's mean points at the site's own image far more often
    than chance; at ε = 1 neither holds."""
    out = tmp_path / "leak.json"
    cfg = tmp_path / "leak.yaml"
    cfg.write_text((CONFIGS / "smoke.yaml").read_text() + "\nclients: 20\nalpha: 0.1\npartition: dirichlet\n")
    r = subprocess.run([sys.executable, "benchmarks/leakage.py", "--config", str(cfg),
                        "--eps", "1", "--repeats", "2", "--out", str(out)], capture_output=True, text=True,
                       cwd=CONFIGS.parent, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["protection"]: row for row in json.loads(out.read_text())["results"]}
    plain, dp = rows["none"], rows["dp eps=1"]
    assert plain["counts_exact_share"]["mean"] == 1.0 and plain["counts_mae"]["mean"] == 0.0
    assert plain["nearest_image_rate"]["mean"] > 5 * plain["chance_rate"]["mean"]
    assert dp["counts_mae"]["mean"] > 1.0
    assert dp["nearest_image_rate"]["mean"] <= plain["nearest_image_rate"]["mean"] / 2
    assert rows["secagg"]["counts_mae"]["mean"] > 0  # per-site counts are not seen, only their total
    assert out.with_suffix(".md").read_text().startswith("# Leakage check")
