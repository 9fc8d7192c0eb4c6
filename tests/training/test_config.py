"""Run configs: files, flags, unknown keys and bad values."""

from __future__ import annotations

import pytest

from tafl.errors import ConfigError
from tafl.training.config import RunConfig, load_config
from tafl.training.contract import unregister_method
from tests.conftest import CONFIGS


@pytest.mark.parametrize("name", ["smoke.yaml", "benchmark.yaml", "paper.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.rounds >= 1


def test_flags_override_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rounds: 3\nalpha: 0.1\n")
    cfg = load_config(f, {"rounds": 9, "seed": None})
    assert cfg.rounds == 9 and cfg.alpha == 0.1 and cfg.seed == 7


def test_unknown_key_names_the_key_and_suggests(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("local_epoch: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'local_epoch'.*local_epochs"):
        load_config(f)


@pytest.mark.parametrize("key,value,match", [
    ("imbalance_factor", 0.5, ">= 1"), ("alpha", 0.0, "> 0"), ("alpha", -1.0, "> 0"), ("frac", 1.5, "fraction"),
    ("rounds", 0, ">= 1"), ("method", "fedsgd", "unknown method"), ("channels", 2, "1 or 3"),
    ("prior_smoothing", "lots", "auto or a number"), ("prior_smoothing", -5, "finite number >= 0"),
    ("prior_smoothing", "nan", "finite number >= 0"),
])
def test_bad_values_are_rejected(key, value, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_dict({key: value}).validate()


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match="'rounds' must be int"):
        RunConfig.from_dict({"rounds": "ten"})
    with pytest.raises(ConfigError, match="'augment' must be bool"):
        RunConfig.from_dict({"augment": "yes"})


def test_int_accepted_for_float_and_null_for_natural():
    cfg = RunConfig.from_dict({"lr": 1, "imbalance_factor": None})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.imbalance_factor is None


def test_bad_yaml_and_missing_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_methods_come_from_the_one_registry(monkeypatch):
    import subprocess
    import sys

    from tafl.training import methods

    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict({"method": "fedsgd"}).validate()
    assert "'method' = 'fedsgd'" in str(e.value) and all(n in str(e.value) for n in methods.method_names())
    assert set(methods.method_names()) == {"fedavg", "fedprox", "creff", "gtafl", "dafl", "lda"}
    for name in methods.method_names():  # every registered name validates and resolves to its Method
        assert RunConfig.from_dict({"method": name}).validate().method == name
        assert issubclass(methods.method_class(name), methods.Method)
    # a method added to the registry is a valid config value: config keeps no list of its own
    methods.register_method("fedsgd")(methods.method_class("fedavg"))
    try:
        assert RunConfig.from_dict({"method": "fedsgd"}).validate().method == "fedsgd"
        assert methods.method_class("fedsgd") is methods.method_class("fedavg")
    finally:
        unregister_method("fedsgd")
    with pytest.raises(ConfigError, match="choose one of fedavg, fedprox, creff, gtafl, dafl"):
        methods.method_class("fedsgd")
    # validating a config loads no method and no torch
    code = ("import sys; from tafl.training.config import RunConfig; RunConfig.from_dict({'method': 'gtafl'})"
            ".validate(); assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_method_settings_stay_flat_keys_and_belong_to_their_method():
    import copy

    from tafl.training.methods.gtafl_config import GTAFLConfig

    cfg = RunConfig.from_dict({"method": "gtafl", "gff_m": 50, "gamma_init": 1.0, "mu": 0.1}).validate()
    assert isinstance(cfg.settings(), GTAFLConfig) and cfg.settings().gff_m == 50 == cfg.gff_m
    flat = cfg.to_dict()
    assert flat["gff_m"] == 50 and flat["gamma_init"] == 1.0 and flat["mu"] == 0.1 and "_settings" not in flat
    assert RunConfig.from_dict(flat) == cfg  # a saved run.json's flat keys give the same config back
    twin = copy.copy(cfg)
    twin.gff_m = 7
    assert cfg.gff_m == 50 and twin != cfg
    with pytest.raises(ConfigError, match="'gff_m' must be int"):
        RunConfig.from_dict({"gff_m": "many"})
    with pytest.raises(ConfigError, match="config 'gff_m' = 0: must be >= 1"):  # checked whichever method runs
        RunConfig.from_dict({"method": "fedavg", "gff_m": 0}).validate()
    with pytest.raises(AttributeError):
        cfg.no_such_setting  # noqa: B018


def test_prior_smoothing_is_auto_or_a_number_from_yaml_or_a_flag(tmp_path):
    assert RunConfig().validate().prior_smoothing_value() is None  # auto: chosen on validation
    f = tmp_path / "c.yaml"
    f.write_text("prior_smoothing: 400\n")
    assert load_config(f).prior_smoothing_value() == 400.0
    assert load_config(f, {"prior_smoothing": "0"}).prior_smoothing_value() == 0.0


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips_through_its_flat_keys(path):
    """The per-method settings changed where a setting lives, not how it is written: every YAML in configs/ still
    loads, and its flat dict (what run.json holds) gives the same configuration back."""
    import yaml

    written = yaml.safe_load(path.read_text()) or {}
    # a folder dataset's YAML leaves the folder to the command line (--data-root, --labels)
    given = {"data_root": "images", "labels": "labels.csv"} if written.get("dataset") == "folder" else {}
    cfg = load_config(path, {k: v for k, v in given.items() if k not in written})
    flat = cfg.to_dict()
    for key, value in written.items():
        if key != "method" and isinstance(value, (int, float, str, bool)):
            assert flat[key.replace("-", "_")] == value, key  # each written setting arrived, the methods' too
    assert RunConfig.from_dict(flat).validate() == cfg


# shared settings added after those configs were written, with the value a config without them has
ADDED_SINCE_52 = {"domain_detector": True, "ood_dicom_dir": None, "open_set_class": None, "conformal": True,
                  "calibration_check": True, "decision_criterion": "macro_f1", "conformal_rows": "pooled",
                  "set_confidence": 0.9}


def test_run_configs_saved_before_the_per_method_settings_load_unchanged():
    """run.json's config as tafl wrote it before issue 52 (RunConfig's 112 flat fields; written by commit 2056e05's
    load_config for configs/smoke.yaml with each method's own settings set) loads, and writes back the same keys and
    values."""
    import json
    from pathlib import Path

    saved = json.loads((Path(__file__).parent / "data" / "run_configs_before_52.json").read_text())
    assert {d["config"]["method"] for d in saved.values()} == {"gtafl", "dafl", "fedavg", "lda", "fedprox"}
    for case, run_json in saved.items():
        old = run_json["config"]
        cfg = RunConfig.from_dict(old).validate()
        d = cfg.to_dict()
        assert {k: v for k, v in d.items() if k not in ADDED_SINCE_52} == old, case
        assert {k: d[k] for k in ADDED_SINCE_52} == ADDED_SINCE_52, case  # what their absence means
