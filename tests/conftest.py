"""Shared fixtures: the real datasets in ../shared/data (skipped when absent) and small configs."""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TAFL_SHARED_DATA", REPO.parent / "shared" / "data"))
CONFIGS = REPO / "configs"
# The smoke models (two rounds on 8×8 digits) are not calibrated for estimation, so their packages' validation
# check (tafl.prior.adaptive_check) would turn prior=adaptive off; the tests that exercise the adaptive path
# adapt anyway, and tests/serving/test_prior_service.py checks the gate itself with TAFL_PRIOR_ADAPTIVE=checked.
os.environ.setdefault("TAFL_PRIOR_ADAPTIVE", "always")
# Where torch is absent (CI's core part, .ci/run core) nothing can be trained or exported, so the package fixtures
# copy packages exported beforehand with torch: `python -m tests.conftest DIR` writes DIR/gtafl and DIR/dafl, and
# TAFL_TEST_PACKAGES=DIR names them. Where torch is installed the variable is ignored: the fixtures export the
# smoke runs they train, so a test that compares a package with its run gets the pair that belong together.
HAS_TORCH = importlib.util.find_spec("torch") is not None
TEST_PACKAGES = None if HAS_TORCH else os.environ.get("TAFL_TEST_PACKAGES")
NEEDS_TRAIN = "training and export need torch: the train extra (pip install -e '.[train]')"


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
SMOKE_DAFL = {"method": "dafl", "backbone": "vit_tafl_tiny", "tokenizer": "conv", "optimizer": "adam", "lr": 0.002}


def _trained(tmp_path_factory, name: str, overrides: dict) -> Path:
    pytest.importorskip("torch", reason=NEEDS_TRAIN)
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


PACKAGES = {"gtafl": ("derm-gtafl", SMOKE_GTAFL), "dafl": ("derm-dafl", SMOKE_DAFL)}
# The shared packages are the decoder's and the service's test subjects: every DICOM the tests send them (CT and MR
# slices to a digits model), colour or greyscale, must reach the model and get a label, so their input domain decides
# nothing (the digits data would make them greyscale-only) and they carry no learned in-domain detector (it would
# rightly abstain on a CT slice). tests/packaging/test_domain.py and tests/training/test_detector.py export packages
# whose header rules refuse and whose detector abstains.
ANY_DOMAIN = ("colour=any", "detector=off")


def _package(tmp_path_factory, request, kind: str) -> Path:
    """A fresh copy of TAFL_TEST_PACKAGES/KIND, or the smoke run of KIND exported (needs torch)."""
    out = tmp_path_factory.mktemp("pkg") / kind
    if TEST_PACKAGES:
        src = Path(TEST_PACKAGES) / kind
        if not (src / "SHA256SUMS").is_file():
            pytest.fail(f"TAFL_TEST_PACKAGES={TEST_PACKAGES} holds no package {kind}/ (python -m tests.conftest DIR)")
        shutil.copytree(src, out)  # tests may edit their package: never the shared one
        return out
    from tafl.packaging.export import export_checkpoint

    export_checkpoint(request.getfixturevalue(f"{kind}_run") / "final.pt", out, name=PACKAGES[kind][0],
                      domain=ANY_DOMAIN)
    return out


@pytest.fixture(scope="session")
def gtafl_pkg(tmp_path_factory, request) -> Path:
    return _package(tmp_path_factory, request, "gtafl")


@pytest.fixture(scope="session")
def dafl_pkg(tmp_path_factory, request) -> Path:
    return _package(tmp_path_factory, request, "dafl")


def export_test_packages(dest: Path) -> None:
    """The smoke packages the fixtures export, written to DEST/gtafl and DEST/dafl for TAFL_TEST_PACKAGES."""
    import tempfile

    from tafl.packaging.export import export_checkpoint
    from tafl.training.config import load_config
    from tafl.training.simulator import train

    with tempfile.TemporaryDirectory() as tmp:
        for kind, (name, overrides) in PACKAGES.items():
            run = Path(tmp) / kind
            train(load_config(CONFIGS / "smoke.yaml", overrides), run, progress=False)
            export_checkpoint(run / "final.pt", dest / kind, name=name, force=(dest / kind).exists(), domain=ANY_DOMAIN)


# ---------------------------------------------------------------- a real service

TOKEN = "s3cret-test-token"


@pytest.fixture(scope="session")
def bentoml_home(tmp_path_factory):
    return tmp_path_factory.mktemp("bentoml_home")


@pytest.fixture(scope="session")
def audit_file(tmp_path_factory):
    return tmp_path_factory.mktemp("audit") / "audit.jsonl"


@pytest.fixture(scope="session")
def server(gtafl_pkg, dafl_pkg, bentoml_home, audit_file, tmp_path_factory):
    from tafl.serving.launch import ServerProcess

    log = tmp_path_factory.mktemp("svc") / "service.log"
    # reloads may name folders under the session's temporary root (every tmp_path lies inside it)
    env = {"BENTOML_HOME": str(bentoml_home), "TAFL_AUDIT_LOG": str(audit_file), "TAFL_MAX_UPLOAD_MB": "8",
           "TAFL_ADMIN_TOKEN": "admin-test-token", "TAFL_PACKAGE_ROOT": str(tmp_path_factory.getbasetemp())}
    with ServerProcess([str(gtafl_pkg), str(dafl_pkg)], env=env, log_path=log) as srv:
        yield srv


@pytest.fixture(scope="session")
def auth_server(gtafl_pkg, tmp_path_factory):
    from tafl.serving.launch import ServerProcess

    # its own BENTOML_HOME keeps its model store and logs apart; its Prometheus files are its own anyway
    # (ServerProcess gives each server a TAFL_PROMETHEUS_DIR, tafl.serving.launch)
    log = tmp_path_factory.mktemp("svc_auth") / "service.log"
    home = tmp_path_factory.mktemp("bentoml_home_auth")
    with ServerProcess([str(gtafl_pkg)], token=TOKEN, env={"BENTOML_HOME": str(home)}, log_path=log) as srv:
        yield srv


def png_bytes(arr: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def digit_png(i: int = 0, size: int = 64, fmt: str = "PNG") -> bytes:
    from sklearn.datasets import load_digits

    d = load_digits()
    img = Image.fromarray(np.round(d.images[i] * 255 / 16).astype(np.uint8), "L").resize((size, size))
    if fmt == "JPEG":
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


if __name__ == "__main__":  # python -m tests.conftest DIR: the test packages for a venv without torch
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.conftest DIR")
    export_test_packages(Path(sys.argv[1]))
