"""Benchmark one federated training run: round time, peak memory and the eleven accuracies.

    python benchmarks/train_bench.py --method fedavg [--config configs/benchmark.yaml]
        [--data-root ../shared/data/medmnist] [--name fedavg_dermamnist] [flags...]

Writes benchmarks/results/<name>.json (and .md) with the command, the scale (width, rounds,
local epochs, clients), mean/median round seconds, peak resident memory of the process, and the
prior-weighted accuracy per test distribution. Extra `--key value` pairs override the config.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.training.config import load_config  # noqa: E402
from tafl.training.longtail import DISTRIBUTION_NAMES  # noqa: E402
from tafl.training.report import SHORT, pct  # noqa: E402
from tafl.training.simulator import train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default=None, help="overrides the config's method (default: the config's)")
    p.add_argument("--config", default=str(REPO / "configs" / "benchmark.yaml"))
    p.add_argument("--data-root", default=str(REPO.parent / "shared" / "data" / "medmnist"))
    p.add_argument("--name", default=None)
    p.add_argument("--out", default=None, help="run folder (default benchmarks/out/<name>)")
    args, extra = p.parse_known_args()
    overrides = {"data_root": args.data_root}
    if args.method:
        overrides["method"] = args.method
    for key, value in zip(extra[::2], extra[1::2]):
        overrides[key.lstrip("-").replace("-", "_")] = _parse(value)
    cfg = load_config(args.config, overrides)
    name = args.name or f"{cfg.method}_{cfg.dataset}"
    out = Path(args.out or REPO / "benchmarks" / "out" / name)
    t0 = time.perf_counter()
    if cfg.engine == "flower":  # --engine flower [--secure_aggregation true]: the run goes through Flower
        from tafl.training.flower import run_flower_simulation

        report = run_flower_simulation(cfg, out, force=True)
    else:
        report = train(cfg, out, force=True, progress=False)
    wall = time.perf_counter() - t0
    rounds = [h["seconds"] for h in report["history"]]
    result = {
        "name": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "scale": {k: getattr(cfg, k) for k in ("dataset", "img_size", "backbone", "width", "clients", "frac", "rounds",
                                               "local_epochs", "batch_size", "imbalance_factor", "alpha", "seed")},
        "wall_s": wall,
        "round_s_mean": statistics.mean(rounds),
        "round_s_median": statistics.median(rounds),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "timing": report["timing"],
        "communication": report["communication"],
        "average_accuracy": report["average_accuracy"],
        "accuracy": {n: report["test_distributions"][n]["accuracy"] for n in DISTRIBUTION_NAMES},
        "sampled_accuracy": {n: report["test_distributions"][n]["sampled_accuracy"] for n in DISTRIBUTION_NAMES},
        "head_middle_tail": {n: {g: report["test_distributions"][n][g] for g in ("head", "middle", "tail")}
                             for n in ("forward50", "uniform", "backward50")},
        "uniform_metrics": {k: v for k, v in report["uniform_metrics"].items() if k != "per_class"},
        "per_class_recall": dict(zip(report["class_names"], report["uniform_metrics"]["per_class"]["recall"])),
        "class_ranks": dict(zip(report["class_names"], report["class_ranks"])),
        "natural_metrics": {k: v for k, v in report.get("natural_metrics", {}).items() if k != "per_class"},
        "experts": {e: {n: d[n]["accuracy"] for n in DISTRIBUTION_NAMES} for e, d in (report.get("experts") or {}).items()},
        "validation": report["validation"],
    }
    res_dir = REPO / "benchmarks" / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    lines = [f"# {name}", "", f"`{result['command']}` on {result['date']} ({result['machine']})", "",
             f"Scale: {result['scale']}", "",
             f"Wall {wall:.0f} s; round {result['round_s_mean']:.1f} s mean; peak RSS {result['peak_rss_mib']:.0f} MiB", "",
             "| " + " | ".join(SHORT[n] for n in DISTRIBUTION_NAMES) + " | Avg |",
             "|" + "---|" * 12,
             "| " + " | ".join(pct(result["accuracy"][n]) for n in DISTRIBUTION_NAMES) +
             f" | {pct(result['average_accuracy'])} |"]
    (res_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _parse(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    # "none" stays a string: it is a value of several settings (calibration none); "null" is the missing value
    return {"true": True, "false": False, "null": None}.get(v.lower(), v)


if __name__ == "__main__":
    main()
