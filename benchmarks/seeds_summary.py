"""Rows of three-seed runs side by side, with paired differences against a baseline row (issue 33's DermaMNIST table).

    python benchmarks/seeds_summary.py --name NAME --base fedavg_la_w0.5 fedavg_la_w0.5 gtafl_cal_w0.5 [--dataset dermamnist]

A row is a run-name prefix: benchmarks/out/<row>_s<seed>_<dataset>/report.json. Per row, mean ± sd over its seeds of
what the validation split says (balanced accuracy, mean of the eleven distributions) and what the test split says
(mean of the eleven at the model's own rule, macro F1 and balanced recall under a uniform prior, the mean of the
eleven adapted to 500 unlabeled images and at the oracle prior); then each row minus the baseline, seed by seed.
Writes benchmarks/results/<NAME>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

METRICS = {
    "val bal. acc": lambda r: r["validation"]["balanced_accuracy"],
    "val mean of 11": lambda r: r["validation"]["average_accuracy"],
    "test mean of 11": lambda r: r["average_accuracy"],
    "macro F1": lambda r: r["uniform_metrics"]["macro_f1"],
    "bal. recall": lambda r: r["uniform_metrics"]["recall"],
    "adapted 500": lambda r: r["prior_adaptation"]["test"]["average"]["adaptive_500"],
    "oracle": lambda r: r["prior_adaptation"]["test"]["average"]["oracle"],
}


def cell(xs: list[float]) -> str:
    if not xs:
        return "—"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--base", required=True, help="the row the others are paired against")
    ap.add_argument("--dataset", default="dermamnist")
    ap.add_argument("--name", default="seeds_summary")
    ns = ap.parse_args()
    runs: dict[str, dict[int, dict]] = {}
    for row in ns.rows:
        runs[row] = {}
        for f in sorted((REPO / "benchmarks" / "out").glob(f"{row}_s[0-9]*_{ns.dataset}/report.json")):
            seed = int(f.parent.name[len(row) + 2:].split("_")[0])
            runs[row][seed] = json.loads(f.read_text())
    table, lines = {}, [f"# {ns.name}", "", "Mean ± sd over seeds (%); `own` is each model's plain rule.", "",
                        "| row | seeds | " + " | ".join(METRICS) + " |", "|---|---|" + "---|" * len(METRICS)]
    for row, rs in runs.items():
        vals = {m: [f(r) for r in rs.values()] for m, f in METRICS.items()}
        table[row] = {"seeds": sorted(rs), **{m: v for m, v in vals.items()}}
        lines.append(f"| {row} | {len(rs)} | " + " | ".join(cell(v) for v in vals.values()) + " |")
    lines += ["", f"Paired against {ns.base}, seed by seed (points):", "",
              "| row | " + " | ".join(METRICS) + " |", "|---|" + "---|" * len(METRICS)]
    base = runs.get(ns.base, {})
    for row, rs in runs.items():
        if row == ns.base:
            continue
        common = sorted(set(rs) & set(base))
        cells = [", ".join(f"{100 * (f(rs[s]) - f(base[s])):+.1f}" for s in common) or "—" for f in METRICS.values()]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{ns.name}.json").write_text(json.dumps(table, indent=2))
    (out / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
