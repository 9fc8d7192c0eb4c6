"""Site-aware prediction sets (issue 54): where the clients are real sites, each site's held-out histograms give it
thresholds of its own (they cover its own images where the federation's need not), the report measures both on
each site's test images, the package keeps them, and a service at that site answers with them (`tafl serve
--site`, TAFL_SITE, or a request's `site`), a real `bentoml serve`. Sites made from the digits data
(tests/training/test_sites.py)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl import conformal  # noqa: E402
from tafl.errors import BadRequest, ConfigError  # noqa: E402
from tests.conftest import digit_png  # noqa: E402
from tests.training.test_sites import SITES, make_sites, site_cfg  # noqa: E402


@pytest.fixture(scope="module")
def site_run(tmp_path_factory):
    from tafl.training.simulator import train

    root = tmp_path_factory.mktemp("sites")
    data = make_sites(root / "d", with_val=True)
    out = root / "run"
    rep = train(site_cfg(data, rounds=1, frac=1.0, calib_holdout=0.3, calibration="vector"), out, progress=False)
    return data, out, rep


def test_each_site_gets_thresholds_of_its_own_from_its_held_out_rows(site_run):
    from tafl.training.checkpoint import load_checkpoint

    _, out, rep = site_run
    state = load_checkpoint(out / "final.pt")["state"]
    rec, hist = state["meta"]["conformal"], state["extras"]["conformal.hist"].double().numpy()
    site_hist = state["extras"]["conformal.site_hist"].double().numpy()
    assert sorted(rec["sites"]) == sorted(SITES) and site_hist.shape == (3, *hist.shape)
    np.testing.assert_array_equal(site_hist.sum(axis=0), hist)  # the sites' histograms are the federation's parts
    for k, name in enumerate(sorted(SITES)):
        assert rec["sites"][name]["calibration_images"] == int(site_hist[k].sum()) > 0
        for level, t in rec["sites"][name]["thresholds"].items():
            np.testing.assert_array_equal(t, conformal.class_thresholds(site_hist[k], 1 - float(level),
                                                                             rec["confidence"]))
    aware = rep["conformal"]["levels"]["0.9"]["site_aware"]["sites"]
    fed = rep["conformal"]["levels"]["0.9"]["class_conditional"]["sites"]
    assert set(aware) == set(fed) == set(SITES)
    assert all(aware[s]["images"] == fed[s]["images"] > 0 for s in SITES)
    assert "Per site at 0.9" in (out / "report.md").read_text()


def test_a_private_site_run_takes_each_sites_validation_rows(tmp_path, site_run):
    from tafl.training.simulator import train

    data, _, _ = site_run
    rep = train(site_cfg(data, rounds=1, frac=1.0, dp_epsilon=8.0, dp_delta=1e-3), tmp_path / "dp", progress=False)
    c = rep["conformal"]
    assert c["fitted"] and c["source"].startswith("the server's validation split")
    assert sorted(c["sites"]) == sorted(SITES)
    assert sum(v["calibration_images"] for v in c["sites"].values()) == c["calibration_images"]


def test_the_package_and_a_service_at_a_site_answer_with_its_thresholds(site_run, tmp_path, monkeypatch):
    import io

    from PIL import Image

    from tafl.packaging import load_package
    from tafl.packaging.export import export_checkpoint
    from tafl.packaging.sets import SCORES, choose_site, set_answer
    from tafl.serving.launch import ServerProcess, preflight

    _, out, _ = site_run
    pkg = export_checkpoint(out / "final.pt", tmp_path / "pkg", domain=("detector=off",))
    sets = pkg.meta.sets
    assert sorted(sets.sites) == sorted(SITES)
    assert all(sorted(v) == sorted(sets.thresholds) for v in sets.sites.values())
    res = pkg.run(pkg.session(["CPUExecutionProvider"]), [np.asarray(Image.open(io.BytesIO(digit_png(i))))
                                                          for i in range(8)])
    for i in range(8):
        for site in SITES:
            a = set_answer(pkg.meta, res, i, 0.9, site)
            assert a["calibrated_for"] == site
            assert a["labels"] == list(np.flatnonzero(res[SCORES][i] <= np.asarray(sets.sites[site][0.9])))
    with pytest.raises(BadRequest, match="east, north, south only"):
        choose_site(pkg.meta, "west")
    with ServerProcess([str(tmp_path / "pkg")], env={"TAFL_SITE": "north"}) as srv:
        def ask(**fields):
            return httpx.post(f"{srv.url}/predict", files={"file": ("x.png", digit_png(3), "image/png")},
                              data=fields, timeout=60)

        north = ask().json()["prediction_set"]
        assert north["calibrated_for"] == "north" and "of north" in north["meaning"]
        south = ask(site="south").json()["prediction_set"]
        assert south["calibrated_for"] == "south"
        bad = ask(site="west")
        assert bad.status_code == 400 and "east, north, south" in bad.json()["error"]["message"]
    monkeypatch.setenv("TAFL_SITE", "west")  # a site no package knows: `tafl serve` stops before it starts
    with pytest.raises(ConfigError, match="TAFL_SITE='west'.*its sites: east, north, south"):
        preflight([str(tmp_path / "pkg")], port=0)
    meta = load_package(tmp_path / "pkg").meta
    assert set(meta.sets.test["site_aware"]) == set(SITES)
    card = (tmp_path / "pkg" / "README.md").read_text()
    assert "Each training site has thresholds of its own (east, north, south" in card and "with its own" in card
