"""The sets' two guarantees side by side on trained runs (issue 54): coverage ≥ 1 − α on average over the
calibration draw (split conformal, `set_confidence` unset) against coverage ≥ 1 − α with probability ≥ the
confidence over that draw (training-conditional, tafl.conformal.rank).

    python benchmarks/conformal_confidence.py [--runs domain_gtafl_derma domain_gtafl_sites] [--seeds 1 2 3]
        [--alpha 0.1] [--confidence 0.9]

Each run is a benchmark run in benchmarks/out/ (RUN_sSEED, from benchmarks/domain_detection.py). The calibration rows
are those training pools by default (`conformal_rows: pooled`): every client's held-out rows and the server's
validation split, scored on the run's calibrated posteriors, summed as grid histograms; on real sites also each
site's own (its held-out rows and its rows of the validation split); from them both rules' thresholds. Beside them:
the central ceiling (the exact pooled quantile of the same rows' scores, each rule) and the server's validation split
alone (what a run under `--dp-epsilon` calibrates on). Nothing is chosen on test images.

On the test split: the lowest prior-weighted coverage of the eleven mixes, the lowest class coverage among classes
with ≥ 30 test images, the uniform-mix set size; per site, the federation's and the site's own thresholds.
Writes benchmarks/results/conformal_confidence.json and .md (mean ± sd over seeds, every seed in the JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from tafl import conformal  # noqa: E402


def summary(sets: np.ndarray, y: np.ndarray, ranks: np.ndarray, sites: np.ndarray | None,
            site_names: list[str]) -> dict:
    from tafl.training.sets import by_class_and_mix

    C = sets.shape[1]
    hit, size = sets[np.arange(len(y)), y], sets.sum(axis=1)
    cov_c, _, mixes = by_class_and_mix(sets, y, ranks)
    big = [float(cov_c[c]) for c in range(C) if (y == c).sum() >= 30]
    out = {"coverage_all": float(hit.mean()), "lowest_mix": min(m["coverage"] for m in mixes.values()),
           "lowest_class_30": min(big) if big else None, "uniform_size": mixes["uniform"]["size"],
           "always": int((sets.all(axis=0)).sum()), "mixes": mixes}
    if sites is not None:
        out["sites"] = {n: {"coverage": float(hit[sites == k].mean()), "size": float(size[sites == k].mean()),
                            "images": int((sites == k).sum())} for k, n in enumerate(site_names) if (sites == k).any()}
    return out


def measure(run: Path, alpha: float, confidence: float) -> dict:
    from conformal_offline import calibrated

    d = calibrated(run)
    C = len(d["class_names"])
    y, s_test = d["test_labels"], conformal.nonconformity(d["test_probs"])
    cal_y = np.concatenate([d["cal_labels"], d["val_labels"]])
    cal_s = conformal.true_class_scores(np.concatenate([d["cal_probs"], d["val_probs"]]), cal_y)
    n_held = len(d["cal_labels"])
    val_hist = conformal.histograms(cal_s[n_held:], d["val_labels"], C)
    hist = conformal.histograms(cal_s[:n_held], d["cal_labels"], C) + val_hist
    site_hist = None
    if d["cal_site"] is not None and d["val_sites"] is not None:  # each site's held-out and validation rows
        cal_sites = np.concatenate([d["cal_site"], d["val_sites"]])
        site_hist = np.stack([conformal.histograms(cal_s[cal_sites == k], cal_y[cal_sites == k], C)
                              for k in range(len(d["site_names"]))])
    sites = d["test_sites"]
    out: dict = {"calibration_per_class": [int(c) for c in hist.sum(axis=1)],
                 "validation_per_class": [int(c) for c in val_hist.sum(axis=1)]}
    for rule, conf in (("average", None), ("confidence", confidence)):
        rows = {"pooled": s_test <= conformal.class_thresholds(hist, alpha, conf),
                "central": s_test <= conformal.exact_thresholds(cal_s, cal_y, C, alpha, conf),
                "validation": s_test <= conformal.class_thresholds(val_hist, alpha, conf)}
        rec = {k: summary(v, y, d["ranks"], sites, d["site_names"]) for k, v in rows.items()}
        if site_hist is not None and sites is not None:  # each test image under its own site's thresholds
            own = np.stack([conformal.class_thresholds(site_hist[k], alpha, conf) for k in range(len(site_hist))])
            rec["site_aware"] = summary(s_test <= own[sites], y, d["ranks"], sites, d["site_names"])
        out[rule] = rec
    return out


def ms(v: list) -> str:
    v = [x for x in v if x is not None]
    return "-" if not v else f"{statistics.mean(v):.3f} ± {statistics.stdev(v) if len(v) > 1 else 0.0:.3f}"


def markdown(res: dict) -> str:
    lines = ["# The sets' two guarantees (issue 54)", "",
             f"α = {res['alpha']}, confidence {res['confidence']}; seeds {res['seeds']}; mean ± sd over them "
             "(each seed in brackets). *average*: coverage ≥ 1 − α on average over the calibration draw; "
             "*confidence*: with that probability over it. pooled: the checkpoint's histograms (held-out rows and "
             "validation split, what training ships); central: the exact quantile of the same rows; validation: "
             "the validation split alone (a DP run's rows).", ""]
    for run, by_seed in res["runs"].items():
        seeds = list(by_seed.values())
        lines += [f"## {run}", "", "| rule | rows | lowest mix | lowest class ≥ 30 | uniform-mix size | "
                  "always in set |", "| --- | --- | --- | --- | --- | --- |"]
        for rule in ("average", "confidence"):
            for rows in ("pooled", "central", "validation"):
                r = [s[rule][rows] for s in seeds]
                each = ", ".join(f"{x['lowest_mix']:.3f}" for x in r)
                lines.append(f"| {rule} | {rows} | {ms([x['lowest_mix'] for x in r])} [{each}] | "
                             f"{ms([x['lowest_class_30'] for x in r])} | {ms([x['uniform_size'] for x in r])} | "
                             f"{ms([x['always'] for x in r])} |")
        if "site_aware" in seeds[0]["average"]:
            lines += ["", "| site | rule | federation: coverage / size | the site's own: coverage [each seed] / size |",
                      "| --- | --- | --- | --- |"]
            for site in seeds[0]["average"]["site_aware"]["sites"]:
                for rule in ("average", "confidence"):
                    fed = [s[rule]["pooled"]["sites"][site] for s in seeds]
                    own = [s[rule]["site_aware"]["sites"][site] for s in seeds]
                    each = ", ".join(f"{x['coverage']:.3f}" for x in own)
                    lines.append(f"| {site} | {rule} | {ms([x['coverage'] for x in fed])} / "
                                 f"{ms([x['size'] for x in fed])} | {ms([x['coverage'] for x in own])} "
                                 f"[{each}] / "
                                 f"{ms([x['size'] for x in own])} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    from trained_run import benchmark_runs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["domain_gtafl_derma", "domain_gtafl_sites"],
                   help="benchmark runs in benchmarks/out without the _sSEED (default: domain_gtafl_derma "
                        "domain_gtafl_sites)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--alpha", type=float, default=0.1, help="miscoverage level α (default: 0.1)")
    p.add_argument("--confidence", type=float, default=0.9,
                   help="the training-conditional rule's confidence 1 − δ (default: 0.9)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "conformal_confidence"),
                   help="results path without suffix (default: benchmarks/results/conformal_confidence)")
    args = p.parse_args()
    res: dict = {"alpha": args.alpha, "confidence": args.confidence, "seeds": args.seeds, "runs": {}}
    for row, seed, run in benchmark_runs(args.runs, args.seeds):
        res["runs"].setdefault(row, {})[seed] = m = measure(run, args.alpha, args.confidence)
        print(f"{run.name}: lowest mix {m['average']['pooled']['lowest_mix']:.3f} (average) "
              f"{m['confidence']['pooled']['lowest_mix']:.3f} (confidence)", flush=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(res))
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
