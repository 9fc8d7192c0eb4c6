"""The three-seed summary behind docs/results.md §2: headline rows, issue 12's targets, the experts'
ordering per seed on validation and test, and the vote rules.

    python benchmarks/seeds_summary.py [--dataset dermamnist] [--out-dir benchmarks/out]

Reads the run folders `benchmarks/seeds_dermamnist.sh` writes (`<row>_s<seed>_<dataset>`), and writes
benchmarks/results/seeds_<dataset>_summary.{md,json}. Every number is mean ± sd over the seeds found.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.training.longtail import DISTRIBUTION_NAMES  # noqa: E402

ROWS = {"fedavg": "FedAvg", "creff": "CReFF (as published)", "creff_stats": "CReFF + statistics",
        "gtafl": "GTAFL", "nocl": "GTAFL −CL (no SimCLR)", "nogs": "GTAFL −GS (no GI-GDS)",
        "noen": "GTAFL −EN (uniform expert only)"}


def ms(xs: list[float]) -> str:
    xs = [100 * x for x in xs if x is not None]
    if not xs:
        return "—"
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"


def mean(xs):
    return statistics.mean(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="dermamnist")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "out"))
    a = p.parse_args()
    runs: dict[str, dict[int, dict]] = {}
    for d in sorted(Path(a.out_dir).glob(f"*_s*_{a.dataset}")):
        m = re.fullmatch(rf"(.+)_s(\d+)_{a.dataset}", d.name)
        if m and (d / "report.json").is_file():
            runs.setdefault(m.group(1), {})[int(m.group(2))] = json.loads((d / "report.json").read_text())
    if not runs:
        raise SystemExit(f"no runs for {a.dataset} in {a.out_dir}")
    acc = {row: {s: {n: r["test_distributions"][n]["accuracy"] for n in DISTRIBUTION_NAMES}
                 | {"avg": r["average_accuracy"]} for s, r in reps.items()} for row, reps in runs.items()}
    # the ablation rows that need no run of their own: parts of the full GTAFL runs
    if "gtafl" in runs:
        for key, name in (("forward", "GTAFL's forward expert alone (same runs)"),
                          ("uniform", "GTAFL's uniform expert alone (−EN, same runs)"),
                          ("backward", "GTAFL's backward expert alone (same runs)"),
                          ("original_head", "GTAFL's FedAvg head (−CR, same runs)")):
            acc[name] = {s: {n: r["experts"][key][n]["accuracy"] for n in DISTRIBUTION_NAMES} for s, r in
                         runs["gtafl"].items()}
            for s in acc[name]:
                acc[name][s]["avg"] = mean([acc[name][s][n] for n in DISTRIBUTION_NAMES])
    cols = ("forward50", "forward10", "uniform", "backward10", "backward50", "avg")
    lines = [f"# Three-seed summary: {a.dataset}", "",
             "`python benchmarks/seeds_summary.py --dataset " + a.dataset + "`: prior-weighted accuracy on the test "
             "split (%), mean ± sd over the seeds (partition, initialisation and sampling all change with the seed).",
             "", "| method | seeds | F50 | F10 | Uni | B10 | B50 | mean of 11 |", "|---|---|---|---|---|---|---|---|"]
    for row in list(ROWS) + [k for k in acc if k not in ROWS]:
        if row not in acc:
            continue
        seeds = sorted(acc[row])
        lines.append(f"| {ROWS.get(row, row)} | {', '.join(map(str, seeds))} | " +
                     " | ".join(ms([acc[row][s][c] for s in seeds]) for c in cols) + " |")
    out: dict = {"accuracy": acc}
    if "gtafl" in runs and "creff" in runs:
        g = {c: mean([acc["gtafl"][s][c] for s in acc["gtafl"]]) for c in cols}
        c_ = {c: mean([acc["creff"][s][c] for s in acc["creff"]]) for c in cols}
        checks = [("GTAFL mean of 11 ≥ 50", g["avg"] >= 0.50, f"{100 * g['avg']:.2f}"),
                  ("GTAFL mean ≥ CReFF + 5", g["avg"] >= c_["avg"] + 0.05, f"{100 * (g['avg'] - c_['avg']):+.2f}"),
                  ("GTAFL backward50 ≥ CReFF + 8", g["backward50"] >= c_["backward50"] + 0.08,
                   f"{100 * (g['backward50'] - c_['backward50']):+.2f}"),
                  ("GTAFL forward50 ≥ CReFF", g["forward50"] >= c_["forward50"],
                   f"{100 * (g['forward50'] - c_['forward50']):+.2f}")]
        def secs(row: str, key: str) -> float:
            return mean([runs[row][s]["timing"].get(key, 0.0) for s in runs[row]])

        client, server = secs("gtafl", "client_s") / secs("creff", "client_s"), \
            secs("gtafl", "server_s") / secs("creff", "server_s")
        checks += [("client time ≤ 1.1× CReFF (whole runs, mean over seeds)", client <= 1.1, f"{client:.2f}×"),
                   ("server time ≤ 3× CReFF (whole runs, mean over seeds)", server <= 3.0, f"{server:.2f}×")]
        lines += ["", "## Issue 12's targets (means over the seeds)", "", "| target | met | value |", "|---|---|---|"]
        lines += [f"| {t} | {'yes' if ok else '**no**'} | {v} |" for t, ok, v in checks]
        out["targets"] = {t: {"met": bool(ok), "value": v} for t, ok, v in checks}
    for row in ("gtafl", "nocl", "nogs", "creff_stats"):
        if row not in runs or not runs[row][next(iter(runs[row]))].get("validation", {}).get("experts"):
            continue
        lines += ["", f"## {ROWS[row]}: the experts, per seed", "",
                  "| seed | split | forward@F50 | backward@F50 | forward@B50 | backward@B50 | ordering holds | "
                  "vote mean | best expert mean |", "|---|---|---|---|---|---|---|---|---|"]
        for s, r in sorted(runs[row].items()):
            for split in ("validation", "test"):
                if split == "test":
                    ex = {e: {n: d[n]["accuracy"] for n in DISTRIBUTION_NAMES} for e, d in r["experts"].items()}
                    vote = r["average_accuracy"]
                else:
                    ex = r["validation"]["experts"]
                    vote = r["validation"]["average_accuracy"]
                if "forward" not in ex:
                    continue
                f, b = ex["forward"], ex["backward"]
                ok = f["forward50"] > b["forward50"] and b["backward50"] > f["backward50"]
                best = max(mean([ex[e][n] for n in DISTRIBUTION_NAMES]) for e in ("forward", "uniform", "backward"))
                lines.append(f"| {s} | {split} | {100 * f['forward50']:.1f} | {100 * b['forward50']:.1f} | "
                             f"{100 * f['backward50']:.1f} | {100 * b['backward50']:.1f} | {'yes' if ok else '**no**'} | "
                             f"{100 * vote:.2f} | {100 * best:.2f} |")
        rules = sorted({k for r in runs[row].values() for k in r.get("vote_rules", {})})
        if rules:
            lines += ["", f"Vote rules ({ROWS[row]}), mean of 11, mean ± sd over the seeds:", "",
                      "| rule | validation | test |", "|---|---|---|"]
            for rule in rules:
                v = [r["validation"]["vote_rules"][rule]["average_accuracy"] for r in runs[row].values()
                     if rule in r["validation"].get("vote_rules", {})]
                t = [r["vote_rules"][rule]["average_accuracy"] for r in runs[row].values() if rule in r["vote_rules"]]
                lines.append(f"| {rule} | {ms(v)} | {ms(t)} |")
    res = REPO / "benchmarks" / "results"
    (res / f"seeds_{a.dataset}_summary.json").write_text(json.dumps(out, indent=1))
    (res / f"seeds_{a.dataset}_summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
