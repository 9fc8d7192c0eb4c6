"""The run folder: run.json written at the start (and checked against on --resume), and a run that failed before
its first checkpoint removed again, so that the same command can simply be retried."""

from __future__ import annotations

import datetime as _dt
import json
import shutil
from pathlib import Path

import tafl
from tafl.errors import ConfigError, RunDirError
from tafl.training.config import RunConfig
from tafl.training.report import write_json


def prepare_out(out: Path, cfg: RunConfig, resume: bool, force: bool) -> RunConfig:
    run_json = out / "run.json"
    if resume:
        if not run_json.is_file():
            raise RunDirError(f"--resume: {out} holds no tafl run (no run.json)")
        saved = RunConfig.from_dict(json.loads(run_json.read_text())["config"], str(run_json)).validate()
        diff = [k for k, v in cfg.to_dict().items() if k != "rounds" and saved.to_dict()[k] != v]
        if diff:
            k = diff[0]
            raise ConfigError(f"--resume: the config differs from the run in {out}: '{k}' was "
                              f"{saved.to_dict()[k]!r}, now {cfg.to_dict()[k]!r} (only 'rounds' may change)")
        saved.rounds = cfg.rounds
        return saved
    if out.exists() and any(out.iterdir()):
        if not force:
            raise RunDirError(f"{out} already holds files; pass --force to replace that run, or --resume to continue it")
        if not run_json.is_file():
            raise RunDirError(f"{out} is not empty and holds no tafl run; refusing to delete it even with --force")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(run_json, {"config": cfg.to_dict(), "created": now(), "tafl_version": tafl.__version__})
    return cfg


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def discard_unstarted_run(out: Path, fresh: bool) -> None:
    """A run that failed before its first checkpoint (a missing dataset, a bad folder CSV) leaves no folder behind,
    or, where the folder held other things before (--force), no run.json: the retry with the same --out is not
    refused as "already holds files"."""
    ckpts = out / "checkpoints"
    if (ckpts.is_dir() and any(ckpts.iterdir())) or (out / "final.pt").exists():
        return
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    else:
        for name in ("run.json", "train.log"):
            (out / name).unlink(missing_ok=True)
