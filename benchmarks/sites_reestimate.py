"""Choose a finished site run's case-mix estimator again with the current code, and redo its per-site figures.

    python benchmarks/sites_reestimate.py RUN [RUN ...]

The estimator is chosen after training, on validation (`choose_prior_estimator`), so a run trained before the
estimator's choice changed can be brought up to date without training again. For each run folder: the same
function training runs, on the run's validation split; then the product's own evaluation of the checkpoint
(`evaluate_checkpoint`). RUN/final.pt gets the new estimator record; RUN/report.json keeps its training history
and timing and takes the new prior_adaptation, sites, site_mean and pooled figures (the old file is kept as
report.before.json). Nothing is chosen on test.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from prior_offline import open_run  # noqa: E402  (benchmarks/)
from tafl.training.checkpoint import save_checkpoint  # noqa: E402
from tafl.training.contract import GlobalState  # noqa: E402
from tafl.training.report import write_json  # noqa: E402
from tafl.training.simulator import choose_prior_estimator, evaluate_checkpoint  # noqa: E402

KEYS = ("prior_adaptation", "sites", "site_mean", "sites_without_test", "pooled_balanced_accuracy")


def main() -> int:
    import numpy as np

    for run in map(Path, sys.argv[1:]):
        t0 = time.perf_counter()
        ck, cfg, ds, method, state = open_run(run)
        state = GlobalState(state.weights, state.extras,
                            {k: v for k, v in state.meta.items() if k != "prior_estimator"})
        state = choose_prior_estimator(method, state, ds, cfg, np.asarray(ck["class_ranks"]))
        ck = dict(ck, state=state.to_dict())
        report, _ = evaluate_checkpoint(ck, ds, method=method)
        old = json.loads((run / "report.json").read_text())
        if not (run / "report.before.json").exists():
            shutil.copy(run / "report.json", run / "report.before.json")
        write_json(run / "report.json", {**old, **{k: report[k] for k in KEYS if k in report}})
        save_checkpoint(ck, run / "final.pt")
        est = state.meta["prior_estimator"]
        print(f"{run}: {est['center']} {est['pseudo_count']:g}; site mean own "
              f"{100 * report['site_mean']['own']['accuracy']:.1f}, adapted "
              f"{100 * report['site_mean']['adapted']['accuracy']:.1f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
