"""Conformal prediction sets fitted after training (tafl.training.sets, issue 54): the sites' histograms give the
thresholds of the pooled held-out rows, the report measures the sets on the test split, and a run says why it fitted
none."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl import conformal  # noqa: E402


@pytest.fixture(scope="module")
def calibrated_run(tmp_path_factory):
    from tafl.training.config import load_config
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    out = tmp_path_factory.mktemp("sets") / "run"
    over = {"rounds": 2, "calibration": "vector", "calib_holdout": 0.2}
    return out, train(load_config(CONFIGS / "smoke.yaml", over), out, progress=False)


@pytest.mark.parametrize("rows", ["pooled", "held_out"])
def test_the_summed_site_histograms_give_the_pooled_rows_thresholds(calibrated_run, rows, tmp_path):
    """Recompute, outside the federation, every client's held-out rows' calibrated posteriors from the checkpoint,
    and the validation split's: the histogram thresholds of the held-out rows and the validation split together
    (`conformal_rows: pooled`, the default) or of the held-out rows alone (`held_out`) equal the run's (nothing
    noised), and lie within one grid bin above the exact quantile of the same rows."""
    from tafl.imaging import Preprocess
    from tafl.prior import Calibration
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.contract import GlobalState
    from tafl.training.evaluate import predict
    from tafl.training.models import ModelConfig
    from tafl.training.prepare import make_method, prepare

    run, report = calibrated_run
    if rows == "held_out":
        from tafl.training.config import load_config
        from tafl.training.simulator import train
        from tests.conftest import CONFIGS

        run = tmp_path / "held_out"
        train(load_config(CONFIGS / "smoke.yaml", {"rounds": 2, "calibration": "vector", "calib_holdout": 0.2,
                                                   "conformal_rows": "held_out"}), run, progress=False)
    ck = load_checkpoint(run / "final.pt")
    cfg = RunConfig.from_dict(ck["run_config"])
    prep = prepare(cfg)
    method = make_method(cfg, ModelConfig.from_dict(ck["model_config"]), Preprocess.from_dict(ck["preprocess"]))
    state = GlobalState.from_dict(ck["state"])
    C = len(prep.dataset.class_names)
    held = np.concatenate([np.asarray(h, np.int64) for h in prep.holdouts])
    module = method.posterior_module(method.broadcast(state))
    images, labels = prep.train.images[held], prep.train.labels[held]
    if rows == "pooled":
        images = np.concatenate([images, prep.dataset.val.images])
        labels = np.concatenate([labels, prep.dataset.val.labels])
    out = predict(module, images, method.normalize, 64, keys=method.output_keys)
    probs = Calibration.from_dict(state.meta["calibration"], C).probs(method.posterior_logits(out))
    scores = conformal.true_class_scores(probs, labels)
    rec = state.meta["conformal"]
    source = "the clients' held-out rows" + (" and the server's validation split" if rows == "pooled" else "")
    assert rec["fitted"] and rec["source"] == source and rec["clients"] == [0, 1, 2, 3]
    assert rec["held_out_images"] == len(held) > 0
    assert rec["validation_images"] == (len(prep.dataset.val) if rows == "pooled" else 0)
    assert rec["calibration_images"] == len(labels) and rec["per_class"] == np.bincount(labels, minlength=C).tolist()
    assert rec["confidence"] == cfg.set_confidence == 0.9  # the default: each package's own coverage
    pooled = conformal.class_thresholds(conformal.histograms(scores, labels, C), 0.1, 0.9)
    assert np.allclose(rec["thresholds"]["0.9"], pooled, atol=1e-12)
    exact = conformal.exact_thresholds(scores, labels, C, 0.1, 0.9)
    assert (pooled >= exact - 1e-12).all() and (pooled <= exact + 1.0 / conformal.GRID + 1e-9).all()
    assert np.allclose(state.extras["conformal.hist"].double().numpy().sum(), len(labels))


def test_the_report_measures_coverage_and_size_per_level_mix_and_class(calibrated_run):
    _, report = calibrated_run
    sets = report["conformal"]
    assert set(sets["levels"]) == {"0.8", "0.9", "0.95"}
    cc, marginal = sets["levels"]["0.9"]["class_conditional"], sets["levels"]["0.9"]["marginal"]
    assert len(cc["mixes"]) == 11 and set(cc["per_class"]) == set(report["class_names"])
    assert 0.0 <= cc["coverage"] <= 1.0 and 0.0 <= cc["size"] <= len(report["class_names"])
    # a higher level never gives smaller sets (the thresholds only grow)
    sizes = [sets["levels"][k]["class_conditional"]["size"] for k in ("0.8", "0.9", "0.95")]
    assert sizes == sorted(sizes)
    # the class-conditional sets' worst mix is covered at least as well as the marginal one's
    assert cc["lowest_mix_coverage"] >= marginal["lowest_mix_coverage"] - 1e-9


def test_without_held_out_rows_the_validation_split_calibrates(tmp_path):
    from tafl.training.config import load_config
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    rep = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1}), tmp_path / "val", progress=False)
    assert rep["conformal"]["fitted"] and rep["conformal"]["source"] == "the server's validation split"
    assert rep["conformal"]["calibration_images"] == 270
    off = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1, "conformal": False}), tmp_path / "off",
                progress=False)
    assert off["conformal"] == {"fitted": False, "why": "turned off (--no-conformal)"}


def test_a_retrain_fits_its_own_sets_and_a_private_one_calibrates_on_validation(calibrated_run, tmp_path):
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import load_config
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    run, report = calibrated_run
    parent = load_checkpoint(run / "final.pt")
    over = {"rounds": 1, "calibration": "vector", "calib_holdout": 0.2}
    again = train(load_config(CONFIGS / "smoke.yaml", over), tmp_path / "a", progress=False, init_from=parent)
    child = load_checkpoint(tmp_path / "a" / "final.pt")["state"]
    assert again["conformal"]["fitted"]
    assert child["meta"]["conformal"]["thresholds"] != parent["state"]["meta"]["conformal"]["thresholds"]
    head = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1, "train_scope": "head"}), tmp_path / "h",
                 progress=False)
    private = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1, "dp_epsilon": 8.0, "dp_delta": 1e-3}),
                    tmp_path / "dp", progress=False, init_from=load_checkpoint(tmp_path / "h" / "final.pt"))
    # under DP the sets come from the coordinator's own validation split (no site's rows, no budget), fitted anew
    assert head["conformal"]["fitted"] and private["conformal"]["fitted"]
    assert private["conformal"]["source"] == ("the server's validation split (under DP: the coordinator's own images, "
                                              "no budget spent)") and private["conformal"]["clients"] == []

