"""What limits a private run's in-domain detector (issue 53): the noise on its released class statistics, or the
features themselves? Offline on the private runs of benchmarks/domain_detection.py (benchmarks/out/
domain_fedavg_derma_dp_s{1,2,3}: FedAvg at ε = 8, the sites training the head on the fixed extractor).

For each run the detector is fitted twice on the same extractor's features of the same training rows: from the
checkpoint's released (noisy) statistics, as shipped, and from the exact sums of those rows (what the sites would
have released without noise). Each is scored as the package scores it (the distance, combined with the energy where
the features are the head's input), its threshold keeping 95 % of the validation split; far sets as in the training
report, with ../shared/data/dicom. Nothing is chosen on test or far-set images.

    python benchmarks/domain_private_offline.py [--seeds 1 2 3]

Writes benchmarks/results/domain_private_offline.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

SETS = ("dicom", "photos", "digits", "noise", "constant")


def measure(run: Path, dicom: Path) -> dict:
    from trained_run import load_run

    from tafl.training.detector import (combine, distances, energies, extract_features, fit_gaussian, head_energies,
                                        threshold_record)
    from tafl.training.ood import detection, far_sets

    r = load_run(run)
    model, method, ds = r.model.eval(), r.method, r.prep.dataset
    bs = r.cfg.eval_batch_size

    def feats_logits(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        f = extract_features(model, torch.from_numpy(images), method.normalize, bs)
        u8 = torch.from_numpy(images)
        with torch.no_grad():
            logits = torch.cat([model(method.normalize(u8[i:i + bs])).double() for i in range(0, len(u8), bs)])
        return f, logits.numpy()

    train = r.prep.train
    f_tr, _ = feats_logits(train.images)
    C = len(ds.class_names)
    sums = np.zeros((C, f_tr.shape[1]))
    np.add.at(sums, train.labels, f_tr)
    exact = fit_gaussian(sums, f_tr.T @ f_tr, np.bincount(train.labels, minlength=C).astype(float))
    shipped = tuple(r.state.extras[k].double().numpy() for k in ("domain.means", "domain.precision"))
    f_val, _ = feats_logits(ds.val.images)
    f_te, l_te = feats_logits(ds.test.images)
    _, size, _, ch = ds.test.images.shape
    far = {n: feats_logits(im) for n, im in far_sets(ds.name, size, ch, r.cfg.test_seed, [dicom]).items() if n in SETS}
    out = {}
    for name, (means, precision) in (("released (shipped)", shipped), ("exact sums, no noise", (exact[0], exact[2]))):
        rec = threshold_record(model, means, precision, f_val)

        def score(f: np.ndarray, logits: np.ndarray) -> np.ndarray:
            e = energies(logits) if head_energies(model, f[:1]) is not None else None
            return combine(distances(f, means, precision), e, rec["energy_match"])

        s_te = score(f_te, l_te)
        out[name] = {"test_refused": float((s_te > rec["threshold"]).mean()),
                     **{n: detection(s_te, score(*fl), rec["threshold"]) for n, fl in far.items()}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"),
                   help="the shared data folder, for its dicom/ far set (default: ../shared/data)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "domain_private_offline"),
                   help="results path without suffix (default: benchmarks/results/domain_private_offline)")
    args = p.parse_args()
    torch.set_num_threads(2)
    res: dict = {"seeds": args.seeds, "runs": {}}
    for s in args.seeds:
        run = REPO / "benchmarks" / "out" / f"domain_fedavg_derma_dp_s{s}"
        if not (run / "final.pt").is_file():
            print(f"{run.name}: not trained (python benchmarks/domain_detection.py --rows fedavg_derma_dp)")
            continue
        res["runs"][s] = measure(run, Path(args.data) / "dicom")
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    runs = list(res["runs"].values())
    lines = ["# A private run's detector: released statistics against exact sums (issue 53)", "",
             f"Seeds {list(res['runs'])}; per cell AUROC / FPR95 for each seed.", "",
             "| statistics | test refused | " + " | ".join(SETS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in SETS) + " |"]
    for k in runs[0] if runs else []:
        cells = [", ".join(f"{100 * r[k]['test_refused']:.1f} %" for r in runs)]
        cells += ["; ".join(f"{r[k][n]['auroc']:.3f} / {100 * r[k][n]['fpr95']:.1f} %" for r in runs) for n in SETS]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
