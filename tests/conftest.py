"""Shared fixtures: the real datasets in ../shared/data (skipped when absent) and small configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TAFL_SHARED_DATA", REPO.parent / "shared" / "data"))
CONFIGS = REPO / "configs"


def shared(*parts: str) -> Path:
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is absent (../shared/data is not on this machine)")
    return p


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TAFL_CACHE", str(tmp_path_factory.getbasetemp() / "tafl-cache"))


@pytest.fixture
def smoke_cfg():
    from tafl.training.config import load_config

    return load_config(CONFIGS / "smoke.yaml")


SMOKE_GTAFL = {"method": "gtafl", "simclr_steps": 2, "simclr_batch": 32, "retrain_epochs": 20, "match_steps": 20}
SMOKE_DAFL = {"method": "dafl", "backbone": "vit_tafl_tiny", "optimizer": "adam", "lr": 0.002}


def _trained(tmp_path_factory, name: str, overrides: dict) -> Path:
    from tafl.training.config import load_config
    from tafl.training.simulator import train

    out = tmp_path_factory.mktemp(name) / "run"
    train(load_config(CONFIGS / "smoke.yaml", overrides), out, progress=False)
    return out


@pytest.fixture(scope="session")
def gtafl_run(tmp_path_factory) -> Path:
    """A GTAFL model trained for two rounds on the smoke config (run folder)."""
    return _trained(tmp_path_factory, "gtafl", SMOKE_GTAFL)


@pytest.fixture(scope="session")
def dafl_run(tmp_path_factory) -> Path:
    """A ViT-DAFL model trained for two rounds on the smoke config (run folder)."""
    return _trained(tmp_path_factory, "dafl", SMOKE_DAFL)


@pytest.fixture(scope="session")
def gtafl_pkg(tmp_path_factory, gtafl_run) -> Path:
    from tafl.packaging.export import export_checkpoint

    out = tmp_path_factory.mktemp("pkg") / "gtafl"
    export_checkpoint(gtafl_run / "final.pt", out, name="derm-gtafl")
    return out


@pytest.fixture(scope="session")
def dafl_pkg(tmp_path_factory, dafl_run) -> Path:
    from tafl.packaging.export import export_checkpoint

    out = tmp_path_factory.mktemp("pkg") / "dafl"
    export_checkpoint(dafl_run / "final.pt", out, name="derm-dafl")
    return out
