"""How long prior estimation takes: EM (tafl.prior.em_prior) over N calibrated posteriors of C classes, maximum
likelihood and smoothed (the Dirichlet prior toward the uniform mix that training chooses, here 400 pseudo-images),
side by side in one run.

    python benchmarks/prior_bench.py

Posteriors are drawn like a 7-class model's (peaked Dirichlet rows mixed under a shifted prior), so EM
runs the iterations it needs on real outputs. Target (issue 13): 512 vectors of 7 classes in under 5 ms.
Writes benchmarks/results/prior_bench.{json,md}; the median of 200 calls per size.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.prior import PriorEstimator, em_prior  # noqa: E402


def posteriors(n: int, C: int, rng: np.random.Generator) -> np.ndarray:
    y = rng.choice(C, n, p=np.arange(1, C + 1) / np.arange(1, C + 1).sum())
    alpha = np.full((n, C), 0.4)
    alpha[np.arange(n), y] = 3.0
    return np.array([rng.dirichlet(a) for a in alpha])


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for n, C in ((100, 7), (512, 7), (500, 7), (2000, 7), (512, 2), (512, 10)):
        P = posteriors(n, C, rng)
        src = np.full(C, 1.0 / C)
        smooth = PriorEstimator(400.0, "uniform")
        for name, fn in (("maximum likelihood", lambda: em_prior(P, src)), ("smoothed 400", lambda: smooth.estimate(P, src))):
            est = fn()
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            rows.append({"estimator": name, "n": n, "classes": C, "median_ms": 1000 * statistics.median(times),
                         "p90_ms": 1000 * sorted(times)[int(0.9 * len(times))], "iterations": est.iterations,
                         "converged": est.converged})
    out = REPO / "benchmarks" / "results"
    (out / "prior_bench.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))
    lines = ["# EM prior estimation time", "", f"`python benchmarks/prior_bench.py` on {time.strftime('%Y-%m-%d')}, "
             "median of 200 calls (tolerance 1e-6, cap 200 iterations). Target: 512 × 7 under 5 ms.", "",
             "| estimator | images | classes | median ms | p90 ms | iterations | converged |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['estimator']} | {r['n']} | {r['classes']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | "
              f"{r['iterations']} | {r['converged']} |" for r in rows]
    (out / "prior_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
