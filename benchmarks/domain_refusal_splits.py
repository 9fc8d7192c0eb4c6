"""Where the in-domain detector's refusals come from (issue 53): the shipped threshold (it keeps 95 % of the
validation split) applied to every split of a trained run, each class apart.

    python benchmarks/domain_refusal_splits.py [--runs domain_gtafl_derma domain_gtafl_sites] [--seeds 1 2 3]

The runs are benchmarks/domain_detection.py's (benchmarks/out/RUN_sSEED). Splits: the validation split (which the
threshold was chosen on, and which GTAFL's server-side SimCLR saw unlabeled), the clients' held-out calibration rows
(10 % of every client's training rows: never trained on, never seen by SimCLR), the training rows (up to 2,000 in
client order), and the test split. Were the threshold too tight because the extractor saw the validation images,
the held-out rows would be refused more often than the validation split; a test split refused more often than both
says the test images differ from every image the server could choose on. Nothing here chooses anything.

Writes benchmarks/results/domain_refusal_splits.json and .md.
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

from trained_run import benchmark_runs, load_run  # noqa: E402

TRAIN_ROWS = 2000


def splits(run: Path) -> dict:
    """Per split: images, refused share at the shipped threshold, its 95 % quantile of the score, and per class."""
    import torch

    from tafl.training.detector import combine, distances, head_energies
    from tafl.training.methods.detector import extract_features

    r = load_run(run)
    cfg, prep, method, state, model = r.cfg, r.prep, r.method, r.state, r.model
    rec = state.meta["domain_detector"]
    means, precision = (state.extras[k].double().numpy() for k in ("domain.means", "domain.precision"))

    def score(images: np.ndarray) -> np.ndarray:
        feats = extract_features(model, torch.from_numpy(images), method.normalize, cfg.eval_batch_size)
        return combine(distances(feats, means, precision), head_energies(model, feats), rec.get("energy_match"))

    ds, train = prep.dataset, prep.train
    held = np.concatenate(prep.holdouts) if prep.holdouts and sum(map(len, prep.holdouts)) else np.zeros(0, np.int64)
    trained = np.concatenate(prep.parts)[:TRAIN_ROWS]
    parts = {"validation": (ds.val.images, ds.val.labels), "held_out": (train.images[held], train.labels[held]),
             "training": (train.images[trained], train.labels[trained]), "test": (ds.test.images, ds.test.labels)}
    thr, C = float(rec["threshold"]), ds.num_classes
    out = {"threshold": thr, "kind": rec.get("kind"), "class_names": list(ds.class_names), "splits": {}}
    for name, (images, labels) in parts.items():
        if not len(images):
            continue
        s = score(images)
        out["splits"][name] = {
            "images": int(len(s)), "refused": float((s > thr).mean()), "q95": float(np.quantile(s, 0.95)),
            "per_class": [{"images": int((labels == c).sum()),
                           "refused": float((s[labels == c] > thr).mean()) if (labels == c).any() else None}
                          for c in range(C)]}
    return out


def markdown(res: dict) -> str:
    lines = ["# The in-domain detector's refusals per split (issue 53)", "",
             "The shipped threshold (95 % of the validation split kept) on each split of the trained runs; "
             "`python benchmarks/domain_refusal_splits.py`. Held-out: the clients' calibration rows, never trained "
             "on nor seen by SimCLR. Refused share per seed; the test split's per class beside the validation's.", ""]
    for row, by_seed in res.items():
        lines += [f"## {row}", "", "| seed | validation | held-out | training | test | test / validation per class |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for seed, r in by_seed.items():
            sp = r["splits"]
            cells = [f"{100 * sp[k]['refused']:.1f} % ({sp[k]['images']})" if k in sp else "—"
                     for k in ("validation", "held_out", "training", "test")]
            per = ", ".join(f"{n} {_pct(t['refused'])}/{_pct(v['refused'])}" for n, t, v in
                            zip(r["class_names"], sp["test"]["per_class"], sp["validation"]["per_class"]))
            lines.append(f"| {seed} | " + " | ".join(cells) + f" | {per} |")
        means = {k: statistics.mean(r["splits"][k]["refused"] for r in by_seed.values() if k in r["splits"])
                 for k in ("validation", "held_out", "training", "test")
                 if any(k in r["splits"] for r in by_seed.values())}
        lines += ["", "Mean over seeds: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in means.items()), ""]
    return "\n".join(lines) + "\n"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=["domain_gtafl_derma", "domain_gtafl_sites"],
                   help="benchmark runs in benchmarks/out without the _sSEED (default: domain_gtafl_derma "
                        "domain_gtafl_sites)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "domain_refusal_splits"),
                   help="output path without extension (default: benchmarks/results/domain_refusal_splits)")
    args = p.parse_args()
    res: dict = {}
    for row, seed, run in benchmark_runs(args.runs, args.seeds):
        res.setdefault(row, {})[seed] = splits(run)
        print(f"{run.name}: " + ", ".join(f"{k} {100 * v['refused']:.1f} %"
                                          for k, v in res[row][seed]["splits"].items()), flush=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    Path(args.out + ".md").write_text(markdown(res))
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
