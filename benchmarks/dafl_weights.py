"""The per-class weights 1 + c_t the DAFL loss applies on real clients, under both term scales.

    python benchmarks/dafl_weights.py [--data-root DIR] [--seeds 1 2 3] [--name dafl_weights]

No training: for DermaMNIST (configs/dafl_dermamnist.yaml) and the HAM10000 images
(configs/dafl_ham10000.yaml) it builds each seed's client partition, takes the clients of the first
round exactly as the simulator selects them, computes c_k, the round's c_{f,t} and each client's
weights with `dafl_scale: paper` and `mean` (tafl.training.methods.dafl.loss_coefficients), and
reports: the loss's scale (the weights' mean over the client's own samples; cross-entropy = 1), the
largest over the smallest class weight, the rarest class's weight over the majority class's, and how often a rarest-class sample of one client
outweighs a majority-class sample of another.
Writes benchmarks/results/<name>.{json,md}.
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

from tafl.training.config import load_config  # noqa: E402
from tafl.training.longtail import select_clients  # noqa: E402
from tafl.training.methods.dafl import class_imbalance, class_normaliser, client_imbalance, loss_coefficients  # noqa: E402,E501
from tafl.training.simulator import prepare  # noqa: E402

SETS = {"dermamnist": ("configs/dafl_dermamnist.yaml", "medmnist"), "ham10000": ("configs/dafl_ham10000.yaml", "ham10000")}


def one(cfg_path: str, root: str, seed: int, lam: float) -> dict:
    cfg = load_config(REPO / cfg_path, {"seed": seed, "data_root": root, "dafl_lambda": lam})
    prep = prepare(cfg)
    counts = torch.as_tensor(np.asarray(prep.client_counts), dtype=torch.float32)  # (K, C)
    sel = select_clients(cfg.clients, cfg.frac, cfg.seed, 1)
    c_f = class_imbalance(counts[sel])
    c_ks = [client_imbalance(counts[k]) for k in sel]
    c_k_mean = float(np.mean(c_ks))
    norm = class_normaliser(counts[sel])
    major, rare = int(np.argmax(prep.train_counts)), int(np.argmin(prep.train_counts))
    rows = {}
    for scale in ("paper", "mean"):
        scale_, spread, rare_major, ws = [], [], [], []
        for k, c_k in zip(sel, c_ks):
            w = 1 + loss_coefficients(c_k, c_f, lam, scale, c_k_mean, norm)
            ws.append(w)
            n = counts[k]
            scale_.append(float((w * n).sum() / n.sum()))
            spread.append(float(w.max() / w.min()))
            rare_major.append(float(w[rare] / w[major]))
        rows[scale] = {"loss_scale_median": float(np.median(scale_)), "loss_scale_max": float(np.max(scale_)),
                       "max_over_min_median": float(np.median(spread)),
                       "rare_over_major_median": float(np.median(rare_major)),
                       # across the round's clients: how often a rarest-class sample of client k outweighs a
                       # majority-class sample of client j (k != j); 1.0 = the class decides, whatever the client
                       "rare_outweighs_major": float(np.mean([float(a[rare] > b[major]) for i, a in enumerate(ws)
                                                               for j, b in enumerate(ws) if i != j]))}
    return {"seed": seed, "lambda": lam, "clients": [int(k) for k in sel], "c_k": c_ks,
            "c_f": [float(v) for v in c_f], "classes": list(prep.dataset.class_names),
            "rare": prep.dataset.class_names[rare], "major": prep.dataset.class_names[major], **rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--lambdas", type=float, nargs="+", default=[0.5, 0.0])
    ap.add_argument("--name", default="dafl_weights")
    ns = ap.parse_args()
    out = {name: [one(cfg, str(Path(ns.data_root) / sub), s, lam) for lam in ns.lambdas for s in ns.seeds]
           for name, (cfg, sub) in SETS.items()}
    res = REPO / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"{ns.name}.json").write_text(json.dumps(out, indent=1))
    lines = ["# DAFL class weights on real clients (first round's participants, no training)", "",
             "`python benchmarks/dafl_weights.py` — medians over the round's clients; loss scale = the weights' mean",
             "over the client's own samples (cross-entropy = 1).", "",
             "| data | seed | λ | median c_k | scale | loss scale (median / max) | max/min class weight | rarest/majority | rarest outweighs majority across clients |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in out.items():
        for r in runs:
            for scale in ("paper", "mean"):
                x = r[scale]
                lines.append(f"| {name} | {r['seed']} | {r['lambda']} | {np.median(r['c_k']):.0f} | {scale} | "
                             f"{x['loss_scale_median']:.1f} / {x['loss_scale_max']:.1f} | {x['max_over_min_median']:.2f} | "
                             f"{x['rare_over_major_median']:.2f} ({r['rare']}/{r['major']}) | {x['rare_outweighs_major']:.2f} |")
    (res / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
