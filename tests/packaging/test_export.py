"""ONNX packages: parity with PyTorch, the vote's tie rule inside the graph, integrity, versions, BentoML."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch", reason="export needs torch: the train extra (pip install -e '.[train]')")

from PIL import Image  # noqa: E402

from tafl.errors import PackageError  # noqa: E402
from tafl.packaging import load_package  # noqa: E402
from tafl.packaging.export import build_graph, export_checkpoint  # noqa: E402
from tafl.packaging.package import list_packages  # noqa: E402
from tafl.training.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from tafl.training.data import load_dataset  # noqa: E402
from tafl.training.config import RunConfig  # noqa: E402

pytestmark = pytest.mark.slow


def _real_images(ck, n=16):
    cfg = RunConfig.from_dict(ck["run_config"])
    cfg.img_size, cfg.channels = ck["preprocess"]["size"], ck["preprocess"]["channels"]
    return load_dataset(cfg.validate()).test.images[:n]


@pytest.mark.parametrize("which", ["gtafl", "dafl"])
def test_package_matches_pytorch_on_real_images(which, request):
    run, pkg_dir = request.getfixturevalue(f"{which}_run"), request.getfixturevalue(f"{which}_pkg")
    pkg = load_package(pkg_dir)
    ck = load_checkpoint(run / "final.pt")
    v = pkg.metadata["verification"]
    assert v["batch_sizes"] == [1, 16] and v["max_abs_prob_diff"] <= 1e-4 and v["max_abs_heatmap_diff"] <= 1e-3
    graph, experts, vote = build_graph(ck)
    x = pkg.preprocess.normalize(_real_images(ck, 16))
    sess = pkg.session(providers=["CPUExecutionProvider"])
    got = pkg.run(sess, x)
    with torch.no_grad():
        ref = dict(zip(type(graph).outputs, (t.numpy() for t in graph(torch.from_numpy(x)))))
    assert np.array_equal(got["label"], ref["label"])
    assert np.abs(got["probs"] - ref["probs"]).max() <= 1e-4
    assert np.abs(got["heatmap"] - ref["heatmap"]).max() <= 1e-3
    assert got["heatmap"].shape == (16, pkg.preprocess.size, pkg.preprocess.size)
    if which == "gtafl":
        assert pkg.expert_names == ["forward", "uniform", "backward"] and vote.rule == "hard"
        assert np.array_equal(got["expert_labels"], ref["expert_labels"])
        assert got["expert_probs"].shape == (16, 3, 10) and got["votes"].shape == (16, 10)
        assert pkg.metadata["heatmap"].startswith("class activation map")
    else:
        assert pkg.metadata["experts"] == [] and "rollout" in pkg.metadata["heatmap"]
        assert {"logits", "probs", "label", "heatmap"} <= {o["name"] for o in pkg.metadata["outputs"]}
    assert pkg.metadata["metrics"]["average_accuracy"] is not None
    assert pkg.metadata["data_provenance"]["training_index_sha256"]


@pytest.mark.parametrize("which", ["gtafl", "dafl"])
def test_the_graph_decides_for_a_prior_given_as_its_optional_input(which, request):
    """log_prior_ratio absent = zeros = the plain rule; a reversed prior gives the Bayes rule of the calibrated
    posteriors, computed here from the graph's own calibrated_probs and the metadata's source prior."""
    from tafl.prior import adapt, log_prior_ratio

    run, pkg_dir = request.getfixturevalue(f"{which}_run"), request.getfixturevalue(f"{which}_pkg")
    pkg = load_package(pkg_dir)
    ck = load_checkpoint(run / "final.pt")
    prior = pkg.metadata["prior"]
    src = np.asarray(prior["source_prior"])
    assert prior["input"] == "log_prior_ratio" and abs(src.sum() - 1) < 1e-9
    assert len(pkg.metadata["verification"]["log_prior_ratio_cases"]) == 3
    sess = pkg.session(providers=["CPUExecutionProvider"])
    x = pkg.preprocess.normalize(_real_images(ck, 16))
    plain = pkg.run(sess, x)
    zeros = pkg.run(sess, x, np.zeros(len(src)))
    for k in ("label", "probs", "calibrated_probs"):
        assert np.array_equal(plain[k], zeros[k]), k
    assert np.allclose(plain["calibrated_probs"].sum(1), 1, atol=1e-5)
    q = np.arange(1.0, len(src) + 1) ** 2
    q = q / q.sum()  # far from either source prior (the training mix, or uniform for the experts)
    r = log_prior_ratio(q, src)
    shifted = pkg.run(sess, x, r)
    want = adapt(plain["calibrated_probs"], src, q)
    assert np.abs(shifted["calibrated_probs"] - want).max() < 1e-4
    assert np.array_equal(shifted["label"], want.argmax(1))
    assert np.allclose(shifted["probs"], shifted["calibrated_probs"])
    # one row per image: each image decided under its own prior
    rows = np.stack([np.zeros(len(src)) if i % 2 else r for i in range(16)]).astype(np.float32)
    mixed = pkg.run(sess, x, rows)
    assert np.array_equal(mixed["label"][::2], shifted["label"][::2])
    assert np.abs(mixed["calibrated_probs"][1::2] - plain["calibrated_probs"][1::2]).max() < 1e-5
    assert np.array_equal(mixed["label"][1::2], plain["label"][1::2])  # a zero row keeps the plain rule


def test_vote_tie_rule_is_inside_the_graph(tmp_path, gtafl_run):
    """Experts with crafted constant outputs: majority wins; when all disagree the uniform expert wins."""
    ck = load_checkpoint(gtafl_run / "final.pt")
    W = ck["state"]["extras"]["expert.weight"]
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    Image.fromarray(np.full((16, 16), 128, np.uint8), "L").save(imgs / "a.png")
    for case, prefs, want in [("tie", (4, 7, 2), 7), ("majority", (3, 3, 9), 3), ("tie2", (0, 5, 9), 5)]:
        b = torch.full((3, 10), -5.0)
        for e, c in enumerate(prefs):
            b[e, c] = 5.0
        ck["state"]["extras"]["expert.weight"] = torch.zeros_like(W)
        ck["state"]["extras"]["expert.bias"] = b
        path = save_checkpoint({k: v for k, v in ck.items() if k not in ("format", "version")}, tmp_path / f"{case}.pt")
        pkg = export_checkpoint(path, tmp_path / f"pkg_{case}", images=str(imgs))
        sess = ort.InferenceSession(str(pkg.model_path), providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).normal(size=(4, 1, 16, 16)).astype(np.float32)
        label, expert_labels, votes = sess.run(["label", "expert_labels", "votes"], {"image": x})
        assert expert_labels.tolist() == [list(prefs)] * 4
        assert label.tolist() == [want] * 4, case
        assert votes.sum(1).tolist() == [3.0] * 4


def test_learned_vote_weights_are_exported_into_the_graph(tmp_path, gtafl_run):
    """A model whose rule is `learned` carries its weights into the graph and the metadata."""
    ck = load_checkpoint(gtafl_run / "final.pt")
    W = ck["state"]["extras"]["expert.weight"]
    b = torch.full((3, 10), -5.0)
    b[0, 2], b[1, 5], b[2, 8] = 2.0, 3.0, 2.5  # soft with equal weights picks class 5; with these, class 8
    ck["state"]["extras"]["expert.weight"] = torch.zeros_like(W)
    ck["state"]["extras"]["expert.bias"] = b
    ck["state"]["meta"].update(vote="learned", vote_weights=[0.1, 0.2, 0.7])
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    Image.fromarray(np.full((16, 16), 128, np.uint8), "L").save(imgs / "a.png")
    path = save_checkpoint({k: v for k, v in ck.items() if k not in ("format", "version")}, tmp_path / "learned.pt")
    pkg = export_checkpoint(path, tmp_path / "pkg_learned", images=str(imgs))
    assert pkg.metadata["vote"]["rule"] == "learned" and pkg.metadata["vote"]["weights"] == pytest.approx([0.1, 0.2, 0.7])
    sess = ort.InferenceSession(str(pkg.model_path), providers=["CPUExecutionProvider"])
    x = np.zeros((2, 1, 16, 16), np.float32)
    (label,) = sess.run(["label"], {"image": x})
    assert label.tolist() == [8, 8]


def test_tampered_and_incomplete_packages_are_refused(tmp_path, gtafl_pkg):
    bad = tmp_path / "tampered"
    shutil.copytree(gtafl_pkg, bad)
    data = bytearray((bad / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(PackageError, match="checksum mismatch for model.onnx"):
        load_package(bad)
    missing = tmp_path / "missing"
    shutil.copytree(gtafl_pkg, missing)
    (missing / "metadata.json").unlink()
    with pytest.raises(PackageError, match="metadata.json is missing"):
        load_package(missing)
    nosums = tmp_path / "nosums"
    shutil.copytree(gtafl_pkg, nosums)
    (nosums / "SHA256SUMS").unlink()
    with pytest.raises(PackageError, match="SHA256SUMS is missing"):
        load_package(nosums)
    schema = tmp_path / "schema"
    shutil.copytree(gtafl_pkg, schema)
    meta = json.loads((schema / "metadata.json").read_text())
    del meta["class_names"]
    (schema / "metadata.json").write_text(json.dumps(meta))
    from tafl.packaging.package import write_checksums

    write_checksums(schema, ["model.onnx", "metadata.json", "README.md", "checkpoint.pt"])  # consistent sums, bad schema
    with pytest.raises(PackageError, match="missing 'class_names'"):
        load_package(schema)
    with pytest.raises(PackageError, match="not found"):
        load_package(tmp_path / "nowhere")


def test_version_bump_and_lineage(tmp_path, gtafl_run, gtafl_pkg):
    child = export_checkpoint(gtafl_run / "final.pt", tmp_path / "v2", parent=gtafl_pkg)
    assert child.version == "1.1.0" and child.metadata["parent_version"] == "1.0.0"
    assert child.name == "derm-gtafl" and child.metadata["parent"]["model_sha256"]
    grandchild = export_checkpoint(gtafl_run / "final.pt", tmp_path / "v3", parent=tmp_path / "v2")
    assert grandchild.version == "1.2.0"
    shutil.copytree(gtafl_pkg, tmp_path / "v1")
    rows = {r["version"]: r for r in list_packages(tmp_path)}
    assert set(rows) == {"1.0.0", "1.1.0", "1.2.0"}
    assert rows["1.2.0"]["parent_version"] == "1.1.0" and rows["1.1.0"]["status"] == "ok"
    with pytest.raises(PackageError, match="--force"):
        export_checkpoint(gtafl_run / "final.pt", tmp_path / "v2")


def test_bentoml_store_round_trip(tmp_path, gtafl_pkg, monkeypatch):
    monkeypatch.setenv("BENTOML_HOME", str(tmp_path / "bentoml"))
    import bentoml

    from tafl.packaging.store import from_bentoml, to_bentoml

    pkg = load_package(gtafl_pkg)
    tag = to_bentoml(pkg, "derm-gtafl")
    assert tag == "derm-gtafl:1_0_0"
    listed = [str(m.tag) for m in bentoml.models.list()]
    assert "derm-gtafl:1_0_0" in listed
    model = bentoml.models.get(tag)
    assert model.info.labels["tafl_method"] == "gtafl" and model.info.metadata["version"] == "1.0.0"
    back = from_bentoml(tag)
    assert back.version == "1.0.0" and back.class_names == pkg.class_names
    with pytest.raises(PackageError, match="no model"):
        from_bentoml("nope:1")


@pytest.mark.parametrize("which", ["gtafl", "dafl"])
def test_a_vector_scaling_calibration_is_applied_in_the_graph(which, request, tmp_path):
    """Per-class scales (calibration `vector`) reach the graph: its calibrated_probs are tafl.prior's
    softmax(a·s∘z + b) of the posteriors' log-probabilities (GTAFL: the experts' mean), read from its own outputs."""
    from tafl.prior import Calibration

    ck = load_checkpoint(request.getfixturevalue(f"{which}_run") / "final.pt")
    C = len(ck["class_names"])
    cal = Calibration(0.8, np.linspace(-0.3, 0.3, C), np.full(C, 1.0 / C), "vector", {}, np.linspace(0.5, 1.5, C))
    ck["state"]["meta"]["calibration"] = cal.to_dict()
    path = save_checkpoint({k: v for k, v in ck.items() if k not in ("format", "version")}, tmp_path / "vec.pt")
    pkg = export_checkpoint(path, tmp_path / "pkg_vec", name=f"vec-{which}")
    meta = pkg.metadata["prior"]
    assert meta["calibration"] == "vector" and meta["class_scale"] == pytest.approx(cal.class_scale.tolist())
    got = pkg.run(pkg.session(providers=["CPUExecutionProvider"]), pkg.preprocess.normalize(_real_images(ck, 16)))
    if which == "gtafl":
        z = np.log(got["expert_probs"].astype(np.float64)).mean(1)
    else:
        lg = got["logits"].astype(np.float64)
        z = lg - lg.max(1, keepdims=True)
        z = z - np.log(np.exp(z).sum(1, keepdims=True))
    want = cal.probs(z)
    assert np.abs(got["calibrated_probs"] - want).max() < 1e-4
    # the per-class scales matter: one scale alone gives other posteriors
    assert np.abs(Calibration(0.8, cal.bias).probs(z) - want).max() > 1e-2
