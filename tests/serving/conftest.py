"""A real `bentoml serve` on 127.0.0.1 with a smoke-trained package of each method."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tafl.serving.launch import ServerProcess

TOKEN = "s3cret-test-token"


@pytest.fixture(scope="session")
def bentoml_home(tmp_path_factory):
    return tmp_path_factory.mktemp("bentoml_home")


@pytest.fixture(scope="session")
def audit_file(tmp_path_factory):
    return tmp_path_factory.mktemp("audit") / "audit.jsonl"


@pytest.fixture(scope="session")
def server(gtafl_pkg, dafl_pkg, bentoml_home, audit_file, tmp_path_factory):
    log = tmp_path_factory.mktemp("svc") / "service.log"
    env = {"BENTOML_HOME": str(bentoml_home), "TAFL_AUDIT_LOG": str(audit_file), "TAFL_MAX_UPLOAD_MB": "8",
           "TAFL_ADMIN_TOKEN": "admin-test-token"}
    with ServerProcess([str(gtafl_pkg), str(dafl_pkg)], env=env, log_path=log) as srv:
        yield srv


@pytest.fixture(scope="session")
def auth_server(gtafl_pkg, bentoml_home, tmp_path_factory):
    log = tmp_path_factory.mktemp("svc_auth") / "service.log"
    with ServerProcess([str(gtafl_pkg)], token=TOKEN, env={"BENTOML_HOME": str(bentoml_home)}, log_path=log) as srv:
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
