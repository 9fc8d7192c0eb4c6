"""The four-site HAM10000 table (issue 33) from benchmarks/out/sites_<row>_s<seed>/report.json.

    python benchmarks/sites_summary.py [--baseline fedavg_la]

Per row (mean ± sd over its seeds): the validation figures a choice may rest on (balanced accuracy of the
pooled validation rows and the per-site adapted accuracy the estimator was chosen by), then the test figures:
pooled balanced accuracy at the model's own rule (FLamby's number), and the mean over sites of each site's
own-mix accuracy at the model's own rule, at the site's own training mix (prior=site), adapted to the mix
estimated from the site's unlabeled test images, and at the site's true mix; then the paired per-seed
differences against the baseline row, and each site's own and adapted accuracy. Writes
benchmarks/results/sites_summary.{json,md} (--name: another name).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ms(xs: list[float]) -> str:
    xs = [100 * x for x in xs]
    if not xs:
        return "—"
    return f"{xs[0]:.1f}" if len(xs) == 1 else f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"


VARYING = ("seed", "data_root", "threads")  # what a reproduction may set differently


def _est(r: dict) -> dict:
    """The run's case-mix estimator record (report.json prior_adaptation.estimator)."""
    return (r.get("prior_adaptation") or {}).get("estimator") or {}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", default="fedavg_la")
    p.add_argument("--name", default="sites_summary", help="writes benchmarks/results/NAME.{json,md}")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    p.add_argument("--recommend", help="the row configs/sites_ham10000.yaml stands for: its runs' config is written "
                                       "to benchmarks/results/sites_recommended.json (tests check the file against it)")
    args = p.parse_args()
    rows: dict[str, dict[int, dict]] = {}
    for f in sorted(Path(args.out).glob("sites_*_s*/report.json")):
        m = re.match(r"sites_(.+)_s(\d+)$", f.parent.name)
        if m:
            rows.setdefault(m.group(1), {})[int(m.group(2))] = json.loads(f.read_text())
    est = {"source": "source prior", "uniform": "uniform mix", "train": "training mix", "site": "site mix"}
    metrics = {
        "val_balanced": lambda r: r["validation"]["balanced_accuracy"],
        "val_site_adapted": lambda r: max(_est(r).get("scores", {}).values(), default=None),
        "pooled_balanced": lambda r: r["pooled_balanced_accuracy"],
        "own": lambda r: r["site_mean"]["own"]["accuracy"],
        "own_balanced": lambda r: r["site_mean"]["own"]["balanced_accuracy"],
        "site": lambda r: r["site_mean"]["site"]["accuracy"],
        "site_balanced": lambda r: r["site_mean"]["site"]["balanced_accuracy"],
        "adapted": lambda r: r["site_mean"]["adapted"]["accuracy"],
        "adapted_balanced": lambda r: r["site_mean"]["adapted"]["balanced_accuracy"],
        "oracle": lambda r: r["site_mean"]["oracle"]["accuracy"],
        "minutes": lambda r: sum(h["seconds"] for h in r["history"]) / 60 / 100,  # ms() multiplies by 100
    }
    table = {}
    for name, runs in rows.items():
        table[name] = {"seeds": sorted(runs)}
        for k, get in metrics.items():
            vals = []
            for s in sorted(runs):
                try:
                    v = get(runs[s])
                except (KeyError, TypeError):
                    v = None
                if v is not None:
                    vals.append(float(v))
            table[name][k] = vals
        table[name]["estimator"] = sorted({f"{est.get(_est(r).get('center'), '?')} {_est(r).get('pseudo_count', 0):g}"
                                           for r in runs.values() if _est(r)})
        table[name]["tau"] = [((r.get("decision") or {}).get("tau")) for _, r in sorted(runs.items())]
    lines = ["# Four-site HAM10000 (Fed-ISIC2019 split): per-site evaluation", "",
             "configs/sites_ham10000.yaml (ResNet-8 ×0.25, 32 px, 4 sites every round, 1 local epoch, 20 rounds); "
             "`benchmarks/sites_ham10000.sh`. Mean ± sd over the seeds. Validation columns may choose; test "
             "columns only report.", "",
             "| row | seeds | val bal. acc | val site-adapted acc | **pooled bal. acc** | site mean: own acc | "
             "own bal. | site-mix acc | site-mix bal. | adapted acc | adapted bal. | oracle acc | training min | τ | estimator |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in table.items():
        lines.append(f"| {name} | {', '.join(map(str, t['seeds']))} | {ms(t['val_balanced'])} | "
                     f"{ms(t['val_site_adapted'])} | **{ms(t['pooled_balanced'])}** | {ms(t['own'])} | "
                     f"{ms(t['own_balanced'])} | {ms(t['site'])} | {ms(t['site_balanced'])} | {ms(t['adapted'])} | "
                     f"{ms(t['adapted_balanced'])} | {ms(t['oracle'])} | "
                     f"{ms(t['minutes'])} | {', '.join('—' if x is None else f'{x:g}' for x in t['tau'])} | "
                     f"{'; '.join(t['estimator'])} |")
    base = rows.get(args.baseline)
    if base:
        lines += ["", f"Paired per seed against {args.baseline} (points; a difference inside the spread is none):", "",
                  "| row | pooled bal. acc | site mean own acc | site mean site-mix acc | site mean adapted acc |",
                  "|---|---|---|---|---|"]
        for name, runs in rows.items():
            if name == args.baseline:
                continue
            common = sorted(set(runs) & set(base))
            cells = []
            for k in ("pooled_balanced", "own", "site", "adapted"):
                try:
                    d = [100 * (metrics[k](runs[s]) - metrics[k](base[s])) for s in common]
                except KeyError:  # runs evaluated before the site rule existed
                    d = []
                cells.append(", ".join(f"{x:+.1f}" for x in d) or "—")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    sites = sorted({s for runs in rows.values() for r in runs.values() for s in r.get("sites", {})})
    lines += ["", "Each site's own test images: own rule / adapted accuracy (mean over seeds):", "",
              "| row | " + " | ".join(sites) + " |", "|---|" + "---|" * len(sites)]
    for name, runs in rows.items():
        cells = []
        for s in sites:
            own = [r["sites"][s]["own"]["accuracy"] for r in runs.values() if s in r.get("sites", {})]
            ad = [r["sites"][s]["adapted"]["accuracy"] for r in runs.values() if s in r.get("sites", {})]
            cells.append(f"{100 * statistics.mean(own):.1f} / {100 * statistics.mean(ad):.1f}" if own else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    res = REPO / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    if args.recommend:
        runs = rows[args.recommend]
        cfgs = [{k: v for k, v in r["config"].items() if k not in VARYING} for r in runs.values()]
        if any(c != cfgs[0] for c in cfgs):
            raise SystemExit(f"the {args.recommend} runs differ in more than {VARYING}")
        (res / "sites_recommended.json").write_text(json.dumps({"row": args.recommend, "seeds": sorted(runs),
                                                                 "config": cfgs[0]}, indent=2, sort_keys=True))
    (res / f"{args.name}.json").write_text(json.dumps(table, indent=2))
    (res / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
