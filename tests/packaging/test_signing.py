"""Package signatures: `tafl keys new`, signed export, and load_package's refusals (tafl.packaging.signing)."""

from __future__ import annotations

import base64
import json
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from tafl.cli import main
from tafl.errors import ConfigError, PackageError
from tafl.packaging import load_package
from tafl.packaging.package import write_checksums
from tafl.packaging.signing import SIG, load_trusted_keys, sign_package

pytestmark = pytest.mark.slow

FILES = ["model.onnx", "metadata.json", "README.md", "checkpoint.pt"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two key pairs made with `tafl keys new`: `a` (trusted in these tests) and `b` (not)."""
    d = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("a", "b"):
        assert main(["keys", "new", "--out", str(d / name), "--name", name]) == 0
        out[name] = (d / name / f"{name}.key", d / name / f"{name}.pub")
    return out


@pytest.fixture(scope="module")
def signed_pkg(tmp_path_factory, gtafl_run, keys):
    """`tafl export --sign-key` of the smoke GTAFL run."""
    out = tmp_path_factory.mktemp("signed") / "pkg"
    assert main(["export", str(gtafl_run / "final.pt"), "--out", str(out), "--name", "derm-gtafl",
                 "--sign-key", str(keys["a"][0])]) == 0
    return out


def _copy(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_keys_new_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path, capsys):
    from cryptography.hazmat.primitives import serialization

    assert main(["keys", "new", "--out", str(tmp_path / "k")]) == 0
    printed = capsys.readouterr().out
    priv, pub = tmp_path / "k" / "tafl-signing.key", tmp_path / "k" / "tafl-signing.pub"
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert priv.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert pub.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    kid = load_trusted_keys(pub).ids[0]
    assert len(kid) == 16 and f"key id {kid}" in printed
    raw = serialization.load_pem_public_key(pub.read_bytes()).public_bytes(serialization.Encoding.Raw,
                                                                           serialization.PublicFormat.Raw)
    import hashlib

    assert kid == hashlib.sha256(raw).hexdigest()[:16]
    before = priv.read_bytes()
    assert main(["keys", "new", "--out", str(tmp_path / "k")]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert priv.read_bytes() == before


def test_signed_export_round_trip_and_the_bentoml_store_keeps_the_signature(signed_pkg, keys, tmp_path, monkeypatch):
    sig = json.loads((signed_pkg / SIG).read_text())
    kid = load_trusted_keys(keys["a"][1]).ids[0]
    assert sig["algorithm"] == "Ed25519" and sig["key_id"] == kid and sig["signed_file"] == "SHA256SUMS"
    assert len(base64.b64decode(sig["signature"])) == 64
    assert SIG not in (signed_pkg / "SHA256SUMS").read_text()
    for trust in (keys["a"][1], str(keys["a"][1].parent), f"{keys['b'][1]},{keys['a'][1]}", [keys["a"][1]]):
        assert load_package(signed_pkg, trusted_keys=trust).signed_by == kid
    monkeypatch.setenv("TAFL_TRUSTED_KEYS", str(keys["a"][1]))
    assert load_package(signed_pkg).signed_by == kid  # the environment's keys by default
    # the store keeps SHA256SUMS.sig and from_bentoml verifies it
    monkeypatch.setenv("BENTOML_HOME", str(tmp_path / "bentoml"))
    import bentoml

    from tafl.packaging.store import from_bentoml, to_bentoml

    tag = to_bentoml(load_package(signed_pkg), "signed-gtafl")
    back = from_bentoml(tag)
    assert back.signed_by == kid
    stored = Path(bentoml.models.get(tag).path) / "model.onnx"
    assert (stored.parent / SIG).is_file()
    data = bytearray(stored.read_bytes())
    data[len(data) // 3] ^= 0x01
    stored.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="checksum mismatch for model.onnx"):
        from_bentoml(tag)
    with pytest.raises(PackageError, match="not a BentoML model tag"):
        from_bentoml("Bad:Tag:x")


def test_tampered_signed_packages_are_refused(signed_pkg, keys, tmp_path):
    trust = keys["a"][1]

    def refused(folder, match):
        with pytest.raises(PackageError, match=match):
            load_package(folder, trusted_keys=trust)

    onnx = _copy(signed_pkg, tmp_path, "onnx")
    data = bytearray((onnx / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (onnx / "model.onnx").write_bytes(bytes(data))
    refused(onnx, "checksum mismatch for model.onnx")
    # metadata changed and SHA256SUMS recomputed to match: the checksums agree, the signature does not
    meta = _copy(signed_pkg, tmp_path, "meta")
    m = json.loads((meta / "metadata.json").read_text())
    m["class_names"][0] = "not-what-was-signed"
    (meta / "metadata.json").write_text(json.dumps(m))
    refused(meta, "checksum mismatch for metadata.json")
    write_checksums(meta, FILES)
    refused(meta, "bad signature")
    sums = _copy(signed_pkg, tmp_path, "sums")
    (sums / "SHA256SUMS").write_text((sums / "SHA256SUMS").read_text() + "\n")
    refused(sums, "bad signature")
    for case, edit, match in [
        ("sigbits", lambda s: {**s, "signature": base64.b64encode(bytes(64)).decode()}, "bad signature"),
        ("sigkey", lambda s: {**s, "key_id": "0123456789abcdef"}, "not a trusted key"),
        ("sigalg", lambda s: {**s, "algorithm": "none"}, "algorithm"),
        ("sigb64", lambda s: {**s, "signature": "***"}, "not base64"),
    ]:
        f = _copy(signed_pkg, tmp_path, case)
        (f / SIG).write_text(json.dumps(edit(json.loads((f / SIG).read_text()))))
        refused(f, match)
    garbage = _copy(signed_pkg, tmp_path, "garbage")
    (garbage / SIG).write_bytes(b"\x00\xff not json")
    refused(garbage, "damaged")
    # a checkpoint the signed list does not cover is never offered for loading (it is a pickle)
    extra = _copy(signed_pkg, tmp_path, "extra")
    lines = [ln for ln in (extra / "SHA256SUMS").read_text().splitlines() if not ln.endswith("checkpoint.pt")]
    (extra / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    sign_package(extra, keys["a"][0])
    pkg = load_package(extra, trusted_keys=trust)
    assert (extra / "checkpoint.pt").is_file() and pkg.checkpoint_path is None
    assert load_package(signed_pkg, trusted_keys=trust).checkpoint_path == signed_pkg / "checkpoint.pt"


def test_unknown_signers_and_unsigned_packages(signed_pkg, gtafl_pkg, keys, tmp_path, monkeypatch):
    monkeypatch.delenv("TAFL_TRUSTED_KEYS", raising=False)
    with pytest.raises(PackageError, match="not a trusted key"):
        load_package(signed_pkg, trusted_keys=keys["b"][1])
    other = _copy(gtafl_pkg, tmp_path, "by-b")
    assert sign_package(other, keys["b"][0]) == load_trusted_keys(keys["b"][1]).ids[0]
    with pytest.raises(PackageError, match="not a trusted key"):
        load_package(other, trusted_keys=keys["a"][1])
    with pytest.raises(PackageError, match="unsigned"):
        load_package(gtafl_pkg, trusted_keys=keys["a"][1])
    monkeypatch.setenv("TAFL_TRUSTED_KEYS", str(keys["a"][1]))
    with pytest.raises(PackageError, match="unsigned"):
        load_package(gtafl_pkg)
    assert load_package(gtafl_pkg, trusted_keys=()).signed_by is None  # the check turned off explicitly
    monkeypatch.delenv("TAFL_TRUSTED_KEYS")
    assert load_package(gtafl_pkg).signed_by is None  # no keys configured: unsigned packages load
    assert load_package(signed_pkg).signed_by is None  # ... and a signature is not checked
    # a trust list that names nothing usable fails closed
    empty = tmp_path / "nokeys"
    empty.mkdir()
    for bad in (str(empty), str(tmp_path / "absent.pub"), str(keys["a"][0])):
        with pytest.raises(ConfigError):
            load_package(signed_pkg, trusted_keys=bad)


def test_the_session_runs_the_bytes_that_were_verified(signed_pkg, keys, tmp_path):
    """model.onnx is read once: replacing the file after load_package changes nothing the session runs, and a
    second session re-reads it and checks it against the verified digest."""
    import onnxruntime as ort

    pkg_dir = _copy(signed_pkg, tmp_path, "swap")
    pkg = load_package(pkg_dir, trusted_keys=keys["a"][1])
    x = np.random.default_rng(0).normal(size=(2, *pkg.metadata["input"]["shape"][1:])).astype(np.float32)
    want = ort.InferenceSession(str(signed_pkg / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        ["probs"], {"image": x})[0]
    # an attacker swaps the graph after the check: a valid ONNX file with other weights
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(pkg_dir / "model.onnx"))
    init = max(m.graph.initializer, key=lambda t: numpy_helper.to_array(t).size)
    arr = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(np.zeros_like(arr), init.name))
    onnx.save(m, str(pkg_dir / "model.onnx"))
    swapped = ort.InferenceSession(str(pkg_dir / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        ["probs"], {"image": x})[0]
    assert not np.allclose(swapped, want)  # the file on disk now answers otherwise
    got = pkg.session(providers=["CPUExecutionProvider"]).run(["probs"], {"image": x})[0]
    assert np.array_equal(got, want)
    assert pkg._model_bytes is None  # one copy: the session holds the graph
    with pytest.raises(PackageError, match="checksum mismatch for model.onnx"):
        pkg.session(providers=["CPUExecutionProvider"])
