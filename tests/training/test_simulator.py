"""End to end in the simulator: the report's schema, resume equivalence, checkpoints, run folders."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.errors import RunDirError  # noqa: E402
from tafl.training.checkpoint import load_checkpoint  # noqa: E402
from tafl.training.longtail import DISTRIBUTION_NAMES  # noqa: E402
from tafl.training.simulator import train  # noqa: E402

pytestmark = pytest.mark.slow


def test_fedavg_two_rounds_report_schema_and_beats_chance(tmp_path, smoke_cfg):
    out = tmp_path / "run"
    report = train(smoke_cfg, out, progress=False)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["average_accuracy"] == pytest.approx(report["average_accuracy"])
    for key in ("method", "dataset", "config", "test_distributions", "average_accuracy", "uniform_metrics", "timing",
                "communication"):
        assert key in on_disk, key
    assert on_disk["method"] == "fedavg" and on_disk["dataset"] == "digits"
    assert list(on_disk["test_distributions"]) == list(DISTRIBUTION_NAMES)
    for d in on_disk["test_distributions"].values():
        assert set(d) >= {"accuracy", "sampled_accuracy", "head", "middle", "tail", "n"}
        assert 0 <= d["accuracy"] <= 1
    assert set(on_disk["uniform_metrics"]) >= {"macro_f1", "precision", "recall", "specificity", "auc"}
    assert on_disk["timing"]["client_s"] > 0 and on_disk["timing"]["server_s"] >= 0
    assert on_disk["communication"]["uplink_bytes"] > 0 and on_disk["communication"]["downlink_bytes"] > 0
    assert on_disk["test_distributions"]["uniform"]["accuracy"] > 1 / 10  # better than chance on 10 classes
    assert len(on_disk["client_class_counts"]) == smoke_cfg.clients
    val = on_disk["validation"]  # the plain accuracy and the per-distribution ones under distinct keys
    assert isinstance(val["accuracy"], float) and 0 <= val["accuracy"] <= 1 and 0 <= val["balanced_accuracy"] <= 1
    assert list(val["distribution_accuracy"]) == list(DISTRIBUTION_NAMES)
    assert val["average_accuracy"] == pytest.approx(sum(val["distribution_accuracy"].values()) / 11)
    md = (out / "report.md").read_text()
    assert md.startswith("# fedavg on digits")
    assert f"## Validation split (%)\n\nAccuracy {100 * val['accuracy']:.2f}, balanced accuracy" in md
    assert (out / "accuracy.png").stat().st_size > 1000
    ck = torch.load(out / "final.pt", weights_only=True)  # tensors and plain config only
    assert ck["method"] == "fedavg" and ck["round"] == 2


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, smoke_cfg):
    smoke_cfg.rounds = 3
    full = tmp_path / "full"
    train(smoke_cfg, full, progress=False)
    part = tmp_path / "part"
    smoke_cfg.rounds = 2
    train(smoke_cfg, part, progress=False)  # stops after round 2, as a killed run would
    smoke_cfg.rounds = 3
    train(smoke_cfg, part, resume=True, progress=False)
    a = load_checkpoint(full / "final.pt")["state"]["weights"]
    b = load_checkpoint(part / "final.pt")["state"]["weights"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    hist = json.loads((part / "report.json").read_text())["history"]
    assert [h["round"] for h in hist] == [1, 2, 3]


def test_output_folder_is_not_overwritten_without_force(tmp_path, smoke_cfg):
    smoke_cfg.rounds = 1
    out = tmp_path / "run"
    train(smoke_cfg, out, progress=False)
    with pytest.raises(RunDirError, match="--force"):
        train(smoke_cfg, out, progress=False)
    train(smoke_cfg, out, force=True, progress=False)
    other = tmp_path / "not_a_run"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(RunDirError, match="refusing"):
        train(smoke_cfg, other, force=True, progress=False)
    assert (other / "precious.txt").exists()


def test_select_val_keeps_the_best_validation_round(tmp_path, smoke_cfg):
    smoke_cfg.rounds = 3
    smoke_cfg.select = "val"
    report = train(smoke_cfg, tmp_path / "run", progress=False)
    hist = report["history"]
    best = max(hist, key=lambda h: h["val_bacc"])
    assert report["selected_round"] == best["round"]


def test_fedprox_runs_and_differs_from_fedavg(tmp_path, smoke_cfg):
    smoke_cfg.rounds = 1
    train(smoke_cfg, tmp_path / "avg", progress=False)
    smoke_cfg.method, smoke_cfg.mu = "fedprox", 1.0
    train(smoke_cfg, tmp_path / "prox", progress=False)
    a = load_checkpoint(tmp_path / "avg" / "final.pt")["state"]["weights"]["head.weight"]
    b = load_checkpoint(tmp_path / "prox" / "final.pt")["state"]["weights"]["head.weight"]
    assert not torch.equal(a, b)
