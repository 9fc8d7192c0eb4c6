"""What the case-mix estimator's smoothing buys: trained runs re-scored with the estimator training now chooses.

    python benchmarks/prior_smoothing_offline.py RUN [RUN ...] [--calibrations run,"vector on validation"]
                                                 [--data-root DIR] [--name prior_smoothing]

For each run's final.pt: one pass over the validation and test splits, the posteriors calibrated as the run's
report calibrates them (`run`: the calibration recorded in the checkpoint, the federated fit on the clients'
held-out rows; `vector on validation`: vector scaling fitted on the validation split, a centralised stand-in whose
smoothing is then chosen on out-of-fold validation posteriors). The smoothing is chosen by the training code's own
`select_prior_smoothing` on the validation split, never on test; then, on the test split, the issue-13 protocol
(`adaptation_accuracies`: n unlabeled images drawn with each of the eleven priors) for the maximum-likelihood EM and
for the chosen estimator, beside the model's own label (`plain`: the operating point) and the oracle. `test grid` is
a diagnostic only: the test split's EM 500 mean for every pseudo-count, to show where the choice landed.
Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from prior_offline import ms, out_of_fold, run_outputs, write_results  # noqa: E402

from tafl.prior import SMOOTHING_GRID, Calibration, PriorEstimator, adaptive_check, fit_calibration  # noqa: E402
from tafl.training.simulator import adaptation_accuracies, select_prior_smoothing  # noqa: E402


def rules(probs, labels, plain, ranks, src, est, sizes, draws, seed) -> dict:
    """The eleven-distribution protocol for one estimator: means and the issue's per-distribution checks."""
    res = adaptation_accuracies(probs, labels, ranks, src, sizes, draws, seed,
                                estimate=lambda p: est.estimate(p, src).prior, plain=plain)
    d, av = res["distributions"], res["average"]
    small, big = str(sizes[0]), str(sizes[-1])
    gaps = {k: v["oracle"] - v["adaptive"][big]["accuracy"] for k, v in d.items()}
    return {"plain": av["plain"], "oracle": av["oracle"], **{f"adaptive_{n}": av[f"adaptive_{n}"] for n in sizes},
            f"tv_{big}": av[f"tv_{big}"], "max_gap": max(gaps.values()), "gaps": gaps,
            "uniform_harm": d["uniform"]["plain"] - d["uniform"]["adaptive"][big]["accuracy"],
            "forward50_harm": d["forward50"]["plain"] - d["forward50"]["adaptive"][big]["accuracy"],
            "backward50_small_gain": d["backward50"]["adaptive"][small]["accuracy"] - d["backward50"]["plain"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--data-root", default=None)
    p.add_argument("--name", default="prior_smoothing")
    p.add_argument("--calibrations", default="run", help="comma-separated: run, vector on validation")
    a = p.parse_args()
    t0 = time.perf_counter()
    rows: dict[str, list[dict]] = {}
    for run in a.runs:
        ck, cfg, ds, method, state, outs, z = run_outputs(run, a.data_root)
        ranks = np.asarray(ck["class_ranks"])
        C = len(ck["class_names"])
        sizes, draws, seed = cfg.adapt_size_list(), cfg.adapt_draws, cfg.test_seed
        for cal_name in [c.strip() for c in a.calibrations.split(",") if c.strip()]:
            if cal_name == "run":
                cal = Calibration.from_dict(state.meta.get("calibration"), C)
                src = cal.source_prior if cal.source_prior is not None else method.default_source_prior(state)
                pv, pv_src = cal.probs(z["val"]), src  # out of sample: the fit never saw the validation split
            elif cal_name == "vector on validation":
                cal = fit_calibration(z["val"], ds.val.labels, "vector")
                src = cal.source_prior
                pv, pv_src = out_of_fold(z["val"], ds.val.labels, "vector", src)
            else:
                raise SystemExit(f"unknown calibration {cal_name!r}")
            chosen = select_prior_smoothing(pv, ds.val.labels, ranks, pv_src, sizes, draws, seed)
            pt = cal.probs(z["test"])
            mle = rules(pt, ds.test.labels, outs["test"]["label"], ranks, src, PriorEstimator(0.0), sizes, draws, seed)
            smooth = rules(pt, ds.test.labels, outs["test"]["label"], ranks, src, chosen, sizes, draws, seed)
            # the package's validation check, on the validation split's means with the chosen estimator
            vres = adaptation_accuracies(pv, ds.val.labels, ranks, pv_src, sizes, draws, seed,
                                         estimate=lambda q, e=chosen, s=pv_src: e.estimate(q, s).prior,
                                         plain=outs["val"]["label"])["average"]
            check = adaptive_check(vres) or {}
            grid = {}
            for alpha in SMOOTHING_GRID:
                e = PriorEstimator(float(alpha))
                grid[f"{alpha:g}"] = adaptation_accuracies(pt, ds.test.labels, ranks, src, [sizes[-1]], draws, seed,
                                                           estimate=lambda q, e=e: e.estimate(q, src).prior
                                                           )["average"][f"adaptive_{sizes[-1]}"]
            rows.setdefault(cal_name, []).append({"run": str(run), "chosen": chosen.to_dict(), "mle": mle,
                                                  "smoothed": smooth, "val_check": check.get("recommended"),
                                                  "test_grid": grid, "sizes": sizes})
            print(f"{run} [{cal_name}]: pseudo-count {chosen.pseudo_count:g}; plain {100 * mle['plain']:.2f}, EM "
                  f"{100 * mle[f'adaptive_{sizes[-1]}']:.2f} -> smoothed {100 * smooth[f'adaptive_{sizes[-1]}']:.2f}, "
                  f"oracle {100 * mle['oracle']:.2f}", flush=True)

    lines = [f"# {a.name}", "", f"`python benchmarks/prior_smoothing_offline.py {' '.join(a.runs)}` — test split, means "
             "of the eleven prior-weighted accuracies (%), mean ± sd over the runs. `plain`: the model's own label (the "
             "operating point). `EM n`: the rule adapted to the maximum-likelihood EM estimate from n unlabeled images; "
             "`smoothed n`: to the estimate of the estimator chosen on validation (EM with a Dirichlet prior of α "
             "pseudo-images toward the uniform mix). `gap`: the largest oracle − smoothed 500 over the eleven; `uni "
             "harm` / `F50 harm`: plain − smoothed 500 on the uniform and the training-like distribution; `B50 100`: "
             "smoothed at n = 100 − plain on backward50; `check`: the package's validation check with the chosen "
             "estimator (runs passing / runs).", ""]
    for cal_name, es in rows.items():
        s, b = es[0]["sizes"][0], es[0]["sizes"][-1]
        g = lambda which, k, pct=True: ms([e[which][k] for e in es], pct)  # noqa: E731
        lines += [f"## calibration: {cal_name}", "",
                  f"| α chosen | plain | EM {s} | EM {b} | smoothed {s} | smoothed {b} | oracle | TV {b}: EM → smoothed | "
                  "gap: EM → smoothed | uni harm: EM → smoothed | F50 harm | B50 100 | check |", "|" + "---|" * 13,
                  f"| {', '.join(format(e['chosen']['pseudo_count'], 'g') for e in es)} | {g('mle', 'plain')} | "
                  f"{g('mle', f'adaptive_{s}')} | {g('mle', f'adaptive_{b}')} | {g('smoothed', f'adaptive_{s}')} | "
                  f"**{g('smoothed', f'adaptive_{b}')}** | {g('mle', 'oracle')} | {g('mle', f'tv_{b}', False)} → "
                  f"{g('smoothed', f'tv_{b}', False)} | {g('mle', 'max_gap')} → {g('smoothed', 'max_gap')} | "
                  f"{g('mle', 'uniform_harm')} → {g('smoothed', 'uniform_harm')} | {g('smoothed', 'forward50_harm')} | "
                  f"{g('smoothed', 'backward50_small_gain')} | {sum(bool(e['val_check']) for e in es)}/{len(es)} |", "",
                  "Per run (smoothed − plain at n = %s; the largest gap's distribution):" % b, ""]
        for e in es:
            sm = e["smoothed"]
            worst = max(sm["gaps"], key=sm["gaps"].get)
            lines.append(f"- {e['run']}: α {e['chosen']['pseudo_count']:g}, smoothed − plain "
                         f"{100 * (sm[f'adaptive_{b}'] - sm['plain']):+.2f}, EM − plain "
                         f"{100 * (e['mle'][f'adaptive_{b}'] - e['mle']['plain']):+.2f}; gap {100 * sm['max_gap']:.2f} "
                         f"({worst}); uniform harm {100 * sm['uniform_harm']:.2f}; validation scores "
                         + ", ".join(f"{k} {100 * v:.2f}" for k, v in e["chosen"]["scores"].items()))
        lines += ["", "Test grid (diagnostic, never a selection): EM %s for each α, mean over the runs: " % b
                  + ", ".join(f"{k} {100 * statistics.mean(e['test_grid'][k] for e in es):.2f}"
                              for k in es[0]["test_grid"]), ""]
    write_results(a.name, {"runs": a.runs, "rows": rows, "seconds": time.perf_counter() - t0}, lines)


if __name__ == "__main__":
    main()
