"""Prior-aware decisions in the real service (issue 13): prior=train|adaptive|explicit, the case-mix window,
its fallback when too few images stand behind it, and what /models and /metrics show. Each service here runs one
worker (TAFL_WORKERS=1): the case-mix window is a worker's, and these tests read the window they filled."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from tafl.packaging import load_package
from tafl.prior import log_prior_ratio, site_prior
from tests.conftest import digit_png

pytestmark = pytest.mark.slow

MIN_IMAGES = 8


@pytest.fixture(scope="module")
def prior_server(gtafl_pkg, tmp_path_factory):
    from tafl.serving.launch import ServerProcess

    log = tmp_path_factory.mktemp("svc_prior") / "service.log"
    env = {"BENTOML_HOME": str(tmp_path_factory.mktemp("bentoml_home_prior")), "TAFL_WORKERS": "1", "TAFL_PRIOR_WINDOW": "64",
           "TAFL_PRIOR_REFRESH": "4", "TAFL_PRIOR_MIN_IMAGES": str(MIN_IMAGES)}
    with ServerProcess([str(gtafl_pkg)], env=env, log_path=log) as srv:
        yield srv


def post(srv, i=0, route="/predict", **fields):
    return httpx.post(f"{srv.url}{route}", files={"file": ("d.png", digit_png(i), "image/png")},
                      data={k: str(v) for k, v in fields.items()}, timeout=60)


def test_train_prior_by_default_and_an_explicit_prior_decides_like_the_package(prior_server, gtafl_pkg):
    pkg = load_package(gtafl_pkg)
    C = len(pkg.class_names)
    plain = post(prior_server, 3).json()
    assert plain["prior"] == {"used": "train"}
    q = np.full(C, 0.02)
    q[7] = 1 - 0.02 * (C - 1)
    r = post(prior_server, 3, prior=",".join(f"{v:.6f}" for v in q))
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["prior"]["used"] == "explicit" and b["prior"]["prior"]["7"] == pytest.approx(q[7], abs=1e-6)
    # the same graph in process, fed the same log prior ratio, decides the same
    sess = pkg.session(providers=["CPUExecutionProvider"])
    from PIL import Image
    import io

    x = pkg.preprocess([np.asarray(Image.open(io.BytesIO(digit_png(3))))])
    want = pkg.run(sess, x, log_prior_ratio(q, np.asarray(pkg.metadata["prior"]["source_prior"])))
    assert b["label"] == int(want["label"][0])
    assert b["probabilities"]["7"] == pytest.approx(float(want["probs"][0, 7]), abs=1e-5)
    assert abs(sum(b["probabilities"].values()) - 1) < 1e-4
    # a JSON list works too, and the batch route takes the option
    assert post(prior_server, 3, prior="[" + ",".join(map(str, q)) + "]").json()["label"] == b["label"]
    batch = httpx.post(f"{prior_server.url}/predict/batch", files=[("file", ("a.png", digit_png(3), "image/png"))] * 2,
                       data={"prior": ",".join(map(str, q))}, timeout=60).json()
    assert batch["prior"]["used"] == "explicit" and [x["label"] for x in batch["results"]] == [b["label"]] * 2


@pytest.mark.parametrize("bad, why", [("0.5,0.5,0.5,0,0,0,0,0,0,0", "sum to 1"),
                                      ("1.5,-0.5,0,0,0,0,0,0,0,0", "negative"),
                                      ("0.5,0.5", "one value per class"),
                                      ("nan,1,0,0,0,0,0,0,0,0", "finite"),
                                      ("lots", "train, site, adaptive"),
                                      ("site", "started without one: start it with --site-mix")])
def test_a_bad_explicit_prior_is_a_400_with_a_message(prior_server, bad, why):
    r = post(prior_server, 1, prior=bad)
    assert r.status_code == 400, r.text
    assert why in r.json()["error"]["message"]


def test_adaptive_falls_back_until_enough_images_then_follows_the_served_mix(prior_server, gtafl_pkg):
    first = post(prior_server, 2, prior="adaptive").json()
    assert first["prior"]["used"] == "train" and first["prior"]["requested"] == "adaptive"
    assert "fallback" in first["prior"]
    for i in range(3 * MIN_IMAGES):  # a stream of served images: the window fills and an estimate is made
        assert post(prior_server, i % 10).status_code == 200
    deadline = time.time() + 10
    while True:
        b = post(prior_server, 2, prior="adaptive").json()
        if b["prior"]["used"] == "adaptive" or time.time() > deadline:
            break
        time.sleep(0.2)
    assert b["prior"]["used"] == "adaptive", b["prior"]
    assert b["prior"]["images"] >= MIN_IMAGES
    assert abs(sum(b["prior"]["prior"].values()) - 1) < 1e-6 and 0 <= b["prior"]["shift_from_source"] <= 1
    mix = httpx.get(f"{prior_server.url}/models", timeout=30).json()["models"][0]["case_mix"]
    assert mix["estimate"]["images"] >= MIN_IMAGES and mix["images_in_window"] <= 64
    assert mix["estimator"] == load_package(gtafl_pkg).metadata["prior"]["estimator"]  # the package's smoothing
    metrics = httpx.get(f"{prior_server.url}/metrics", timeout=30).text
    assert "tafl_case_mix_estimate" in metrics and "tafl_case_mix_shift" in metrics


def test_a_model_whose_validation_says_adaptation_hurts_is_not_adapted(gtafl_run, tmp_path, monkeypatch):
    """The package records its run's validation check (tafl.prior.adaptive_check); with TAFL_PRIOR_ADAPTIVE=checked
    (the default outside the tests) the service and `tafl score` keep the source prior for prior=adaptive and say
    why, however many images are served, while the estimate still feeds /models and /metrics."""
    import json
    import shutil

    from tafl.clients.score import score_folder
    from tafl.packaging.export import export_checkpoint
    from tafl.serving.launch import ServerProcess

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(gtafl_run / "final.pt", run / "final.pt")
    rep = json.loads((gtafl_run / "report.json").read_text())
    rep["prior_adaptation"]["validation"]["average"].update(calibrated=0.40, plain=0.48, adaptive_100=0.25,
                                                            adaptive_500=0.26)
    (run / "report.json").write_text(json.dumps(rep))
    pkg = export_checkpoint(run / "final.pt", tmp_path / "pkg", name="derm-uncal", domain=["detector=off"])
    check = pkg.metadata["prior"]["adaptive_check"]
    assert check["recommended"] is False and "26.0 % against 48.0 %" in check["why"]
    assert any("prior=adaptive is off" in line for line in pkg.metadata["limitations"])
    env = {"BENTOML_HOME": str(tmp_path / "bentoml_home"), "TAFL_WORKERS": "1", "TAFL_PRIOR_ADAPTIVE": "checked", "TAFL_PRIOR_WINDOW": "64",
           "TAFL_PRIOR_REFRESH": "4", "TAFL_PRIOR_MIN_IMAGES": str(MIN_IMAGES)}
    with ServerProcess([str(tmp_path / "pkg")], env=env, log_path=tmp_path / "service.log") as srv:
        for i in range(3 * MIN_IMAGES):
            assert post(srv, i % 10).status_code == 200
        time.sleep(1.0)
        b = post(srv, 2, prior="adaptive").json()
        assert b["prior"]["used"] == "train" and "validation split" in b["prior"]["fallback"], b["prior"]
        mix = httpx.get(f"{srv.url}/models", timeout=30).json()["models"][0]["case_mix"]
        assert mix["adaptive_blocked"] == check["why"] and mix["estimate"]["images"] >= MIN_IMAGES
        explicit = post(srv, 2, prior=",".join(["0.1"] * 10)).json()  # an explicit prior is the caller's: it decides
        assert explicit["prior"]["used"] == "explicit"
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(120):
        (folder / f"{i:03d}.png").write_bytes(digit_png(i % 10))
    monkeypatch.setenv("TAFL_PRIOR_ADAPTIVE", "checked")
    s = score_folder(folder, tmp_path / "s.csv", package=str(tmp_path / "pkg"), progress=False, prior="adaptive")
    assert s["prior"]["used"] == "train" and s["prior"]["fallback"] == check["why"]


def test_a_package_with_an_operating_point_decides_there_and_says_so(dafl_run, tmp_path):
    """The label a served request gets is the graph's argmax(logits + offset) (tafl.training.decision); its
    probabilities stay the model's, and the response's prior section names the operating point."""
    from PIL import Image
    import io

    from tafl.packaging.export import export_checkpoint
    from tafl.serving.launch import ServerProcess
    from tafl.training.checkpoint import load_checkpoint, save_checkpoint

    ck = load_checkpoint(dafl_run / "final.pt")
    C = len(ck["class_names"])
    offset = np.full(C, -0.3)
    offset[7] += 0.3 * C  # centred, and large enough to move some labels to class 7
    ck["state"]["meta"]["decision"] = {"kind": "logit_adjustment", "tau": 0.5, "offset": offset.tolist(),
                                       "criterion": "the macro F1 under a uniform class prior", "scores": {}}
    path = save_checkpoint({k: v for k, v in ck.items() if k not in ("format", "version")}, tmp_path / "op.pt")
    pkg = export_checkpoint(path, tmp_path / "pkg", name="derm-op", domain=["detector=off"])
    assert pkg.metadata["decision"]["tau"] == 0.5
    sess = pkg.session(providers=["CPUExecutionProvider"])
    with ServerProcess([str(tmp_path / "pkg")], env={"BENTOML_HOME": str(tmp_path / "bentoml_home"), "TAFL_WORKERS": "1"},
                       log_path=tmp_path / "service.log") as srv:
        moved = 0
        for i in range(10):
            b = post(srv, i).json()
            assert b["prior"] == {"used": "train", "operating_point": {
                "tau": 0.5, "rule": "logit adjustment chosen on validation"}}
            want = pkg.run(sess, pkg.preprocess([np.asarray(Image.open(io.BytesIO(digit_png(i))))]))
            assert b["label"] == int(want["label"][0]) == int((want["logits"][0] + offset).argmax())
            assert b["probabilities"]["7"] == pytest.approx(float(want["probs"][0, 7]), abs=1e-5)
            moved += b["label"] != int(want["probs"][0].argmax())
        assert moved > 0  # the offset did decide some labels against the probabilities' argmax


def test_a_package_with_a_malformed_estimator_record_is_refused_at_load(gtafl_pkg, tmp_path):
    """A package whose metadata prior.estimator cannot be read (here a negative pseudo-count, checksums rewritten so
    only the record is wrong) is refused by the registry as a bad package, naming the record."""
    import json
    import shutil

    from tafl.errors import PackageError
    from tafl.packaging.package import SUMS, write_checksums
    from tafl.serving.runtime import ModelRegistry

    pkg = tmp_path / "pkg"
    shutil.copytree(gtafl_pkg, pkg)
    meta = json.loads((pkg / "metadata.json").read_text())
    meta["prior"]["estimator"] = {"pseudo_count": -5, "center": "uniform"}
    (pkg / "metadata.json").write_text(json.dumps(meta))
    write_checksums(pkg, [line.split()[1] for line in (pkg / SUMS).read_text().splitlines() if line.strip()])
    with pytest.raises(PackageError, match="metadata prior.estimator: .*pseudo"):
        ModelRegistry([str(pkg)])


def _site_centred(gtafl_pkg, dest):
    """The smoke package with its estimator centred on the site's own mix (50 pseudo-images; the training mix as the
    fallback), checksums rewritten so only the record differs."""
    import json
    import shutil

    from tafl.packaging.package import SUMS, write_checksums

    shutil.copytree(gtafl_pkg, dest)
    meta = json.loads((dest / "metadata.json").read_text())
    meta["prior"]["estimator"] = {"kind": "em", "pseudo_count": 50.0, "center": "site",
                                  "center_mix": meta["prior"]["source_prior"]}
    (dest / "metadata.json").write_text(json.dumps(meta))
    write_checksums(dest, [line.split()[1] for line in (dest / SUMS).read_text().splitlines() if line.strip()])
    return load_package(dest)


def test_a_site_gives_its_own_class_mix_as_the_centre_of_the_case_mix_estimate(gtafl_pkg, tmp_path, monkeypatch):
    """An estimator centred on the site's own mix (chosen on validation where sites are real, issue 33): the service
    (TAFL_SITE_MIX, `tafl serve --site-mix`) and `tafl score --site-mix` shrink their estimate toward the counts the
    site gives, not toward the training mix; a class the model lacks is refused before anything starts."""
    from tafl.clients.score import score_folder
    from tafl.errors import ConfigError
    from tafl.prior import PriorEstimator
    from tafl.serving.launch import ServerProcess, preflight

    pkg = _site_centred(gtafl_pkg, tmp_path / "pkg")
    names = pkg.class_names
    spec = ",".join(f"{n}={90 if n == names[7] else 1}" for n in names)  # a site where class 7 is most images
    want_mix = np.array([90.0 if n == names[7] else 1.0 for n in names])
    want_mix /= want_mix.sum()

    monkeypatch.setenv("TAFL_SITE_MIX", "zebra=3")
    with pytest.raises(ConfigError, match="TAFL_SITE_MIX for derm-gtafl: no class 'zebra'"):
        preflight([str(tmp_path / "pkg")], port=0)
    monkeypatch.delenv("TAFL_SITE_MIX")

    env = {"BENTOML_HOME": str(tmp_path / "bentoml_home"), "TAFL_WORKERS": "1", "TAFL_PRIOR_WINDOW": "64", "TAFL_PRIOR_REFRESH": "4",
           "TAFL_PRIOR_MIN_IMAGES": str(MIN_IMAGES), "TAFL_SITE_MIX": spec}
    with ServerProcess([str(tmp_path / "pkg")], env=env, log_path=tmp_path / "service.log") as srv:
        # prior=site: every image decided for the site's own mix at once, as an explicit prior of that mix would be
        q_site = site_prior(want_mix)
        for i in (3, 7, 8):
            r, e = post(srv, i, prior="site").json(), post(srv, i, prior=",".join(f"{v:.12g}" for v in q_site)).json()
            assert r["prior"]["used"] == "site" and r["prior"]["prior"][names[7]] == pytest.approx(q_site[7])
            assert (r["label"], r["probability"]) == (e["label"], pytest.approx(e["probability"], abs=1e-6))
        assert httpx.get(f"{srv.url}/models", timeout=30).json()["models"][0]["site_prior"][names[7]] == \
            pytest.approx(q_site[7])
        for i in range(2 * MIN_IMAGES):
            assert post(srv, i % 10).status_code == 200
        deadline = time.time() + 10
        while (mix := httpx.get(f"{srv.url}/models", timeout=30).json()["models"][0]["case_mix"])["estimate"] is None \
                and time.time() < deadline:
            time.sleep(0.2)
    assert mix["estimator"]["center"] == "site" and np.allclose(mix["estimator"]["site_mix"], want_mix)

    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i:03d}.png").write_bytes(digit_png(i % 10))
    with pytest.raises(ConfigError, match="goes with --prior site .* or --prior adaptive"):
        score_folder(folder, tmp_path / "x.csv", package=str(tmp_path / "pkg"), progress=False, site_mix=spec)
    with pytest.raises(ConfigError, match="--prior site decides every image for this site's own class mix"):
        score_folder(folder, tmp_path / "x.csv", package=str(tmp_path / "pkg"), progress=False, prior="site")
    with pytest.raises(ConfigError, match="--site-mix: no class 'zebra'"):
        score_folder(folder, tmp_path / "x.csv", package=str(tmp_path / "pkg"), progress=False, prior="adaptive",
                     site_mix="zebra=1")
    assert not (tmp_path / "x.csv").exists()  # refused before anything was scored
    plain = score_folder(folder, tmp_path / "p.csv", package=str(tmp_path / "pkg"), progress=False, prior="adaptive")
    site = score_folder(folder, tmp_path / "s.csv", package=str(tmp_path / "pkg"), progress=False, prior="adaptive",
                        site_mix=spec)
    C = len(names)
    rows = [r.split(",") for r in (tmp_path / "s.csv").read_text().splitlines()]
    cols = [rows[0].index(f"p{c}") for c in range(C)]
    P = np.array([[float(r[c]) for c in cols] for r in rows[1:]])
    src = np.asarray(pkg.metadata["prior"]["source_prior"])
    q = PriorEstimator.from_dict(pkg.metadata["prior"]["estimator"]).for_site(want_mix).estimate(P, src).prior
    assert np.allclose([site["prior"]["estimate"][n] for n in names], q)
    # 50 pseudo-images of a mix that is 90 % class 7 pull the estimate of 40 balanced images toward class 7
    assert site["prior"]["estimate"][names[7]] > plain["prior"]["estimate"][names[7]] + 0.2
    # --prior site: the rows are those of the site's mix given as an explicit prior; the summary names the rule
    fixed = score_folder(folder, tmp_path / "f.csv", package=str(tmp_path / "pkg"), progress=False, prior="site",
                         site_mix=spec)
    score_folder(folder, tmp_path / "e.csv", package=str(tmp_path / "pkg"), progress=False,
                 prior=",".join(f"{v:.12g}" for v in site_prior(want_mix)))
    assert fixed["prior"]["used"] == "site" and fixed["prior"]["prior"][names[7]] == pytest.approx(q_site[7])
    labels = [[r.split(",")[1] for r in (tmp_path / f).read_text().splitlines()] for f in ("f.csv", "e.csv")]
    assert labels[0] == labels[1] and labels[0].count(names[7]) > 4


def test_a_package_with_the_confusion_estimator_estimates_through_its_matrix(gtafl_pkg, tmp_path):
    """A package whose training chose the confusion-matrix estimator (soft BBSE, issue 56): `tafl score --prior
    adaptive` estimates the folder's mix through the package's M, and the service's window says which estimator
    runs."""
    import json
    import shutil

    from tafl.clients.score import score_folder
    from tafl.packaging.package import SUMS, write_checksums
    from tafl.prior import PriorEstimator, confusion_prior, em_prior
    from tafl.serving.launch import ServerProcess

    dest = tmp_path / "pkg"
    shutil.copytree(gtafl_pkg, dest)
    meta = json.loads((dest / "metadata.json").read_text())
    C = len(meta["prior"]["source_prior"])
    M = np.full((C, C), 0.3 / (C - 1)) + np.eye(C) * (0.7 - 0.3 / (C - 1))  # 70 % right, the rest spread
    meta["prior"]["estimator"] = {"kind": "confusion", "pseudo_count": 0.0, "center": "uniform",
                                  "confusion": M.tolist()}
    (dest / "metadata.json").write_text(json.dumps(meta))
    write_checksums(dest, [line.split()[1] for line in (dest / SUMS).read_text().splitlines() if line.strip()])
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i:03d}.png").write_bytes(digit_png(i % 10))
    res = score_folder(folder, tmp_path / "a.csv", package=str(dest), progress=False, prior="adaptive")
    rows = [r.split(",") for r in (tmp_path / "a.csv").read_text().splitlines()]
    P = np.array([[float(r[rows[0].index(f"p{c}")]) for c in range(C)] for r in rows[1:]])
    src = np.asarray(meta["prior"]["source_prior"])
    names = load_package(dest).class_names
    got = np.array([res["prior"]["estimate"][n] for n in names])
    assert np.allclose(got, confusion_prior(P, M, src).prior)
    assert not np.allclose(got, em_prior(P, src).prior, atol=1e-3)  # not EM's answer
    assert PriorEstimator.from_dict(meta["prior"]["estimator"]).kind == "confusion"
    env = {"BENTOML_HOME": str(tmp_path / "bentoml_home"), "TAFL_WORKERS": "1", "TAFL_PRIOR_WINDOW": "64",
           "TAFL_PRIOR_REFRESH": "4", "TAFL_PRIOR_MIN_IMAGES": str(MIN_IMAGES)}
    with ServerProcess([str(dest)], env=env, log_path=tmp_path / "service.log") as srv:
        for i in range(2 * MIN_IMAGES):
            assert post(srv, i % 10).status_code == 200
        mix = httpx.get(f"{srv.url}/models", timeout=30).json()["models"][0]["case_mix"]
    assert mix["estimator"]["kind"] == "confusion" and np.allclose(mix["estimator"]["confusion"], M)
