"""How finely the test split can measure issue 13's oracle gap, and how sure each measured gap is.

    python benchmarks/prior_gap_resolution.py RUN [RUN ...] [--data-root DIR] [--boot 500]
                                              [--name prior_gap_resolution]

The prior-weighted accuracy of a distribution is Σ_c π_c·acc_c over the test split's images of each class, so one
image of class c moves it by π_c / (test images of c). On a rare-heavy mix the rarest training class carries half
the weight and has a couple of dozen test images: that is the smallest gap the split can show (`one image`).

For each run, as the product ships it (the run's federated calibration and the estimator its training chose on
validation, from the checkpoint), per distribution: the gap oracle − adapted at the largest n and its paired
bootstrap interval (5th–95th percentile) over the test images, resampled within each class, as the test report
computes them (`adaptation_accuracies(..., boot=B)`), with `--boot` replicates. Diagnostic only: nothing is chosen.
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

from prior_offline import run_outputs, write_results  # noqa: E402

from tafl.prior import Calibration, PriorEstimator  # noqa: E402
from tafl.training.longtail import DISTRIBUTIONS  # noqa: E402
from tafl.training.simulator import adaptation_accuracies  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--data-root", default=None)
    p.add_argument("--boot", type=int, default=500)
    p.add_argument("--name", default="prior_gap_resolution")
    a = p.parse_args()
    t0 = time.perf_counter()
    per_run = []
    for run in a.runs:
        ck, cfg, ds, method, state, _, z = run_outputs(run, a.data_root, ("test",))
        ranks = np.asarray(ck["class_ranks"])
        C = len(ck["class_names"])
        n, draws, seed = cfg.adapt_size_list()[-1], cfg.adapt_draws, cfg.test_seed
        cal = Calibration.from_dict(state.meta.get("calibration"), C)
        src = cal.source_prior
        est = PriorEstimator.from_dict(state.meta.get("prior_estimator"))
        probs = cal.probs(z["test"])
        dists = adaptation_accuracies(probs, ds.test.labels, ranks, src, [n], draws, seed, boot=a.boot,
                                      estimate=lambda p, est=est, src=src: est.estimate(p, src).prior)["distributions"]
        res = {k: {**d["gap"], "gap": d["gap"]["value"], "one_image": d["one_image"]} for k, d in dists.items()}
        per_run.append({"run": str(run), "estimator": est.to_dict().get("pseudo_count"), "distributions": res})
        print(run, {k: f"{100 * v['gap']:.2f} [{100 * v['lo']:.2f}, {100 * v['hi']:.2f}]" for k, v in res.items()},
              flush=True)

    names = [d[0] for d in DISTRIBUTIONS]
    lines = [f"# {a.name}", "", f"`python benchmarks/prior_gap_resolution.py {' '.join(a.runs)}` — test split; per "
             "distribution, the gap oracle − adapted (points, n = 500, the run's federated calibration and its "
             "validation-chosen estimator) with a paired bootstrap 90 % interval over the test images "
             f"({a.boot} replicates, resampled within each class); `one image`: the most one test image can move the "
             "distribution's prior-weighted accuracy. Diagnostic only.", "",
             "| distribution | one image | " + " | ".join(Path(r["run"]).name for r in per_run) + " | mean |",
             "|---|---|" + "---|" * (len(per_run) + 1)]
    for nm in names:
        cells = [f"{100 * r['distributions'][nm]['gap']:.2f} [{100 * r['distributions'][nm]['lo']:.2f}, "
                 f"{100 * r['distributions'][nm]['hi']:.2f}]" for r in per_run]
        mean = statistics.mean(100 * r["distributions"][nm]["gap"] for r in per_run)
        lines.append(f"| {nm} | {100 * per_run[0]['distributions'][nm]['one_image']:.2f} | " + " | ".join(cells)
                     + f" | {mean:.2f} |")
    worst = [max(r["distributions"].values(), key=lambda v: v["gap"]) for r in per_run]
    lines += ["", "Largest gap per run, and whether its interval reaches 2: " + "; ".join(
        f"{Path(r['run']).name} {100 * w['gap']:.2f} [{100 * w['lo']:.2f}, {100 * w['hi']:.2f}] "
        f"({'reaches' if w['lo'] <= 0.02 else 'above'})" for r, w in zip(per_run, worst)), ""]
    write_results(a.name, {"runs": a.runs, "per_run": per_run, "seconds": time.perf_counter() - t0}, lines)


if __name__ == "__main__":
    main()
