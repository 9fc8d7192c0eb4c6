"""The learned in-domain detector (issue 53, item 2): a class-conditional Gaussian with a shared covariance on the
final model's features, fitted from the sites' feature sums in one statistics round, its threshold chosen on the
validation split alone, carried into the package's graph as `domain_distance` and into every /predict answer."""

from __future__ import annotations

import csv
import json

import httpx
import numpy as np
import pytest
from pydicom.data import get_testdata_file

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.training.detector import KEEP, combine, distances, fit_gaussian, head_energies  # noqa: E402
from tests.conftest import digit_png  # noqa: E402


def test_the_sites_sums_give_the_pooled_gaussian():
    """Means and shared covariance from per-site sums equal those of the pooled features (no image pooled)."""
    rng = np.random.default_rng(0)
    C, D = 4, 6
    feats = [rng.normal(size=(n, D)) + rng.normal(size=D) for n in (30, 50, 20)]
    labels = [rng.integers(0, C - 1, len(f)) for f in feats]  # class C-1 has no image anywhere
    sums, outer, counts = np.zeros((C, D)), np.zeros((D, D)), np.zeros(C)
    for f, y in zip(feats, labels):  # what each site sends
        np.add.at(sums, y, f)
        outer += f.T @ f
        counts += np.bincount(y, minlength=C)
    means, classes, precision = fit_gaussian(sums, outer, counts, shrinkage=0.0)
    F, Y = np.concatenate(feats), np.concatenate(labels)
    assert classes.tolist() == [0, 1, 2]  # an absent class has no mean to be near
    ref_means = np.stack([F[Y == c].mean(0) for c in range(C - 1)])
    centred = F - ref_means[Y]
    ref_cov = centred.T @ centred / (len(F) - (C - 1))
    assert np.allclose(means, ref_means) and np.allclose(np.linalg.inv(precision), ref_cov)
    # the distance is the squared Mahalanobis distance to the nearest mean, computed directly
    x = rng.normal(size=(5, D))
    direct = np.array([min((v - m) @ precision @ (v - m) for m in ref_means) for v in x])
    assert np.allclose(distances(x, means, precision), direct)


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    from tafl.training.config import load_config
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    out = tmp_path_factory.mktemp("det") / "run"
    report = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 2}), out, progress=False)
    return out, report


def test_the_threshold_comes_from_validation_and_the_report_measures_the_test_split(fedavg_run):
    _, report = fedavg_run
    det = report["domain_detector"]
    assert det["fitted"] and det["kind"] == "mahalanobis+energy" and det["keep"] == KEEP
    match = det["energy_match"]  # the energy put on the distance's scale, from the validation split
    assert match["log_distance"][1] > 0 and match["energy"][1] > 0
    assert abs(det["val_refused"] - (1 - KEEP)) <= 0.01  # the validation split's 95th percentile
    test = det["test"]
    assert test["images"] == 360 and 0.0 <= test["refused"] <= 0.15, test  # in-domain test images mostly kept
    assert set(test["refused_per_class"]) == set(report["class_names"])
    assert test["balanced_accuracy_accepted"] is not None


def test_the_package_scores_as_training_did_and_flags_what_it_never_saw(fedavg_run, tmp_path):
    """The graph's score (the distance, or the head's energy on its scale where larger) equals the training side's
    on the same images; a CT slice decoded as the service
    decodes it, noise and a blank frame lie beyond the threshold; the validation digits mostly within."""
    from tafl.imaging import decode_image
    from tafl.packaging.export import export_checkpoint
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.data import load_dataset
    from tafl.training.methods.detector import extract_features
    from tafl.training.models import ModelConfig, build_model

    run, _ = fedavg_run
    pkg = export_checkpoint(run / "final.pt", tmp_path / "pkg")
    assert "domain_distance" in [o.name for o in pkg.meta.outputs]
    t = pkg.meta.domain.detector.threshold
    assert t is not None and pkg.meta.verification.fields["max_rel_domain_distance_diff"] <= 1e-3
    # the card and the metadata state what training measured against the far sets
    far = pkg.meta.domain.detector.detection
    assert set(far) >= {"dicom", "photos", "noise", "constant"} and 0.5 < far["noise"]["auroc"] <= 1.0
    assert "Measured at training against images it must not answer" in pkg.card and "noise" in pkg.card
    ck = load_checkpoint(run / "final.pt")
    ds = load_dataset(RunConfig.from_dict(ck["run_config"]))
    val = ds.val.images[:64]
    model = build_model(ModelConfig.from_dict(ck["model_config"]))
    model.load_state_dict(ck["state"]["weights"])
    pre = pkg.preprocess
    mean = torch.tensor(pre.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(pre.std, dtype=torch.float32).view(1, -1, 1, 1)
    norm = lambda b: (b.permute(0, 3, 1, 2).float() / 255.0 - mean) / std  # noqa: E731
    ex = ck["state"]["extras"]
    feats = extract_features(model, torch.from_numpy(val), norm, 32)
    dist = distances(feats, ex["domain.means"].double().numpy(), ex["domain.precision"].double().numpy())
    ref = combine(dist, head_energies(model, feats), ck["state"]["meta"]["domain_detector"]["energy_match"])
    assert (ref > dist).any() and (ref == dist).any()  # both parts decide some of these images
    got = pkg.run(pkg.session(), pre.normalize(val))["domain_distance"]
    assert np.allclose(got, ref, rtol=1e-3), np.abs(got - ref).max()
    assert (got <= t).mean() >= 0.85
    ct = decode_image(open(get_testdata_file("CT_small.dcm"), "rb").read()).frames
    rng = np.random.default_rng(0)
    far = [*ct, rng.integers(0, 255, (64, 64), np.uint8), np.zeros((64, 64), np.uint8)]
    d = pkg.run(pkg.session(), far)["domain_distance"]
    assert (d > t).all(), (d, t)


def test_under_dp_the_detector_is_one_counted_release_and_still_flags_far_images(tmp_path):
    """With --dp-epsilon the sites' sums are one Gaussian release of clipped features: the plan counted it from the
    start (one more release for every site in the ledger, ε within the target), the noisy covariance is still a
    precision, and the threshold still refuses far images; --no-domain-detector fits none and the package says so."""
    from tafl.packaging.export import export_checkpoint
    from tafl.training.config import load_config
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    over = {"rounds": 1, "dp_epsilon": 8.0, "dp_delta": 1e-3}
    report = train(load_config(CONFIGS / "smoke.yaml", over), tmp_path / "run", progress=False)
    det = report["domain_detector"]
    assert det["fitted"] and det["private"] == "differential privacy", det
    priv = report["privacy"]
    assert priv["epsilon"] <= priv["epsilon_target"] + 1e-6
    assert all(c["releases"] >= 1 for c in priv["clients"].values()), priv["clients"]  # the detector's release
    # under DP the sets are calibrated on the server's validation split: no site sends anything for them (issue 54)
    sets = report["conformal"]
    assert sets["fitted"] and sets["clients"] == [] and sets["source"].startswith("the server's validation split")
    far = det["detection"]  # a one-round smoke model under DP noise (drawn from the OS): weak, but above chance
    assert far["noise"]["mahalanobis"]["auroc"] > 0.6, far
    off = train(load_config(CONFIGS / "smoke.yaml", {**over, "domain_detector": False}), tmp_path / "off",
                progress=False)
    assert off["domain_detector"] == {"fitted": False, "why": "turned off (--no-domain-detector)"}
    # one release fewer: the same ε target buys less noise on everything else
    z_on = min(c["stats_noise_multiplier"] for c in priv["clients"].values())
    z_off = min(c["stats_noise_multiplier"] for c in off["privacy"]["clients"].values())
    assert z_off < z_on
    pkg = export_checkpoint(tmp_path / "off" / "final.pt", tmp_path / "pkg")
    assert pkg.meta.domain.detector.threshold is None and "domain_distance" not in [o.name for o in pkg.meta.outputs]
    assert json.loads((tmp_path / "pkg" / "metadata.json").read_text())["domain"]["detector"]["fitted"] is False


@pytest.fixture(scope="module")
def detector_server(fedavg_run, tmp_path_factory):
    """The FedAvg smoke model with its detector, served (the shared test packages are exported without one)."""
    from tafl.packaging.export import export_checkpoint
    from tafl.serving.launch import ServerProcess

    run, _ = fedavg_run
    base = tmp_path_factory.mktemp("svc_det")
    pkg = export_checkpoint(run / "final.pt", base / "pkg", name="digits-det", domain=["colour=any"])
    env = {"BENTOML_HOME": str(base / "home"), "TAFL_AUDIT_LOG": str(base / "audit.jsonl"), "TAFL_WORKERS": "1"}
    with ServerProcess([str(base / "pkg")], env=env, log_path=base / "service.log") as srv:
        srv.log, srv.pkg = base / "service.log", pkg
        yield srv


@pytest.mark.slow
def test_out_of_domain_means_no_finding_in_every_answer(detector_server):
    """A CT slice to a digits model: /predict abstains (no label, the reason), gives the label only when asked and
    marks it, files no SR unless a "not assessed" one is asked for, draws no heatmap; the digits get labels and
    in-domain verdicts; /models, /metrics and the Open Inference Protocol count and say the same; the case-mix
    window holds only the in-domain images."""
    import io

    import pydicom
    from tritonclient.http import InferenceServerClient, InferInput

    from tafl.imaging.dicom_sr import NOT_ASSESSED

    url = detector_server.url
    ct = open(get_testdata_file("CT_small.dcm"), "rb").read()
    r = httpx.post(f"{url}/predict", files={"file": ("ct.dcm", ct, "application/dicom")}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["abstained"] is True and body["label"] is None and body["class_name"] is None, body
    assert body["probability"] is None and body["probabilities"] is None and body["experts"] == []
    dom = body["domain"]
    assert dom["in_domain"] is False and dom["distance"] > dom["threshold"] and "beyond" in dom["reason"]
    assert body["reason"].startswith("the model abstained: the image lies outside its domain")
    marked = httpx.post(f"{url}/predict", data={"abstain": "false"},
                        files={"file": ("ct.dcm", ct, "application/dicom")}, timeout=60).json()
    assert marked["abstained"] is False and isinstance(marked["label"], int) and marked["domain"]["in_domain"] is False
    assert "not a finding" in marked["outside_domain_note"]
    bad = httpx.post(f"{url}/predict", data={"abstain": "maybe"}, files={"file": ("ct.dcm", ct)}, timeout=60)
    assert bad.status_code == 400
    sr = httpx.post(f"{url}/predict", data={"format": "sr", "abstain": "false"},
                    files={"file": ("ct.dcm", ct, "application/dicom")}, timeout=60)
    assert sr.status_code == 422 and sr.json()["error"]["code"] == "OutsideDomain", sr.text  # abstain=false: JSON only
    assert "not_assessed=true" in sr.json()["error"]["message"]
    na = httpx.post(f"{url}/predict", data={"format": "sr", "not_assessed": "true", "heatmap": "true"},
                    files={"file": ("ct.dcm", ct, "application/dicom")}, timeout=60)
    assert na.status_code == 200 and na.headers["content-type"] == "application/dicom", na.text  # no heatmap SC
    ds = pydicom.dcmread(io.BytesIO(na.content))
    assert ds.Modality == "SR" and "not assessed" in ds.SeriesDescription
    assert NOT_ASSESSED in str(ds.ContentSequence)
    hm = httpx.post(f"{url}/heatmap", files={"file": ("ct.dcm", ct, "application/dicom")}, timeout=60)
    assert hm.status_code == 422 and hm.json()["error"]["code"] == "OutsideDomain"
    b = httpx.post(f"{url}/predict/batch", files=[("file", (f"{i}.png", digit_png(i), "image/png"))
                                                  for i in range(8)] + [("file", ("ct.dcm", ct))], timeout=60)
    res = b.json()["results"]
    verdicts = [x["domain"]["in_domain"] for x in res[:8]]
    assert sum(verdicts) >= 6, verdicts  # the digits it was trained on: mostly in
    assert all(x["abstained"] == (not x["domain"]["in_domain"]) for x in res)
    assert all(isinstance(x["label"], int) for x in res[:8] if x["domain"]["in_domain"])
    assert res[8]["abstained"] and res[8]["label"] is None
    # the Open Inference Protocol: the graph's domain_distance and the service's in_domain beside the label
    client = InferenceServerClient(url.split("://", 1)[1])
    meta = client.get_model_metadata("digits-det")
    assert "in_domain" in [o["name"] for o in meta["outputs"]] and meta["parameters"]["domain_threshold"] > 0
    pre = detector_server.pkg.preprocess
    from tafl.imaging import decode_image

    x = pre([decode_image(ct).frames[0], decode_image(digit_png(3)).frames[0]]).astype(np.float32)
    inp = InferInput(detector_server.pkg.meta.input.name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = client.infer("digits-det", [inp])
    in_dom, dist = out.as_numpy("in_domain"), out.as_numpy("domain_distance")
    assert in_dom.dtype == bool and not in_dom[0] and dist[0] > meta["parameters"]["domain_threshold"]
    # counted: the CT answers (/predict ×2, format=sr ×2, /heatmap, the batch's, OIP's) and the digits' outliers
    m = httpx.get(f"{url}/models", timeout=30).json()["models"][0]
    d = m["domain"]
    outside = 7 + (8 - sum(verdicts)) + int(not in_dom[1])
    assert d["abstained"] == outside and d["refused"] == 0, d
    assert d["answered"] == sum(verdicts) + int(in_dom[1]) and d["detector"]["threshold"] > 0
    assert abs(d["outside_share"] - outside / (outside + d["answered"])) < 1e-9
    assert m["case_mix"]["images_in_window"] == d["answered"], m["case_mix"]
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert f'by="detector"' in metrics and "tafl_outside_domain_total" in metrics
    assert "Traceback" not in detector_server.log.read_text()


@pytest.mark.slow
def test_the_client_the_cli_and_scoring_say_when_the_model_abstained(detector_server, tmp_path, capsys):
    from tafl.cli import main
    from tafl.clients.client import Client
    from tafl.clients.score import score_folder

    ct = get_testdata_file("CT_small.dcm")
    with Client(detector_server.url) as c:
        p = c.predict(ct)
        assert p.abstained and p.label is None and not p.in_domain and "abstained" in p.reason
        q = c.predict(ct, abstain=False)
        assert not q.abstained and q.label is not None and q.domain and not q.domain.in_domain
        d = c.predict(digit_png(0))
        assert d.in_domain and d.domain.distance <= d.domain.threshold
    assert main(["predict", ct, "--url", detector_server.url]) == 0
    out = capsys.readouterr().out
    assert "no finding: the model abstained" in out
    assert main(["predict", ct, "--url", detector_server.url, "--label-outside-domain"]) == 0
    assert "OUTSIDE THE MODEL'S DOMAIN: not a finding" in capsys.readouterr().out
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "ct.dcm").write_bytes(open(ct, "rb").read())
    for i in range(3):
        (folder / f"d{i}.png").write_bytes(digit_png(i))
    for how in ({"url": detector_server.url}, {"package": str(detector_server.pkg.path)}):
        out_csv = tmp_path / f"{'url' if 'url' in how else 'pkg'}.csv"
        summary = score_folder(folder, out_csv, progress=False, **how)
        rows = {r["path"]: r for r in csv.DictReader(open(out_csv))}
        assert rows["ct.dcm"]["in_domain"] == "False" and not rows["ct.dcm"]["label"] and not rows["ct.dcm"]["error"]
        assert float(rows["ct.dcm"]["domain_distance"]) > 0
        assert summary["abstained"] >= 1 and summary["predicted"] == 4 - summary["abstained"]
        assert sum(m["predicted"] for m in summary["class_mix"]) == summary["predicted"]


def test_a_retrain_fits_its_own_detector_and_never_keeps_the_parents(fedavg_run, tmp_path):
    """The parent's detector describes the parent's features: a retrain refits it (also a private one), and a
    retrain that fits none exports no stale one."""
    from tafl.packaging.export import export_checkpoint
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import load_config
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    run, report = fedavg_run
    parent = load_checkpoint(run / "final.pt")
    again = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1}), tmp_path / "a", progress=False,
                  init_from=parent)
    assert again["domain_detector"]["fitted"] and again["domain_detector"]["threshold"] != \
        report["domain_detector"]["threshold"]
    head = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1, "train_scope": "head"}), tmp_path / "h",
                 progress=False)  # DP's GroupNorm model, trained without DP: it has a detector
    assert head["domain_detector"]["fitted"]
    private = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1, "dp_epsilon": 8.0, "dp_delta": 1e-3}),
                    tmp_path / "dp", progress=False, init_from=load_checkpoint(tmp_path / "h" / "final.pt"))
    assert private["domain_detector"]["fitted"] and private["domain_detector"]["threshold"] != \
        head["domain_detector"]["threshold"]
    private = train(load_config(CONFIGS / "smoke.yaml", {"rounds": 1, "train_scope": "head", "domain_detector": False}),
                    tmp_path / "p", progress=False, init_from=load_checkpoint(tmp_path / "h" / "final.pt"))
    assert private["domain_detector"]["fitted"] is False
    pkg = export_checkpoint(tmp_path / "p" / "final.pt", tmp_path / "pkg")
    assert "domain_distance" not in [o.name for o in pkg.meta.outputs] and pkg.meta.domain.detector.threshold is None


def test_open_set_class_trains_without_it_and_measures_how_its_images_are_flagged(tmp_path):
    """--open-set-class 3: a digits model that never saw a 3; its test 3s are the report's unseen class, measured
    beside the far sets (AUROC in [0, 1], the share the threshold accepts); an unknown name is one clear error."""
    from tafl.errors import DataError
    from tafl.training.config import load_config
    from tafl.training.data import load_dataset
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    cfg = load_config(CONFIGS / "smoke.yaml", {"rounds": 2, "open_set_class": "3"})
    ds = load_dataset(cfg)
    assert "3" not in ds.class_names and len(ds.class_names) == 9 and len(ds.open_set) > 0
    assert ds.train.labels.max() == 8 and ds.provenance["open_set_class"]["test_images"] == len(ds.open_set)
    report = train(cfg, tmp_path / "run", progress=False)
    unseen = report["domain_detector"]["detection"]["unseen_class"]["score"]
    assert unseen["images"] == len(ds.open_set) and 0.0 <= unseen["auroc"] <= 1.0 and 0.0 <= unseen["accepted"] <= 1
    with pytest.raises(DataError, match="is not a class of this dataset; its classes are 0, 1, 2"):
        load_dataset(load_config(CONFIGS / "smoke.yaml", {"open_set_class": "cat"}))


def test_a_vit_is_scored_on_its_tokens_before_the_final_norm(dafl_run, tmp_path):
    """ViT-DAFL's detector features are its class token and mean patch token before the final LayerNorm (twice the
    width of its features); the exported graph computes the same distance as training does on them."""
    from tafl.packaging.export import export_checkpoint
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.methods.detector import extract_features
    from tafl.training.models import ModelConfig, build_model

    ck = load_checkpoint(dafl_run / "final.pt")
    if not (ck["state"]["meta"].get("domain_detector") or {}).get("fitted"):
        pytest.skip("the shared ViT-DAFL run fitted no detector")
    model = build_model(ModelConfig.from_dict(ck["model_config"]))
    model.load_state_dict(ck["state"]["weights"])
    assert model.domain_dim == 2 * model.feature_dim
    det = ck["state"]["meta"]["domain_detector"]  # its features are not its head's input: the distance alone
    assert det["kind"] == "mahalanobis" and det["energy_match"] is None
    pkg = export_checkpoint(dafl_run / "final.pt", tmp_path / "pkg")
    assert pkg.meta.verification.fields["max_rel_domain_distance_diff"] <= 1e-3
    pre = pkg.preprocess
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (16, pre.size, pre.size, pre.channels), np.uint8)
    mean = torch.tensor(pre.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(pre.std, dtype=torch.float32).view(1, -1, 1, 1)
    norm = lambda b: (b.permute(0, 3, 1, 2).float() / 255.0 - mean) / std  # noqa: E731
    feats = extract_features(model, torch.from_numpy(images), norm, 8)
    assert feats.shape == (16, model.domain_dim)
    ex = ck["state"]["extras"]
    ref = distances(feats, ex["domain.means"].double().numpy(), ex["domain.precision"].double().numpy())
    got = pkg.run(pkg.session(), pre.normalize(images))["domain_distance"]
    assert np.allclose(got, ref, rtol=1e-3), np.abs(got - ref).max()
