"""Flower deployment vs the in-process simulator: per-round wall time and bytes on the wire.

    python benchmarks/flower_bench.py [--method gtafl] [--rounds 3] [--engines inproc,cold,warm]

The same config (embedded digits at 16x16, quarter-width ResNet-8, 3 clients all taking part)
runs in-process and on a loopback Flower deployment (SuperLink + 3 SuperNodes as processes), in
two ways: `warm`, the default of `LocalFederation`, where each SuperNode runs `--isolation process`
beside one long-lived ClientApp process; `cold`, Flower's default `--isolation subprocess`, a
fresh `flwr-clientapp` process per message. Writes benchmarks/results/flower.{json,md}, with the
machine's core count and load average at the start (results on a loaded machine say so).
"""

from __future__ import annotations

import argparse
import json
import os
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

ENGINES = {"inproc": "in-process", "cold": "Flower loopback, a process per message",
           "warm": "Flower loopback, one warm ClientApp process per node"}


def _flower(cfg_file: Path, tmp: Path, warm: bool) -> tuple[dict, float]:
    name = "warm" if warm else "cold"
    with LocalFederation(3, tmp / f"flwr-{name}", warm=warm) as fed:
        t0 = time.perf_counter()
        r = fed.run({"config": str(cfg_file), "out": str(tmp / name), "force": True})
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(r.stdout[-3000:] + r.stderr[-3000:])
    return json.loads((tmp / name / "report.json").read_text()), wall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="gtafl")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default="inproc,cold,warm", help="comma-separated subset of " + ",".join(ENGINES))
    args = p.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if not engines or set(engines) - set(ENGINES):
        p.error(f"--engines: choose from {', '.join(ENGINES)}")
    over = {"method": args.method, "clients": 3, "frac": 1.0, "rounds": args.rounds, "threads": 1,
            "simclr_steps": 2, "simclr_batch": 32, "retrain_epochs": 20, "match_steps": 20}
    cfg = load_config(REPO / "configs" / "smoke.yaml", over)
    load = os.getloadavg()
    reports: dict[str, tuple[dict, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg_file = tmp / "cfg.yaml"
        cfg_file.write_text(yaml.safe_dump(cfg.to_dict()))
        for e in engines:
            t0 = time.perf_counter()
            if e == "inproc":
                reports[e] = train(cfg, tmp / "inproc", progress=False), time.perf_counter() - t0
            else:
                reports[e] = _flower(cfg_file, tmp, warm=e == "warm")

    def per_round(rep):
        return statistics.mean(h["seconds"] for h in rep["history"])

    out = {"date": time.strftime("%Y-%m-%d"), "method": args.method, "rounds": args.rounds,
           "machine": {"cpus": os.cpu_count(), "load_avg_1_5_15": [round(x, 2) for x in load]}}
    keys = {"inproc": "in_process", "cold": "flower_per_message_process", "warm": "flower_deployment"}
    for e, (rep, wall) in reports.items():
        out[keys[e]] = {"engine": ENGINES[e], "round_s": per_round(rep),
                        "round_s_each": [h["seconds"] for h in rep["history"]], "wall_s": wall, **rep["communication"]}
    if "inproc" in reports:
        for e in ("cold", "warm"):
            if e in reports:
                out[f"round_time_overhead_{e}"] = per_round(reports[e][0]) / per_round(reports["inproc"][0])
    if "warm" in reports and "cold" in reports:
        out["warm_speedup_over_cold"] = per_round(reports["cold"][0]) / per_round(reports["warm"][0])
    fl = next((reports[e][0]["communication"] for e in ("warm", "cold") if e in reports), None)
    if fl:
        out["wire_overhead"] = ((fl["wire_uplink_bytes"] + fl["wire_downlink_bytes"])
                                / (fl["uplink_bytes"] + fl["downlink_bytes"]))
    res = REPO / "benchmarks" / "results"
    (res / "flower.json").write_text(json.dumps(out, indent=2) + "\n")
    rows = []
    for e, (rep, wall) in reports.items():
        c = rep["communication"]
        up, down = (c["wire_uplink_bytes"], c["wire_downlink_bytes"]) if e != "inproc" else (c["uplink_bytes"],
                                                                                           c["downlink_bytes"])
        each = ", ".join(f"{h['seconds']:.1f}" for h in rep["history"])
        rows.append(f"| {ENGINES[e]} | {per_round(rep):.1f} ({each}) | {wall:.0f} | {up / 1e6:.2f} | {down / 1e6:.2f} |")
    text = (f"# Flower deployment vs in-process ({out['date']}, {args.method}, digits 16x16, 3 clients, "
            f"{args.rounds} rounds)\n\n{os.cpu_count()} cores, load average {load[0]:.2f} / {load[1]:.2f} / "
            f"{load[2]:.2f} at the start.\n\n| engine | s / round (each round) | wall s | uplink MB | downlink MB |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            "Bytes: tensor bytes in-process, bytes on the wire for Flower.")
    notes = []
    for e in ("cold", "warm"):
        if f"round_time_overhead_{e}" in out:
            notes.append(f"round time ×{out[f'round_time_overhead_{e}']:.1f} of in-process ({e})")
    if "warm_speedup_over_cold" in out:
        notes.append(f"warm ×{out['warm_speedup_over_cold']:.1f} faster per round than cold")
    if "wire_overhead" in out:
        notes.append(f"bytes on the wire ×{out['wire_overhead']:.3f} of the tensors' own size")
    text += (" " + "; ".join(notes) + "." if notes else "") + "\n"
    (res / "flower.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
