"""metadata.json as a typed, versioned contract (tafl.packaging.metadata): what export writes reads back to the same
object and the same bytes; every problem is named by its field; metadata an older tafl wrote loads (migrated), and
metadata from a newer tafl is refused with both versions named. Runs without torch (the package fixtures copy the
exported packages in the core install)."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

from tafl.errors import PackageError
from tafl.packaging import load_package
from tafl.packaging.card import render_card
from tafl.packaging.metadata import ADDED_IN_1, SCHEMA, SCHEMA_VERSION, PackageMetadata, listing
from tafl.packaging.package import SUMS, write_checksums

# what metadata.json held before later tafl 1.x releases added the keys of ADDED_IN_1
FIRST_KEYS = ("schema", "name", "version", "parent_version", "created", "method", "backbone", "class_names", "input",
              "outputs", "experts", "vote", "heatmap", "training", "data_provenance", "metrics", "intended_use",
              "limitations")


def _raw(pkg_dir) -> tuple[str, dict]:
    text = (pkg_dir / "metadata.json").read_text()
    return text, json.loads(text)


def _rewritten(src, dest, raw: dict):
    """A copy of the package at `src` with `raw` as its metadata.json, and its checksums rewritten (as its exporter
    would write them)."""
    shutil.copytree(src, dest)
    (dest / "metadata.json").write_text(json.dumps(raw))
    names = [line.split("  ", 1)[1] for line in (dest / SUMS).read_text().splitlines() if line.strip()]
    write_checksums(dest, names)
    return dest


@pytest.mark.parametrize("kind", ["gtafl", "dafl"])
def test_what_export_wrote_reads_back_to_the_same_object_and_bytes(kind, request):
    pkg_dir = request.getfixturevalue(f"{kind}_pkg")
    text, raw = _raw(pkg_dir)
    meta = PackageMetadata.from_json(raw)
    assert meta.schema == SCHEMA and meta.schema_version == SCHEMA_VERSION
    assert json.dumps(meta.to_json(), indent=2) == text  # the keys in export's order, every value as written
    assert PackageMetadata.from_json(meta.to_json()) == meta and meta.extra == {}
    pkg = load_package(pkg_dir)
    assert pkg.meta == meta and pkg.metadata == raw  # typed for tafl; the JSON as written for GET /models
    assert render_card(meta) == pkg.card  # the card is a function of the metadata alone
    assert list(meta.prior.source_prior) == raw["prior"]["source_prior"] and pkg.class_names == raw["class_names"]
    assert meta.expert_names == [e["name"] for e in raw["experts"]] and (kind == "gtafl") == bool(meta.experts)
    assert meta.input.preprocess.to_json() == raw["input"]["preprocess"] == pkg.preprocess.to_dict()


def test_every_problem_is_named_by_its_field(gtafl_pkg):
    _, raw = _raw(gtafl_pkg)
    bad = copy.deepcopy(raw)
    del bad["class_names"]
    bad["version"] = "1.0"
    bad["input"]["preprocess"]["size"] = "16"
    bad["outputs"] = [o for o in bad["outputs"] if o["name"] != "votes"]
    bad["experts"][1]["weight"] = "heavy"
    with pytest.raises(PackageError) as err:
        PackageMetadata.from_json(bad, "pkg/metadata.json")
    msg = err.value.message
    assert msg.startswith("pkg/metadata.json: ")
    for problem in ("'version' is '1.0', not a semantic version", "missing 'class_names'",
                    "'input.preprocess.size' has type str, expected an integer", "'outputs' lack ['votes']",
                    "'experts[1].weight' has type str"):
        assert problem in msg
    assert msg.count("; ") == 4  # one clause per problem
    wrong_prior = copy.deepcopy(raw)
    wrong_prior["prior"]["source_prior"] = [0.5, 0.5]
    with pytest.raises(PackageError, match=r"'prior.source_prior' has 2 values, expected one per class \(10\)"):
        PackageMetadata.from_json(wrong_prior)
    with pytest.raises(PackageError, match="expected a JSON object"):
        PackageMetadata.from_json([raw])


def test_metadata_from_a_newer_tafl_is_refused_naming_both_versions(gtafl_pkg, tmp_path):
    _, raw = _raw(gtafl_pkg)
    newer = dict(raw, schema=f"tafl-model-package/{SCHEMA_VERSION + 1}")
    pkg = _rewritten(gtafl_pkg, tmp_path / "newer", newer)
    with pytest.raises(PackageError) as err:
        load_package(pkg)
    assert f"tafl-model-package/{SCHEMA_VERSION + 1}" in err.value.message and SCHEMA in err.value.message
    assert "written by a newer tafl" in err.value.message and "upgrade tafl" in err.value.message
    with pytest.raises(PackageError, match="is not a tafl model package's"):
        PackageMetadata.from_json(dict(raw, schema="other-format/1"))
    with pytest.raises(PackageError, match="missing 'schema'"):
        PackageMetadata.from_json({k: v for k, v in raw.items() if k != "schema"})


def test_metadata_an_older_tafl_wrote_loads_and_answers_as_it_did(gtafl_pkg, tmp_path):
    """A package from before the keys of ADDED_IN_1 (no prior input, operating point, privacy or verification
    record) loads; what it lacks reads as what its absence meant, and its graph answers as before."""
    _, raw = _raw(gtafl_pkg)
    old = {k: raw[k] for k in FIRST_KEYS}
    pkg = load_package(_rewritten(gtafl_pkg, tmp_path / "old", old))
    meta = pkg.meta
    assert meta.prior is None and not meta.decision and meta.decision.tau is None and not meta.privacy
    assert not meta.verification and not meta.parent and meta.class_codes is None and meta.tafl_version is None
    assert set(ADDED_IN_1) == set(raw) - set(FIRST_KEYS) | {"class_codes"}  # every key added since is migrated
    assert pkg.metadata == old  # GET /models hands on the file as it is
    now = load_package(gtafl_pkg)
    x = np.random.default_rng(0).normal(size=(3, *meta.input.shape[1:])).astype(np.float32)
    got, want = pkg.run(pkg.session(["CPUExecutionProvider"]), x), now.run(now.session(["CPUExecutionProvider"]), x)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    with pytest.raises(PackageError, match="predates prior-aware inference"):
        pkg.run(pkg.session(["CPUExecutionProvider"]), x, np.zeros(len(pkg.class_names)))


def test_keys_this_tafl_does_not_know_are_kept_and_written_back(gtafl_pkg):
    _, raw = _raw(gtafl_pkg)
    meta = PackageMetadata.from_json(dict(raw, site_notes={"reviewed": "2026-01-02"}))
    assert meta.extra == {"site_notes": {"reviewed": "2026-01-02"}}
    assert meta.to_json() == dict(raw, site_notes={"reviewed": "2026-01-02"})


def test_records_read_what_they_hold_and_cope_with_what_they_lack(gtafl_pkg):
    """The records other parts write are carried whole; their properties read None (or empty) where a value is
    missing or of another shape, as the page and the card expect, instead of refusing the package."""
    _, raw = _raw(gtafl_pkg)
    odd = copy.deepcopy(raw)
    odd["metrics"].update(accuracy=[1, 2], sites={"a": {"n_test": 3, "own": "text"}, "b": 5},
                          nan_probe=float("nan"))
    meta = PackageMetadata.from_json(odd)
    assert meta.metrics.accuracy == {} and meta.metrics.sites["a"].n_test == 3
    assert meta.metrics.sites["a"].rule("own").accuracy is None and meta.metrics.sites["b"].n_test is None
    assert meta.metrics.to_json() == odd["metrics"]  # as written, the NaN probe too
    assert meta.metrics.average_accuracy == raw["metrics"]["average_accuracy"]
    assert meta.training.run.dataset == raw["training"]["run_config"]["dataset"]
    assert meta.prior.estimator.to_json() == raw["prior"]["estimator"]


def test_the_listing_reads_any_metadata_json():
    assert listing({"name": "m", "version": "1.0.0", "metrics": {"average_accuracy": 0.5,
                                                                "accuracy": {"forward50": 0.7}}}) == {
        "name": "m", "version": "1.0.0", "parent_version": None, "method": None, "created": None,
        "average_accuracy": 0.5, "backward50": None, "forward50": 0.7}
    assert listing("not an object")["name"] is None
