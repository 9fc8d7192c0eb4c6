"""GTAFL vs CReFF cost, side by side in one process: client and server time per round and their parts.

    python benchmarks/gtafl_speed.py [--rounds 3] [--data-root ../shared/data/medmnist]

Runs CReFF, GTAFL (SimCLR every round, the replication setting) and GTAFL with SimCLR every 5th
round on the DermaMNIST benchmark config (paper-width ResNet-8, 32x32) for a few rounds each,
alternating, and records the ratios. Targets (issue 3): client time within 1.15x of CReFF's (the
experts share one feature pass), server time within 3x (the three experts' matching and
retraining as one tensor program). Writes benchmarks/results/gtafl_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.training.config import load_config  # noqa: E402
from tafl.training.simulator import train  # noqa: E402

VARIANTS = {"creff": {"method": "creff"}, "gtafl": {"method": "gtafl"},
            "gtafl_simclr_every5": {"method": "gtafl", "simclr_every": 5}}
PARTS = ("client_s", "server_s", "aggregate_s", "gff_s", "retrain_s", "simclr_s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--data-root", default=str(REPO.parent / "shared" / "data" / "medmnist"))
    args = p.parse_args()
    times = {k: {part: 0.0 for part in PARTS} for k in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in VARIANTS.items():
            cfg = load_config(REPO / "configs" / "benchmark.yaml",
                              {**over, "data_root": args.data_root, "rounds": args.rounds, "eval_every": args.rounds})
            rep = train(cfg, Path(tmp) / name, progress=False)
            for part in PARTS:
                times[name][part] = rep["timing"].get(part, 0.0) / args.rounds
    c, g, g5 = times["creff"], times["gtafl"], times["gtafl_simclr_every5"]

    def ratio(a: dict, b: dict, key: str) -> float:
        return a[key] / b[key] if b[key] else float("nan")

    server_wo = {k: v["server_s"] - v["simclr_s"] for k, v in times.items()}
    out = {"date": time.strftime("%Y-%m-%d"), "rounds_each": args.rounds,
           "scale": "DermaMNIST, paper-width ResNet-8, 32x32, 8 clients/round, 2 local epochs (configs/benchmark.yaml)",
           "seconds_per_round": times,
           "ratios": {"client_gtafl_vs_creff": ratio(g, c, "client_s"),
                      "server_gtafl_vs_creff": ratio(g, c, "server_s"),
                      "server_gtafl_simclr_every5_vs_creff": ratio(g5, c, "server_s"),
                      "server_without_simclr_gtafl_vs_creff": server_wo["gtafl"] / server_wo["creff"],
                      "gff_plus_retrain_gtafl_vs_creff": (g["gff_s"] + g["retrain_s"]) / (c["gff_s"] + c["retrain_s"])},
           "paper_table_vi": {"client": 1.24, "server": 7.9}, "targets": {"client": "<= 1.15", "server": "<= 3"}}
    res = REPO / "benchmarks" / "results"
    (res / "gtafl_speed.json").write_text(json.dumps(out, indent=2))
    lines = [f"# GTAFL vs CReFF cost ({out['date']}; {out['scale']}; {args.rounds} rounds each)", "",
             "| variant | " + " | ".join(PARTS) + " |", "|---|" + "---|" * len(PARTS)]
    for k, v in times.items():
        lines.append(f"| {k} | " + " | ".join(f"{v[p]:.2f}" for p in PARTS) + " |")
    lines += ["", "Seconds per round.", ""] + [f"- {k}: {v:.2f}×" for k, v in out["ratios"].items()]
    (res / "gtafl_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
