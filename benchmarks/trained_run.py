"""A trained run as the offline benchmarks read it: the checkpoint, its config, the data it was prepared from, the
method and the final model (`load_run`); and the benchmark runs of benchmarks/domain_detection.py by row and seed
(`benchmark_runs`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]


@dataclass
class TrainedRun:
    ck: dict[str, Any]  # the checkpoint
    cfg: Any  # RunConfig
    prep: Any  # tafl.training.prepare.Prepared: the dataset, the training rows, the clients' parts and hold-outs
    method: Any
    state: Any  # GlobalState
    model: Any  # the final model, its weights loaded


def load_run(run: Path) -> TrainedRun:
    """The run folder's final.pt, its data prepared as training prepared them, and its method and model."""
    from tafl.imaging import Preprocess
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.contract import GlobalState
    from tafl.training.models import ModelConfig, build_model
    from tafl.training.prepare import make_method, prepare

    ck = load_checkpoint(run / "final.pt")
    cfg = RunConfig.from_dict(ck["run_config"], "checkpoint run_config")
    prep = prepare(cfg)
    method = make_method(cfg, ModelConfig.from_dict(ck["model_config"]), Preprocess.from_dict(ck["preprocess"]))
    state = GlobalState.from_dict(ck["state"])
    model = build_model(method.model_cfg)
    model.load_state_dict(state.weights)
    return TrainedRun(ck, cfg, prep, method, state, model)


def benchmark_runs(rows: list[str], seeds: list[int]) -> Iterator[tuple[str, int, Path]]:
    """(row, seed, folder) of every trained benchmarks/out/ROW_sSEED, in order; an untrained one is named and left
    out."""
    for row in rows:
        for seed in seeds:
            run = REPO / "benchmarks" / "out" / f"{row}_s{seed}"
            if not (run / "final.pt").is_file():
                print(f"{run.name}: not trained (benchmarks/domain_detection.py), left out", flush=True)
                continue
            yield row, seed, run
