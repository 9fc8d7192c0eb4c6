"""bentofile.yaml builds offline, and the built bento serves the store model it bundles."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.conftest import REPO, digit_png


@pytest.mark.slow
def test_bento_builds_offline_and_serves_its_model(gtafl_pkg, tmp_path):
    from tafl.serving.launch import ServerProcess

    env = {**os.environ, "BENTOML_HOME": str(tmp_path / "home"), "BENTOML_DO_NOT_TRACK": "True"}
    env.pop("TAFL_PACKAGES", None)
    store = subprocess.run([sys.executable, "-c", "import sys; from tafl.packaging import load_package; "
                            "from tafl.packaging.store import to_bentoml; "
                            "print(to_bentoml(load_package(sys.argv[1]), 'tafl-model'))", str(gtafl_pkg)],
                           env=env, capture_output=True, text=True, timeout=120)
    assert store.returncode == 0, store.stderr
    assert store.stdout.strip() == "tafl-model:1_0_0"

    build = subprocess.run([sys.executable, "-m", "bentoml", "build", str(REPO)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    listed = subprocess.run([sys.executable, "-m", "bentoml", "list", "-o", "json"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert '"tafl:' in listed.stdout
    bento_yaml = next((tmp_path / "home" / "bentos" / "tafl").glob("*/bento.yaml")).read_text()
    assert "tag: tafl-model:1_0_0" in bento_yaml, "the bento references the stored package (bundled on export)"

    # no TAFL_PACKAGES: the service falls back to the bundled store model
    with ServerProcess([], target="tafl:latest", env={"BENTOML_HOME": env["BENTOML_HOME"]},
                       log_path=tmp_path / "bento.log") as srv:
        r = httpx.post(f"{srv.url}/predict", files={"file": ("d.png", digit_png(3), "image/png")}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == {"name": "derm-gtafl", "version": "1.0.0", "method": "gtafl"}
        models = httpx.get(f"{srv.url}/models", timeout=30).json()["models"]
        assert models[0]["source"].startswith("tafl-model:")


def test_package_list_keeps_tags_whole(monkeypatch):
    from tafl.serving.settings import Settings

    monkeypatch.setenv("TAFL_PACKAGES", "tafl-model:1_0_0, /srv/pkgs/derm ,ham-dafl")
    assert Settings.from_env().packages == ["tafl-model:1_0_0", "/srv/pkgs/derm", "ham-dafl"]
    monkeypatch.delenv("TAFL_PACKAGES")
    assert Settings.from_env().packages == ["tafl-model:latest"]
