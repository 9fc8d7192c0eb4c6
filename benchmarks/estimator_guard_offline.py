"""Offline: would a per-window trust check on the case-mix estimate keep `prior=adaptive` from falling below the
default rule? Measured on the claims protocol's trained runs (benchmarks/claims_protocol.py), nothing retrained.

    python benchmarks/estimator_guard_offline.py [--sets pneumoniamnist,dermamnist] [--seeds 1,2,3,4,5]
        [--rows recommended,fedavg_tau] [--width 0.25] [--n 500] [--draws 5] [--name estimator_guard_offline]

The check: EM (the posteriors' own estimate) and soft BBSE (the estimate through the confusion matrix M, which
holds under label shift whatever the calibration) estimate the same mix where the posteriors describe the served
images as they described the validation images. Their disagreement (total variation) on a window of n images is
compared with its 95th percentile on validation windows drawn at each of the eleven mixes (M from one half of each
class's validation rows, windows from the other half, so the threshold is not in sample). Above it, the window
falls back to the default rule. Per run, the test mean of the eleven at the default rule, always adapted, and
guarded, and how often the guard fell back; writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from claims_protocol import run_dir  # noqa: E402


def outputs(run: Path):
    """Calibrated posteriors (under the shipped source prior), default-rule labels and labels of the validation and
    test splits, and the estimator the package ships."""
    import torch

    from tafl.imaging import Preprocess
    from tafl.prior import Calibration, PriorEstimator
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.contract import GlobalState
    from tafl.training.data import load_dataset
    from tafl.training.evaluate import predict
    from tafl.training.models import ModelConfig
    from tafl.training.simulator import make_method

    torch.set_num_threads(1)
    ck = load_checkpoint(run / "final.pt")
    cfg = RunConfig.from_dict(ck["run_config"])
    cfg.img_size, cfg.channels = ck["preprocess"]["size"], ck["preprocess"]["channels"]
    ds = load_dataset(cfg.validate())
    method = make_method(cfg, ModelConfig.from_dict(ck["model_config"]), Preprocess.from_dict(ck["preprocess"]))
    state = GlobalState.from_dict(ck["state"])
    C = len(ds.class_names)
    cal = Calibration.from_dict(state.meta.get("calibration"), C)
    source = cal.source_prior if cal.source_prior is not None else method.default_source_prior(state)
    module = method.inference_model(state)
    res = {}
    for split, data in (("val", ds.val), ("test", ds.test)):
        out = predict(module, data.images, method.normalize, 256, keys=method.output_keys)
        res[split] = (cal.probs(method.posterior_logits(out)), np.asarray(out["label"]), data.labels)
    return res, np.asarray(source), np.asarray(ck["class_ranks"]), PriorEstimator.from_dict(
        state.meta.get("prior_estimator"))


def window(rows_by_class, target, n, rng):
    per = rng.multinomial(n, target)
    return np.concatenate([rng.choice(rows_by_class[c], m, replace=True) for c, m in enumerate(per) if m])


def analyse(run: Path, n: int, draws: int) -> dict:
    from tafl.prior import adapt, confusion_prior, em_prior, soft_confusion, total_variation
    from tafl.training.estimator import confusion_folds
    from tafl.training.longtail import DISTRIBUTIONS, distribution_prior

    res, source, ranks, est = outputs(run)
    pv, _, yv = res["val"]
    pt, plain_t, yt = res["test"]
    C = pv.shape[1]
    rng = np.random.default_rng(11)
    # the threshold: validation windows, M from the other half
    tvs = []
    for fit, held in confusion_folds(yv, 0) or []:
        M = soft_confusion(pv[fit], yv[fit], C)
        rows = [held[yv[held] == c] for c in range(C)]
        for _, kind, imf in DISTRIBUTIONS:
            target = np.where([len(r) > 0 for r in rows], distribution_prior(ranks, kind, imf), 0.0)
            target /= target.sum()
            for _ in range(draws):
                idx = window(rows, target, n, rng)
                tvs.append(total_variation(em_prior(pv[idx], source).prior, confusion_prior(pv[idx], M, source).prior))
    thr = float(np.percentile(tvs, 95)) if tvs else float("inf")
    M = soft_confusion(pv, yv, C)
    rows = [np.flatnonzero(yt == c) for c in range(C)]
    counts = np.bincount(yt, minlength=C)

    def acc(pred, target):
        ok = (pred == yt).astype(float)
        rec = np.bincount(yt, weights=ok, minlength=C) / np.maximum(counts, 1)
        return float((target * rec).sum())

    from scipy.stats import chi2

    crit = float(chi2.ppf(0.95, C - 1))

    def loglik(p, q):  # the served window's log-likelihood of mix q (posteriors p under `source`)
        return float(np.log(np.maximum((p / source) @ q, 1e-300)).sum())

    out = {"default": [], "adapted": [], "guarded": [], "fell_back": 0, "windows": 0, "threshold": thr,
           "lr": [], "lr_fell_back": 0}
    for i, (_, kind, imf) in enumerate(DISTRIBUTIONS):
        target = np.where(counts > 0, distribution_prior(ranks, kind, imf), 0.0)
        target /= target.sum()
        out["default"].append(acc(plain_t, target))
        a, g, lr = [], [], []
        for k in range(draws):
            idx = window(rows, target, n, np.random.default_rng([313, i, n, k]))
            q = est.estimate(pt[idx], source).prior
            adapted = adapt(pt, source, q).argmax(1)
            a.append(acc(adapted, target))
            s = total_variation(em_prior(pt[idx], source).prior, confusion_prior(pt[idx], M, source).prior)
            fell = s > thr
            out["fell_back"] += int(fell)
            out["windows"] += 1
            g.append(acc(plain_t, target) if fell else a[-1])
            # the likelihood-ratio test of "no shift": the estimate is used only where the window's likelihood says
            # its mix differs from the source prior (2Δℓ above the χ² 95 % point, C − 1 degrees of freedom)
            quiet = 2 * (loglik(pt[idx], em_prior(pt[idx], source).prior) - loglik(pt[idx], source)) < crit
            out["lr_fell_back"] += int(quiet)
            lr.append(acc(plain_t, target) if quiet else a[-1])
        out["adapted"].append(float(np.mean(a)))
        out["guarded"].append(float(np.mean(g)))
        out["lr"].append(float(np.mean(lr)))
    return {"default": float(np.mean(out["default"])), "adapted": float(np.mean(out["adapted"])),
            "guarded": float(np.mean(out["guarded"])), "fell_back": out["fell_back"] / out["windows"],
            "threshold": thr, "lr_guarded": float(np.mean(out["lr"])),
            "lr_fell_back": out["lr_fell_back"] / out["windows"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="pneumoniamnist,dermamnist")
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--rows", default="recommended,fedavg_tau")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--n", type=int, default=500, help="images per window (default: 500)")
    ap.add_argument("--draws", type=int, default=5, help="windows per mix (default: 5)")
    ap.add_argument("--name", default="estimator_guard_offline")
    ns = ap.parse_args()
    table, lines = {}, [f"# {ns.name}", "", f"n = {ns.n}, {ns.draws} windows per mix; test mean of the eleven, %.", "",
                        "| set | row | seed | default | adapted | EM–BBSE guard | fell back | threshold (TV) "
                        "| LR guard | fell back |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in ns.sets.split(","):
        for r in ns.rows.split(","):
            for k in (int(x) for x in ns.seeds.split(",")):
                run = run_dir(s, r, k, ns.width)
                if not (run / "final.pt").exists():
                    continue
                v = analyse(run, ns.n, ns.draws)
                table[f"{s}/{r}/{k}"] = v
                lines.append(f"| {s} | {r} | {k} | {100 * v['default']:.1f} | {100 * v['adapted']:.1f} | "
                             f"{100 * v['guarded']:.1f} | {100 * v['fell_back']:.0f}% | {v['threshold']:.3f} | "
                             f"{100 * v['lr_guarded']:.1f} | {100 * v['lr_fell_back']:.0f}% |")
    for key in ("adapted", "guarded", "lr_guarded"):
        d = [v[key] - v["default"] for v in table.values()]
        if d:
            lines.append(f"\n{key} − default: mean {100 * statistics.mean(d):+.1f}, worst {100 * min(d):+.1f}, "
                         f"runs below the default rule {sum(x < 0 for x in d)} of {len(d)}")
    res = REPO / "benchmarks" / "results"
    (res / f"{ns.name}.json").write_text(json.dumps(table, indent=1))
    (res / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
