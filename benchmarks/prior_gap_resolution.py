"""How finely the test split can measure issue 13's oracle gap, and how sure each measured gap is.

    python benchmarks/prior_gap_resolution.py RUN [RUN ...] [--data-root DIR] [--boot 500]
                                              [--name prior_gap_resolution]

The prior-weighted accuracy of a distribution is Σ_c π_c·acc_c over the test split's images of each class, so one
image of class c moves it by π_c / (test images of c). On a rare-heavy mix the rarest training class carries half
the weight and has a couple of dozen test images: that is the smallest gap the split can show (`one image`).

For each run, as the product ships it (the run's federated calibration and the estimator its training chose on
validation, from the checkpoint), per distribution: the gap oracle − adapted at the largest n (mean over the
protocol's draws, exactly `adaptation_accuracies`), and a paired bootstrap interval (5th–95th percentile) over the
test images, resampled within each class: the same images score the adapted and the oracle rules, so the interval
is how sure the split is of their difference, not of either accuracy. Diagnostic only: nothing is chosen.
Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from prior_offline import open_run  # noqa: E402

from tafl.prior import Calibration, PriorEstimator, adapt  # noqa: E402
from tafl.training.evaluate import predict  # noqa: E402
from tafl.training.longtail import DISTRIBUTIONS, distribution_prior  # noqa: E402


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
        ck, cfg, ds, method, state = open_run(run, a.data_root)
        ranks = np.asarray(ck["class_ranks"])
        C = len(ck["class_names"])
        n, draws, seed = cfg.adapt_size_list()[-1], cfg.adapt_draws, cfg.test_seed
        cal = Calibration.from_dict(state.meta.get("calibration"), C)
        src = cal.source_prior
        est = PriorEstimator.from_dict(state.meta.get("prior_estimator"))
        out = predict(method.inference_model(state), ds.test.images, method.normalize, 256, keys=method.output_keys)
        probs, y = cal.probs(method.posterior_logits(out)), ds.test.labels
        rows = [np.flatnonzero(y == c) for c in range(C)]
        counts = np.array([len(r) for r in rows])
        rng_boot = np.random.default_rng([int(cfg.seed), 991])
        # one resampling of the test images per bootstrap replicate, shared by every distribution
        boots = [np.concatenate([rng_boot.choice(r, len(r), replace=True) for r in rows]) for _ in range(a.boot)]
        res = {}
        for i, (name, kind, imf) in enumerate(DISTRIBUTIONS):
            prior = distribution_prior(ranks, kind, imf)
            target = np.where(counts > 0, prior, 0.0)
            target /= target.sum()
            oracle_ok = adapt(probs, src, target).argmax(1) == y
            adapted_ok = []
            for k in range(draws):  # the protocol's draws (simulator.adaptation_accuracies)
                rng = np.random.default_rng([seed, 313, i, n, k])
                per_class = rng.multinomial(n, target)
                idx = np.concatenate([rng.choice(rows[c], m, replace=True) for c, m in enumerate(per_class) if m])
                q = est.estimate(probs[idx], src).prior
                adapted_ok.append(adapt(probs, src, q).argmax(1) == y)
            adapted_ok = np.mean(adapted_ok, axis=0)  # per image: the share of draws that got it right

            diff = oracle_ok - adapted_ok  # per image: the oracle right minus the draws' share right

            def gap(sel: np.ndarray, diff=diff, target=target) -> float:
                per_class = np.bincount(y[sel], weights=diff[sel], minlength=C) / np.maximum(
                    np.bincount(y[sel], minlength=C), 1)
                return float((target * per_class).sum())

            g = gap(np.arange(len(y)))
            bs = np.array([gap(b) for b in boots])
            res[name] = {"gap": g, "lo": float(np.percentile(bs, 5)), "hi": float(np.percentile(bs, 95)),
                         "one_image": float((target / np.maximum(counts, 1)).max())}
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
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"runs": a.runs, "per_run": per_run,
                                                   "seconds": time.perf_counter() - t0}, indent=2))
    (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
