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
import itertools
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
from tafl.training.methods import GlobalState  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--data-root", default=None)
    p.add_argument("--name", default="prior_offline")
    p.add_argument("--draws", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated candidate names to keep (default: all)")
    p.add_argument("--estimators", default="", help=f"comma-separated estimators to keep (of {', '.join(ESTIMATORS)})")
    a = p.parse_args()
    rows: dict[tuple[str, str], list[dict]] = {}
    t0 = time.perf_counter()
    for run in a.runs:
        ck = load_checkpoint(Path(run) / "final.pt")
        cfg = RunConfig.from_dict(ck["run_config"], "checkpoint")
        if a.data_root:
            cfg.data_root = a.data_root
        cfg.img_size, cfg.channels = ck["preprocess"]["size"], ck["preprocess"]["channels"]
        ds = load_dataset(cfg.validate())
        from tafl.imaging import Preprocess

        method = make_method(cfg, ModelConfig.from_dict(ck["model_config"]), Preprocess.from_dict(ck["preprocess"]))
        state = GlobalState.from_dict(ck["state"])
        ranks = np.asarray(ck["class_ranks"])
        counts = np.asarray(ck["train_class_counts"], np.float64)
        C = len(counts)
        keep = [c.strip() for c in a.only.split(",") if c.strip()]
        keep_est = [c.strip() for c in a.estimators.split(",") if c.strip()]
        for cand, splits in candidates(method, state, ds, cfg).items():
            if keep and not any(cand.startswith(k) for k in keep):
                continue
            zv, _, kind = splits["val"]
            src = counts / counts.sum() if kind == "train" else np.full(C, 1.0 / C)
            cals = {"none": Calibration(source_prior=src), "BCTS on validation": fit_calibration(zv, ds.val.labels, "bcts")}
            for (cal_name, cal), (est_name, make_est) in itertools.product(cals.items(), ESTIMATORS.items()):
                if keep_est and est_name not in keep_est:
                    continue
                entry = {"run": str(run), "temperature": cal.temperature}
                estimate = make_est(cal.probs(zv), ds.val.labels, cal.source_prior)
                for split, labels in (("val", ds.val.labels), ("test", ds.test.labels)):
                    z, plain, _ = splits[split]
                    probs = cal.probs(z)
                    acc = adaptation_accuracies(probs, labels, ranks, cal.source_prior, [100, 500], a.draws, 0,
                                                estimate=estimate)
                    plain_acc = adaptation_accuracies(np.eye(C)[plain], labels, ranks, np.full(C, 1.0 / C), [1], 1, 0)
                    av = acc["average"]
                    gaps = [d["oracle"] - d["adaptive"]["500"]["accuracy"] for d in acc["distributions"].values()]
                    entry[split] = {"plain": plain_acc["average"]["calibrated"], "calibrated": av["calibrated"],
                                    "oracle": av["oracle"], "adaptive_100": av["adaptive_100"],
                                    "adaptive_500": av["adaptive_500"], "tv_500": av["tv_500"],
                                    "max_gap_500": max(gaps),
                                    "uniform": acc["distributions"]["uniform"]["adaptive"]["500"]["accuracy"],
                                    "backward50_100": acc["distributions"]["backward50"]["adaptive"]["100"]["accuracy"],
                                    "backward50_calibrated": acc["distributions"]["backward50"]["calibrated"]}
                rows.setdefault((cand, cal_name, est_name), []).append(entry)
    out = REPO / "benchmarks" / "results"
    (out / f"{a.name}.json").write_text(json.dumps({"runs": a.runs, "rows": {" | ".join(k): v for k, v in rows.items()},
                                                    "seconds": time.perf_counter() - t0}, indent=2))

    def ms(vals):
        vals = [100 * v for v in vals]
        return f"{statistics.mean(vals):.2f} ± {statistics.stdev(vals):.2f}" if len(vals) > 1 else f"{vals[0]:.2f}"

    lines = [f"# {a.name}", "", f"`python benchmarks/prior_offline.py {' '.join(a.runs)}` — mean of the eleven "
             "prior-weighted accuracies (%), mean ± sd over the runs; `plain` is the model's own decision (GTAFL: "
             "the vote), `calibrated` the calibrated posterior's argmax, `EM n` the rule adapted to the prior EM "
             "estimates from n unlabeled images, `oracle` the rule adapted to the true prior; `gap` the largest "
             "oracle − EM 500 over the eleven distributions.", ""]
    for split in ("val", "test"):
        lines += [f"## {split}", "", "| posteriors | calibration | estimator | plain | calibrated | est 100 | est 500 | "
                  "oracle | TV 500 | gap | B50 est 100 | B50 calibrated |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (cand, cal, est), es in rows.items():
            g = lambda k: ms([e[split][k] for e in es])  # noqa: E731
            lines.append(f"| {cand} | {cal} | {est} | {g('plain')} | {g('calibrated')} | {g('adaptive_100')} | "
                         f"{g('adaptive_500')} | {g('oracle')} | {g('tv_500')} | {g('max_gap_500')} | "
                         f"{g('backward50_100')} | {g('backward50_calibrated')} |")
        lines.append("")
    (out / f"{a.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
