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
