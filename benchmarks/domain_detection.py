"""The in-domain detector measured (issue 53): each row trained over three seeds, each run's report's
`domain_detector` gathered, then the cost of the score in the package (ONNX Runtime, same run, with and without it).

    python benchmarks/domain_detection.py [--rows gtafl_derma dafl_derma dafl_conv_derma gtafl_sites open_bcc
        fedavg_derma_dp]
        [--seeds 1 2 3] [--data ../shared/data] [--width 0.25] [--rounds 20]

Rows (scaled for 2 CPU cores; say so where the numbers are quoted):
- gtafl_derma: the recommended GTAFL configuration (vector calibration on a 10 % hold-out, the validation operating
  point) on DermaMNIST, configs/benchmark.yaml with the ResNet-8 at --width (0.25: 16-32-64 channels).
- dafl_derma: ViT-DAFL on DermaMNIST, configs/dafl_dermamnist.yaml as it is (the first recipe: patch tokenizer,
  30 rounds, no operating point).
- dafl_conv_derma: ViT-DAFL's recommended recipe, configs/dafl_conv_dermamnist.yaml as it is (conv tokenizer,
  60 rounds, federated vector calibration, the validation operating point).
- gtafl_sites: the recommended configuration on HAM10000's four hospitals, configs/sites_ham10000.yaml as it is.
- open_bcc: gtafl_derma trained without basal cell carcinoma (--open-set-class): a malignant finding a skin model
  can meet and the sites may not have labelled, with 103 DermaMNIST test images (enough for a stable AUROC, where
  vascular lesions and dermatofibroma have 29 and 23); its test images are the unseen class.
- fedavg_derma_dp: FedAvg under record-level DP (--dp-epsilon 8: the sites train the head on a fixed extractor, the
  private configuration that learns on DermaMNIST; GTAFL under DP stays at chance there), the validation operating
  point, at --width: the detector's statistics released with noise under the one accountant, the prediction sets
  calibrated on the server's validation split.

Far sets in every run: --ood-dicom-dir DATA/dicom plus pydicom's own test files, decoded by the service's decoder;
scikit-image's photographs (random crops); scikit-learn's digits; uniform noise; constant frames. The threshold
keeps 95 % of the validation split; nothing is chosen on test or out-of-domain images.

`--refit` brings runs trained before a change to the server's validation-side decision (tafl.training.detector
.threshold_record: the energy's matching and the threshold) up to date without retraining: the sites' statistics
round is unchanged, so the Gaussian in the checkpoint stands; the step after it is redone on the validation split,
the checkpoint saved, and the report's `domain_detector` measured again (its `refit` says so).

Writes benchmarks/results/domain_detection.json and .md (mean ± sd over the seeds, every seed's value in the JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.training.config import load_config  # noqa: E402
from tafl.training.simulator import train  # noqa: E402

RECOMMENDED = {"method": "gtafl", "calibration": "vector", "calib_holdout": 0.1, "decision": "validation"}
ROWS = {
    "gtafl_derma": ("benchmark.yaml", "medmnist", dict(RECOMMENDED)),
    "dafl_derma": ("dafl_dermamnist.yaml", "medmnist", {}),
    "dafl_conv_derma": ("dafl_conv_dermamnist.yaml", "medmnist", {}),
    "gtafl_sites": ("sites_ham10000.yaml", "ham10000", {}),
    "open_bcc": ("benchmark.yaml", "medmnist", dict(RECOMMENDED, open_set_class="basal cell carcinoma")),
    "fedavg_derma_dp": ("benchmark.yaml", "medmnist",
                        {"method": "fedavg", "decision": "validation", "dp_epsilon": 8.0}),
}
WIDTH_ROWS = ("gtafl_derma", "open_bcc", "fedavg_derma_dp")


def run_row(row: str, seed: int, args) -> dict:
    cfg_file, sub, over = ROWS[row]
    over = dict(over, seed=seed, data_root=str(Path(args.data) / sub), ood_dicom_dir=str(Path(args.data) / "dicom"),
                threads=args.threads)
    if row in WIDTH_ROWS:
        over.update(width=args.width, rounds=args.rounds)
    out = REPO / "benchmarks" / "out" / f"domain_{row}_s{seed}"
    report_file = out / "report.json"
    if report_file.is_file() and not args.force:
        if args.refit:
            t0 = time.perf_counter()
            report = refit(out)
            print(f"{out.name}: refit in {time.perf_counter() - t0:.0f} s", flush=True)
            return report
        print(f"{out.name}: done already", flush=True)
        return json.loads(report_file.read_text())
    t0 = time.perf_counter()
    report = train(load_config(REPO / "configs" / cfg_file, over), out, force=True, progress=False)
    print(f"{out.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return report


def refit(run: Path) -> dict:
    """The run's detector decided again on its validation split from the checkpoint's Gaussian, and measured again;
    the checkpoint and report.json are rewritten. Returns the report."""
    import numpy as np
    import torch

    from tafl.imaging import Preprocess
    from tafl.training.checkpoint import load_checkpoint, save_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.contract import GlobalState
    from tafl.training.detector import detector_report, threshold_record
    from tafl.training.evaluate import predict
    from tafl.training.methods.detector import extract_features
    from tafl.training.models import ModelConfig, build_model
    from tafl.training.prepare import make_method, prepare
    from tafl.training.report import write_report

    ck = load_checkpoint(run / "final.pt")
    report = json.loads((run / "report.json").read_text())
    state = GlobalState.from_dict(ck["state"])
    rec = state.meta.get("domain_detector") or {}
    if not rec.get("fitted"):
        return report
    cfg = RunConfig.from_dict(ck["run_config"], "checkpoint run_config")
    ds = prepare(cfg).dataset
    method = make_method(cfg, ModelConfig.from_dict(ck["model_config"]), Preprocess.from_dict(ck["preprocess"]))
    model = build_model(method.model_cfg)
    model.load_state_dict(state.weights)
    val_feats = extract_features(model, torch.from_numpy(ds.val.images), method.normalize, cfg.eval_batch_size)
    means, precision = (state.extras[k].double().numpy() for k in ("domain.means", "domain.precision"))
    decided = threshold_record(model, means, precision, val_feats)
    rec = {**rec, **decided, "refit": f"the validation-side decision redone on the trained run (was {rec['kind']})"}
    state = GlobalState(state.weights, state.extras, dict(state.meta, domain_detector=rec))
    ck["state"] = state.to_dict()
    save_checkpoint(ck, run / "final.pt")
    out = predict(method.inference_model(state), ds.test.images, method.normalize, cfg.eval_batch_size,
                  keys=method.output_keys)
    report["domain_detector"] = detector_report(method, state, ds, np.asarray(out["label"]), cfg.eval_batch_size,
                                                cfg.test_seed, cfg.ood_dicom_dir)
    write_report(run, report)
    return report


def cost(run: Path, repeats: int = 9, batches: tuple[int, ...] = (1, 64)) -> dict:
    """Package size and ONNX Runtime images per second with and without the detector's output, alternated in one
    process at each batch size (ratios; absolute numbers on this shared machine are noise). Batch 1 is where the
    detector's few small graph nodes weigh most: the service's adaptive batches are mostly 1 to 6 images."""
    import shutil
    import tempfile

    import numpy as np
    import torch

    from tafl.packaging.export import export_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="tafl-domain-cost-"))
    try:
        with_det = export_checkpoint(run / "final.pt", tmp / "with")
        ck = torch.load(run / "final.pt", map_location="cpu", weights_only=False)
        ck["state"]["meta"].pop("domain_detector", None)
        for k in ("domain.means", "domain.precision"):
            ck["state"]["extras"].pop(k, None)
        torch.save(ck, tmp / "plain.pt")
        plain = export_checkpoint(tmp / "plain.pt", tmp / "without")
        sizes = {n: sum(f.stat().st_size for f in (tmp / n).rglob("*") if f.is_file()) for n in ("with", "without")}
        sessions = {"with": (with_det, with_det.session(["CPUExecutionProvider"], 2)),
                    "without": (plain, plain.session(["CPUExecutionProvider"], 2))}
        out: dict = {"bytes_with": sizes["with"], "bytes_without": sizes["without"],
                     "growth_bytes": sizes["with"] - sizes["without"], "repeats": repeats, "batches": {}}
        rng = np.random.default_rng(0)
        pre = with_det.preprocess
        for batch in batches:
            x = pre.normalize(rng.integers(0, 256, (batch, pre.size, pre.size, pre.channels), dtype=np.uint8))
            rates: dict[str, list[float]] = {"with": [], "without": []}
            for _ in range(repeats):
                for name, (pkg, sess) in sessions.items():
                    pkg.run(sess, x)
                    t0, n = time.perf_counter(), 0
                    while time.perf_counter() - t0 < 0.5:
                        pkg.run(sess, x)
                        n += batch
                    rates[name].append(n / (time.perf_counter() - t0))
            out["batches"][str(batch)] = {
                "throughput_ratio": statistics.median(w / o for w, o in zip(rates["with"], rates["without"])),
                "images_per_s_with": statistics.median(rates["with"]),
                "images_per_s_without": statistics.median(rates["without"])}
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summarise(reports: dict[str, dict[int, dict]]) -> dict:
    out = {}
    for row, by_seed in reports.items():
        dets = {s: r.get("domain_detector") or {} for s, r in by_seed.items()}
        entry: dict = {"seeds": sorted(dets), "fitted": {s: bool(d.get("fitted")) for s, d in dets.items()},
                       # the run's own accuracy beside its detector: the mean of the eleven, and pooled balanced
                       # accuracy where the data have sites
                       "average_accuracy": {s: r.get("average_accuracy") for s, r in by_seed.items()},
                       "pooled_balanced_accuracy": {s: r.get("pooled_balanced_accuracy") for s, r in by_seed.items()}}
        ok = {s: d for s, d in dets.items() if d.get("fitted")}
        if not ok:
            out[row] = entry
            continue
        entry["kind"] = {s: d.get("kind", "mahalanobis") for s, d in ok.items()}
        entry["refit"] = {s: d.get("refit") for s, d in ok.items()}
        entry["test_refused"] = {s: d["test"]["refused"] for s, d in ok.items()}
        entry["balanced_accuracy_all"] = {s: d["test"]["balanced_accuracy_all"] for s, d in ok.items()}
        entry["balanced_accuracy_accepted"] = {s: d["test"]["balanced_accuracy_accepted"] for s, d in ok.items()}
        sets: dict = {}
        for s, d in ok.items():
            for name, m in d.get("detection", {}).items():
                for score, vals in m.items():
                    for k, v in vals.items():
                        sets.setdefault(name, {}).setdefault(score, {}).setdefault(k, {})[s] = v
        entry["detection"] = sets
        out[row] = entry
    return out


def ms(values: dict) -> str:
    v = [x for x in values.values() if x is not None]
    if not v:
        return "-"
    sd = statistics.stdev(v) if len(v) > 1 else 0.0
    return f"{statistics.mean(v):.3f} ± {sd:.3f}"


def markdown(summary: dict, costs: dict, args) -> str:
    lines = ["# In-domain detector (issue 53)", "",
             f"Seeds {' '.join(map(str, args.seeds))}; mean ± sd over them. Scale: {args.width}-width ResNet-8, "
             f"{args.rounds} rounds for the DermaMNIST GTAFL rows; ViT-DAFL and the four sites as their configs. "
             "AUROC and FPR at 95 % TPR follow pytorch-ood (out-of-domain positive); `accepted` is the share of a "
             "set the package's threshold lets through.", ""]
    for row, e in summary.items():
        lines += [f"## {row}", ""]
        if "detection" not in e:
            lines += ["no detector fitted", ""]
            continue
        lines += [f"- the run's mean of the eleven: {ms(e.get('average_accuracy', {}))}; pooled balanced accuracy: "
                  f"{ms(e.get('pooled_balanced_accuracy', {}))}",
                  f"- in-domain test images refused: {ms(e['test_refused'])}",
                  f"- balanced accuracy, accepted images: {ms(e['balanced_accuracy_accepted'])}; all images: "
                  f"{ms(e['balanced_accuracy_all'])}", "",
                  f"- score: {', '.join(sorted(set(e['kind'].values())))}", "",
                  "| set | images | score AUROC | FPR95 | accepted | Mahalanobis AUROC | FPR95 | energy AUROC | "
                  "FPR95 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, m in e["detection"].items():
            maha, en = m["mahalanobis"], m.get("energy", {})
            score = m.get("score", maha)  # a report from before the combination: the distance was the score
            lines.append(f"| {name} | {int(statistics.mean(score['images'].values()))} | {ms(score['auroc'])} | "
                         f"{ms(score['fpr95'])} | {ms(score.get('accepted', {}))} | {ms(maha['auroc'])} | "
                         f"{ms(maha['fpr95'])} | {ms(en.get('auroc', {}))} | {ms(en.get('fpr95', {}))} |")
        lines.append("")
    if costs:
        lines += ["## Cost (one package per row, seed " + str(args.seeds[0]) + ")", "",
                  "| row | package growth | batch | ORT images/s with / without |", "| --- | --- | --- | --- |"]
        for row, c in costs.items():
            for batch, b in c["batches"].items():
                lines.append(f"| {row} | {c['growth_bytes'] / 1e3:.1f} kB | {batch} | {b['throughput_ratio']:.3f} "
                             f"({b['images_per_s_with']:.0f} / {b['images_per_s_without']:.0f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                   help="rows to run (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"), help="the shared data folder "
                   "(default: ../shared/data)")
    p.add_argument("--width", type=float, default=0.25, help="ResNet-8 width of the DermaMNIST GTAFL rows "
                   "(default: 0.25)")
    p.add_argument("--rounds", type=int, default=20, help="rounds of the DermaMNIST GTAFL rows (default: 20)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument("--force", action="store_true", help="retrain runs that have a report (default: reuse them)")
    p.add_argument("--refit", action="store_true", help="redo the detector's validation-side decision on runs that "
                   "have a report, without retraining (default: reuse them as they are)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "domain_detection"),
                   help="results path without suffix (default: benchmarks/results/domain_detection)")
    args = p.parse_args()
    reports = {row: {s: run_row(row, s, args) for s in args.seeds} for row in args.rows}
    costs = {}
    for row in args.rows:
        run = REPO / "benchmarks" / "out" / f"domain_{row}_s{args.seeds[0]}"
        if (reports[row][args.seeds[0]].get("domain_detector") or {}).get("fitted"):
            costs[row] = cost(run)
    summary = summarise(reports)
    res = {"rows": summary, "cost": costs, "seeds": args.seeds, "width": args.width, "rounds": args.rounds}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(summary, costs, args))
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
