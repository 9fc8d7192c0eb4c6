"""The case-mix estimator's `site` centre (each site's own training mix) against the centres it had before, on
finished four-site runs (issue 33): for each run, the estimator is chosen on validation twice by the product's own
chooser (`select_prior_smoothing_sites`), once with each site's training mix on offer and once without; both
choices are then read on every site's own test rows: the mean over sites of the accuracy adapted to the mix
estimated from the site's unlabeled test images, and the oracle (the site's true mix). Nothing is chosen on test.

    python benchmarks/site_center_offline.py benchmarks/out/sites_gtafl_cal_s* [--name site_center_sites]

Writes benchmarks/results/<name>.md and .json.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from prior_offline import run_outputs, write_results  # noqa: E402  (benchmarks/)
from tafl.prior import Calibration, adapt  # noqa: E402
from tafl.training.simulator import select_prior_smoothing_sites, site_train_mixes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--name", default="site_center_sites")
    args = ap.parse_args()
    rows, payload = [], {}
    for run in args.runs:
        ck, cfg, ds, method, state, outs, logits = run_outputs(run)
        C = len(ds.class_names)
        calib = Calibration.from_dict(state.meta.get("calibration"), C)
        source = calib.source_prior if calib.source_prior is not None else method.default_source_prior(state)
        probs = {s: calib.probs(z) for s, z in logits.items()}
        counts = state.extras["global_counts"].numpy().astype(np.float64)
        mixes = site_train_mixes(ds)
        res = {}
        for arm, offer in (("before", None), ("site centre on offer", mixes)):
            est = select_prior_smoothing_sites(probs["val"], ds.val.labels, ds.val.sites, source,
                                               train_mix=counts / counts.sum(), site_mixes=offer)
            key = f"{est.center}:{est.pseudo_count:g}"
            adapted, oracle = [], []
            for k in range(len(ds.site_names)):
                idx = np.flatnonzero(ds.test.sites == k)
                if len(idx) == 0:
                    continue
                p, y = probs["test"][idx], ds.test.labels[idx]
                q = est.for_site(mixes.get(k)).estimate(p, source).prior
                adapted.append(float((adapt(p, source, q).argmax(1) == y).mean()))
                truth = np.bincount(y, minlength=C) / len(y)
                oracle.append(float((adapt(p, source, truth).argmax(1) == y).mean()))
            res[arm] = {"estimator": key, "validation": est.record["scores"][key],
                        "adapted": float(np.mean(adapted)), "oracle": float(np.mean(oracle)), "per_site": adapted}
            rows.append(f"| {Path(run).name} | {arm} | {key} | {100 * res[arm]['validation']:.1f} | "
                        f"{100 * res[arm]['adapted']:.1f} | {100 * res[arm]['oracle']:.1f} | "
                        f"{100 * (res[arm]['oracle'] - res[arm]['adapted']):.1f} |")
        payload[Path(run).name] = res
    lines = ["# The case-mix estimator's site centre, chosen on validation, read on each site's test rows", "",
             f"`python benchmarks/site_center_offline.py {' '.join(args.runs)}`", "",
             "| run | centres offered | chosen (centre:pseudo-images) | validation: site mean adapted | "
             "test: site mean adapted | test: oracle | oracle − adapted |", "|---|---|---|---|---|---|---|", *rows]
    def sd(x: list[float]) -> float:
        return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0

    lines += ["", "Per row (the run name without its seed), mean ± sd over its runs:", "",
              "| row | centres offered | test: site mean adapted | oracle − adapted |", "|---|---|---|---|"]
    for row in dict.fromkeys(re.sub(r"_s\d+$", "", name) for name in payload):
        runs = [v for name, v in payload.items() if re.sub(r"_s\d+$", "", name) == row]
        for arm in ("before", "site centre on offer"):
            a = [100 * v[arm]["adapted"] for v in runs]
            g = [100 * (v[arm]["oracle"] - v[arm]["adapted"]) for v in runs]
            lines.append(f"| {row} | {arm} | {np.mean(a):.1f} ± {sd(a):.1f} | {np.mean(g):.1f} ± {sd(g):.1f} |")
    write_results(args.name, payload, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
