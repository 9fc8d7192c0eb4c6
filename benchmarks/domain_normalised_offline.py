"""Whether L2-normalised features (Mahalanobis++, Mueller & Hein 2025) make a better in-domain detector (issue 53),
offline on trained runs of benchmarks/domain_detection.py (benchmarks/out/RUN_sSEED).

    python benchmarks/domain_normalised_offline.py [--runs domain_gtafl_derma] [--seeds 1 2 3]

Per run: the class-conditional Gaussian on the pooled training rows' detector features (what the sites' sums give),
as they are and each divided by its norm; the score as shipped (the distance, with the energy matched on the
validation split where the run's kind has it), the threshold at 95 % of the validation split, and per far set
(as the training report builds them, with ../shared/data/dicom) AUROC and FPR at 95 % TPR. The `raw` rows reproduce
the run's report. Nothing is chosen on test or far images.

Writes benchmarks/results/domain_normalised_offline.json.
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

from trained_run import benchmark_runs, load_run  # noqa: E402


def measure(run: Path, dicom: Path) -> dict:
    import torch

    from tafl.imaging import Preprocess
    from tafl.training.detector import combine, distances, energy_match, fit_gaussian, head_energies
    from tafl.training.methods.detector import extract_features
    from tafl.training.ood import detection, far_sets

    r = load_run(run)
    cfg, prep, method, model = r.cfg, r.prep, r.method, r.model
    pre = Preprocess.from_dict(r.ck["preprocess"])

    def feats(images: np.ndarray) -> np.ndarray:
        return extract_features(model, torch.from_numpy(np.ascontiguousarray(images)), method.normalize, 256)

    rows = np.concatenate(prep.parts)
    y = prep.train.labels[rows]
    f_train, f_val, f_test = feats(prep.train.images[rows]), feats(prep.dataset.val.images), feats(
        prep.dataset.test.images)
    far = {k: feats(v) for k, v in far_sets(cfg.dataset, pre.size, pre.channels, cfg.test_seed, [dicom]).items()}
    C = prep.dataset.num_classes
    energy = head_energies(model, f_val) is not None
    out = {}
    for name, unit in (("raw", False), ("normalised", True)):
        def nz(f: np.ndarray) -> np.ndarray:
            return f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12) if unit else f

        a = nz(f_train)
        sums = np.zeros((C, a.shape[1]))
        np.add.at(sums, y, a)
        means, _, precision = fit_gaussian(sums, a.T @ a, np.bincount(y, minlength=C).astype(float))
        match = energy_match(distances(nz(f_val), means, precision), head_energies(model, f_val)) if energy else None

        def score(f: np.ndarray) -> np.ndarray:
            return combine(distances(nz(f), means, precision), head_energies(model, f), match)

        s_val, s_test = score(f_val), score(f_test)
        thr = float(np.quantile(s_val, 0.95))
        out[name] = {"test_refused": float((s_test > thr).mean()),
                     "far": {k: detection(s_test, score(f), thr) for k, f in far.items()}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["domain_gtafl_derma"],
                   help="benchmark runs in benchmarks/out without the _sSEED (default: domain_gtafl_derma)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"),
                   help="the shared data folder, for its dicom/ (default: ../shared/data)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "domain_normalised_offline.json"),
                   help="results file (default: benchmarks/results/domain_normalised_offline.json)")
    args = p.parse_args()
    res: dict = {}
    for row, seed, run in benchmark_runs(args.runs, args.seeds):
        r = res.setdefault(row, {})[seed] = measure(run, Path(args.data) / "dicom")
        for name, v in r.items():
            cells = ", ".join(f"{k} {d['auroc']:.4f}/{d['fpr95']:.3f}" for k, d in v["far"].items())
            print(f"{run.name} {name}: refused {v['test_refused']:.3f}; AUROC/FPR95 {cells}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
