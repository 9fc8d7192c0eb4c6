"""Checkpoints: tensors and plain config only, loadable with `torch.load(..., weights_only=True)`.

Checkpoints travel between sites, so they never hold pickled objects. One checkpoint carries
everything needed to rebuild the model and continue or evaluate the run: the model config, the
run config, class names, preprocessing, the global state (weights, method extras), the round
and the history. Writes are atomic (temporary file, then rename), so a kill never leaves a
half-written checkpoint behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tafl.errors import CheckpointError

FORMAT = "tafl-checkpoint"
VERSION = 1
REQUIRED = ("format", "version", "method", "model_config", "run_config", "class_names", "preprocess", "state",
            "round")


def save_checkpoint(obj: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    obj = {"format": FORMAT, "version": VERSION, **obj}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, foreign pickle, unsafe globals: all mean "not ours"
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path} is not a readable tafl checkpoint (corrupt, truncated, or a pickle with "
                              f"objects: {type(exc).__name__}: {first})") from exc
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a tafl checkpoint (no '{FORMAT}' format marker)")
    if obj.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {obj.get('version')}; this tafl reads version {VERSION}")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise CheckpointError(f"{path} is incomplete: missing {', '.join(missing)}")
    return obj


def latest_round_checkpoint(folder: Path) -> Path | None:
    """The newest readable per-round checkpoint in `folder`, skipping unreadable ones."""
    if not folder.is_dir():
        return None
    for p in sorted(folder.glob("round_*.pt"), reverse=True):
        try:
            load_checkpoint(p)
            return p
        except CheckpointError:
            continue
    return None
