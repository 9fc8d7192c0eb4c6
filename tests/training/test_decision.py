"""The validation-chosen operating point (tafl.training.decision, `decision: validation`): the choice, and that
training's report, the exported graph and a retrain all decide with it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.errors import ConfigError  # noqa: E402
from tafl.training.decision import (  # noqa: E402
    GRID, check_record, mixes_accuracy, offset_for, search_operating_point, select_operating_point, uniform_macro_f1)
from tafl.training.evaluate import evaluate_outputs, uniform_metrics  # noqa: E402
from tafl.training.longtail import ranks_from_counts  # noqa: E402


def _long_tailed_logits(rng, n_per_class=(400, 200, 80, 20), margin=1.2):
    """A model that ranks every class well (class signal on its own logit) but adds the training log-prior, so
    its argmax under-calls the rare classes: the case logit adjustment repairs."""
    counts = np.asarray(n_per_class, float)
    prior = counts / counts.sum()
    y = np.concatenate([np.full(m, c) for c, m in enumerate(n_per_class)])
    z = rng.normal(size=(len(y), len(counts))) + np.log(prior)
    z[np.arange(len(y)), y] += margin
    return z, y, prior


@pytest.mark.filterwarnings("ignore:Only one class is present:UserWarning")  # AUC of the absent-class case
def test_uniform_macro_f1_is_the_reports_metric():
    rng = np.random.default_rng(0)
    for absent in (None, 2):
        y = rng.integers(0, 5, 300)
        if absent is not None:
            y[y == absent] = 0
        p = rng.integers(0, 5, 300)
        want = uniform_metrics(np.full((300, 5), 0.2), p, y, 5)["macro_f1"]
        assert uniform_macro_f1(p, y, 5) == pytest.approx(want, abs=1e-12)


@pytest.mark.filterwarnings("ignore:Only one class is present:UserWarning")
def test_the_mixes_criterion_is_the_reports_mean_of_the_eleven():
    """`mixes_accuracy` on any rows is what the report calls the mean of the eleven (tafl.training.evaluate), absent
    classes included."""
    rng = np.random.default_rng(3)
    for absent in (None, 4):
        y = rng.integers(0, 6, 500)
        if absent is not None:
            y[y == absent] = 1
        p = np.where(rng.random(500) < 0.6, y, rng.integers(0, 6, 500))
        ranks = rng.permutation(6)
        want = evaluate_outputs(np.full((500, 6), 1 / 6), p, y, ranks)["average_accuracy"]
        assert mixes_accuracy(p, y, ranks) == pytest.approx(want, abs=1e-12)


def test_each_criterion_chooses_its_own_best_and_the_default_is_the_macro_f1():
    rng = np.random.default_rng(4)
    z, y, prior = _long_tailed_logits(rng, margin=0.8)
    ranks = ranks_from_counts(prior)
    mixes, f1 = select_operating_point(z, y, prior, criterion="mixes"), select_operating_point(z, y, prior)
    assert mixes["criterion_key"] == "mixes" and f1["criterion_key"] == "macro_f1"
    assert "eleven case mixes" in mixes["criterion"] and "macro F1" in f1["criterion"]
    for t in GRID:  # every τ's score is that criterion's value of the rule it makes
        pred = (z + offset_for(t, prior)).argmax(1)
        assert mixes["scores"][f"{t:.1f}"] == pytest.approx(mixes_accuracy(pred, y, ranks), abs=1e-12)
        assert f1["scores"][f"{t:.1f}"] == pytest.approx(uniform_macro_f1(pred, y, 4), abs=1e-12)
    assert mixes["scores"][f"{mixes['tau']:.1f}"] == max(mixes["scores"].values())
    assert f1["scores"][f"{f1['tau']:.1f}"] == max(f1["scores"].values())
    with pytest.raises(ValueError, match="unknown operating-point criterion 'auc'"):
        search_operating_point(lambda o: z.argmax(1), y, prior, 4, criterion="auc")


def test_the_offset_raises_rare_recall_and_is_chosen_on_the_data_given():
    rng = np.random.default_rng(1)
    z, y, prior = _long_tailed_logits(rng)
    rec = select_operating_point(z, y, prior)
    assert rec["tau"] > 0.3 and set(rec["scores"]) == {f"{t:.1f}" for t in GRID}
    assert rec["scores"][f"{rec['tau']:.1f}"] > rec["scores"]["0.0"] + 0.05
    o = check_record(rec, 4)
    assert abs(o.sum()) < 1e-9 and o[3] > o[0]  # the rarest class gains, the commonest loses
    # fresh data from the same model: the chosen point still lifts the rare class's recall
    z2, y2, _ = _long_tailed_logits(np.random.default_rng(2))
    rare = y2 == 3
    assert ((z2 + o).argmax(1)[rare] == 3).mean() > (z2.argmax(1)[rare] == 3).mean() + 0.2


def test_a_model_already_balanced_keeps_its_argmax():
    """Ties (a perfectly separable validation split scores 1 at every τ) go to the smallest τ, the argmax."""
    y = np.repeat(np.arange(3), [50, 20, 5])
    z = np.eye(3)[y] * 20.0
    rec = select_operating_point(z, y, np.array([0.7, 0.25, 0.05]))
    assert rec["tau"] == 0.0 and np.allclose(rec["offset"], 0) and np.allclose(offset_for(0, [0.5, 0.5]), 0)


def test_bad_records_and_inputs_are_refused():
    assert check_record(None, 3) is None
    with pytest.raises(ValueError, match="3 finite"):
        check_record({"offset": [0.0, 1.0]}, 3)
    with pytest.raises(ValueError, match="3 finite"):
        check_record({"offset": [0.0, float("nan"), 1.0]}, 3)
    with pytest.raises(ValueError, match="offset"):
        check_record({"tau": 0.3}, 3)
    with pytest.raises(ValueError, match="validation logits"):
        select_operating_point(np.zeros((0, 3)), np.zeros(0, int), np.ones(3) / 3)


def test_config_refuses_unknown_decision_kinds_and_takes_one_for_every_method(smoke_cfg):
    from dataclasses import replace

    replace(smoke_cfg, method="gtafl", decision="validation").validate()  # the experts' common move (test_expert_form)
    with pytest.raises(ConfigError, match="'decision'.*choose one of argmax, validation"):
        replace(smoke_cfg, decision="balanced").validate()
    with pytest.raises(ConfigError, match="'decision_criterion'.*choose one of macro_f1, mixes"):
        replace(smoke_cfg, decision_criterion="f1").validate()
    replace(smoke_cfg, method="dafl", decision="validation").validate()


@pytest.fixture(scope="module")
def op_run(tmp_path_factory):
    """fedavg on the smoke config with the operating point chosen on validation."""
    from tafl.training.config import load_config
    from tafl.training.simulator import train

    from tests.conftest import CONFIGS

    out = tmp_path_factory.mktemp("op") / "run"
    train(load_config(CONFIGS / "smoke.yaml", {"decision": "validation", "imbalance_factor": 50,
                                               "decision_criterion": "mixes"}), out, progress=False)
    return out


@pytest.mark.slow
def test_training_reports_and_exports_the_operating_point(op_run, tmp_path):
    """The report's labels, the package's `label` output and `tafl eval` all decide at argmax(logits + offset);
    the probabilities carry no offset; a non-zero log_prior_ratio decides by the Bayes rule, without it."""
    import json

    from tafl.packaging.export import export_checkpoint
    from tafl.prior import adapt, log_prior_ratio
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.data import load_dataset

    report = json.loads((op_run / "report.json").read_text())
    rec = report["decision"]
    assert rec["validation_images"] > 0 and rec["tau"] in GRID
    assert rec["scores"][f"{rec['tau']:.1f}"] >= rec["scores"]["0.0"]
    # the mixes criterion is the report's own mean of the eleven, on the validation split at the chosen point
    assert rec["criterion_key"] == "mixes"
    assert rec["scores"][f"{rec['tau']:.1f}"] == pytest.approx(report["validation"]["average_accuracy"], abs=1e-9)
    assert "Operating point" in (op_run / "report.md").read_text()
    ck = load_checkpoint(op_run / "final.pt")
    assert ck["state"]["meta"]["decision"] == rec
    pkg = export_checkpoint(op_run / "final.pt", tmp_path / "pkg", name="op-fedavg")
    assert pkg.metadata["decision"]["tau"] == rec["tau"]
    cfg = RunConfig.from_dict(ck["run_config"])
    cfg.img_size, cfg.channels = ck["preprocess"]["size"], ck["preprocess"]["channels"]
    ds = load_dataset(cfg.validate())
    x = pkg.preprocess.normalize(ds.test.images)
    sess = pkg.session(providers=["CPUExecutionProvider"])
    got = pkg.run(sess, x)
    o = np.asarray(rec["offset"])
    assert np.array_equal(got["label"], (got["logits"] + o).argmax(1))
    lg = got["logits"].astype(np.float64)
    sm = np.exp(lg - lg.max(1, keepdims=True))
    assert np.abs(got["probs"] - sm / sm.sum(1, keepdims=True)).max() < 1e-5
    # the report's confusion matrix is the package's decisions on the same test split
    cm = np.zeros((len(pkg.class_names),) * 2, int)
    np.add.at(cm, (ds.test.labels, got["label"]), 1)
    assert np.array_equal(cm, np.asarray(report["confusion_matrix"]))
    src = np.asarray(pkg.metadata["prior"]["source_prior"])
    q = np.full(len(src), 1.0 / len(src))
    shifted = pkg.run(sess, x, log_prior_ratio(q, src))
    assert np.array_equal(shifted["label"], adapt(got["calibrated_probs"], src, q).argmax(1))
    if rec["tau"] > 0:
        assert "operating point chosen on validation" in " ".join(pkg.metadata["limitations"])


@pytest.mark.slow
def test_the_validation_check_compares_adapting_with_the_operating_point(op_run, tmp_path):
    """`prior=adaptive` falls back to the model's own label, here the operating point; the report records that
    label's accuracy beside the calibrated argmax's, and the package's check is read against it."""
    import json

    from tafl.packaging.export import export_checkpoint

    report = json.loads((op_run / "report.json").read_text())
    pa = report["prior_adaptation"]
    assert pa["test"]["average"]["plain"] == pytest.approx(report["average_accuracy"], abs=1e-9)
    assert pa["validation"]["average"]["plain"] == pytest.approx(report["validation"]["average_accuracy"], abs=1e-9)
    for name, d in report["test_distributions"].items():
        assert d["plain"] == pytest.approx(d["accuracy"], abs=1e-9), name
    check = export_checkpoint(op_run / "final.pt", tmp_path / "pkg", name="op-check").metadata["prior"]["adaptive_check"]
    assert check["against"] == "plain"
    assert check["plain"] == pytest.approx(report["validation"]["average_accuracy"], abs=1e-9)
    assert check["recommended"] == (check["adaptive"] >= check["plain"] - 0.01)


@pytest.mark.slow
def test_the_case_mix_estimator_is_chosen_on_validation_and_travels_to_the_package(op_run, tmp_path):
    """The smoothing is chosen on the validation split by the protocol the report then applies: the chosen score is
    the report's own validation mean of the adapted rule; the checkpoint, the report, the package and its card
    carry the same record."""
    import json

    from tafl.packaging.export import export_checkpoint
    from tafl.prior import SMOOTHING_GRID, PriorEstimator
    from tafl.training.checkpoint import load_checkpoint

    report = json.loads((op_run / "report.json").read_text())
    pa = report["prior_adaptation"]
    rec = pa["estimator"]
    assert rec["kind"] in ("em", "confusion") and rec["center"] == "uniform" and rec["chosen"] == "validation"
    assert rec["pseudo_count"] in SMOOTHING_GRID and rec["validation_images"] > 0
    key = ("confusion:" if rec["kind"] == "confusion" else "") + f"{rec['pseudo_count']:g}"
    assert rec["scores"][key] == max(rec["scores"].values())
    val = pa["validation"]["average"]
    if rec["kind"] == "em":  # EM fits nothing: its score is the report's own validation mean of the adapted rule
        assert rec["scores"][key] == pytest.approx(np.mean([val[f"adaptive_{n}"] for n in pa["sizes"]]), abs=1e-9)
    else:  # the confusion estimator was scored cross-fitted; it ships with M from every validation row
        assert np.asarray(rec["confusion"]).shape == (10, 10)
    assert load_checkpoint(op_run / "final.pt")["state"]["meta"]["prior_estimator"] == rec
    pkg = export_checkpoint(op_run / "final.pt", tmp_path / "pkg", name="op-estimator")
    assert pkg.metadata["prior"]["estimator"] == rec
    assert PriorEstimator.from_dict(rec).describe() in (tmp_path / "pkg" / "README.md").read_text()
    assert PriorEstimator.from_dict(rec).describe() in (op_run / "report.md").read_text()


@pytest.mark.slow
def test_a_fixed_smoothing_is_kept_as_configured(tmp_path):
    import json

    from tafl.training.config import load_config
    from tafl.training.simulator import train

    from tests.conftest import CONFIGS

    out = tmp_path / "fixed"
    train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1, "prior_smoothing": 37}), out, progress=False)
    rec = json.loads((out / "report.json").read_text())["prior_adaptation"]["estimator"]
    assert rec["pseudo_count"] == 37.0 and rec["chosen"] == "config" and "scores" not in rec


@pytest.mark.slow
def test_a_retrain_fits_its_own_operating_point_and_calibration(op_run, tmp_path):
    """A parent's operating point (and calibration) describe the parent's weights: a retrain does not inherit them."""
    import json

    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import load_config
    from tafl.training.simulator import train

    from tests.conftest import CONFIGS

    parent = load_checkpoint(op_run / "final.pt")
    parent["state"]["meta"]["decision"] = dict(parent["state"]["meta"]["decision"], tau=9.9, offset=[5.0] * 10)
    parent["state"]["meta"]["prior_estimator"] = {"kind": "em", "pseudo_count": 12345.0, "center": "uniform"}
    out = tmp_path / "child"
    train(load_config(CONFIGS / "smoke.yaml", {"decision": "validation", "imbalance_factor": 50, "rounds": 1}), out,
          progress=False, init_from=parent)
    report = json.loads((out / "report.json").read_text())
    rec = report["decision"]
    assert rec["tau"] in GRID and rec["offset"] != [5.0] * 10
    assert report["prior_adaptation"]["estimator"]["pseudo_count"] != 12345.0  # its own, chosen on validation


@pytest.mark.slow
def test_a_corrupt_operating_point_is_refused_with_a_message(op_run, tmp_path):
    """A checkpoint whose decision record is broken is refused by export and by evaluation, not run with it."""
    from tafl.errors import CheckpointError, PackageError
    from tafl.packaging.export import export_checkpoint
    from tafl.training.checkpoint import load_checkpoint, save_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.data import load_dataset
    from tafl.training.simulator import evaluate_checkpoint

    ck = load_checkpoint(op_run / "final.pt")
    ck["state"]["meta"]["decision"] = dict(ck["state"]["meta"]["decision"], offset=[0.0, float("nan")])
    path = save_checkpoint({k: v for k, v in ck.items() if k not in ("format", "version")}, tmp_path / "bad.pt")
    with pytest.raises(PackageError, match="operating point cannot be exported.*10 finite"):
        export_checkpoint(path, tmp_path / "pkg", name="bad-op")
    assert not (tmp_path / "pkg" / "model.onnx").exists()
    cfg = RunConfig.from_dict(ck["run_config"])
    cfg.img_size, cfg.channels = ck["preprocess"]["size"], ck["preprocess"]["channels"]
    with pytest.raises(CheckpointError, match="operating point is unusable"):
        evaluate_checkpoint(load_checkpoint(path), load_dataset(cfg.validate()))
