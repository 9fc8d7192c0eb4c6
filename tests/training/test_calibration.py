"""The federated calibration round and the prior-adaptation section of the report (issue 13)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.errors import ConfigError  # noqa: E402
from tafl.prior import fit_calibration  # noqa: E402
from tafl.training.checkpoint import load_checkpoint  # noqa: E402
from tafl.training.config import load_config  # noqa: E402
from tafl.training.longtail import DISTRIBUTION_NAMES, dirichlet_partition, holdout_split  # noqa: E402
from tafl.training.contract import ClientResult, GlobalState  # noqa: E402
from tafl.training.simulator import (  # noqa: E402
    adaptation_accuracies, calibration_problem, make_method, prepare, train)
from tests.conftest import CONFIGS, SMOKE_GTAFL  # noqa: E402


def test_holdout_rows_are_disjoint_from_training_rows_and_zero_changes_nothing():
    labels = np.random.default_rng(0).integers(0, 5, 400)
    parts = dirichlet_partition(labels, 4, 0.5, 7, num_classes=5)
    same, held = holdout_split(parts, 0.0, 7)
    assert all(np.array_equal(a, b) for a, b in zip(same, parts)) and all(len(h) == 0 for h in held)
    train_rows, held = holdout_split(parts, 0.2, 7)
    for p, t, h in zip(parts, train_rows, held):
        assert not set(t) & set(h) and sorted(set(t) | set(h)) == sorted(p)
        assert len(h) == round(0.2 * len(p))
    assert all(len(t) >= 1 for t in holdout_split([np.array([3])], 0.4, 7)[0])


def test_class_balanced_holdout_gives_rare_classes_more_and_caps_each_class():
    rng = np.random.default_rng(1)
    labels = np.concatenate([np.zeros(900, int), np.full(60, 1), np.full(40, 2)])[rng.permutation(1000)]
    parts = dirichlet_partition(labels, 3, 5.0, 7, num_classes=3)
    rows_train, rows_held = holdout_split(parts, 0.1, 7, labels, "rows")
    assert [h.tolist() for h in rows_held] == [h.tolist() for h in holdout_split(parts, 0.1, 7)[1]]  # default
    cls_train, cls_held = holdout_split(parts, 0.1, 7, labels, "classes")
    for p, t, h in zip(parts, cls_train, cls_held):
        assert not set(t) & set(h) and sorted(set(t) | set(h)) == sorted(p)
        for c in range(3):
            n_c, h_c = int((labels[p] == c).sum()), int((labels[h] == c).sum())
            assert h_c <= round(0.3 * n_c)  # the cap
            assert h_c <= round(0.1 * len(p) / len(np.unique(labels[p])))  # the even share
    rare = lambda held: int(np.isin(np.concatenate(held), np.flatnonzero(labels == 2)).sum())  # noqa: E731
    common = lambda held: int(np.isin(np.concatenate(held), np.flatnonzero(labels == 0)).sum())  # noqa: E731
    assert rare(cls_held) >= 2 * max(rare(rows_held), 1) and common(cls_held) < common(rows_held)
    assert all(len(t) >= 1 for t in holdout_split([np.array([3])], 0.4, 7, labels, "classes")[0])
    with pytest.raises(ValueError, match="labels"):
        holdout_split(parts, 0.1, 7, None, "classes")
    with pytest.raises(ConfigError, match="calib_holdout_mode"):
        holdout_split(parts, 0.1, 7, labels, "stratified")
    with pytest.raises(ConfigError, match="calib_holdout_mode"):
        load_config(CONFIGS / "smoke.yaml", {"calib_holdout_mode": "stratified"})


def test_calibration_needs_held_out_rows():
    with pytest.raises(ConfigError, match="held-out"):
        load_config(CONFIGS / "smoke.yaml", {"calibration": "bcts"})
    with pytest.raises(ConfigError, match="calibration"):
        load_config(CONFIGS / "smoke.yaml", {"calibration": "platt", "calib_holdout": 0.1})
    with pytest.raises(ConfigError, match="adapt_sizes"):
        load_config(CONFIGS / "smoke.yaml", {"adapt_sizes": "100,x"})


def test_bad_calibration_statistics_are_refused():
    C, P = 3, 4
    ok = {"calib_nll": torch.ones(1), "calib_grad": torch.zeros(P), "calib_hess": torch.eye(P),
          "calib_counts": torch.tensor([2.0, 1.0, 0.0]), "calib_n": torch.tensor([3.0])}
    assert calibration_problem(ClientResult(0, 3, {}, ok), C, P) is None
    nan = dict(ok, calib_grad=torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    assert "NaN" in calibration_problem(ClientResult(0, 3, {}, nan), C, P)
    shape = dict(ok, calib_hess=torch.eye(P + 1))
    assert "shape" in calibration_problem(ClientResult(0, 3, {}, shape), C, P)
    neg = dict(ok, calib_counts=torch.tensor([4.0, -1.0, 0.0]))
    assert "negative" in calibration_problem(ClientResult(0, 3, {}, neg), C, P)


@pytest.mark.slow
@pytest.mark.parametrize("method, kind", [("fedavg", "bcts"), ("gtafl", "bcts"), ("fedavg", "vector")])
def test_the_federated_fit_equals_the_pooled_fit_on_the_clients_held_out_rows(tmp_path, method, kind):
    # the check against validation (test_calibration_check.py) would ship no calibration where the fit does not help
    over = {"calibration": kind, "calib_holdout": 0.2, "adapt_draws": 2, "adapt_sizes": "50,200",
            "calibration_check": False}
    if method == "gtafl":
        over.update(SMOKE_GTAFL, cl=False)
    cfg = load_config(CONFIGS / "smoke.yaml", over)
    report = train(cfg, tmp_path / "run", progress=False)
    fed = report["prior_adaptation"]["calibration"]
    assert fed["kind"] == kind and fed["fit"]["nll_after"] <= fed["fit"]["nll_before"]
    # the same fit on the pooled held-out rows, which no client ever sent
    prep = prepare(cfg)
    rows = np.concatenate(prep.holdouts)
    assert not set(rows) & set(np.concatenate(prep.parts))
    assert prep.client_counts.sum() == len(prep.train) - len(rows)  # the census counts training rows only
    ck = load_checkpoint(tmp_path / "run" / "final.pt")
    m = make_method(cfg, prep.model_cfg, prep.dataset.preprocess)
    state = GlobalState.from_dict(ck["state"])
    z = m.calibration.logits(m.broadcast(state), torch.from_numpy(prep.train.images[rows]))
    pooled = fit_calibration(z, prep.train.labels[rows], kind, cfg.calib_rounds)
    assert fed["temperature"] == pytest.approx(pooled.temperature, rel=1e-6)
    assert np.allclose(fed["bias"], pooled.bias, atol=1e-6)
    if kind == "vector":  # C per-class scales, as JSON in the round config (the Flower path carries the same)
        assert np.allclose(fed["class_scale"], pooled.class_scale, atol=1e-6)
        assert np.ptp(fed["class_scale"]) > 1e-3
    assert np.allclose(fed["source_prior"], np.bincount(prep.train.labels[rows], minlength=10) / len(rows))
    assert report["communication"]["uplink_bytes"] > 0
    # every distribution reports the adapted, the oracle and the calibrated rule, with the estimate's error
    for name in DISTRIBUTION_NAMES:
        d = report["test_distributions"][name]
        assert 0 <= d["oracle"] <= 1 and 0 <= d["calibrated"] <= 1
        assert set(d["adaptive"]) == {"50", "200"}
        assert 0 <= d["adaptive"]["200"]["tv"] <= 1
        gap = d["gap"]  # the gap at the largest n, with its interval, beside the finest step the split can show
        assert gap["n"] == 200 and gap["value"] == pytest.approx(d["oracle"] - d["adaptive"]["200"]["accuracy"])
        assert gap["lo"] <= gap["hi"] and 0 < d["one_image"] <= 1
    avg = report["prior_adaptation"]["validation"]["average"]
    assert {"calibrated", "oracle", "adaptive_50", "adaptive_200"} <= set(avg)
    assert "Gap to the oracle at n = 200" in (tmp_path / "run" / "report.md").read_text()


@pytest.mark.slow
def test_a_client_with_nan_calibration_statistics_is_dropped(tmp_path, monkeypatch):
    from tafl.training.methods.calibration import CalibrationClient

    real = CalibrationClient.update

    def poisoned(self, payload, data, round_cfg):
        res = real(self, payload, data, round_cfg)
        if data.client_id == 1:
            res.extras["calib_grad"] = torch.full_like(res.extras["calib_grad"], float("nan"))
        return res

    monkeypatch.setattr(CalibrationClient, "update", poisoned)
    cfg = load_config(CONFIGS / "smoke.yaml", {"calibration": "temperature", "calib_holdout": 0.2,
                                               "adapt_draws": 1, "adapt_sizes": "50", "calibration_check": False})
    report = train(cfg, tmp_path / "run", progress=False)
    fit = report["prior_adaptation"]["calibration"]["fit"]
    assert fit["dropped"] == [1] and 1 not in fit["clients"] and fit["clients"]
    assert np.isfinite(report["prior_adaptation"]["calibration"]["temperature"])


def _noisy_posteriors(labels: np.ndarray, C: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(len(labels), C)) + 1.5 * np.eye(C)[labels]
    e = np.exp(logits)
    return e / e.sum(1, keepdims=True)


def test_the_gap_interval_is_the_protocols_gap_and_narrows_with_more_test_rows():
    C = 4
    labels = np.repeat(np.arange(C), [200, 100, 40, 10])
    probs = _noisy_posteriors(labels, C)
    ranks, src = np.arange(C), np.bincount(labels) / len(labels)
    plain = probs.argmax(1)
    base = adaptation_accuracies(probs, labels, ranks, src, [50, 200], 3, 0, plain=plain)
    res = adaptation_accuracies(probs, labels, ranks, src, [50, 200], 3, 0, plain=plain, boot=100)
    assert res["average"] == base["average"]  # the bootstrap leaves the protocol's numbers as they were
    for name, d in res["distributions"].items():
        assert d["gap"]["value"] == pytest.approx(d["oracle"] - d["adaptive"]["200"]["accuracy"])
        assert d["gap"]["lo"] <= d["gap"]["hi"]
        assert d["one_image"] >= 1 / len(labels), name
    # one row of the rarest class (10 rows) moves a rare-heavy mix most: π_c / rows of c at its largest
    b50 = res["distributions"]["backward50"]
    assert b50["one_image"] == pytest.approx((_prior("backward50", ranks) / np.array([200, 100, 40, 10])).max())
    # four copies of every row: the same gap, measured on four times the rows, is surer
    big = adaptation_accuracies(np.tile(probs, (4, 1)), np.tile(labels, 4), ranks, src, [50, 200], 3, 0, boot=100)
    gap_big, gap_res = big["distributions"]["backward50"]["gap"], b50["gap"]
    assert gap_big["hi"] - gap_big["lo"] < 0.75 * (gap_res["hi"] - gap_res["lo"])
    assert big["distributions"]["backward50"]["one_image"] == pytest.approx(b50["one_image"] / 4)


def test_perfect_posteriors_leave_no_gap_to_the_oracle():
    C = 3
    labels = np.repeat(np.arange(C), [60, 30, 10])
    probs = np.clip(np.eye(C)[labels], 1e-6, None)
    probs /= probs.sum(1, keepdims=True)
    res = adaptation_accuracies(probs, labels, np.arange(C), np.full(C, 1 / C), [20, 100], 2, 0, boot=50)
    for d in res["distributions"].values():
        assert d["oracle"] == pytest.approx(1.0) and d["gap"]["value"] == pytest.approx(0.0, abs=1e-12)
        assert d["gap"]["lo"] == pytest.approx(0.0, abs=1e-12) and d["gap"]["hi"] == pytest.approx(0.0, abs=1e-12)


def _prior(name: str, ranks: np.ndarray) -> np.ndarray:
    from tafl.training.longtail import DISTRIBUTIONS, distribution_prior

    kind, imf = next((k, f) for n, k, f in DISTRIBUTIONS if n == name)
    return distribution_prior(ranks, kind, imf)
