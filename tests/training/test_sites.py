"""Clients from a column (issue 33, part 1): `--client-column` makes one federated client per real site of a
folder dataset, `--split-column` takes the train/val/test split from the CSV, and the bad inputs of such a CSV are
clear errors. The sites here are made from the digits data: three "hospitals" with different case mixes, one of
them without a class, as vidir_molemax has no akiec in Fed-ISIC2019."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.errors import ConfigError, DataError  # noqa: E402
from tafl.training.config import RunConfig, load_config  # noqa: E402
from tests.conftest import CONFIGS  # noqa: E402

SITES = ("north", "south", "east")


def make_sites(root: Path, *, with_val: bool = False, drop: dict | None = None) -> Path:
    """digits as PNGs and labels.csv (image_id, dx, lesion_id, center, fold): each site's classes follow its own
    mix; every fifth lesion is test (every seventh val, with_val); `east` has no 9s."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    site = "north"
    for i, (x, y) in enumerate(zip(d.images, d.target)):
        if i % 2 == 0:  # a lesion's two images come from one site, as in a real hospital split
            weights = {"north": 1 + (y < 3) * 4, "south": 1 + (y > 6) * 4, "east": 2}
            site = str(rng.choice(SITES, p=np.array([weights[s] for s in SITES], float) / sum(weights.values())))
            if site == "east" and (y == 9 or d.target[min(i + 1, len(d.target) - 1)] == 9):
                site = "north"
        lesion = f"L{i // 2}"  # two images per lesion: a group that must not straddle train and val
        k = i // 2
        fold = "test" if k % 5 == 0 else "val" if with_val and k % 7 == 0 else "train"
        name = f"img{i}"
        Image.fromarray(np.uint8(x * 15)).save(root / "images" / f"{name}.png")
        rows.append({"image_id": name, "dx": str(y), "lesion_id": lesion, "center": site, "fold": fold})
    for key, value in (drop or {}).items():
        rows = [r for r in rows if r[key] != value]
    write_rows(root, rows)
    return root


def write_rows(root: Path, rows: list[dict]) -> None:
    with open(root / "labels.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def site_cfg(root: Path, **over) -> RunConfig:
    flags = {"dataset": "folder", "data_root": str(root), "labels": "labels.csv", "label_column": "dx",
             "group_column": "lesion_id", "client_column": "center", "split_column": "fold", "img_size": 16,
             "channels": 1, "cache_dir": "", **over}
    return load_config(CONFIGS / "smoke.yaml", {k: v for k, v in flags.items() if v is not None})


def csv_rows(root: Path) -> list[dict]:
    with open(root / "labels.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_one_client_per_site_on_its_own_rows_and_the_split_from_the_column(tmp_path):
    from tafl.training.simulator import prepare

    root = make_sites(tmp_path / "d")
    cfg = site_cfg(root)
    assert cfg.imbalance_factor is None  # the smoke file's synthetic long tail is replaced by the sites' own
    prep = prepare(cfg)
    ds, rows = prep.dataset, csv_rows(root)
    assert ds.site_names == sorted(SITES) and cfg.clients == 3 and len(prep.parts) == 3
    by_id = {r["image_id"]: r for r in rows}
    # every client's rows come from its own site, and together they are all training rows
    for k, part in enumerate(prep.parts):
        assert {by_id[i]["center"] for i in prep.train.ids[part]} == {ds.site_names[k]}
    assert sum(len(p) for p in prep.parts) == len(prep.train)
    # test is exactly the column's test rows; val is carved from training rows only, per site, by lesion
    assert set(ds.test.ids) == {r["image_id"] for r in rows if r["fold"] == "test"}
    assert {by_id[i]["fold"] for i in ds.val.ids} == {"train"}
    train_lesions = {by_id[i]["lesion_id"] for i in ds.train.ids}
    assert not train_lesions & {by_id[i]["lesion_id"] for i in ds.val.ids}
    for k, site in enumerate(ds.site_names):
        site_train = sum(r["fold"] == "train" and r["center"] == site for r in rows)
        held = int((ds.val.sites == k).sum())
        assert 0.08 * site_train < held < 0.25 * site_train  # about val_fraction of that site's training rows
    # the real mixes differ by site, and east has no 9s: a normal case, not an error
    east = ds.site_names.index("east")
    assert prep.client_counts[east][9] == 0 and prep.client_counts.sum() == len(prep.train)
    assert np.argmax(prep.client_counts[ds.site_names.index("north")]) < 3


def test_val_rows_in_the_column_are_the_validation_split(tmp_path):
    from tafl.training.data import load_dataset

    root = make_sites(tmp_path / "d", with_val=True)
    ds = load_dataset(site_cfg(root))
    rows = {r["image_id"]: r["fold"] for r in csv_rows(root)}
    assert {rows[i] for i in ds.val.ids} == {"val"} and {rows[i] for i in ds.train.ids} == {"train"}


@pytest.mark.slow
def test_a_site_run_trains_and_reports_each_site_on_its_own_mix(tmp_path):
    import json

    import torch

    from tafl.training.simulator import train

    root = make_sites(tmp_path / "d")
    train(site_cfg(root, rounds=1, frac=1.0), tmp_path / "run", progress=False)
    ck = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert ck["run_config"]["clients"] == 3 and ck["run_config"]["client_column"] == "center"
    assert ck["data_provenance"]["site_names"] == sorted(SITES) and len(ck["client_class_counts"]) == 3
    # the report: each site on its own test rows (its real mix) at the model's rule, adapted, and the oracle
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    rows = csv_rows(root)
    assert set(report["sites"]) == set(SITES) and report["sites_without_test"] == []
    for site, r in report["sites"].items():
        test = [x for x in rows if x["center"] == site and x["fold"] == "test"]
        assert r["n_test"] == len(test) and sum(r["test_class_counts"]) == len(test)
        assert r["test_class_counts"][9] == sum(x["dx"] == "9" for x in test)
        for rule in ("own", "site", "adapted", "oracle"):
            assert 0 <= r[rule]["balanced_accuracy"] <= 1 and 0 <= r[rule]["accuracy"] <= 1
        assert abs(sum(r["estimated_mix"]) - 1) < 1e-6
    own = [r["own"]["accuracy"] for r in report["sites"].values()]
    assert report["site_mean"]["own"]["accuracy"] == pytest.approx(sum(own) / 3)
    # pooled: the whole test split at the model's rule, the same number as the report's own balanced accuracy
    n = sum(r["n_test"] for r in report["sites"].values())
    assert n == sum(x["fold"] == "test" for x in rows) and 0 < report["pooled_balanced_accuracy"] <= 1
    md = (tmp_path / "run" / "report.md").read_text()
    assert "## Per site: each site's own test images (%)" in md and "| mean over sites |" in md
    # the package carries the per-site figures; its model card shows the table (the page renders the same rows)
    from tafl.packaging.export import export_checkpoint

    pkg = export_checkpoint(tmp_path / "run" / "final.pt", tmp_path / "pkg", domain=["detector=off"])
    met = pkg.metadata["metrics"]
    assert met["sites"]["east"]["own"] == report["sites"]["east"]["own"]
    assert met["pooled_balanced_accuracy"] == report["pooled_balanced_accuracy"]
    card = pkg.card.split("### Per site", 1)[1].split("\n## ", 1)[0]
    own = 100 * report["sites"]["north"]["own"]["accuracy"]
    n_north = report["sites"]["north"]["n_test"]
    from tafl.intervals import wilson

    _, lo, hi = wilson(report["sites"]["north"]["own"]["accuracy"] * n_north, n_north)  # the share with its interval
    assert f"| north | {n_north} | {own:.1f}% ({100 * lo:.1f}–{100 * hi:.1f}%) |" in card
    assert f"| all sites pooled | {n} | — | {100 * report['pooled_balanced_accuracy']:.1f}% | — | — | — |" in card


def test_the_site_rule_decides_each_site_for_its_own_training_mix_without_its_test_images():
    """`site` in the per-site report: each site's test rows decided for that site's own training mix (smoothed by
    tafl.prior.site_prior), which a site knows from its own labels; it never reads the test labels' mix."""
    from types import SimpleNamespace

    from tafl.prior import adapt, site_prior
    from tafl.training.data import Split
    from tafl.training.simulator import site_evaluation

    rng = np.random.default_rng(0)
    C, n = 3, 300

    def split(labels, sites):
        return Split(np.zeros((len(labels), 1, 1, 1), np.uint8), np.asarray(labels), np.arange(len(labels)),
                     np.asarray(sites))

    # site 0 sees mostly class 0, site 1 mostly class 2; the test rows follow the same mixes
    train_labels = np.r_[np.zeros(80, int), np.ones(10, int), 2 * np.ones(10, int),
                         np.zeros(10, int), np.ones(10, int), 2 * np.ones(80, int)]
    train_sites = np.r_[np.zeros(100, int), np.ones(100, int)]
    test_sites = np.r_[np.zeros(n // 2, int), np.ones(n // 2, int)]
    test_labels = np.where(test_sites == 0, rng.choice(C, n, p=[0.8, 0.1, 0.1]), rng.choice(C, n, p=[0.1, 0.1, 0.8]))
    # a weak, balanced model: the true class gets a little more than the others
    logits = rng.normal(0, 1, (n, C)) + 0.8 * np.eye(C)[test_labels]
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    ds = SimpleNamespace(class_names=["a", "b", "c"], site_names=["left", "right"],
                         train=split(train_labels, train_sites), test=split(test_labels, test_sites))
    method = SimpleNamespace(posterior_logits=lambda out: np.log(out["probs"]),
                             default_source_prior=lambda state: np.full(C, 1 / C))
    state = SimpleNamespace(meta={})
    res = site_evaluation(method, state, {"probs": probs, "label": probs.argmax(1)}, ds)
    for k, name in enumerate(ds.site_names):
        idx = test_sites == k
        mix = np.bincount(train_labels[train_sites == k], minlength=C)
        want = adapt(probs[idx], np.full(C, 1 / C), site_prior(mix)).argmax(1)
        got = res["sites"][name]["site"]["accuracy"]
        assert got == pytest.approx((want == test_labels[idx]).mean())
        assert got > res["sites"][name]["own"]["accuracy"] + 0.1  # the balanced rule is wrong for a skewed site
    assert res["site_mean"]["site"]["accuracy"] == pytest.approx(
        np.mean([r["site"]["accuracy"] for r in res["sites"].values()]))
    # the site prior: the site's mix with 1 % of the uniform mix, so a class the site never saw stays possible
    q = site_prior([98, 2, 0])
    assert q.sum() == pytest.approx(1) and q[2] == pytest.approx(0.01 / 3)
    assert q[0] == pytest.approx(0.99 * 0.98 + 0.01 / 3)
    assert site_prior([0.5, 0.5, 0]).tolist() == pytest.approx(site_prior([50, 50, 0]).tolist())  # shares or counts
    for bad in ([0, 0, 0], [1, -1, 2], [np.nan, 1, 1], [3]):
        with pytest.raises(ConfigError, match="one non-negative count per class"):
            site_prior(bad)


@pytest.mark.parametrize("flags,pattern", [
    ({"clients": 5}, "makes one client per site, so clients does not apply"),
    ({"alpha": 0.3, "partition": "dirichlet"}, "so alpha, partition do not apply"),
    ({"imbalance_factor": 10.0}, "imbalance_factor does not apply"),
])
def test_simulated_client_flags_are_errors_with_a_client_column(tmp_path, flags, pattern):
    with pytest.raises(ConfigError, match=pattern):
        site_cfg(tmp_path, **flags)


def test_a_file_that_sets_both_is_an_error_and_other_datasets_have_no_columns(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("dataset: folder\ndata_root: x\nlabels: y.csv\nclient_column: center\nclients: 4\n")
    with pytest.raises(ConfigError, match="clients does not apply"):
        load_config(f)
    with pytest.raises(ConfigError, match="'client_column'.*only for dataset 'folder'"):
        load_config(None, {"client_column": "center"})
    with pytest.raises(ConfigError, match="imbalance_factor.*own long tail"):
        RunConfig.from_dict({"dataset": "folder", "data_root": "x", "labels": "y", "client_column": "c"}).validate()


def test_bad_site_csvs_are_clear_errors(tmp_path):
    from tafl.training.data import load_dataset
    from tafl.training.simulator import prepare

    one = make_sites(tmp_path / "one", drop={"center": "south"})
    rows = csv_rows(one)
    for r in rows:
        r["center"] = "north"
    write_rows(one, rows)
    with pytest.raises(DataError, match="column 'center' holds one value \\('north'\\)"):
        load_dataset(site_cfg(one))

    for r in rows[:3]:
        r["fold"] = "holdout"
    write_rows(one, rows)
    with pytest.raises(DataError, match="column 'fold' holds 'holdout'; each row must be one of train, val or test"):
        load_dataset(site_cfg(one, client_column=None))

    with pytest.raises(DataError, match="no column 'hospital'"):
        load_dataset(site_cfg(make_sites(tmp_path / "d"), client_column="hospital"))

    # a site whose rows are all test rows has nothing to train a client on
    only_test = make_sites(tmp_path / "t")
    rows = csv_rows(only_test)
    for r in rows:
        if r["center"] == "east":
            r["fold"] = "test"
    write_rows(only_test, rows)
    with pytest.raises(DataError, match="site\\(s\\) east have no training rows"):
        prepare(site_cfg(only_test))


def test_with_sites_the_estimator_is_chosen_on_each_sites_own_validation_mix():
    """Real sites: the smoothing (and its centre) that adapts best on each site's validation rows at its own mix.
    Here a weak model (flat posteriors) at two sites whose mixes are like training: shrinking toward the training
    mix wins over the uniform mix, which would throw the common class away."""
    from tafl.prior import PriorEstimator
    from tafl.training.simulator import select_prior_smoothing_sites

    rng = np.random.default_rng(0)
    source = np.array([0.7, 0.2, 0.1])
    labels = rng.choice(3, size=600, p=source)
    logits = rng.normal(0, 1, (600, 3)) + 0.3 * np.eye(3)[labels] + np.log(source)  # barely informative
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    sites = np.repeat([0, 1], 300)
    est = select_prior_smoothing_sites(probs, labels, sites, source)
    assert isinstance(est, PriorEstimator) and est.center == "source" and est.pseudo_count > 0
    assert est.record["sites"] == 2 and est.record["criterion"].startswith("the mean over sites")
    s = est.record["scores"]
    assert s[f"source:{est.pseudo_count:g}"] >= max(s.values()) - 1e-12 and s["source:1600"] > s["uniform:1600"]
    assert "toward the mix the model's probabilities assume" in est.describe()

    # a model with balanced scores (local_adjust: its probabilities assume the uniform mix) at the same sites: the
    # training images' mix is a centre of its own, and the one that wins; the package keeps the mix it shrinks to
    balanced = probs / source
    balanced /= balanced.sum(1, keepdims=True)
    est = select_prior_smoothing_sites(balanced, labels, sites, np.full(3, 1 / 3), train_mix=source * 10)
    assert est.center == "train" and est.center_mix == pytest.approx(tuple(source))
    back = PriorEstimator.from_dict(est.to_dict())
    assert back.center_mix == pytest.approx(tuple(source)) and "toward the training images' mix" in back.describe()
    assert back.estimate(balanced[:5], np.full(3, 1 / 3)).prior.argmax() == 0  # five images barely move it
    with pytest.raises(ConfigError, match="center 'train' needs center_mix"):
        PriorEstimator.from_dict({"pseudo_count": 10, "center": "train"})


def test_each_sites_own_training_mix_is_a_centre_where_it_adapts_best_on_validation():
    """Two sites whose mixes are opposite (class 0 common at one, class 2 at the other) and a weak model: the
    federation's training mix sits between them, each site's own mix is where its images are. The chooser offers
    the `site` centre, which wins; the estimator keeps the federation's mix as the fallback of a deployment that
    gives no site mix, and a site's mix (counts or shares) moves the centre there."""
    from tafl.prior import PriorEstimator
    from tafl.training.simulator import select_prior_smoothing_sites

    rng = np.random.default_rng(1)
    mixes = {0: np.array([0.8, 0.15, 0.05]), 1: np.array([0.05, 0.15, 0.8])}
    labels = np.concatenate([rng.choice(3, size=200, p=mixes[k]) for k in (0, 1)])
    sites = np.repeat([0, 1], 200)
    source = np.full(3, 1 / 3)  # the pooled mix
    logits = rng.normal(0, 1, (400, 3)) + 0.5 * np.eye(3)[labels]  # barely informative, under the pooled mix
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    counts = {k: m * 1000 for k, m in mixes.items()}  # what each site knows: its own labelled images' counts
    est = select_prior_smoothing_sites(probs, labels, sites, source, site_mixes=counts)
    assert est.center == "site" and est.pseudo_count > 0 and est.center_mix == pytest.approx(tuple(source))
    s = est.record["scores"]
    assert s[f"site:{est.pseudo_count:g}"] > max(v for k, v in s.items() if not k.startswith("site:")) + 0.05
    # without the sites' mixes on offer the chooser is what it was
    assert select_prior_smoothing_sites(probs, labels, sites, source).center in ("source", "uniform")

    back = PriorEstimator.from_dict(est.to_dict())
    assert back.center == "site" and back.site_mix is None
    assert "(none given: the training images' mix)" in back.describe()
    at0 = back.for_site(counts[0])
    assert at0.site_mix == pytest.approx(tuple(mixes[0])) and "toward the site's own mix" in at0.describe()
    assert at0.center_prior(source) == pytest.approx(mixes[0])
    assert back.center_prior(source) == pytest.approx(source)  # no site mix: the federation's mix
    assert PriorEstimator.from_dict(at0.to_dict()).site_mix == pytest.approx(tuple(mixes[0]))
    few = probs[sites == 0][:5]
    assert at0.estimate(few, source).prior.argmax() == 0
    assert back.for_site(counts[1]).estimate(few, source).prior.argmax() == 2
    assert PriorEstimator(10.0, "uniform").for_site(counts[0]).site_mix is None  # other centres ignore a site mix
    with pytest.raises(ConfigError, match="one non-negative count per class"):
        back.for_site([0, 0, 0])


def test_a_site_mix_is_read_from_class_counts_or_a_json_file(tmp_path):
    import json

    from tafl.prior import parse_site_mix

    names = ["akiec", "mel", "nv"]
    assert parse_site_mix("nv=2977, mel=20", names).tolist() == [0, 20, 2977]
    (tmp_path / "mix.json").write_text(json.dumps({"nv": 0.9, "akiec": 0.1}))
    assert parse_site_mix(str(tmp_path / "mix.json"), names).tolist() == [0.1, 0, 0.9]
    for bad, why in [("nv:12", "CLASS=COUNT pairs"), ("df=3", "no class 'df'"), ("nv=many", "must be a number"),
                     ("nv=-1", "finite number >= 0"), ("nv=0", "at least one class"),
                     (str(tmp_path / "none.json"), "cannot read"), ("nv=inf", "finite number")]:
        with pytest.raises(ConfigError, match=why):
            parse_site_mix(bad, names, "--site-mix")
    (tmp_path / "big.json").write_bytes(b" " * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1024 KiB"):
        parse_site_mix(str(tmp_path / "big.json"), names)
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    with pytest.raises(ConfigError, match="JSON object of class counts"):
        parse_site_mix(str(tmp_path / "list.json"), names)


def test_the_recommended_config_file_is_the_configuration_its_table_row_ran():
    """configs/sites_ham10000.yaml is the row the docs recommend (benchmarks/sites_summary.py --recommend writes
    that row's run config): `tafl train --config` with it and a seed trains what the table measured."""
    import json

    from tests.conftest import REPO

    rec = json.loads((REPO / "benchmarks" / "results" / "sites_recommended.json").read_text())
    ran = rec["config"]
    cfg = load_config(CONFIGS / "sites_ham10000.yaml", {"data_root": "../shared/data/ham10000"}).to_dict()
    assert ran["clients"] == 4  # one client per hospital, from the CSV
    differ = {k: (cfg.get(k), v) for k, v in ran.items() if k not in ("clients", "seed", "threads") and cfg.get(k) != v}
    assert not differ, differ
    assert len(rec["seeds"]) == 3
