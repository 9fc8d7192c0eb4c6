"""The calibration check's margin on trained runs (issue 56): each validation row's NLL under the fitted calibration
and under the model's own posteriors (both moved to the validation rows' mix, as `tafl.training.calibrate` compares
them), the mean change with its standard error and one-sided 95 % bound (`calibrate.verdict`), beside the same
change on the test split, which nothing chose on.

    python benchmarks/calibration_check_offline.py RUN [RUN ...] [--out benchmarks/results/calibration_check_offline.json]

A RUN is a training run folder (final.pt). Where the run's check refused its fit, the rejected fit is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from trained_run import load_run  # noqa: E402


def measure(run: Path) -> dict:
    from tafl.prior import Calibration
    from tafl.training.calibrate import nll_rows, verdict
    from tafl.training.evaluate import predict

    r = load_run(run)
    cfg, ds, method, state = r.cfg, r.prep.dataset, r.method, r.state
    C = ds.num_classes
    rec = state.meta["calibration"]
    check = (rec.get("fit") or {}).get("check") or {}
    fitted = Calibration.from_dict(rec if check.get("shipped", True) else rec["fit"]["rejected"], C)
    own = np.asarray(method.default_source_prior(state), np.float64)
    module = method.inference_model(state)
    out = {"shipped": check.get("shipped"), "kind": fitted.kind}
    for name, split in (("validation", ds.val), ("test", ds.test)):
        z = method.posterior_logits(predict(module, split.images, method.normalize, cfg.eval_batch_size,
                                            keys=method.output_keys))
        y = split.labels
        mix = np.bincount(y, minlength=C) / len(y)
        v = verdict(nll_rows(fitted, z, y, mix), nll_rows(Calibration(), z, y, mix, own), fitted.kind)
        out[name] = {k: v[k] for k in ("images", "nll_calibrated", "nll_uncalibrated", "nll_change", "nll_change_se",
                                       "nll_change_bound", "shipped")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="training run folders")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "calibration_check_offline.json"),
                   help="results file (default: benchmarks/results/calibration_check_offline.json)")
    args = p.parse_args()
    res = {}
    for run in map(Path, args.runs):
        r = res[f"{run.parent.name}/{run.name}"] = measure(run)
        v, t = r["validation"], r["test"]
        print(f"{run.parent.name}/{run.name}: shipped {r['shipped']}; validation change {v['nll_change']:+.4f} ± "
              f"{v['nll_change_se']:.4f} (bound {v['nll_change_bound']:+.4f}); test change {t['nll_change']:+.4f}",
              flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
