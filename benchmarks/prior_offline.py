"""Which posteriors should feed prior estimation, and what adaptation buys: an offline study of trained runs.

    python benchmarks/prior_offline.py RUN [RUN ...] [--data-root DIR] [--name prior_offline]

For each run's final.pt: one pass over the validation and test splits, then for every candidate
posterior (GTAFL: the experts' mean log-probability, each expert alone, the FedAvg head; other methods:
the softmax) and every calibration (none; BCTS fitted on the validation split, a centralised stand-in
for the federated fit that `--calibration bcts` runs on the clients' held-out rows), the eleven-
distribution mean of the plain, calibrated, oracle-adapted and EM-adapted rules (n unlabeled images
drawn with each distribution's prior, `adapt_draws` draws; tafl.training.simulator.adaptation_accuracies).
Writes benchmarks/results/<name>.{json,md}. The validation columns are in-sample for the BCTS rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.prior import Calibration, confusion_prior, em_prior, fit_calibration, soft_confusion  # noqa: E402
from tafl.training.checkpoint import load_checkpoint  # noqa: E402
from tafl.training.config import RunConfig  # noqa: E402
from tafl.training.data import load_dataset  # noqa: E402
from tafl.training.evaluate import predict  # noqa: E402
from tafl.training.contract import GlobalState  # noqa: E402
from tafl.training.methods.base import ProbsAndLabel  # noqa: E402
from tafl.training.models import ModelConfig, build_model  # noqa: E402
from tafl.training.simulator import adaptation_accuracies, make_method  # noqa: E402


# prior estimators: make(validation probs, validation labels, source prior) -> estimate(probs) -> prior.
# The confusion matrix is the validation split's (a centralised stand-in for the clients' held-out sums).
ESTIMATORS = {
    "EM": lambda pv, yv, src: (lambda p: em_prior(p, src).prior),
    "EM MAP 50": lambda pv, yv, src: (lambda p: em_prior(p, src, pseudo_count=50).prior),
    "confusion": lambda pv, yv, src: (lambda p, M=soft_confusion(pv, yv, len(src)): confusion_prior(p, M, src).prior),
    "confusion MAP 50": lambda pv, yv, src: (lambda p, M=soft_confusion(pv, yv, len(src)):
                                             confusion_prior(p, M, src, pseudo_count=50).prior),
}


def candidates(method, state, ds, cfg) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray, str]]]:
    """name -> split -> (logits, plain predictions, source-prior kind)."""
    module = method.inference_model(state)
    outs = {s: predict(module, getattr(ds, s).images, method.normalize, 256, keys=method.output_keys)
            for s in ("val", "test")}
    res: dict[str, dict] = {}
    if "expert_probs" in outs["val"]:
        names = list(state.meta.get("experts"))
        lp = {s: np.log(np.clip(o["expert_probs"], 1e-12, None)) for s, o in outs.items()}
        res["experts (mean log-prob)"] = {s: (lp[s].mean(1), outs[s]["label"], "uniform") for s in outs}
        for e, name in enumerate(names):
            res[f"{name} expert"] = {s: (lp[s][:, e], outs[s]["label"], "uniform") for s in outs}
        model = build_model(ModelConfig.from_dict(method.model_cfg.to_dict()))
        model.load_state_dict(state.weights)
        head = {s: predict(ProbsAndLabel(model), getattr(ds, s).images, method.normalize, 256) for s in outs}
        res["FedAvg head"] = {s: (np.log(np.clip(head[s]["probs"], 1e-12, None)), outs[s]["label"], "train")
                              for s in outs}
    else:
        res["softmax"] = {s: (np.log(np.clip(o["probs"], 1e-12, None)), o["label"], "train") for s, o in outs.items()}
    return res


def whole_split_estimate(probs: np.ndarray, labels: np.ndarray, target: np.ndarray, source: np.ndarray,
                         iters: int = 500) -> np.ndarray:
    """EM's limit for n → ∞: the estimate from the whole split with every image weighted so the class mix is
    `target`. What is left of its error is bias (calibration), not the sampling of n images."""
    C = probs.shape[1]
    cnt = np.bincount(labels, minlength=C)
    w = np.where(cnt > 0, target / np.maximum(cnt, 1), 0.0)[labels]
    w = w / w.sum()
    ratio, q = probs / source, source.copy()
    for _ in range(iters):
        post = ratio * q
        post /= post.sum(1, keepdims=True)
        q = (w[:, None] * post).sum(0)
    return q


def out_of_fold(z: np.ndarray, labels: np.ndarray, kind: str, src0: np.ndarray, folds: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Calibrated posteriors of every validation image from a calibration fitted on the other folds (stratified),
    all mapped to the split's class mix: how a calibration fitted on this split does on images it has not seen.
    The selection among calibrations reads these, never the test split."""
    C = z.shape[1]
    rng = np.random.default_rng(0)
    fold = np.zeros(len(labels), int)
    for c in range(C):
        idx = rng.permutation(np.flatnonzero(labels == c))
        fold[idx] = np.arange(len(idx)) % folds
    common = src0 if kind == "none" else np.bincount(labels, minlength=C) / len(labels)
    out = np.zeros(z.shape)
    for f in range(folds):
        tr = fold != f
        cal = Calibration(source_prior=src0) if kind == "none" else fit_calibration(z[tr], labels[tr], kind)
        p = cal.probs(z[~tr]) * common / np.clip(cal.source_prior, 1e-12, None)
        out[~tr] = p / p.sum(1, keepdims=True)
    return out, common


def open_run(run: str | Path, data_root: str | None = None):
    """A run folder's final.pt with its config, dataset (at the model's size), method and global state."""
    from tafl.imaging import Preprocess

    ck = load_checkpoint(Path(run) / "final.pt")
    cfg = RunConfig.from_dict(ck["run_config"], "checkpoint")
    if data_root:
        cfg.data_root = data_root
    cfg.img_size, cfg.channels = ck["preprocess"]["size"], ck["preprocess"]["channels"]
    ds = load_dataset(cfg.validate())
    method = make_method(cfg, ModelConfig.from_dict(ck["model_config"]), Preprocess.from_dict(ck["preprocess"]))
    return ck, cfg, ds, method, GlobalState.from_dict(ck["state"])


CALIBRATIONS = {"none": "none", "BCTS on validation": "bcts", "vector on validation": "vector"}


def run_outputs(run: str | Path, data_root: str | None = None, splits: tuple[str, ...] = ("val", "test")):
    """`open_run`, and the kept model's outputs and posterior logits (what calibration works on) on the splits."""
    ck, cfg, ds, method, state = open_run(run, data_root)
    module = method.inference_model(state)
    outs = {s: predict(module, getattr(ds, s).images, method.normalize, 256, keys=method.output_keys)
            for s in splits}
    return ck, cfg, ds, method, state, outs, {s: method.posterior_logits(o) for s, o in outs.items()}


def write_results(name: str, payload: dict, lines: list[str]) -> None:
    """benchmarks/results/<name>.json (the payload) and <name>.md (the lines), and the lines on stdout."""
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def ms(vals, pct=True) -> str:
    """mean ± sd of the runs' values (× 100 and two decimals for a share; three decimals otherwise)."""
    vals = [100 * v if pct else v for v in vals]
    f = "{:.2f}" if pct else "{:.3f}"
    return (f + " ± " + f).format(statistics.mean(vals), statistics.stdev(vals)) if len(vals) > 1 else f.format(vals[0])


def main() -> None:
    from tafl.prior import total_variation
    from tafl.training.longtail import DISTRIBUTIONS, distribution_prior

    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--data-root", default=None)
    p.add_argument("--name", default="prior_offline")
    p.add_argument("--draws", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated candidate names to keep (default: all)")
    p.add_argument("--estimators", default="EM", help=f"comma-separated estimators (of {', '.join(ESTIMATORS)})")
    p.add_argument("--calibrations", default=",".join(CALIBRATIONS),
                   help=f"comma-separated calibrations (of {', '.join(CALIBRATIONS)})")
    a = p.parse_args()
    rows: dict[tuple[str, str, str], list[dict]] = {}
    t0 = time.perf_counter()
    for run in a.runs:
        ck, cfg, ds, method, state = open_run(run, a.data_root)
        ranks = np.asarray(ck["class_ranks"])
        C = len(ck["class_names"])
        keep = [c.strip() for c in a.only.split(",") if c.strip()]
        keep_est = [c.strip() for c in a.estimators.split(",") if c.strip()]
        keep_cal = [c.strip() for c in a.calibrations.split(",") if c.strip()]
        for cand, splits in candidates(method, state, ds, cfg).items():
            if keep and not any(cand.startswith(k) for k in keep):
                continue
            zv, _, kind = splits["val"]
            # the prior the uncalibrated posteriors describe (a class-weighted DAFL loss: the loss-weighted mix)
            src = np.asarray(method.default_source_prior(state), np.float64) if kind == "train" else np.full(C, 1 / C)
            for cal_name in keep_cal:
                ckind = CALIBRATIONS[cal_name]
                cal = Calibration(source_prior=src) if ckind == "none" else fit_calibration(zv, ds.val.labels, ckind)
                oof, oof_src = out_of_fold(zv, ds.val.labels, ckind, src)
                for est_name in keep_est:
                    make_est = ESTIMATORS[est_name]
                    entry = {"run": str(run), "temperature": cal.temperature}
                    estimate = make_est(cal.probs(zv), ds.val.labels, cal.source_prior)
                    o = adaptation_accuracies(oof, ds.val.labels, ranks, oof_src, [500], a.draws, 0,
                                              estimate=make_est(oof, ds.val.labels, oof_src))["average"]
                    entry["val_oof"] = {"adaptive_500": o["adaptive_500"], "oracle": o["oracle"], "tv_500": o["tv_500"]}
                    for split, labels in (("val", ds.val.labels), ("test", ds.test.labels)):
                        z, plain, _ = splits[split]
                        probs = cal.probs(z)
                        acc = adaptation_accuracies(probs, labels, ranks, cal.source_prior, [100, 500], a.draws, 0,
                                                    estimate=estimate)
                        plain_acc = adaptation_accuracies(np.eye(C)[plain], labels, ranks, np.full(C, 1.0 / C), [1], 1, 0)
                        av, dist = acc["average"], acc["distributions"]
                        gaps = [d["oracle"] - d["adaptive"]["500"]["accuracy"] for d in dist.values()]
                        tv_inf, tv_fixed, corr = [], [], []
                        for name, k, imf in DISTRIBUTIONS:
                            t = distribution_prior(ranks, k, imf)
                            t = np.where(np.bincount(labels, minlength=C) > 0, t, 0)
                            t = t / t.sum()
                            q_inf = whole_split_estimate(probs, labels, t, cal.source_prior)
                            tv_inf.append(total_variation(q_inf, t))
                            # is the bias systematic? the bias the out-of-fold validation posteriors show for the
                            # same prior, subtracted from this split's estimate (a diagnostic, never a selection)
                            b_val = whole_split_estimate(oof, ds.val.labels, t, oof_src) - t
                            fixed = np.clip(q_inf - b_val, 0, None)
                            tv_fixed.append(total_variation(fixed / max(fixed.sum(), 1e-12), t))
                            b = q_inf - t
                            corr.append(float(np.corrcoef(b, b_val)[0, 1]) if b.std() > 0 and b_val.std() > 0 else 0.0)
                        pd = plain_acc["distributions"]
                        entry[split] = {"plain": plain_acc["average"]["calibrated"], "calibrated": av["calibrated"],
                                        "oracle": av["oracle"], "adaptive_100": av["adaptive_100"],
                                        "adaptive_500": av["adaptive_500"], "tv_500": av["tv_500"],
                                        "tv_inf": float(np.mean(tv_inf)), "tv_inf_val_corrected": float(np.mean(tv_fixed)),
                                        "bias_corr_val": float(np.mean(corr)), "max_gap_500": max(gaps),
                                        "gaps_500": dict(zip(dist, gaps)),
                                        "uniform_harm": pd["uniform"]["calibrated"] - dist["uniform"]["adaptive"]["500"]["accuracy"],
                                        "forward50_harm": pd["forward50"]["calibrated"]
                                        - dist["forward50"]["adaptive"]["500"]["accuracy"],
                                        "backward50_100_gain": dist["backward50"]["adaptive"]["100"]["accuracy"]
                                        - pd["backward50"]["calibrated"]}
                    rows.setdefault((cand, cal_name, est_name), []).append(entry)
    out = REPO / "benchmarks" / "results"
    (out / f"{a.name}.json").write_text(json.dumps({"runs": a.runs, "rows": {" | ".join(k): v for k, v in rows.items()},
                                                    "seconds": time.perf_counter() - t0}, indent=2))

    lines = [f"# {a.name}", "", f"`python benchmarks/prior_offline.py {' '.join(a.runs)}` — mean of the eleven "
             "prior-weighted accuracies (%), mean ± sd over the runs; `plain` is the model's own decision (GTAFL: "
             "the vote), `EM n` the rule adapted to the prior EM estimates from n unlabeled images (`--draws` "
             "draws), `oracle` the rule adapted to the true prior; `TV 500` / `TV ∞` the estimate's total variation "
             "from the true prior at n = 500 and from the whole split (its bias); `gap` the largest oracle − EM 500 "
             "over the eleven; `uni harm` / `F50 harm` what EM 500 loses to the plain rule on the uniform and the "
             "training-like distribution; `B50 100` what EM at n = 100 gains on backward50. `val OOF`: EM 500 on "
             "validation with calibrations fitted on the other folds (5-fold), the selection criterion. `TV ∞ fix`: TV ∞ "
             "after subtracting the bias that the out-of-fold validation posteriors show for the same prior; `bias r`: "
             "the correlation of the two biases over the classes (mean over the eleven). The correction is picked with "
             "the true prior, so `TV ∞ fix` is an optimistic bound: where it is not below `TV ∞`, no correction learnt on "
             "the validation split can remove the bias.", ""]
    for split in ("val", "test"):
        lines += [f"## {split}", "", "| posteriors | calibration | estimator | val OOF EM 500 | plain | EM 100 | EM 500 | "
                  "oracle | TV 500 | TV ∞ | TV ∞ fix | bias r | gap | uni harm | F50 harm | B50 100 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (cand, cal, est), es in rows.items():
            g = lambda k, pct=True: ms([e[split][k] for e in es], pct)  # noqa: E731
            lines.append(f"| {cand} | {cal} | {est} | {ms([e['val_oof']['adaptive_500'] for e in es])} | {g('plain')} | "
                         f"{g('adaptive_100')} | {g('adaptive_500')} | {g('oracle')} | {g('tv_500', False)} | "
                         f"{g('tv_inf', False)} | {g('tv_inf_val_corrected', False)} | {g('bias_corr_val', False)} | {g('max_gap_500')} | {g('uniform_harm')} | {g('forward50_harm')} | "
                         f"{g('backward50_100_gain')} |")
        lines.append("")
    (out / f"{a.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
