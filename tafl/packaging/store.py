"""The BentoML model store: a package goes in with `bentoml.models.create`, comes out by tag."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tafl.errors import PackageError
from tafl.packaging.package import ModelPackage, load_package

FILES = ("model.onnx", "metadata.json", "README.md", "checkpoint.pt", "SHA256SUMS", "SHA256SUMS.sig")


def to_bentoml(pkg: ModelPackage, name: str) -> str:
    """Store the package under `name`; returns the tag (name:version)."""
    import bentoml

    version = pkg.version.replace(".", "_")  # BentoML versions are [a-z0-9_.-]; keep the semantic version readable
    m = pkg.meta
    info = {"name": m.name, "version": m.version, "parent_version": m.parent_version, "method": m.method,
            "backbone": m.backbone, "class_names": list(m.class_names), "created": m.created,
            "average_accuracy": m.metrics.average_accuracy}
    info = {k: v for k, v in info.items() if v is not None}  # BentoML metadata takes basic types, not None
    labels = {"framework": "onnx", "tafl_method": m.method, "tafl_version": pkg.version}
    try:
        with bentoml.models.create(f"{name}:{version}", labels=labels, metadata=info, module="tafl.packaging") as bm:
            for f in FILES:
                if (pkg.path / f).is_file():
                    shutil.copyfile(pkg.path / f, Path(bm.path) / f)
    except bentoml.exceptions.BentoMLException as exc:
        raise PackageError(f"cannot store {pkg.name} in the BentoML model store as '{name}': {exc}") from exc
    return f"{name}:{version}"


def from_bentoml(tag: str, trusted_keys: Any = None) -> ModelPackage:
    """Load (and verify: checksums, and the signature where keys are configured; `trusted_keys` as in
    `load_package`) a package from the BentoML model store by tag."""
    import bentoml

    try:
        model = bentoml.models.get(tag)
    except bentoml.exceptions.NotFound as exc:
        raise PackageError(f"no model '{tag}' in the BentoML model store: store one with "
                           "`tafl export CKPT --out PKG --to-bentoml NAME`, or set TAFL_PACKAGES to package "
                           "folders or tags") from exc
    except (bentoml.exceptions.BentoMLException, ValueError) as exc:  # an invalid tag
        raise PackageError(f"'{tag[:80]}' is not a BentoML model tag (name[:version]: lower-case letters, digits, "
                           "'-', '_', '.')") from exc
    return load_package(model.path, trusted_keys)
