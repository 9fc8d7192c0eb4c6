"""ViT-DAFL runs side by side: validation (which decides) and the test metrics of the paper.

    python benchmarks/dafl_summary.py LABEL=RUN[,RUN...] [LABEL=RUN ...] [--name dafl_summary]

Each LABEL groups the run folders of one recipe (one per seed); every number is mean ± sd over
the group's runs (a single run shows its value). Columns: validation balanced accuracy and
eleven-distribution mean (the recipe choice), then on the test split the eleven-distribution mean,
accuracy as it comes, macro F1, balanced recall, AUC and the recall of the two rarest training
classes, and the last round's γ. Writes benchmarks/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ms(xs: list[float], scale: float = 100.0) -> str:
    xs = [scale * x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{xs[0]:.1f}" if len(xs) == 1 else f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"


def row(report: dict) -> dict:
    ranks = report["class_ranks"]  # each class's rank by training count, 0 = the most frequent
    order = sorted(range(len(ranks)), key=lambda c: ranks[c])
    rare = [order[-1], order[-2]]
    rec = report["uniform_metrics"]["per_class"]["recall"]
    return {"val_bacc": report["validation"]["balanced_accuracy"], "val_avg": report["validation"]["average_accuracy"],
            "avg": report["average_accuracy"], "acc": report["natural_metrics"]["accuracy"],
            "f1": report["uniform_metrics"]["macro_f1"], "bacc": report["uniform_metrics"]["recall"],
            "auc": report["uniform_metrics"]["auc"], "rare1": rec[rare[0]], "rare2": rec[rare[1]],
            "gamma": report.get("gamma"), "rare_names": [report["class_names"][i] for i in rare]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("groups", nargs="+")
    ap.add_argument("--name", default="dafl_summary")
    ns = ap.parse_args()
    out, lines = {}, ["| recipe | runs | val bal. acc | val avg (11) | test avg (11) | accuracy | macro F1 | "
                      "balanced recall | AUC | recall rarest | recall 2nd rarest | γ |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in ns.groups:
        label, _, runs = g.partition("=")
        rows = [row(json.loads((Path(r) / "report.json").read_text())) for r in runs.split(",")
                if (Path(r) / "report.json").is_file()]
        if not rows:
            continue
        out[label] = {"runs": runs.split(","), "rows": rows}
        col = {k: [r[k] for r in rows] for k in rows[0] if k != "rare_names"}
        lines.append(f"| {label} | {len(rows)} | {ms(col['val_bacc'])} | {ms(col['val_avg'])} | {ms(col['avg'])} | "
                     f"{ms(col['acc'])} | {ms(col['f1'])} | {ms(col['bacc'])} | {ms(col['auc'])} | "
                     f"{ms(col['rare1'])} ({rows[0]['rare_names'][0]}) | {ms(col['rare2'])} ({rows[0]['rare_names'][1]}) | "
                     f"{ms(col['gamma'], 1.0)} |")
    res = REPO / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"{ns.name}.json").write_text(json.dumps(out, indent=1))
    (res / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
