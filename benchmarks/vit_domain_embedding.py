"""Whether the ViT's in-domain detector gains from its token embedding (issue 53), offline on the three ViT-DAFL runs of
benchmarks/domain_detection.py (benchmarks/out/domain_dafl_derma_s{1,2,3}).

The shipped detector scores the last block's class token and mean patch token (`Classifier.domain_features`); on two
seeds of three it misses the photographs and blank-frame targets, and no block does better
(benchmarks/vit_domain_layers.py). Lee et al. 2018 score low-level features too. Here the tokenizer's output, before
any attention, summarised per image by the mean (`embed`) and the mean and standard deviation (`embed_stats`) of its
patch tokens, is scored alone, concatenated with the shipped features under one Gaussian (`shipped+embed`,
`shipped+embed_stats`), and as the larger of the two Gaussians' log distances, each standardised on the validation
split (`max(shipped, embed_stats)`). Each Gaussian is class-conditional with a shared covariance on the pooled training
features (what the sites' sums give); the threshold keeps 95 % of the validation split; far sets as in the training
report, with ../shared/data/dicom. Nothing is chosen on test or far-set images.

    python benchmarks/vit_domain_embedding.py [--seeds 1 2 3]

Writes benchmarks/results/vit_domain_embedding.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETS = ("dicom", "photos", "digits", "noise", "constant")


def features(run: Path, far_dirs: list[Path]) -> dict:
    from tafl.imaging import Preprocess
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.data import load_dataset
    from tafl.training.models import ModelConfig, build_model
    from tafl.training.ood import far_sets

    ck = load_checkpoint(run / "final.pt")
    cfg = RunConfig.from_dict(ck["run_config"])
    ds = load_dataset(cfg)
    m = build_model(ModelConfig.from_dict(ck["model_config"]))
    m.load_state_dict(ck["state"]["weights"])
    m.eval()
    pre = Preprocess.from_dict(ck["preprocess"])
    mean = torch.tensor(pre.mean).view(1, -1, 1, 1).float()
    std = torch.tensor(pre.std).view(1, -1, 1, 1).float()
    vit = m.extractor

    @torch.no_grad()
    def feats(u8: np.ndarray) -> dict[str, np.ndarray]:
        out: dict[str, list] = {"shipped": [], "embed": [], "embed_stats": []}
        for i in range(0, len(u8), 256):
            x = (torch.from_numpy(u8[i:i + 256]).permute(0, 3, 1, 2).float() / 255 - mean) / std
            e = vit.patch_embed(x)  # (B, patches, D): the tokens before position, attention and any block
            out["shipped"].append(m.domain_features(x).double())
            out["embed"].append(e.mean(1).double())
            out["embed_stats"].append(torch.cat([e.mean(1), e.std(1)], 1).double())
        return {k: torch.cat(v).numpy() for k, v in out.items()}

    far = far_sets(ds.name, pre.size, pre.channels, 0, far_dirs)
    return {"train": feats(ds.train.images), "y": ds.train.labels, "C": len(ds.class_names),
            "val": feats(ds.val.images), "test": feats(ds.test.images),
            "far": {n: feats(im) for n, im in far.items() if n in SETS}}


def zscores(d: dict, key: str) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Standardised log Mahalanobis distances to the nearest class mean of the validation, test and far sets' features
    `key` (a '+'-joined key concatenates)."""
    from tafl.training.detector import distances, fit_gaussian

    def get(block: dict) -> np.ndarray:
        return np.concatenate([block[k] for k in key.split("+")], axis=1)

    F, y, C = get(d["train"]), d["y"], d["C"]
    sums = np.zeros((C, F.shape[1]))
    np.add.at(sums, y, F)
    mu, _, P = fit_gaussian(sums, F.T @ F, np.bincount(y, minlength=C).astype(float))
    lv = np.log(distances(get(d["val"]), mu, P))

    def z(block: dict) -> np.ndarray:
        return (np.log(distances(get(block), mu, P)) - lv.mean()) / lv.std()

    return z(d["val"]), z(d["test"]), {n: z(b) for n, b in d["far"].items()}


def evaluate(val: np.ndarray, test: np.ndarray, far: dict[str, np.ndarray]) -> dict:
    from tafl.training.ood import detection

    thr = float(np.quantile(val, 0.95))
    r: dict = {"refused": float((test > thr).mean())}
    for n, f in far.items():
        r[n] = detection(test, f, thr)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"),
                   help="the shared data folder, for its dicom/ far set (default: ../shared/data)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vit_domain_embedding"),
                   help="results path without suffix (default: benchmarks/results/vit_domain_embedding)")
    args = p.parse_args()
    torch.set_num_threads(2)
    res: dict = {"seeds": args.seeds, "runs": {}}
    for s in args.seeds:
        run = REPO / "benchmarks" / "out" / f"domain_dafl_derma_s{s}"
        if not (run / "final.pt").is_file():
            print(f"{run.name}: not trained (python benchmarks/domain_detection.py --rows dafl_derma)", flush=True)
            continue
        d = features(run, [Path(args.data) / "dicom"])
        z = {k: zscores(d, k) for k in ("shipped", "embed", "embed_stats", "shipped+embed", "shipped+embed_stats")}
        rows = {k: evaluate(*v) for k, v in z.items()}
        a, b = z["shipped"], z["embed_stats"]
        rows["max(shipped, embed_stats)"] = evaluate(np.maximum(a[0], b[0]), np.maximum(a[1], b[1]),
                                                     {n: np.maximum(a[2][n], b[2][n]) for n in a[2]})
        res["runs"][s] = rows
        for k, r in rows.items():
            print(s, k, f"refused {r['refused']:.3f}",
                  " ".join(f"{n} {r[n]['auroc']:.4f}/{r[n]['fpr95']:.3f}" for n in SETS if n in r), flush=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# The ViT's detector with its token embedding (issue 53)", "",
             f"Seeds {list(res['runs'])}; per cell AUROC / FPR95 for each seed; refused: the test split's share "
             "above the threshold that keeps 95 % of validation.", "",
             "| features | refused | " + " | ".join(SETS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in SETS) + " |"]
    runs = list(res["runs"].values())
    for k in runs[0] if runs else []:
        cells = [", ".join(f"{r[k]['refused']:.3f}" for r in runs)]
        for n in SETS:
            cells.append("; ".join(f"{r[k][n]['auroc']:.3f} / {100 * r[k][n]['fpr95']:.1f} %" for r in runs))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    if runs:
        worst = {k: min(r[k][n]["auroc"] for r in runs for n in SETS) for k in runs[0]}
        lines += ["", "Lowest AUROC over every set and seed: " + ", ".join(f"{k} {v:.4f}" for k, v in worst.items()),
                  f"(mean over seeds of the shipped features' photographs AUROC: "
                  f"{statistics.mean(r['shipped']['photos']['auroc'] for r in runs):.4f})"]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
