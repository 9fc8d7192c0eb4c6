"""Flower deployment vs the in-process simulator: per-round wall time and bytes on the wire.

    python benchmarks/flower_bench.py [--method gtafl] [--rounds 3]

The same config (embedded digits at 16x16, quarter-width ResNet-8, 3 clients all taking part)
runs in-process and on a loopback Flower deployment (SuperLink + 3 SuperNodes as processes).
Writes benchmarks/results/flower.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.training.config import load_config  # noqa: E402
from tafl.training.flower_local import LocalFederation  # noqa: E402
from tafl.training.simulator import train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="gtafl")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    over = {"method": args.method, "clients": 3, "frac": 1.0, "rounds": args.rounds, "threads": 1,
            "simclr_steps": 2, "simclr_batch": 32, "retrain_epochs": 20, "match_steps": 20}
    cfg = load_config(REPO / "configs" / "smoke.yaml", over)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        local = train(cfg, Path(tmp) / "inproc", progress=False)
        local_wall = time.perf_counter() - t0
        cfg_file = Path(tmp) / "cfg.yaml"
        cfg_file.write_text(yaml.safe_dump(cfg.to_dict()))
        with LocalFederation(3, Path(tmp) / "flwr") as fed:
            t0 = time.perf_counter()
            r = fed.run({"config": str(cfg_file), "out": str(Path(tmp) / "flower"), "force": True})
            fl_wall = time.perf_counter() - t0
            if r.returncode != 0:
                sys.exit(r.stdout[-3000:] + r.stderr[-3000:])
        flower = json.loads((Path(tmp) / "flower" / "report.json").read_text())

    def per_round(rep):
        return statistics.mean(h["seconds"] for h in rep["history"])

    c = flower["communication"]
    out = {"date": time.strftime("%Y-%m-%d"), "method": args.method, "rounds": args.rounds,
           "in_process": {"round_s": per_round(local), "wall_s": local_wall, **local["communication"]},
           "flower_deployment": {"round_s": per_round(flower), "wall_s": fl_wall, **c},
           "round_time_overhead": per_round(flower) / per_round(local),
           "wire_overhead": (c["wire_uplink_bytes"] + c["wire_downlink_bytes"]) / (c["uplink_bytes"] + c["downlink_bytes"])}
    res = REPO / "benchmarks" / "results"
    (res / "flower.json").write_text(json.dumps(out, indent=2))
    text = (f"# Flower deployment vs in-process ({out['date']}, {args.method}, digits 16x16, 3 clients, "
            f"{args.rounds} rounds)\n\n| engine | s / round | wall s | uplink MB | downlink MB |\n|---|---|---|---|---|\n"
            f"| in-process | {out['in_process']['round_s']:.1f} | {local_wall:.0f} | "
            f"{local['communication']['uplink_bytes'] / 1e6:.2f} | {local['communication']['downlink_bytes'] / 1e6:.2f} |\n"
            f"| Flower loopback (on the wire) | {out['flower_deployment']['round_s']:.1f} | {fl_wall:.0f} | "
            f"{c['wire_uplink_bytes'] / 1e6:.2f} | {c['wire_downlink_bytes'] / 1e6:.2f} |\n\n"
            f"Round time ×{out['round_time_overhead']:.1f}; bytes on the wire ×{out['wire_overhead']:.3f} of the "
            "tensors' own size.\n")
    (res / "flower.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
