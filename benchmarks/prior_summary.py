"""What prior-aware inference buys in trained runs, as their own report.json records it (the calibration the run
fitted, federatedly on the clients' held-out rows, or none): mean ± sd over the runs of the eleven-distribution
mean of the plain rule, the rule adapted to EM's estimate from n unlabeled test images, and the oracle rule.

    python benchmarks/prior_summary.py RUN [RUN ...] [--name prior_summary]

Writes benchmarks/results/<name>.{json,md}. Per run also the issue-13 checks: the largest oracle − EM 500 gap over
the eleven distributions, what EM 500 loses to the plain rule on the uniform and the training-like (forward50)
distributions, what EM at n = 100 gains on backward50, and the package's validation check (tafl.prior.adaptive_check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.prior import adaptive_check, validation_average  # noqa: E402


def one(run: Path) -> dict:
    r = json.loads((run / "report.json").read_text())
    pa = r["prior_adaptation"]
    dist = r["test_distributions"]
    sizes = [str(n) for n in pa["sizes"]]
    big, small = sizes[-1], sizes[0]
    plain = {k: d["accuracy"] for k, d in dist.items()}
    em = {k: d["adaptive"][big]["accuracy"] for k, d in dist.items()}
    gaps = {k: d["oracle"] - em[k] for k, d in dist.items()}
    check = adaptive_check(validation_average(r)) or {}
    return {"run": str(run), "calibration": pa["calibration"]["kind"],
            "temperature": pa["calibration"].get("temperature"),
            "plain": r["average_accuracy"], "calibrated": pa["test"]["average"]["calibrated"],
            f"em_{small}": pa["test"]["average"][f"adaptive_{small}"], f"em_{big}": pa["test"]["average"][f"adaptive_{big}"],
            "oracle": pa["test"]["average"]["oracle"], f"tv_{big}": pa["test"]["average"][f"tv_{big}"],
            "max_gap": max(gaps.values()), "gaps": gaps,
            "uniform_harm": plain["uniform"] - em["uniform"], "forward50_harm": plain["forward50"] - em["forward50"],
            "backward50_small_gain": dist["backward50"]["adaptive"][small]["accuracy"] - plain["backward50"],
            "val_check": check.get("recommended"), "sizes": sizes}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--name", default="prior_summary")
    a = p.parse_args()
    rows = [one(Path(r)) for r in a.runs]
    small, big = rows[0]["sizes"][0], rows[0]["sizes"][-1]
    cols = [("plain", "plain", True), (f"em_{small}", f"EM {small}", True), (f"em_{big}", f"EM {big}", True),
            ("oracle", "oracle", True), (f"tv_{big}", f"TV {big}", False), ("max_gap", "largest gap", True),
            ("uniform_harm", "uniform harm", True), ("forward50_harm", "F50 harm", True),
            ("backward50_small_gain", f"B50 gain at {small}", True)]

    def ms(vals, pct):
        vals = [100 * v if pct else v for v in vals]
        f = "{:.2f}" if pct else "{:.3f}"
        return (f + " ± " + f).format(statistics.mean(vals), statistics.stdev(vals)) if len(vals) > 1 else f.format(vals[0])

    lines = [f"# {a.name}", "", f"`python benchmarks/prior_summary.py {' '.join(a.runs)}` — each run's own report.json "
             "(calibration: " + ", ".join(sorted({r['calibration'] for r in rows})) + "); means of the eleven "
             "prior-weighted accuracies (%), mean ± sd over the runs. `harm`: plain − EM on that distribution; "
             "`gain`: EM − plain.", "", "| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols),
             "| " + " | ".join(ms([r[k] for r in rows], pct) for k, _, pct in cols) + " |", "", "Per run:", ""]
    for r in rows:
        lines.append(f"- {r['run']}: " + ", ".join(f"{lab} {100 * r[k]:.2f}" if pct else f"{lab} {r[k]:.3f}"
                                                    for k, lab, pct in cols) + f"; validation check: {r['val_check']}")
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"runs": a.runs, "rows": rows}, indent=2))
    (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
