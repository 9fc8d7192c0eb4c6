"""The in-domain detector and its metrics against a reference nobody here wrote (issue 53, item 6): pytorch-ood's
Mahalanobis detector (Lee et al. 2018) fitted on the same features gives the package graph's `domain_distance`, and
with its energy-based detector (Liu et al. 2020) on the head's logits the graph's combined score; pytorch-ood's
OODMetrics gives the report's AUROC and FPR at 95 % TPR.

pytorch-ood is a test dependency only (the `reference` extra, which needs torch): without it these tests skip."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")
pytest.importorskip("pytorch_ood", reason="needs pytorch-ood: the reference extra (pip install -e '.[reference]')")

from tafl.training.detector import fit_gaussian  # noqa: E402
from tafl.training.ood import detection  # noqa: E402


def test_the_graphs_distance_is_pytorch_oods_mahalanobis_score(tmp_path):
    """Fit both on the same training features (tafl from the per-class sums the sites would send, without
    shrinkage, as pytorch-ood has none); the exported ONNX graph's distance on test images equals pytorch-ood's
    score rescaled (it keeps the unnormalised covariance and half the distance: d = 2 (N - K) score) to 1e-4; with the
    run's energy matching, the graph's score equals the larger of that and pytorch-ood's energy put on its scale."""
    from pytorch_ood.detector import EnergyBased, Mahalanobis

    from tafl.packaging.export import export_checkpoint
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig, load_config
    from tafl.training.data import load_dataset
    from tafl.training.methods.detector import extract_features
    from tafl.training.models import ModelConfig, build_model
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    run = tmp_path / "run"
    train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1, "method": "fedavg"}), run, progress=False)
    ck = load_checkpoint(run / "final.pt")
    ds = load_dataset(RunConfig.from_dict(ck["run_config"]))
    model = build_model(ModelConfig.from_dict(ck["model_config"]))
    model.load_state_dict(ck["state"]["weights"])
    from tafl.imaging import Preprocess

    pre = Preprocess.from_dict(ck["preprocess"])
    mean = torch.tensor(pre.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(pre.std, dtype=torch.float32).view(1, -1, 1, 1)
    norm = lambda b: (b.permute(0, 3, 1, 2).float() / 255.0 - mean) / std  # noqa: E731
    feats = extract_features(model, torch.from_numpy(ds.train.images), norm, 128)
    labels = ds.train.labels
    C, D = len(ds.class_names), feats.shape[1]
    sums = np.zeros((C, D))
    np.add.at(sums, labels, feats)
    means, classes, precision = fit_gaussian(sums, feats.T @ feats, np.bincount(labels, minlength=C).astype(float),
                                             shrinkage=0.0)
    assert len(classes) == C
    ck["state"]["extras"]["domain.means"] = torch.from_numpy(means.astype(np.float32))
    ck["state"]["extras"]["domain.precision"] = torch.from_numpy(precision.astype(np.float32))
    det = ck["state"]["meta"]["domain_detector"]
    match = det["energy_match"]
    assert det["kind"] == "mahalanobis+energy" and match is not None
    ck["state"]["meta"]["domain_detector"] = dict(det, energy_match=None, kind="mahalanobis")
    torch.save(ck, tmp_path / "plain.pt")
    ck["state"]["meta"]["domain_detector"] = det
    torch.save(ck, tmp_path / "combined.pt")
    (tmp_path / "report.json").write_text("{}")
    test = ds.test.images[:200]
    outs = {}
    for name in ("plain", "combined"):
        pkg = export_checkpoint(tmp_path / f"{name}.pt", tmp_path / f"pkg-{name}")
        outs[name] = pkg.run(pkg.session(), pre.normalize(test))["domain_distance"].astype(np.float64)
    got = outs["plain"]

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # pytorch-ood allocates its buffers in the default dtype
    try:
        ref = Mahalanobis(None).fit_features(torch.from_numpy(feats), torch.from_numpy(labels))
        test_feats = extract_features(model, torch.from_numpy(test), norm, 128)
        score = ref.predict_features(torch.from_numpy(test_feats)).numpy()
        with torch.no_grad():
            energy = EnergyBased.score(model.head.double()(torch.from_numpy(test_feats))).numpy()
    finally:
        torch.set_default_dtype(old)
    expected = 2 * (len(labels) - C) * score
    rel = np.abs(got - expected) / np.maximum(np.abs(expected), 1.0)
    assert rel.max() <= 1e-4, rel.max()
    assert np.corrcoef(got, expected)[0, 1] > 0.9999
    (mu_l, sd_l), (mu_e, sd_e) = match["log_distance"], match["energy"]
    equivalent = np.exp(mu_l + sd_l * (energy - mu_e) / sd_e)
    assert (equivalent > expected).any() and (equivalent < expected).any()  # both parts decide some images
    combined = np.maximum(expected, equivalent)
    rel = np.abs(outs["combined"] - combined) / np.maximum(np.abs(combined), 1.0)
    assert rel.max() <= 1e-4, rel.max()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_reports_metrics_are_pytorch_oods(seed):
    """AUROC and FPR at 95 % TPR on scores with ties and overlap equal OODMetrics' (out-of-domain: label -1)."""
    from pytorch_ood.metrics import OODMetrics

    rng = np.random.default_rng(seed)
    s_in = np.round(rng.normal(0, 1, 300), 1)  # rounded: ties within and across the two sets
    s_out = np.round(rng.normal(1.5, 1.2, 120 + 40 * seed), 1)
    m = OODMetrics()
    m.update(torch.from_numpy(np.r_[s_in, s_out]),
             torch.from_numpy(np.r_[np.zeros(len(s_in), np.int64), -np.ones(len(s_out), np.int64)]))
    ref = m.compute()
    ours = detection(s_in, s_out)
    assert abs(ours["auroc"] - ref["AUROC"]) <= 1e-9, (ours, ref)
    assert abs(ours["fpr95"] - ref["FPR95TPR"]) <= 1e-9, (ours, ref)
