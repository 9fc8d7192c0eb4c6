"""Method lda (tafl.training.methods.lda): the discriminant head the server fits from the sites' class feature sums,
its one release per site under DP and the accountant's count of it, and the settings it refuses."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")
pytest.importorskip("opacus", reason="needs opacus and dp-accounting: the train extra")

from tafl.errors import ConfigError  # noqa: E402
from tafl.training.config import load_config  # noqa: E402
from tafl.training.methods.lda import fit_lda  # noqa: E402
from tests.conftest import CONFIGS  # noqa: E402


def _gaussians(n_per_class, means, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, means.shape[1])) + m for n, m in zip(n_per_class, means)]
    return np.concatenate(xs), np.concatenate([np.full(n, c) for c, n in enumerate(n_per_class)])


def test_the_fitted_head_is_the_bayes_rule_for_shared_covariance_gaussians():
    """Three unit-covariance Gaussians whose means differ in a whitened frame: the head from the class sums alone
    matches the Bayes rule's decisions on fresh draws, and its bias carries the class shares (a long tail)."""
    k = 6
    means = np.zeros((3, k))
    means[1, 0], means[2, 1] = 1.5, -1.5
    counts = [4000, 400, 100]
    x, y = _gaussians(counts, means)
    xt, yt = _gaussians([3000, 3000, 3000], means, seed=1)
    # the Bayes rule for N(μ_c, Σ_w) with Σ_w the total covariance (I plus the means' spread) minus the between-class
    p = np.asarray(counts, float) / sum(counts)
    total = np.cov(x.T, bias=True)
    within = total - ((means - p @ means).T * p) @ (means - p @ means)
    inv = np.linalg.inv(within)
    bayes = (xt @ inv @ means.T - 0.5 * np.einsum("ck,kj,cj->c", means, inv, means) + np.log(p)).argmax(1)
    # fit_lda assumes the whitened total covariance is I: here it is I plus the spread of the means, so compare on
    # data whitened by the sample's own total covariance, as the server's basis does
    vals, vecs = np.linalg.eigh(total)
    white = vecs / np.sqrt(vals)
    mu = x.mean(0)
    xw, xtw = (x - mu) @ white, (xt - mu) @ white
    sums_w = np.stack([xw[y == c].sum(0) for c in range(3)])
    W, b = fit_lda(sums_w, np.asarray(counts, float), shrink=1e-6)
    pred = (xtw @ W.T + b).argmax(1)
    # the same decisions but where the 100-image class's estimated mean moves the boundary a little
    assert (pred == bayes).mean() > 0.97
    assert abs((pred == yt).mean() - (bayes == yt).mean()) < 0.01
    # without its share term the head tells the classes apart on a balanced test set (chance: 1/3)
    assert ((xtw @ W.T + b - np.log(p)).argmax(1) == yt).mean() > 0.6
    # the long tail is in the bias: the commonest class has the largest share term
    assert int(np.argmax(b - b.mean())) == 0


def test_an_unreported_class_is_never_chosen_for_its_mean_and_bad_shapes_are_refused():
    sums = np.array([[10.0, 0.0], [0.0, 0.0], [0.0, -10.0]])
    W, b = fit_lda(sums, np.array([10.0, 0.0, 10.0]))
    x = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, -3.0], [-3.0, 3.0]])
    assert 1 not in set((x @ W.T + b).argmax(1).tolist())
    with pytest.raises(ValueError, match="sums"):
        fit_lda(np.zeros((3, 2)), np.zeros(2))
    with pytest.raises(ValueError, match="no class"):
        fit_lda(np.zeros((3, 2)), np.zeros(3))


@pytest.mark.parametrize("overrides,key,why", [
    ({"method": "lda", "train_scope": "all"}, "train_scope", "needs train_scope head"),
    ({"method": "lda", "secure_aggregation": True, "engine": "flower", "clients": 4, "frac": 0.75}, "frac",
     "--frac 1"),
    ({"method": "lda", "local_adjust": 1.0}, "local_adjust", "applies to fedavg and fedprox"),
    ({"method": "lda", "secure_aggregation": True, "engine": "flower", "clients": 4, "frac": 1.0, "rounds": 3},
     "rounds", "differencing"),
])
def test_settings_lda_cannot_take_are_refused_before_training(overrides, key, why):
    with pytest.raises(ConfigError) as exc:
        load_config(CONFIGS / "smoke.yaml", overrides)
    assert f"config '{key}'" in str(exc.value) and why in str(exc.value)


def test_lda_trains_on_the_head_scope_by_default():
    assert load_config(CONFIGS / "smoke.yaml", {"method": "lda"}).train_scope == "head"


def test_a_run_learns_and_under_dp_each_site_releases_once(tmp_path):
    """The smoke data, six rounds at half the sites a round: without DP the head beats chance by far; at ε = 2 the
    accountant counts one release per site however often it was selected (no DP-SGD step), and spends no more
    than the target."""
    from tafl.training.simulator import train

    plain = tmp_path / "plain"
    train(load_config(CONFIGS / "smoke.yaml", {"method": "lda", "rounds": 6, "frac": 0.5}), plain, progress=False)
    rep = json.loads((plain / "report.json").read_text())
    assert rep["privacy"]["mechanism"] == "none"
    assert rep["uniform_metrics"]["recall"] > 0.5  # balanced accuracy; 10 digit classes: chance is 0.1
    assert all(h["loss"] is None for h in rep["history"])  # the sites train nothing, so there is no loss
    private = tmp_path / "dp"
    train(load_config(CONFIGS / "smoke.yaml", {"method": "lda", "rounds": 6, "frac": 0.5, "dp_epsilon": 2.0}),
          private, progress=False)
    rep = json.loads((private / "report.json").read_text())
    p = rep["privacy"]
    selected = {c for h in rep["history"] for c in h["clients"]}
    # every site answers the in-domain detector's round after training: one more release, selected or not
    assert set(p["clients"]) >= {str(c) for c in selected}
    assert sum(len(h["clients"]) for h in rep["history"]) > len(selected)  # some site was selected twice
    for k, c in p["clients"].items():
        want = 2 if int(k) in selected else 1  # its class sums once, however often selected; the detector's sums
        assert c["steps"] == 0 and c["releases"] == want and c["epsilon"] <= 2.0 + 1e-3
    assert rep["domain_detector"]["fitted"]
    # the plan spends its budget on the three releases (the census, the class sums, the detector's sums)
    assert p["epsilon"] >= 0.97 * 2.0
    assert "no DP-SGD" in p["mechanism"] and p["dp_sgd_trains"].startswith("nothing")
    # the multiplier the report states is the releases' (there is no DP-SGD step to state one for)
    assert p["noise_multiplier"]["max"] == max(c["stats_noise_multiplier"] for c in p["clients"].values())
    assert math.isfinite(rep["average_accuracy"])


def test_a_run_where_no_site_s_sums_arrive_stops_instead_of_exporting_an_untrained_head():
    from tafl.errors import TrainingDiverged
    from tafl.imaging import Preprocess
    from tafl.training.methods.lda import LDA
    from tafl.training.models import ModelConfig

    cfg = load_config(CONFIGS / "smoke.yaml", {"method": "lda", "rounds": 2})
    m = LDA(cfg, ModelConfig("resnet8", 4, 1, 8, 0.25, norm="group"), Preprocess(size=8, channels=1, mean=(0.5,),
                                                                                 std=(0.25,)))
    state = m.init_state(np.array([5, 5, 5, 5]))
    state = m.server_update(state, [], 1)  # round 1 of 2: wait for later rounds
    assert state.meta["lda_sites"] == []
    with pytest.raises(TrainingDiverged, match="nothing to fit"):
        m.server_update(state, [], 2)
