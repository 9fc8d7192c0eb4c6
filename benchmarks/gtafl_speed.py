"""GTAFL vs CReFF cost, side by side in one process: client and server time per round and their parts.

    python benchmarks/gtafl_speed.py [--rounds 5] [--data-root ../shared/data/medmnist]

Runs CReFF (as published), GTAFL in its default config, and GTAFL with the earlier SimCLR setting
(10 steps of 2 × 128 images every round) on the DermaMNIST benchmark config (paper-width ResNet-8,
32×32, 8 clients a round, 2 local epochs) for a few rounds each, one after another in one
process, and records the ratios. The finishing round (GTAFL: every client embeds its gradient rows
once more with the final extractor, the server retrains the experts once more) is measured
separately and then charged to the benchmark's 20 rounds, which is what the default config runs.
Targets (issue 12): client time ≤ 1.1× CReFF's, server time ≤ 3× CReFF's in the default config.
Writes benchmarks/results/gtafl_speed.{json,md}.
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
            "gtafl, SimCLR 10 steps x 128 every round": {"method": "gtafl", "simclr_every": 1, "simclr_steps": 10,
                                                         "simclr_batch": 128}}
PARTS = ("client_s", "server_s", "aggregate_s", "gff_s", "retrain_s", "simclr_s")
BENCH_ROUNDS = 20  # configs/benchmark.yaml


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--data-root", default=str(REPO.parent / "shared" / "data" / "medmnist"))
    args = p.parse_args()
    per_round, finish = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in VARIANTS.items():
            cfg = load_config(REPO / "configs" / "benchmark.yaml",
                              {**over, "data_root": args.data_root, "rounds": args.rounds, "eval_every": args.rounds})
            rep = train(cfg, Path(tmp) / name.split(",")[0], progress=False)
            t = rep["timing"]
            own = (rep.get("finishing_round") or {}).get("timing", {})  # the finishing round's own parts
            per_round[name] = {part: (t.get(part, 0.0) - own.get(part, 0.0)) / args.rounds for part in PARTS}
            finish[name] = {"client_s": own.get("client_s", 0.0), "server_s": own.get("server_s", 0.0)}

    def run_total(name: str, part: str) -> float:  # a default-config run: 20 rounds and the finishing round
        return BENCH_ROUNDS * per_round[name][part] + finish[name][part]

    c, g, old = "creff", "gtafl", "gtafl, SimCLR 10 steps x 128 every round"
    out = {"date": time.strftime("%Y-%m-%d"), "rounds_each": args.rounds,
           "scale": "DermaMNIST, paper-width ResNet-8, 32x32, 8 clients/round, 2 local epochs (configs/benchmark.yaml)",
           "seconds_per_round": per_round, "finishing_round_seconds": finish,
           "ratios": {"client, default config (20 rounds + finish), gtafl / creff": run_total(g, "client_s") /
                      run_total(c, "client_s"),
                      "server, default config (20 rounds + finish), gtafl / creff": run_total(g, "server_s") /
                      run_total(c, "server_s"),
                      "server per round, gtafl / creff": per_round[g]["server_s"] / per_round[c]["server_s"],
                      "server per round, earlier SimCLR setting / creff": per_round[old]["server_s"] /
                      per_round[c]["server_s"],
                      "GFF + retraining per round, gtafl / creff": (per_round[g]["gff_s"] + per_round[g]["retrain_s"]) /
                      (per_round[c]["gff_s"] + per_round[c]["retrain_s"])},
           "targets": {"client": "<= 1.1", "server": "<= 3"}}
    res = REPO / "benchmarks" / "results"
    (res / "gtafl_speed.json").write_text(json.dumps(out, indent=2))
    lines = [f"# GTAFL vs CReFF cost ({out['date']}; {out['scale']}; {args.rounds} rounds each)", "",
             "Seconds per round (the finishing round apart):", "",
             "| variant | " + " | ".join(PARTS) + " | finishing round: client | server |",
             "|---|" + "---|" * (len(PARTS) + 2)]
    for k, v in per_round.items():
        lines.append(f"| {k} | " + " | ".join(f"{v[p]:.2f}" for p in PARTS) +
                     f" | {finish[k]['client_s']:.2f} | {finish[k]['server_s']:.2f} |")
    lines += [""] + [f"- {k}: {v:.2f}×" for k, v in out["ratios"].items()]
    (res / "gtafl_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
