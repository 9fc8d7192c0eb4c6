"""Package signatures (docs/design.md, "The model package"): Ed25519 over the exact bytes of a package's SHA256SUMS.

    tafl keys new --out DIR [--name NAME]   DIR/NAME.key (PKCS#8 PEM, mode 0600) and DIR/NAME.pub
    tafl export CKPT --out PKG --sign-key DIR/NAME.key   (or TAFL_SIGNING_KEY)

Export writes `SHA256SUMS.sig` beside SHA256SUMS, a JSON object

    {"schema": "tafl-signature/1", "algorithm": "Ed25519", "key_id": "<16 hex>",
     "signed_file": "SHA256SUMS", "signature": "<base64 of the 64-byte signature>"}

where the key id is the first 16 hex digits of the SHA-256 of the raw 32-byte public key. Since
SHA256SUMS names every file of the package with its SHA-256, the signature covers them all.
`load_package(path, trusted_keys=...)` (and the service, through TAFL_TRUSTED_KEYS: public key
files or folders of `*.pub` files, comma-separated) refuses an unsigned package, a signature by a
key it does not trust, a bad signature, and any file that disagrees with the signed manifest.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tafl.errors import ConfigError, PackageError
from tafl.settings import trusted_keys_setting

SIG = "SHA256SUMS.sig"
SIG_SCHEMA = "tafl-signature/1"
ALGORITHM = "Ed25519"
TRUSTED_ENV = "TAFL_TRUSTED_KEYS"
SIGNING_ENV = "TAFL_SIGNING_KEY"
MAX_SIG_BYTES = 4096  # a signature file is ~200 bytes; anything far larger is not one


def _raw_public(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key) -> str:
    """The first 16 hex digits of the SHA-256 of the raw 32-byte Ed25519 public key."""
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


def new_keypair(out: str | Path, name: str = "tafl-signing") -> tuple[Path, Path, str]:
    """Write a new Ed25519 key pair: OUT/NAME.key (PKCS#8 PEM, unencrypted, mode 0600) and OUT/NAME.pub
    (SubjectPublicKeyInfo PEM). Refuses to overwrite either file. Returns (private path, public path, key id)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r} must be a plain file name (no '/', not starting with '.')")
    out = Path(out)
    priv_path, pub_path = out / f"{name}.key", out / f"{name}.pub"
    for p in (priv_path, pub_path):
        if p.exists() or p.is_symlink():
            raise ConfigError(f"{p} already exists; refusing to overwrite a key (choose another --name or --out)")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new(priv_path, pem, 0o600)
    try:
        _write_new(pub_path, pub, 0o644)
    except BaseException:
        priv_path.unlink(missing_ok=True)
        raise
    return priv_path, pub_path, key_id(key.public_key())


def _write_new(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    except FileExistsError as exc:
        raise ConfigError(f"{path} already exists; refusing to overwrite a key") from exc
    try:
        os.fchmod(fd, mode)  # the umask may only narrow the mode; make it exact
        os.write(fd, data)
    finally:
        os.close(fd)


def load_private_key(path: str | Path):
    """An Ed25519 private key from a PEM file (as `tafl keys new` writes it)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the signing key {p}: {exc.strerror or exc}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{p} is not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{p} holds a {type(key).__name__}; package signing takes an Ed25519 key "
                          "(`tafl keys new`)")
    return key


def _load_public_key(p: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the trusted key {p}: {exc.strerror or exc}") from exc
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{p} is not a PEM public key ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{p} holds a {type(key).__name__}; trusted keys are Ed25519 public keys")
    return key


@dataclass(frozen=True)
class TrustedKeys:
    """Public keys by key id. Empty: no keys configured (signatures are not required)."""

    keys: dict[str, Any]

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def ids(self) -> list[str]:
        return sorted(self.keys)


NO_KEYS = TrustedKeys({})


def load_trusted_keys(spec: Any) -> TrustedKeys:
    """Public keys from a path, a comma-separated string of paths, or a list of paths (or loaded keys): each a
    PEM public key file, or a folder whose `*.pub` files are. A spec that names something but yields no key is a
    ConfigError: a misconfigured trust list never means 'accept anything'."""
    if isinstance(spec, TrustedKeys):
        return spec
    if spec is None or spec == "" or spec == () or spec == []:
        return NO_KEYS
    if isinstance(spec, (str, os.PathLike)):
        items: Iterable[Any] = [s.strip() for s in str(spec).split(",") if s.strip()] if isinstance(spec, str) \
            else [spec]
    else:
        items = spec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    keys: dict[str, Any] = {}
    for item in items:
        if isinstance(item, Ed25519PublicKey):
            keys[key_id(item)] = item
            continue
        p = Path(item).expanduser()
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix == ".pub" and f.is_file())
            if not files:
                raise ConfigError(f"trusted keys: the folder {p} holds no *.pub public key")
        elif p.is_file():
            files = [p]
        else:
            raise ConfigError(f"trusted keys: {p} is neither a public key file nor a folder of them")
        for f in files:
            k = _load_public_key(f)
            keys[key_id(k)] = k
    if not keys:
        raise ConfigError(f"trusted keys: {spec!r} names no public key")
    return TrustedKeys(keys)


def trusted_keys_from_env() -> TrustedKeys:
    """TAFL_TRUSTED_KEYS (comma-separated public key files or folders, tafl.settings.trusted_keys_setting); unset or
    empty: no keys."""
    return load_trusted_keys(trusted_keys_setting())


def signature_for(sums: bytes, private_key) -> dict[str, Any]:
    """The signature file's object for the exact bytes of SHA256SUMS."""
    return {"schema": SIG_SCHEMA, "algorithm": ALGORITHM, "key_id": key_id(private_key.public_key()),
            "signed_file": "SHA256SUMS", "signature": base64.b64encode(private_key.sign(sums)).decode("ascii")}


def sign_package(folder: str | Path, private_key: Any) -> str:
    """Sign the package folder's SHA256SUMS (the key object or its PEM path); writes SHA256SUMS.sig and returns
    the key id. The folder's files are not checked here: `load_package` checks them against the signed list."""
    if not hasattr(private_key, "sign"):
        private_key = load_private_key(private_key)
    folder = Path(folder)
    sums = folder / "SHA256SUMS"
    try:
        data = sums.read_bytes()
    except OSError as exc:
        raise PackageError(f"{folder}: cannot sign, SHA256SUMS is unreadable ({exc.strerror or exc})") from exc
    sig = signature_for(data, private_key)
    (folder / SIG).write_text(json.dumps(sig, indent=2) + "\n")
    return sig["key_id"]


def verify_signature(sums: bytes, sig_bytes: bytes | None, trusted: TrustedKeys) -> str:
    """The id of the trusted key whose valid signature over `sums` is in `sig_bytes` (the signature file's
    content, None when there is none). PackageError (without any path) otherwise."""
    from cryptography.exceptions import InvalidSignature

    if sig_bytes is None:
        raise PackageError(f"the package is unsigned ({SIG} is missing) and this service only accepts packages "
                           f"signed by a trusted key ({', '.join(trusted.ids)}); export it with --sign-key")
    if len(sig_bytes) > MAX_SIG_BYTES:
        raise PackageError(f"{SIG} is {len(sig_bytes)} bytes: not a signature file")
    try:
        sig = json.loads(sig_bytes)
    except (ValueError, RecursionError):
        raise PackageError(f"{SIG} is not valid JSON: the signature file is damaged") from None
    if not isinstance(sig, dict):
        raise PackageError(f"{SIG} is not a JSON object: the signature file is damaged")
    if sig.get("schema") != SIG_SCHEMA or sig.get("algorithm") != ALGORITHM or sig.get("signed_file") != "SHA256SUMS":
        raise PackageError(f"{SIG}: expected schema {SIG_SCHEMA!r}, algorithm {ALGORITHM!r} over SHA256SUMS")
    kid, b64 = sig.get("key_id"), sig.get("signature")
    if not isinstance(kid, str) or not isinstance(b64, str):
        raise PackageError(f"{SIG}: 'key_id' and 'signature' must be strings")
    key = trusted.keys.get(kid)
    if key is None:
        raise PackageError(f"the package is signed by key {kid[:16]!r}, which is not a trusted key (trusted: "
                           f"{', '.join(trusted.ids)})")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise PackageError(f"{SIG}: the signature is not base64") from None
    try:
        key.verify(raw, sums)
    except InvalidSignature:
        raise PackageError(f"bad signature: SHA256SUMS does not match the signature of key {kid} (the file list "
                           "or the signature was modified after signing)") from None
    return kid
