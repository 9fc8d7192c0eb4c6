"""Class-conditional conformal sets measured offline on trained runs (issue 54), before they are wired into training:
what the score, the grid and the calibration rows give on the eleven test mixes, per class and per site.

    python benchmarks/conformal_offline.py [--runs domain_gtafl_derma domain_gtafl_sites] [--seeds 1 2 3]
        [--alpha 0.1]

Each run is a benchmark run in benchmarks/out/ (RUN_sSEED, from benchmarks/domain_detection.py: the recommended
GTAFL configuration with its federated vector calibration on 10 % of every client's rows held out of training). The
calibration rows are exactly those held-out rows, each client's on its own; their calibrated posteriors (the
model's posterior under its source prior, the calibration the run fitted) give the scores. Per client a histogram
per class on tafl.conformal's grid; their sum gives the federated thresholds (what a statistics round would
compute, no privacy yet); beside them the marginal variant (one threshold) and the central ceiling (the exact
pooled quantile). Scores: 1 − p (LAC, tafl.conformal) and, for comparison, APS (the posterior mass of every class
at least as likely as the candidate, Romano et al. 2020, not randomised). Two more LAC rows take the server's
validation split, which no calibration was fitted on: pooled with the held-out rows (`lac_pooled`, what training
ships by default: `conformal_rows: pooled`) and alone (`lac_validation`). Nothing is chosen on test images.

On the test split: per class coverage and mean set size; per mix of the eleven, the prior-weighted coverage
Σ_c π(c)·coverage_c and set size (as the report weights accuracy); per site where the data have sites.
Writes benchmarks/results/conformal_offline.json and .md (mean ± sd over seeds, every seed in the JSON).
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

from tafl import conformal  # noqa: E402


def aps_scores(probs: np.ndarray) -> np.ndarray:
    """(N, C) APS scores: for each candidate c, the mass of every class with p ≥ p_c (c included)."""
    p = np.asarray(probs, np.float64)
    return (p[:, None, :] * (p[:, None, :] >= p[:, :, None])).sum(axis=2)


def calibrated(run: Path) -> dict:
    """The run's calibrated posteriors on every client's held-out rows (with the client) and on the test split."""
    import torch

    from tafl.imaging import Preprocess
    from tafl.prior import Calibration
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.contract import GlobalState
    from tafl.training.evaluate import predict
    from tafl.training.models import ModelConfig
    from tafl.training.prepare import make_method, prepare

    torch.set_num_threads(2)
    ck = load_checkpoint(run / "final.pt")
    cfg = RunConfig.from_dict(ck["run_config"], "checkpoint run_config")
    prep = prepare(cfg)
    ds = prep.dataset
    method = make_method(cfg, ModelConfig.from_dict(ck["model_config"]), Preprocess.from_dict(ck["preprocess"]))
    state = GlobalState.from_dict(ck["state"])
    C = len(ds.class_names)
    calib = Calibration.from_dict(state.meta.get("calibration"), C)
    module = method.inference_model(state)

    def probs(images: np.ndarray) -> np.ndarray:
        if not len(images):
            return np.zeros((0, C))
        out = predict(module, images, method.normalize, cfg.eval_batch_size, keys=method.output_keys)
        return calib.probs(method.posterior_logits(out))

    rows = [np.asarray(h, np.int64) for h in prep.holdouts] or [np.zeros(0, np.int64)]  # none: calib_holdout 0
    client = np.concatenate([np.full(len(r), k) for k, r in enumerate(rows)])
    idx = np.concatenate(rows)
    return {"cal_probs": probs(prep.train.images[idx]), "cal_labels": prep.train.labels[idx], "cal_client": client,
            "cal_site": None if prep.train.sites is None else np.asarray(prep.train.sites)[idx],
            "val_probs": probs(ds.val.images), "val_labels": ds.val.labels,
            "val_sites": None if getattr(ds.val, "sites", None) is None else np.asarray(ds.val.sites),
            "test_probs": probs(ds.test.images), "test_labels": ds.test.labels,
            "test_sites": None if ds.test.sites is None else np.asarray(ds.test.sites),
            "site_names": list(ds.site_names or []), "class_names": list(ds.class_names),
            "ranks": np.asarray(ck["class_ranks"])}


def measure(d: dict, alpha: float) -> dict:
    from tafl.training.sets import by_class_and_mix

    C = len(d["class_names"])
    y_cal, y = d["cal_labels"], d["test_labels"]
    out: dict = {"calibration_images": int(len(y_cal)),
                 "calibration_per_class": np.bincount(y_cal, minlength=C).tolist(),
                 "clients": int(d["cal_client"].max() + 1) if len(y_cal) else 0}
    variants = {}
    for score_name, score in (("lac", conformal.nonconformity), ("aps", aps_scores)):
        s_cal = score(d["cal_probs"])[np.arange(len(y_cal)), y_cal]
        hists = sum(conformal.histograms(s_cal[d["cal_client"] == k], y_cal[d["cal_client"] == k], C)
                    for k in range(out["clients"]))
        s_test = score(d["test_probs"])
        variants[f"{score_name}_federated"] = s_test <= conformal.class_thresholds(hists, alpha)
        variants[f"{score_name}_marginal"] = s_test <= conformal.marginal_threshold(hists, alpha)
        variants[f"{score_name}_central"] = s_test <= conformal.exact_thresholds(s_cal, y_cal, C, alpha)
        if score_name == "lac":  # the server's validation split: pooled with the held-out rows, and alone
            y_val = d["val_labels"]
            val_hist = conformal.histograms(score(d["val_probs"])[np.arange(len(y_val)), y_val], y_val, C)
            variants["lac_pooled"] = s_test <= conformal.class_thresholds(hists + val_hist, alpha)
            variants["lac_validation"] = s_test <= conformal.class_thresholds(val_hist, alpha)
    for name, sets in variants.items():
        hit = sets[np.arange(len(y)), y]
        size = sets.sum(axis=1)
        cov_c, size_c, mixes = by_class_and_mix(sets, y, d["ranks"])
        rec = {"coverage_all": float(hit.mean()), "size_all": float(size.mean()),
               "empty_share": float((size == 0).mean()),
               "per_class": {d["class_names"][c]: {"coverage": None if np.isnan(cov_c[c]) else float(cov_c[c]),
                                                   "size": None if np.isnan(size_c[c]) else float(size_c[c]),
                                                   "test_images": int((y == c).sum())} for c in range(C)},
               "mixes": mixes, "min_mix_coverage": min(m["coverage"] for m in mixes.values())}
        if d["test_sites"] is not None:
            rec["sites"] = {n: {"coverage": float(hit[d["test_sites"] == k].mean()),
                                "size": float(size[d["test_sites"] == k].mean()),
                                "images": int((d["test_sites"] == k).sum())}
                            for k, n in enumerate(d["site_names"]) if (d["test_sites"] == k).any()}
        out[name] = rec
    return out


def ms(v: list[float]) -> str:
    v = [x for x in v if x is not None]
    return "-" if not v else f"{statistics.mean(v):.3f} ± {statistics.stdev(v) if len(v) > 1 else 0.0:.3f}"


def markdown(res: dict, alpha: float) -> str:
    lines = ["# Conformal sets offline (issue 54)", "",
             f"α = {alpha}; seeds {res['seeds']}; mean ± sd over them. Calibration: every client's held-out rows "
             "(10 %), histograms summed (federated), one threshold (marginal), exact pooled quantile (central); "
             "LAC pooled: the held-out rows' histograms and the validation split's; LAC validation: that split "
             "alone.", ""]
    for run, by_seed in res["runs"].items():
        seeds = list(by_seed.values())
        lines += [f"## {run}", "", f"calibration images per class (seed {res['seeds'][0]}): "
                  f"{seeds[0]['calibration_per_class']}", "",
                  "| variant | coverage (all test) | lowest mix coverage | uniform-mix size | lowest class coverage "
                  "(≥ 30 test images) | empty sets |", "| --- | --- | --- | --- | --- | --- |"]
        for v in [k for k in seeds[0] if isinstance(seeds[0][k], dict) and "coverage_all" in seeds[0][k]]:
            low_class = [min(c["coverage"] for c in s[v]["per_class"].values()
                             if c["coverage"] is not None and c["test_images"] >= 30) for s in seeds]
            lines.append(f"| {v} | {ms([s[v]['coverage_all'] for s in seeds])} | "
                         f"{ms([s[v]['min_mix_coverage'] for s in seeds])} | "
                         f"{ms([s[v]['mixes']['uniform']['size'] for s in seeds])} | {ms(low_class)} | "
                         f"{ms([s[v]['empty_share'] for s in seeds])} |")
        if "sites" in seeds[0]["lac_federated"]:
            lines += ["", "| site | LAC federated coverage | size |", "| --- | --- | --- |"]
            for site in seeds[0]["lac_federated"]["sites"]:
                lines.append(f"| {site} | {ms([s['lac_federated']['sites'][site]['coverage'] for s in seeds])} | "
                             f"{ms([s['lac_federated']['sites'][site]['size'] for s in seeds])} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["domain_gtafl_derma", "domain_gtafl_sites"],
                   help="benchmark runs in benchmarks/out without the _sSEED (default: domain_gtafl_derma "
                        "domain_gtafl_sites)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--alpha", type=float, default=0.1, help="miscoverage level α (default: 0.1)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "conformal_offline"),
                   help="results path without suffix (default: benchmarks/results/conformal_offline)")
    args = p.parse_args()
    res: dict = {"alpha": args.alpha, "seeds": args.seeds, "grid": conformal.GRID, "runs": {}}
    for run in args.runs:
        for s in args.seeds:
            d = calibrated(REPO / "benchmarks" / "out" / f"{run}_s{s}")
            res["runs"].setdefault(run, {})[s] = measure(d, args.alpha)
            print(f"{run}_s{s}: lac federated coverage {res['runs'][run][s]['lac_federated']['coverage_all']:.3f}",
                  flush=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(res, args.alpha))
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
