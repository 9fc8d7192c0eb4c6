"""/admin/reload on a real `bentoml serve`: its own admin token, a package root, BentoML tags, signed packages
only (TAFL_TRUSTED_KEYS), and no host path in any answer or log line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tafl.packaging.package import write_checksums
from tafl.packaging.signing import new_keypair, sign_package
from tests.conftest import TOKEN, digit_png

pytestmark = pytest.mark.slow

ADMIN = "reload-admin-token"
FILES = ["model.onnx", "metadata.json", "README.md", "checkpoint.pt"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, gtafl_pkg):
    """Keys, a package root with signed, unsigned, tampered and foreign-signed packages, and a signed package
    outside the root (with a symlink to it from inside)."""
    base = tmp_path_factory.mktemp("reload-world")
    a_key, a_pub, a_id = new_keypair(base / "keys", "trusted")
    b_key, _, _ = new_keypair(base / "keys-other", "other")
    root = base / "root"
    root.mkdir()

    def pkg(where, name, key=None, version=None):
        dst = where / name
        shutil.copytree(gtafl_pkg, dst)
        if version:
            m = json.loads((dst / "metadata.json").read_text())
            m["version"], m["parent_version"] = version, m["version"]
            (dst / "metadata.json").write_text(json.dumps(m))
            write_checksums(dst, FILES)
        if key:
            sign_package(dst, key)
        return dst

    v1 = pkg(root, "v1", a_key)
    pkg(root, "v2", a_key, version="1.1.0")
    pkg(root, "unsigned")
    pkg(root, "by-other", b_key, version="1.2.0")
    t = pkg(root, "tampered", a_key, version="1.3.0")
    data = bytearray((t / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (t / "model.onnx").write_bytes(bytes(data))
    outside = base / "elsewhere"
    outside.mkdir()
    out_pkg = pkg(outside, "secret-pkg", a_key, version="9.0.0")
    (root / "link-out").symlink_to(out_pkg, target_is_directory=True)
    inner = pkg(root, "file-link", a_key, version="1.4.0")
    (inner / "README.md").unlink()
    (inner / "README.md").symlink_to(out_pkg / "README.md")  # a file in the root that leads outside it
    return {"base": base, "root": root, "v1": v1, "pub": a_pub, "kid": a_id, "outside": out_pkg}


@pytest.fixture(scope="module")
def secured(world, tmp_path_factory):
    from tafl.serving.launch import ServerProcess

    d = tmp_path_factory.mktemp("svc_reload")
    env = {"BENTOML_HOME": str(d / "bentoml"), "TAFL_ADMIN_TOKEN": ADMIN, "TAFL_PACKAGE_ROOT": str(world["root"]),
           "TAFL_TRUSTED_KEYS": str(world["pub"]), "TAFL_AUDIT_LOG": str(d / "audit.jsonl")}
    with ServerProcess([str(world["v1"])], token=TOKEN, env=env, log_path=d / "service.log") as srv:
        srv.audit_path, srv.log_file = d / "audit.jsonl", d / "service.log"
        yield srv


def reload(srv, body, token=ADMIN, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if isinstance(body, bytes):
        return httpx.post(f"{srv.url}/admin/reload", content=body, headers={**headers, "Content-Type":
                                                                             "application/json"}, timeout=60)
    return httpx.post(f"{srv.url}/admin/reload", json=body, headers=headers, timeout=60)


def version(srv):
    r = httpx.post(f"{srv.url}/predict", files={"file": ("a.png", digit_png(1), "image/png")},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.json()["model"]["version"]


def no_host_path(text, world):
    for p in (str(world["base"]), str(world["root"]), str(world["outside"]), str(world["base"].parent)):
        assert p not in text, (p, text[:400])


def test_reload_needs_the_admin_token_not_the_api_token(secured):
    for token in (None, TOKEN, "wrong"):
        r = reload(secured, {"package": "./v2"}, token=token)
        assert r.status_code == 401 and r.json()["error"]["code"] == "Unauthorized", (token, r.text[:200])
    assert version(secured) == "1.0.0"


def test_reload_is_disabled_without_an_admin_token(auth_server):
    """TAFL_API_TOKEN alone no longer opens /admin/reload: 403 'reloading is disabled'."""
    for token in (TOKEN, None):
        r = reload(auth_server, {"package": "derm-gtafl:1_0_0"}, token=token)
        assert r.status_code == 403, r.text[:200]
        assert r.json()["error"]["message"].startswith("reloading is disabled")


def test_reload_refuses_folders_outside_the_package_root_without_echoing_them(secured, world):
    root, outside = world["root"], world["outside"]
    refs = [str(root / ".." / "elsewhere" / "secret-pkg"), "../elsewhere/secret-pkg", str(outside),
            "./link-out", str(root / "link-out"), "./file-link", "/etc", str(root), "./"]
    for ref in refs:
        r = reload(secured, {"package": ref})
        assert r.status_code == 403, (ref, r.status_code, r.text[:300])
        body = r.json()
        assert body["error"]["code"] == "Forbidden" and "package root" in body["error"]["message"]
        no_host_path(r.text, world)
        assert ref not in r.text and "secret-pkg" not in r.text
    for ref in ("~/x", "a\\b", "./v2\x00"):
        r = reload(secured, {"package": ref})
        assert r.status_code == 400, (ref, r.text[:200])
    assert version(secured) == "1.0.0"
    logs = secured.log_file.read_text() + secured.audit_path.read_text()
    logs = logs.replace(str(world["v1"]), "")  # the operator's own TAFL_PACKAGES may be logged
    assert str(world["root"]) not in logs and "secret-pkg" not in logs and "elsewhere" not in logs


def test_reload_answers_400_to_odd_tags_and_bodies(secured):
    bodies = [{"package": t} for t in ("UPPER:1", "a:b:c", "-lead", "x:", ":v", "a" * 64, "tag with space",
                                       "name:" + "v" * 64, "émoji")]
    bodies += [{"package": 5}, {"package": ""}, {"package": None}, {"package": ["v2"]}, {}, [], "v2", 3,
               {"package": "v2", "extra": 1}]
    for body in bodies:
        r = reload(secured, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "BadRequest", (body, r.text[:200])
    for raw in (b"not json", b"", b"\xff\xfe\x00", b"[" * 20000, b'{"package": "v2"', b"null"):
        r = reload(secured, raw)
        assert r.status_code == 400, (raw[:20], r.status_code, r.text[:200])
        assert "JSON" in r.json()["error"]["message"]
    r = reload(secured, {"package": "no-such-model:1_0_0"})  # a well-formed tag the store lacks
    assert r.status_code == 400 and r.json()["error"]["code"] == "PackageError"
    assert version(secured) == "1.0.0"


def test_reload_refuses_unsigned_tampered_and_foreign_signed_packages(secured, world):
    for ref, why in (("./unsigned", "unsigned"), ("./tampered", "checksum mismatch for model.onnx"),
                     ("./by-other", "not a trusted key"), ("./missing", "no package folder")):
        r = reload(secured, {"package": ref})
        assert r.status_code == 400, (ref, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == "PackageError" and why in err["message"], (ref, err)
        assert "under the package root" in err["message"]
        no_host_path(r.text, world)
        assert version(secured) == "1.0.0"  # the old model keeps answering


def test_a_signed_package_under_the_root_is_swapped_in(secured, world):
    r = reload(secured, {"package": "./v2"})
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    assert body["version"] == "1.1.0" and body["previous_version"] == "1.0.0"
    assert body["source"] == "package-root:v2" and body["signed_by"] == world["kid"]
    assert version(secured) == "1.1.0"
    models = httpx.get(f"{secured.url}/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    m = models.json()["models"][0]
    assert m["version"] == "1.1.0" and m["source"] == "package-root:v2" and m["signed_by"] == world["kid"]
    # an absolute path that lies inside the root is accepted too
    r = reload(secured, {"package": str(world["v1"])})
    assert r.status_code == 200 and r.json()["version"] == "1.0.0" and r.json()["source"] == "package-root:v1"
    no_host_path(r.text, world)
    audit = [a for a in map(json.loads, secured.audit_path.read_text().splitlines())
             if a.get("route") == "/admin/reload" and a.get("status") == 200]
    assert [a["package"] for a in audit][-2:] == ["package-root:v2", "package-root:v1"]


def test_the_service_refuses_to_start_on_an_unsigned_package(world, gtafl_pkg, tmp_path):
    """With TAFL_TRUSTED_KEYS, `tafl serve` exits non-zero with the reason before starting BentoML, and the
    service itself (`bentoml serve`, as ServerProcess starts it) never becomes ready: its worker fails with the
    reason (BentoML keeps restarting it, so ServerProcess.start raises only at its timeout)."""
    import time

    from tafl.procs import start_group, stop_group
    from tafl.serving.launch import free_port, serve_command, service_env

    env = {**os.environ, "BENTOML_HOME": str(tmp_path / "bentoml"), "TAFL_TRUSTED_KEYS": str(world["pub"])}
    r = subprocess.run([sys.executable, "-m", "tafl.cli", "serve", str(gtafl_pkg), "--port", str(free_port())],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "unsigned" in r.stderr and "trusted key" in r.stderr, r.stderr[-500:]
    r = subprocess.run([sys.executable, "-m", "tafl.cli", "serve", str(gtafl_pkg), "--port", str(free_port()),
                        "--trusted-keys", str(tmp_path / "absent.pub")],
                       env={**os.environ, "BENTOML_HOME": str(tmp_path / "bentoml")}, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 2 and "trusted keys" in r.stderr, r.stderr[-500:]
    log, port = tmp_path / "service.log", free_port()
    proc = start_group(serve_command("127.0.0.1", port),
                       env=service_env([str(gtafl_pkg)], None, {"BENTOML_HOME": str(tmp_path / "bentoml"),
                                                                "TAFL_TRUSTED_KEYS": str(world["pub"])}),
                       log_path=log)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "PackageError" not in (log.read_text() if log.is_file() else ""):
            time.sleep(0.5)
        text = log.read_text()
        assert "the package is unsigned" in text and "trusted key" in text, text[-2000:]
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code
        except httpx.HTTPError:
            ready = None
        assert ready != 200
    finally:
        stop_group(proc)
