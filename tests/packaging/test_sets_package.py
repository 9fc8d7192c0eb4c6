"""Conformal prediction sets in the package (issue 54, item 2): export keeps the class thresholds of a few coverage
levels, computed from the run's summed calibration histograms, and the graph answers the set at the export's level
from the calibrated source-prior posteriors, whatever prior the request gives; the metadata refuses sets it cannot
honour; a request's coverage option picks another kept level and nothing else."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from tafl import conformal
from tafl.errors import BadRequest, ConfigError, PackageError
from tafl.packaging.metadata import PackageMetadata
from tafl.packaging.sets import MASK, SCORES, choose_coverage, set_answer


def _images(pkg, n: int = 24) -> np.ndarray:
    from sklearn.datasets import load_digits

    d = load_digits()
    frames = [np.kron(img / 16 * 255, np.ones((4, 4))).astype(np.uint8) for img in d.images[:n]]
    return pkg.preprocess(frames)


@pytest.mark.parametrize("kind", ["gtafl", "dafl"])
def test_the_graph_answers_the_set_from_the_source_prior_posteriors(kind, request):
    from tafl.packaging import load_package

    pkg = load_package(request.getfixturevalue(f"{kind}_pkg"))
    sets = pkg.meta.sets
    assert sets.fitted and sets.coverage == 0.9
    assert sorted(sets.thresholds) == [0.8, 0.9, 0.95]
    for lo, hi in ((0.8, 0.9), (0.9, 0.95)):  # a higher level never has a tighter threshold
        assert all(a <= b for a, b in zip(sets.thresholds[lo], sets.thresholds[hi]))
    sess = pkg.session(["CPUExecutionProvider"])
    x = _images(pkg)
    out = pkg.run(sess, x)
    assert out[MASK].dtype == np.bool_ and out[MASK].shape == out[SCORES].shape == (len(x), len(pkg.class_names))
    np.testing.assert_allclose(out[SCORES], 1 - out["calibrated_probs"], atol=1e-5)
    t = np.asarray(sets.thresholds[0.9])
    assert np.array_equal(out[MASK], out[SCORES] <= t)
    # another prior moves the label and the calibrated posteriors, never the set
    source = np.asarray(pkg.meta.prior.source_prior)
    q = np.full(len(source), 0.5 / (len(source) - 1))
    q[0] = 0.5
    ratio = np.log(q / source)
    shifted = pkg.run(sess, x, ratio)
    assert not np.allclose(shifted["calibrated_probs"], out["calibrated_probs"], atol=1e-3)
    np.testing.assert_allclose(shifted[SCORES], out[SCORES], atol=1e-6)
    assert np.array_equal(shifted[MASK], out[MASK])
    # the answer's set at another kept level is the scores against that level's thresholds
    for i in range(len(x)):
        a9, a95 = set_answer(pkg.meta, out, i), set_answer(pkg.meta, out, i, 0.95)
        assert a9["labels"] == list(np.flatnonzero(out[MASK][i]))
        assert set(a9["labels"]) <= set(a95["labels"]) and a95["coverage"] == 0.95
        assert a9["classes"] == [pkg.class_names[c] for c in a9["labels"]] and a9["size"] == len(a9["labels"])


def test_thresholds_are_the_histograms_and_coverage_is_chosen_at_export(gtafl_run, tmp_path):
    import torch

    from tafl.packaging.export import export_checkpoint

    ck = torch.load(gtafl_run / "final.pt", weights_only=False)
    hist = ck["state"]["extras"]["conformal.hist"].double().numpy()
    pkg = export_checkpoint(gtafl_run / "final.pt", tmp_path / "p85", coverage=0.85, domain=("detector=off",))
    sets = pkg.meta.sets
    assert sets.coverage == 0.85 and sorted(sets.thresholds) == [0.8, 0.85, 0.9, 0.95]
    for level, t in sets.thresholds.items():
        np.testing.assert_array_equal(t, conformal.class_thresholds(hist, 1 - level, 0.9))  # the run's rule
    assert sets.confidence == ck["state"]["meta"]["conformal"]["confidence"] == 0.9
    assert sets.calibration_images == int(hist.sum())
    out = pkg.run(pkg.session(["CPUExecutionProvider"]), _images(pkg))
    assert np.array_equal(out[MASK], out[SCORES] <= np.asarray(sets.thresholds[0.85]))
    card = (tmp_path / "p85" / "README.md").read_text()
    assert "Prediction sets:" in card and "at least 85%" in card and "with 90% confidence" in card
    source = ck["state"]["meta"]["conformal"]["source"]  # where the calibration images came from, as the card says
    assert sets.source == source and f"{sets.calibration_images} calibration images ({source})" in card
    # a checkpoint from before the rule was a choice keeps the rule its report measured: coverage on average
    del ck["state"]["meta"]["conformal"]["confidence"]
    (tmp_path / "old").mkdir()
    torch.save(ck, tmp_path / "old" / "final.pt")
    old = export_checkpoint(tmp_path / "old" / "final.pt", tmp_path / "p_old", domain=("detector=off",)).meta.sets
    assert old.confidence is None
    np.testing.assert_array_equal(old.thresholds[0.9], conformal.class_thresholds(hist, 0.1))
    assert (np.asarray(old.thresholds[0.9]) <= np.asarray(sets.thresholds[0.9])).all()
    assert "on average over the calibration images' draw" in (tmp_path / "p_old" / "README.md").read_text()
    with pytest.raises(ConfigError, match="--coverage 1.2"):
        export_checkpoint(gtafl_run / "final.pt", tmp_path / "bad", coverage=1.2)
    assert not (tmp_path / "bad").exists()


def test_metadata_refuses_sets_it_cannot_honour(gtafl_pkg):
    raw = json.loads((gtafl_pkg / "metadata.json").read_text())
    assert PackageMetadata.from_json(raw).sets.fitted
    cases = {
        "lack ['conformal_scores', 'prediction_set']": lambda m: m.update(
            outputs=[o for o in m["outputs"] if o["name"] not in (SCORES, MASK)]),
        "no thresholds for its coverage 0.85": lambda m: m["sets"].update(coverage=0.85),
        "expected 10 thresholds": lambda m: m["sets"]["levels"]["0.95"].pop(),
        "without a coverage": lambda m: m["sets"].update(coverage="ninety"),
    }
    for problem, edit in cases.items():
        bad = copy.deepcopy(raw)
        edit(bad)
        with pytest.raises(PackageError, match=problem.replace("[", r"\[").replace("]", r"\]")):
            PackageMetadata.from_json(bad)
    old = copy.deepcopy(raw)  # a package from before the sets reads, without sets
    del old["sets"]
    meta = PackageMetadata.from_json(old)
    assert not meta.sets and not meta.sets.fitted and "sets" not in meta.to_json()


def test_a_request_picks_a_kept_level_or_is_told_which_exist(gtafl_pkg):
    meta = PackageMetadata.from_json(json.loads((gtafl_pkg / "metadata.json").read_text()))
    assert choose_coverage(meta, None) == choose_coverage(meta, "") == 0.9
    assert choose_coverage(meta, "0.95") == choose_coverage(meta, "95") == 0.95
    for bad in ("0.7", "abc", "nan"):
        with pytest.raises(BadRequest, match="0.8, 0.9, 0.95"):
            choose_coverage(meta, bad)
    raw = json.loads((gtafl_pkg / "metadata.json").read_text())
    raw["sets"] = {"fitted": False, "why": "turned off (--no-conformal)"}
    none = PackageMetadata.from_json(raw)
    assert choose_coverage(none, None) is None
    with pytest.raises(BadRequest, match="no prediction sets .turned off"):
        choose_coverage(none, "0.9")
    assert set_answer(none, {SCORES: np.zeros((1, 10))}, 0) is None
