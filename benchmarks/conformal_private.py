"""Where a private run's prediction sets can be calibrated (issue 54): the sites' held-out histograms released with
Gaussian noise (each site adds all of it, or, under SecAgg+, the noise of one release split over the sum), against
the server's validation split (the coordinator's own images: no budget), and site-aware thresholds (each site's own
held-out rows) against the federation's, measured on trained runs.

    python benchmarks/conformal_private.py [--runs domain_gtafl_derma domain_gtafl_sites] [--seeds 1 2 3]

The runs and the held-out rows are benchmarks/conformal_offline.py's (the recommended GTAFL configuration, 10 % of
every client's rows held out). Noise: z_s per bin of a site's histogram (a record moves one count of one bin:
sensitivity 1), at z_s = 0.9 (what the accountant gives lda's two releases at ε = 8, δ = 1e-5) and 5.1 (GTAFL's
statistics releases at ε = 8 with DP-SGD: z = 1.7 at dp_stats_ratio 3; docs/results.md, "Privacy"); a sets release
would add one more release to the plan, raising both a little. Thresholds from the noisy sum by
tafl.conformal.noisy_threshold (at least the noiseless one unless a draw passes 2 σ), on coarser grids, whose
cumulative noise is smaller. Five noise draws per seed. Nothing is chosen on test images.

Writes benchmarks/results/conformal_private.json and .md (mean ± sd over seeds; every seed in the JSON).
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

from conformal_offline import calibrated  # noqa: E402

from tafl import conformal  # noqa: E402

NOISE = (0.9, 5.1)
GRIDS = (20, 50, 200)
DRAWS = 5


def summary(sets: np.ndarray, y: np.ndarray, ranks: np.ndarray, sites: np.ndarray | None,
            site_names: list[str]) -> dict:
    from tafl.training.longtail import DISTRIBUTIONS, distribution_prior

    C = sets.shape[1]
    hit, size = sets[np.arange(len(y)), y], sets.sum(axis=1)
    cov_c = np.array([hit[y == c].mean() if (y == c).any() else np.nan for c in range(C)])
    size_c = np.array([size[y == c].mean() if (y == c).any() else np.nan for c in range(C)])
    present = ~np.isnan(cov_c)
    mixes = []
    for _, kind, imf in DISTRIBUTIONS:
        prior = distribution_prior(ranks, kind, imf) * present
        mixes.append(float(np.nansum(prior / prior.sum() * cov_c)))
    uni = distribution_prior(ranks, "uniform", 1.0) * present
    out = {"coverage": float(hit.mean()), "lowest_mix": min(mixes),
           "uniform_size": float(np.nansum(uni / uni.sum() * size_c)),
           "lowest_class_30": float(min(cov_c[c] for c in range(C) if (y == c).sum() >= 30))}
    if sites is not None:
        out["sites"] = {n: float(hit[sites == k].mean()) for k, n in enumerate(site_names) if (sites == k).any()}
    return out


def measure(d: dict, alpha: float, rng: np.random.Generator) -> dict:
    C = len(d["class_names"])
    y_cal, cl = d["cal_labels"], d["cal_client"]
    K = int(cl.max()) + 1
    s_cal = conformal.true_class_scores(d["cal_probs"], y_cal)
    s_test = conformal.nonconformity(d["test_probs"])
    y, ranks = d["test_labels"], d["ranks"]
    sites, names = d["test_sites"], d["site_names"]

    def result(thr) -> dict:
        return summary(s_test <= thr, y, ranks, sites, names)

    out: dict = {"clients": K, "calibration_images": int(len(y_cal)),
                 "validation_images": int(len(d["val_labels"])),
                 "federated": result(conformal.class_thresholds(conformal.histograms(s_cal, y_cal, C), alpha)),
                 "validation": result(conformal.class_thresholds(conformal.histograms(
                     conformal.true_class_scores(d["val_probs"], d["val_labels"]), d["val_labels"], C), alpha))}
    val_hist = conformal.histograms(conformal.true_class_scores(d["val_probs"], d["val_labels"]), d["val_labels"], C)
    out["held_out_plus_validation"] = result(conformal.class_thresholds(
        conformal.histograms(s_cal, y_cal, C) + val_hist, alpha))
    for z in NOISE:
        for grid in GRIDS:
            per_client = [conformal.histograms(s_cal[cl == k], y_cal[cl == k], C, grid) for k in range(K)]
            for mode, sigma in (("each_site", z * np.sqrt(K)), ("secagg", z)):
                draws = []
                for _ in range(DRAWS):
                    noisy = sum(h + rng.normal(0, sigma / np.sqrt(K), h.shape) for h in per_client)
                    thr = np.array([conformal.noisy_threshold(noisy[c], alpha, sigma) for c in range(C)])
                    draws.append(result(thr))
                out[f"dp_z{z}_g{grid}_{mode}"] = {k: float(np.mean([r[k] for r in draws]))
                                                  for k in ("coverage", "lowest_mix", "uniform_size", "lowest_class_30")}
    if sites is not None and d["cal_site"] is not None:  # each site's own held-out rows set its thresholds
        own = {k: conformal.class_thresholds(conformal.histograms(s_cal[d["cal_site"] == k], y_cal[d["cal_site"] == k],
                                                                   C), alpha) for k in range(len(names))}
        thr = np.stack([own[int(s)] for s in sites])
        sets = s_test <= thr
        hit = sets[np.arange(len(y)), y]
        out["site_aware"] = {"sites": {n: float(hit[sites == k].mean()) for k, n in enumerate(names)},
                             "site_size": {n: float(sets[sites == k].sum(axis=1).mean()) for k, n in enumerate(names)},
                             "calibration_per_site": {n: int((d["cal_site"] == k).sum()) for k, n in enumerate(names)}}
        out["federated"]["site_size"] = {n: float((s_test <= conformal.class_thresholds(conformal.histograms(
            s_cal, y_cal, C), alpha))[sites == k].sum(axis=1).mean()) for k, n in enumerate(names)}
    return out


def ms(v: list[float]) -> str:
    return f"{statistics.mean(v):.3f} ± {statistics.stdev(v) if len(v) > 1 else 0.0:.3f}"


def markdown(res: dict) -> str:
    lines = ["# Prediction sets for private runs (issue 54)", "",
             f"α = {res['alpha']}; seeds {res['seeds']}; mean ± sd over seeds ({DRAWS} noise draws each). "
             "federated: the sites' held-out histograms, no noise; validation: the server's validation split; "
             "held_out_plus_validation: both summed; "
             "dp_zZ_gG_each_site: every site adds N(0, Z²) per bin of a G-bin grid; _secagg: the same noise split "
             "over the SecAgg+ sum.", ""]
    for run, by_seed in res["runs"].items():
        seeds = list(by_seed.values())
        first = seeds[0]
        lines += [f"## {run}", "", f"{first['clients']} clients, {first['calibration_images']} held-out images, "
                  f"{first['validation_images']} validation images (seed {res['seeds'][0]})", "",
                  "| calibration | coverage | lowest mix coverage | uniform-mix size | lowest class (≥ 30 test) |",
                  "| --- | --- | --- | --- | --- |"]
        for v in [k for k in first if isinstance(first[k], dict) and "coverage" in first[k]]:
            lines.append(f"| {v} | {ms([s[v]['coverage'] for s in seeds])} | "
                         f"{ms([s[v]['lowest_mix'] for s in seeds])} | {ms([s[v]['uniform_size'] for s in seeds])} | "
                         f"{ms([s[v]['lowest_class_30'] for s in seeds])} |")
        if "site_aware" in first:
            lines += ["", "| site | federated coverage / size | site-aware coverage / size | site's held-out images |",
                      "| --- | --- | --- | --- |"]
            for n in first["site_aware"]["sites"]:
                lines.append(f"| {n} | {ms([s['federated']['sites'][n] for s in seeds])} / "
                             f"{ms([s['federated']['site_size'][n] for s in seeds])} | "
                             f"{ms([s['site_aware']['sites'][n] for s in seeds])} / "
                             f"{ms([s['site_aware']['site_size'][n] for s in seeds])} | "
                             f"{first['site_aware']['calibration_per_site'][n]} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["domain_gtafl_derma", "domain_gtafl_sites"],
                   help="benchmark runs in benchmarks/out without the _sSEED (default: domain_gtafl_derma "
                        "domain_gtafl_sites)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--alpha", type=float, default=0.1, help="miscoverage level α (default: 0.1)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "conformal_private"),
                   help="results path without suffix (default: benchmarks/results/conformal_private)")
    args = p.parse_args()
    res: dict = {"alpha": args.alpha, "seeds": args.seeds, "noise": list(NOISE), "grids": list(GRIDS), "runs": {}}
    for run in args.runs:
        for s in args.seeds:
            d = calibrated(REPO / "benchmarks" / "out" / f"{run}_s{s}")
            res["runs"].setdefault(run, {})[s] = measure(d, args.alpha, np.random.default_rng(s))
            print(f"{run}_s{s}: done", flush=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(res))
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
