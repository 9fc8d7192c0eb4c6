"""Model packages: a folder (or the same folder inside the BentoML model store) that serving loads
without PyTorch (docs/design.md, "The model package").

    model.onnx      the graph: image batch in; label, probabilities, expert votes, heatmap out
    metadata.json   name, version, lineage, classes, input/output spec, vote rule, provenance, metrics
    README.md       the model card, generated from the metadata
    checkpoint.pt   the training checkpoint, so `tafl retrain --from PKG` can continue training
    SHA256SUMS      one line per file above: "<sha256>  <name>"
    SHA256SUMS.sig  optional: an Ed25519 signature over the exact bytes of SHA256SUMS (tafl.packaging.signing)

`load_package` verifies every checksum and the metadata schema and refuses a tampered or
incomplete package with a `PackageError` that names the problem. With trusted keys (the argument,
or TAFL_TRUSTED_KEYS) it also refuses an unsigned package, an unknown signer and a bad signature.
model.onnx is read once: the bytes that were hashed are the bytes ONNX Runtime is given.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tafl.errors import OutsideDomain, PackageError
from tafl.files import sha256_file
from tafl.imaging import Preprocess
from tafl.packaging.domain import contradiction
from tafl.packaging.metadata import SCHEMA, PackageMetadata, listing, parse_version

__all__ = ["SCHEMA", "ModelPackage", "bump_minor", "list_packages", "load_package", "parse_version", "write_checksums"]

REQUIRED_FILES = ("model.onnx", "metadata.json", "README.md")
SUMS = "SHA256SUMS"
MAX_SUMS_BYTES = 1 << 20  # a manifest of a handful of lines; anything larger is not one
IN_MEMORY = ("model.onnx", "metadata.json", "README.md")  # hashed from the bytes that are then used


def write_checksums(folder: Path, names: list[str]) -> None:
    lines = [f"{sha256_file(folder / n)}  {n}" for n in sorted(names)]
    (folder / SUMS).write_text("\n".join(lines) + "\n")


def bump_minor(v: str) -> str:
    major, minor, _ = parse_version(v)
    return f"{major}.{minor + 1}.0"


@dataclass
class ModelPackage:
    path: Path
    meta: PackageMetadata  # metadata.json, checked and typed: what tafl reads of a package
    metadata: dict[str, Any]  # metadata.json as written, for what hands the JSON on as it is (GET /models)
    card: str
    files: dict[str, str] = field(default_factory=dict)  # name -> the sha256 SHA256SUMS lists (and the file had)
    signed_by: str | None = None  # the trusted key id whose signature was verified; None: not checked
    _model_bytes: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def version(self) -> str:
        return self.meta.version

    @property
    def class_names(self) -> list[str]:
        return list(self.meta.class_names)

    @property
    def preprocess(self) -> Preprocess:
        return Preprocess.from_dict(self.meta.input.preprocess.to_json())

    @property
    def expert_names(self) -> list[str]:
        return self.meta.expert_names

    def check_domain(self, decoded: Any) -> None:
        """OutsideDomain (422) when a decoded image's DICOM header contradicts the domain this model was trained on
        (metadata.json's `domain`): called between decoding and the model, wherever tafl classifies an image."""
        if decoded.kind == "dicom" and self.meta.domain:
            why = contradiction(self.meta.domain, decoded.info)
            if why:
                raise OutsideDomain(f"outside the model's domain: {why}. {self.name} {self.version} gives it no "
                                    "answer")

    @property
    def model_path(self) -> Path:
        return self.path / "model.onnx"

    @property
    def checkpoint_path(self) -> Path | None:
        """checkpoint.pt when SHA256SUMS lists it and it still has the listed digest (a checkpoint is a pickle:
        one the manifest does not cover is never offered for loading)."""
        p = self.path / "checkpoint.pt"
        digest = self.files.get("checkpoint.pt")
        if digest is None or not p.is_file():
            return None
        if sha256_file(p) != digest:
            raise PackageError(f"{self.name} {self.version}: checksum mismatch for checkpoint.pt: the file was "
                               "modified after the package was loaded")
        return p

    def model_bytes(self) -> bytes:
        """The verified bytes of model.onnx: those load_package hashed, or (after `release_model_bytes`) the file
        read again and checked against the same digest."""
        if self._model_bytes is not None:
            return self._model_bytes
        data = self.model_path.read_bytes()
        want = self.files.get("model.onnx")
        if want is None or hashlib.sha256(data).hexdigest() != want:
            raise PackageError(f"{self.name} {self.version}: checksum mismatch for model.onnx: the file was "
                               "modified after the package was loaded")
        return data

    def release_model_bytes(self) -> None:
        """Drop the in-memory copy of model.onnx (an ONNX Runtime session holds its own)."""
        self._model_bytes = None

    def session(self, providers: list[str] | None = None, threads: int | None = None, spin: bool = True):
        """An ONNX Runtime session, CUDA first where it is available, built from
        the verified bytes of model.onnx, never from the path after the check. `spin=False`: ONNX Runtime's
        pool threads sleep between runs instead of spinning, for a process that runs one small batch at a time
        beside other work (the DICOM listener: docs/results.md, "Spinning threads in the listener")."""
        import onnxruntime as ort

        if providers is None:
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" in providers and not cuda_driver_present():
            providers = [p for p in providers if p != "CUDAExecutionProvider"]  # no driver: skip ORT's noisy attempt
        if "CUDAExecutionProvider" in providers and "CUDAExecutionProvider" in available:
            try:  # preload first, or the CUDA provider fails to load libcublasLt (CUDA libraries from pip wheels)
                ort.preload_dlls()
            except Exception:  # noqa: BLE001 - a CPU-only machine: the CPU provider takes over
                pass
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        if not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        use = [p for p in providers if p in available] or ["CPUExecutionProvider"]
        data = self.model_bytes()
        try:
            sess = ort.InferenceSession(data, sess_options=opts, providers=use)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own types
            raise PackageError(f"{self.name} {self.version}: ONNX Runtime cannot load model.onnx "
                               f"({str(exc)[:300]})") from exc
        del data
        self.release_model_bytes()  # the session holds the graph; a second session re-reads and re-checks
        return sess

    def run(self, session, images: np.ndarray | list,
            log_prior_ratio: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Run the graph on a normalised float batch (N, C, H, W) or a list of images/arrays; `log_prior_ratio`
        ((C,), (1, C) or (N, C): log q − log source prior) decides for a prior q where the graph takes one."""
        x = images if isinstance(images, np.ndarray) and images.dtype == np.float32 and images.ndim == 4 \
            else self.preprocess(list(images) if not isinstance(images, list) else images)
        names = [o.name for o in session.get_outputs()]
        feed = {self.meta.input.name: x}
        if log_prior_ratio is not None:
            if self.meta.prior is None:
                raise PackageError(f"{self.name} {self.version} predates prior-aware inference: its graph takes no "
                                   "prior; re-export it with this tafl")
            r = np.asarray(log_prior_ratio, np.float32)
            feed["log_prior_ratio"] = r.reshape(1, -1) if r.ndim == 1 else r
        return dict(zip(names, session.run(names, feed)))


def cuda_driver_present() -> bool:
    """Whether an NVIDIA driver is loadable here (onnxruntime-gpu lists CUDA even where none is)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def read_metadata(raw: Any, where: str = "metadata.json") -> PackageMetadata:
    """The typed metadata of `raw` (tafl.packaging.metadata: checked, migrated, a newer schema refused), with its
    preprocessing also checked as tafl.imaging.Preprocess takes it."""
    meta = PackageMetadata.from_json(raw, where)
    try:
        Preprocess.from_dict(meta.input.preprocess.to_json())
    except (KeyError, TypeError, ValueError) as exc:
        raise PackageError(f"{where}: input.preprocess is invalid ({exc})") from exc
    return meta


def run_folder_hint(folder: Path) -> None:
    """PackageError saying how to make a package when `folder` is a training run's output (final.pt, run.json)
    rather than a package: what `tafl serve runs/x` meets."""
    if (folder / "final.pt").is_file():
        raise PackageError(f"{folder} is a training run folder, not a model package; make one with: "
                           f"tafl export {folder / 'final.pt'} --out PKG")
    if (folder / "run.json").is_file():
        raise PackageError(f"{folder} is a training run folder without a final model (final.pt; the run has not "
                           f"finished), not a model package; finish it with: tafl train --out {folder} --resume, "
                           f"then: tafl export {folder / 'final.pt'} --out PKG")


def load_package(path: str | Path, trusted_keys: Any = None) -> ModelPackage:
    """Verify the signature (when keys are configured), the checksums and the metadata; a tampered, unsigned
    or incomplete package is refused with a PackageError.

    `trusted_keys`: None reads TAFL_TRUSTED_KEYS (unset: signatures are not required); `()` or an empty list
    turns the check off; else public key files, folders of `*.pub` files, a comma-separated string of them, or
    a `signing.TrustedKeys`. model.onnx, metadata.json and README.md are hashed from the bytes kept and used."""
    from tafl.packaging.signing import (
        SIG,
        load_trusted_keys,
        trusted_keys_from_env,
        verify_signature,
    )

    trusted = trusted_keys_from_env() if trusted_keys is None else load_trusted_keys(trusted_keys)
    folder = Path(path)
    if not folder.is_dir():
        raise PackageError(f"model package not found: {folder} is not a folder")
    sums = folder / SUMS
    if not sums.is_file():
        run_folder_hint(folder)
        raise PackageError(f"{folder}: incomplete package, {SUMS} is missing")
    sums_bytes = _read_small(sums, MAX_SUMS_BYTES)
    signed_by = None
    if trusted:
        sig = folder / SIG
        try:
            verify_from = _read_small(sig, 4096) if sig.is_file() else None
            signed_by = verify_signature(sums_bytes, verify_from, trusted)
        except PackageError as exc:
            raise PackageError(f"{folder}: {exc.message}") from None
    try:
        text = sums_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise PackageError(f"{sums}: not UTF-8 text") from None
    listed: dict[str, str] = {}
    for i, line in enumerate(text.splitlines(), 1):
        parts = line.strip().split(maxsplit=1)
        if not parts:
            continue
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]):
            raise PackageError(f"{sums}:{i}: malformed line")
        name = parts[1].lstrip("*")
        if "/" in name or "\\" in name or ".." in name or name in (SUMS, SIG):
            raise PackageError(f"{sums}: refuses path {name!r}")
        if name in listed:
            raise PackageError(f"{sums}: lists {name} twice")
        listed[name] = parts[0]
    for name in REQUIRED_FILES:
        if name not in listed:
            raise PackageError(f"{folder}: {SUMS} does not cover {name}")
    kept: dict[str, bytes] = {}
    for name, digest in listed.items():
        f = folder / name
        if not f.is_file():
            raise PackageError(f"{folder}: incomplete package, {name} is missing")
        if name in IN_MEMORY:
            kept[name] = f.read_bytes()
            got = hashlib.sha256(kept[name]).hexdigest()
        else:
            got = sha256_file(f)
        if got != digest:
            raise PackageError(f"{folder}: checksum mismatch for {name}: the file was modified after export")
    try:
        raw = json.loads(kept["metadata.json"])
    except (ValueError, RecursionError) as exc:
        raise PackageError(f"{folder / 'metadata.json'}: not valid JSON ({str(exc)[:120]})") from exc
    meta = read_metadata(raw, str(folder / "metadata.json"))
    try:
        card = kept["README.md"].decode("utf-8")
    except UnicodeDecodeError:
        raise PackageError(f"{folder / 'README.md'}: the model card is not UTF-8 text") from None
    return ModelPackage(folder, meta, raw, card, files=listed, signed_by=signed_by, _model_bytes=kept["model.onnx"])


def _read_small(path: Path, limit: int) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise PackageError(f"{path}: {len(data)}+ bytes, larger than such a file can be")
    return data


def list_packages(root: str | Path) -> list[dict[str, Any]]:
    """Every package folder under `root` (one level, or root itself): version, metrics, lineage, integrity."""
    root = Path(root)
    if not root.is_dir():
        raise PackageError(f"{root} is not a folder")
    folders = [root] if (root / "metadata.json").is_file() else sorted(p for p in root.iterdir() if p.is_dir())
    rows = []
    for f in folders:
        if not (f / "metadata.json").is_file():
            continue
        row: dict[str, Any] = {"path": str(f)}
        try:
            raw, row["status"] = load_package(f).metadata, "ok"
        except PackageError as exc:
            row["status"] = f"REFUSED: {exc.message}"
            try:
                raw = json.loads((f / "metadata.json").read_text())
            except (OSError, json.JSONDecodeError):
                rows.append(row)
                continue
        row.update(listing(raw))
        rows.append(row)
    return rows
