"""A calibration that can say no (issue 56): the fitted calibration ships only where it lowers the NLL of the
validation rows it was not fitted on, by more than their noise; otherwise the uncalibrated posteriors ship, and the
report says so."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.prior import Calibration, adapt  # noqa: E402
from tafl.training.calibrate import check_calibration  # noqa: E402
from tafl.training.checkpoint import load_checkpoint  # noqa: E402
from tafl.training.config import load_config  # noqa: E402
from tafl.training.contract import GlobalState  # noqa: E402
from tafl.training.evaluate import predict  # noqa: E402
from tafl.training.simulator import make_method, prepare, train  # noqa: E402
from tests.conftest import CONFIGS  # noqa: E402


@pytest.fixture(scope="module")
def calibrated_run(tmp_path_factory):
    cfg = load_config(CONFIGS / "smoke.yaml", {"calibration": "vector", "calib_holdout": 0.2, "rounds": 3,
                                               "adapt_draws": 1, "adapt_sizes": "50"})
    out = tmp_path_factory.mktemp("calcheck") / "run"
    report = train(cfg, out, progress=False)
    prep = prepare(cfg)
    method = make_method(cfg, prep.model_cfg, prep.dataset.preprocess)
    return cfg, out, report, prep, method


def _val_nll(method, state, prep, cal: Calibration) -> float:
    """The NLL of the validation rows under `cal`, moved to their class mix: computed here from the checkpoint."""
    module = method.inference_model(state)
    z = method.posterior_logits(predict(module, prep.dataset.val.images, method.normalize, 256,
                                        keys=method.output_keys))
    y = prep.dataset.val.labels
    mix = np.bincount(y, minlength=z.shape[1]) / len(y)
    p = adapt(cal.probs(z), cal.source_prior, mix)
    with np.errstate(divide="ignore"):
        nll = -np.log(p[np.arange(len(y)), y])
    # rows whose probability underflows: exactly, in log space (the softmax's own log form)
    lp = cal.logits(z) + np.log(np.where(mix > 0, mix, 1)) - np.log(cal.source_prior)
    lp = lp - np.log(np.exp(lp - lp.max(1, keepdims=True)).sum(1, keepdims=True)) - lp.max(1, keepdims=True)
    return float(np.where(np.isfinite(nll) & (nll < 600), nll, -lp[np.arange(len(y)), y]).mean())


@pytest.mark.slow
def test_the_check_records_both_validation_nlls_and_ships_only_a_better_fit(calibrated_run):
    cfg, out, report, prep, method = calibrated_run
    state = GlobalState.from_dict(load_checkpoint(out / "final.pt")["state"])
    cal = Calibration.from_dict(state.meta["calibration"], 10)
    check = cal.fit["check"]
    assert check["checked"] and check["images"] == len(prep.dataset.val.labels)
    identity = Calibration(source_prior=np.asarray(method.default_source_prior(state)))
    # the bound on the mean change is the paired rows' own: recomputed here from the two posteriors row by row (the
    # rows' NLLs by nll_rows, whose mean the uncalibrated and shipped NLLs below check independently)
    from tafl.training.calibrate import nll_rows

    fitted = cal if check["shipped"] else Calibration.from_dict(cal.fit["rejected"], 10)
    z = method.posterior_logits(predict(method.inference_model(state), prep.dataset.val.images, method.normalize, 256,
                                        keys=method.output_keys))
    y = prep.dataset.val.labels
    mix = np.bincount(y, minlength=10) / len(y)
    change = nll_rows(fitted, z, y, mix) - nll_rows(Calibration(), z, y, mix, identity.source_prior)
    se = change.std(ddof=1) / np.sqrt(len(change))
    assert check["nll_change"] == pytest.approx(change.mean(), abs=1e-6)
    assert check["nll_change_se"] == pytest.approx(se, rel=1e-4)
    assert check["nll_change_bound"] == pytest.approx(change.mean() + 1.645 * se, abs=1e-6)
    assert check["shipped"] == (check["nll_change_bound"] < 0)
    if check["shipped"]:
        assert cal.kind == "vector" and check["nll_calibrated"] < check["nll_uncalibrated"]
        assert check["nll_calibrated"] == pytest.approx(_val_nll(method, state, prep, cal), rel=1e-6)
        assert "checked on" in (out / "report.md").read_text()
    else:
        assert cal.kind == "none"
        assert "uncalibrated: the fitted vector calibration" in (out / "report.md").read_text()
    assert check["nll_uncalibrated"] == pytest.approx(_val_nll(method, state, prep, identity), rel=1e-6)


def test_a_fit_whose_gain_lies_within_the_noise_is_not_shipped():
    """The verdict on paired validation rows: a clear gain ships; a gain smaller than the rows' noise does not, and
    says so with its bound; a loss does not, and says it raised the NLL. The bound is the mean change plus 1.645
    standard errors (checked against scipy's one-sided t bound, which it approaches at these sizes)."""
    from scipy import stats

    from tafl.training.calibrate import verdict

    rng = np.random.default_rng(0)
    base = rng.gamma(2.0, 0.4, 800)  # the uncalibrated rows' NLLs
    clear = verdict(base - 0.05 + rng.normal(0, 0.2, 800), base, "vector")
    noisy = verdict(base - 0.005 + rng.normal(0, 0.5, 800), base, "vector")
    worse = verdict(base + 0.03 + rng.normal(0, 0.2, 800), base, "vector")
    assert clear["shipped"] and "why" not in clear and clear["nll_change_bound"] < 0
    assert noisy["nll_change"] < 0 < noisy["nll_change_bound"] and not noisy["shipped"]
    assert "did not lower beyond their noise" in noisy["why"] and f"{noisy['nll_change_bound']:+.4f}" in noisy["why"]
    assert not worse["shipped"] and "raised the NLL of 800 validation images" in worse["why"]
    change = (base - 0.005 + np.random.default_rng(1).normal(0, 0.5, 800)) - base
    rec = verdict(base + change, base, "vector")
    t_bound = change.mean() + stats.t.ppf(0.95, len(change) - 1) * stats.sem(change)
    assert rec["nll_change_bound"] == pytest.approx(t_bound, abs=2e-4)
    assert rec["nll_change_se"] == pytest.approx(stats.sem(change), rel=1e-9)
    one = verdict(base[:1] - 1.0, base[:1], "vector")  # one row says nothing about the noise: refused
    assert not one["shipped"]


@pytest.mark.slow
def test_a_calibration_that_raises_the_validation_nll_is_not_shipped(calibrated_run):
    cfg, out, report, prep, method = calibrated_run
    state = GlobalState.from_dict(load_checkpoint(out / "final.pt")["state"])
    C = 10
    # a fit that is confidently wrong: every logit scaled up ten-fold and class 0 pushed far ahead
    bad = Calibration(scale=10.0, bias=np.r_[8.0, np.full(C - 1, -8.0 / (C - 1))],
                      source_prior=np.full(C, 1.0 / C), kind="bcts", fit={"images": 99})
    state = GlobalState(state.weights, state.extras, dict(state.meta, calibration=bad.to_dict()))
    kept = check_calibration(method, state, prep.dataset.val.images, prep.dataset.val.labels, 256)
    cal = Calibration.from_dict(kept.meta["calibration"], C)
    check = cal.fit["check"]
    assert cal.kind == "none" and not check["shipped"] and check["kind"] == "bcts"
    assert cal.scale == 1.0 and cal.bias is None
    assert np.allclose(cal.source_prior, method.default_source_prior(state))
    assert cal.fit["rejected"]["kind"] == "bcts" and cal.fit["rejected"]["bias"][0] == pytest.approx(8.0)
    assert check["nll_calibrated"] > check["nll_uncalibrated"]
    assert check["nll_calibrated"] == pytest.approx(_val_nll(method, state, prep, bad), rel=1e-6)
    assert "raised the NLL of" in check["why"]
    # without validation rows nothing is checked, and the fit ships saying so
    kept = check_calibration(method, state, prep.dataset.val.images[:0], prep.dataset.val.labels[:0], 256)
    cal = Calibration.from_dict(kept.meta["calibration"], C)
    assert cal.kind == "bcts" and cal.fit["check"] == {"checked": False, "shipped": True,
                                                       "why": "no validation rows to check it on"}


@pytest.mark.slow
def test_the_package_card_says_which_posteriors_shipped(calibrated_run, tmp_path):
    """A package from a run whose fit was refused states it on its card with both NLLs, and its graph applies no
    calibration (its calibrated output is the plain softmax of the posteriors)."""
    from tafl.packaging.export import export_checkpoint
    from tafl.training.checkpoint import save_checkpoint

    cfg, out, report, prep, method = calibrated_run
    ck = load_checkpoint(out / "final.pt")
    state = GlobalState.from_dict(ck["state"])
    bad = Calibration(scale=10.0, bias=np.r_[8.0, np.full(9, -8.0 / 9)], source_prior=np.full(10, 0.1), kind="bcts")
    state = GlobalState(state.weights, state.extras, dict(state.meta, calibration=bad.to_dict()))
    kept = check_calibration(method, state, prep.dataset.val.images, prep.dataset.val.labels, 256)
    save_checkpoint({**ck, "state": kept.to_dict()}, tmp_path / "refused.pt")
    pkg = export_checkpoint(tmp_path / "refused.pt", tmp_path / "pkg", name="refused-calibration")
    card = (tmp_path / "pkg" / "README.md").read_text()
    check = pkg.metadata["prior"]["fit"]["check"]
    assert pkg.metadata["prior"]["calibration"] == "none" and not check["shipped"]
    assert (f"a bcts calibration was fitted and not shipped: it raised the NLL of {check['images']} validation "
            f"images, {check['nll_uncalibrated']:.3f} to {check['nll_calibrated']:.3f}") in card
