"""Offline diagnostic of the GTAFL experts' specialisation: GFF matching and expert retraining on
the real features of a trained extractor, with everything else held fixed.

    python benchmarks/gff_offline_diag.py [RUN_DIR] [--rounds 10]
        (default RUN_DIR: benchmarks/out/gtafl_nocl_dermamnist)

The run's final extractor embeds its long-tailed training split and its validation split once.
Each variant then repeats rounds of: the class-mean cross-entropy gradient of up to 256 training
features per class at the experts' heads (what the clients send, aggregated), 100 matching
steps on the persistent banks, retraining of the three experts on their banks — the same
`tafl.training.gff` functions the federated run uses. The experts are scored on the validation
split (forward50 / uniform / backward50 prior-weighted accuracy); the test split is not read.
A few minutes on 2 cores. Writes benchmarks/results/gff_offline_diag.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.training import gff  # noqa: E402
from tafl.training.config import RunConfig  # noqa: E402
from tafl.training.evaluate import evaluate_outputs  # noqa: E402
from tafl.training.models import build_model  # noqa: E402
from tafl.training.simulator import prepare  # noqa: E402


def embed(run: Path) -> dict:
    cfg = RunConfig.from_dict(json.loads((run / "run.json").read_text())["config"], str(run / "run.json")).validate()
    prep = prepare(cfg)
    state = torch.load(run / "final.pt", weights_only=True)["state"]
    model = build_model(prep.model_cfg)
    model.load_state_dict(state["weights"])
    model.eval()
    pre = prep.dataset.preprocess

    def feats(split) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model.features(torch.from_numpy(pre.normalize(split.images[s:s + 256])))
                              for s in range(0, len(split.labels), 256)])

    return {"tr": feats(prep.train), "ytr": torch.as_tensor(prep.train.labels), "va": feats(prep.dataset.val),
            "yva": prep.dataset.val.labels, "ranks": prep.ranks, "counts": prep.train_counts,
            "lam": cfg.gff_lambda, "m": cfg.gff_m}


def variant(f: dict, *, lam: float, rounds: int, init: str = "normal", retrain_epochs: int = 300,
            match_head: str = "own", seed: int = 0) -> dict:
    tr, ytr = f["tr"], f["ytr"]
    C, D = len(f["counts"]), tr.shape[1]
    g = torch.Generator().manual_seed(seed)
    banks = gff.GFFBanks.create(gff.expert_counts(gff.EXPERT_NAMES, f["counts"], f["ranks"], f["m"], lam), D, g)
    if init == "real_stats":  # per-dimension mean and std of the real features (the server does not have them)
        banks.features = banks.features * tr.std(0) + tr.mean(0)
    W, b = gff.init_heads(3, C, D, g)
    for _ in range(rounds):
        idx = torch.cat([torch.nonzero(ytr == c).squeeze(1)[torch.randperm(int((ytr == c).sum()), generator=g)[:256]]
                         for c in range(C)])
        Wm, bm = (W, b) if match_head == "own" else (W[1:2].expand_as(W).contiguous(), b[1:2].expand_as(b).contiguous())
        gW, gb = gff.class_head_gradients(tr[idx], ytr[idx], Wm, bm, torch.arange(C))
        gff.match(banks, Wm, bm, gW.permute(1, 0, 2, 3), gb.permute(1, 0, 2), torch.ones(C, dtype=torch.bool), 100, 0.1)
        W, b, ce = gff.retrain(banks, W, b, retrain_epochs, 0.01, 32, g)
    mu = tr.mean(0)
    out = {"lambda": lam, "init": init, "retrain_epochs": retrain_epochs, "match_head": match_head, "retrain_ce": ce,
           "bank_feature_norm": float(banks.features.norm(dim=-1)[banks.mask.bool()].mean()), "experts": {}}
    for e, name in enumerate(gff.EXPERT_NAMES):
        p = torch.softmax(f["va"] @ W[e].t() + b[e], -1).numpy()
        td = evaluate_outputs(p, p.argmax(1), f["yva"], f["ranks"])["test_distributions"]
        shift = (W[e] @ mu).numpy()  # the logit each class gets from the real features' common mean
        out["experts"][name] = {"val_forward50": 100 * td["forward50"]["accuracy"],
                                "val_uniform": 100 * td["uniform"]["accuracy"],
                                "val_backward50": 100 * td["backward50"]["accuracy"],
                                "bias_range": float(b[e].max() - b[e].min()),
                                "mean_feature_logit_range": float(shift.max() - shift.min()),
                                "head_class_bias_minus_tail": float(b[e][int(np.argmin(f["ranks"]))]
                                                                    - b[e][int(np.argmax(f["ranks"]))]),
                                "head_class_mean_logit_minus_tail": float(shift[int(np.argmin(f["ranks"]))]
                                                                          - shift[int(np.argmax(f["ranks"]))])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="?", default=str(REPO / "benchmarks" / "out" / "gtafl_nocl_dermamnist"))
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    f = embed(Path(args.run))
    norms = f["tr"].norm(dim=1)
    mu = f["tr"].mean(0)
    rows = []
    for lam in (0.01, 0.1):
        for kw in ({}, {"init": "real_stats"}, {"retrain_epochs": 20}, {"match_head": "uniform"}):
            rows.append(variant(f, lam=lam, rounds=args.rounds, **kw))
            print(json.dumps(rows[-1]), flush=True)
    out = {"run": str(args.run), "rounds": args.rounds, "date": time.strftime("%Y-%m-%d"),
           "real_features": {"norm_mean": float(norms.mean()), "common_mean_norm": float(mu.norm()),
                             "min_value": float(f["tr"].min())},
           "variants": rows, "wall_s": time.perf_counter() - t0}
    res = REPO / "benchmarks" / "results"
    (res / "gff_offline_diag.json").write_text(json.dumps(out, indent=2))
    lines = [f"# GFF experts offline ({out['date']}; {args.run}, {args.rounds} rounds, validation split)", "",
             f"Real features: mean norm {out['real_features']['norm_mean']:.1f}, of which the common mean vector "
             f"{out['real_features']['common_mean_norm']:.1f}; smallest value {out['real_features']['min_value']:.2f} "
             "(after ReLU and pooling). Banks start N(0, 1): norm ≈ √D, zero mean.", "",
             "| λ | variant | bank norm | expert | val F50 | val Uni | val B50 | head−tail bias | head−tail W·μ |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = ("default" if r["init"] == "normal" and r["retrain_epochs"] == 300 and r["match_head"] == "own" else
                f"init {r['init']}" if r["init"] != "normal" else
                f"{r['retrain_epochs']} retrain epochs" if r["retrain_epochs"] != 300 else f"match at {r['match_head']}")
        for e, v in r["experts"].items():
            lines.append(f"| {r['lambda']} | {name} | {r['bank_feature_norm']:.1f} | {e} | {v['val_forward50']:.1f} | "
                         f"{v['val_uniform']:.1f} | {v['val_backward50']:.1f} | {v['head_class_bias_minus_tail']:+.2f} | "
                         f"{v['head_class_mean_logit_minus_tail']:+.2f} |")
    lines += ["", "head−tail: the most frequent class's value minus the rarest class's, for the learned bias b and "
              "for W·μ, the logit the real features' common mean μ adds at test time (the banks never show it)."]
    (res / "gff_offline_diag.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
