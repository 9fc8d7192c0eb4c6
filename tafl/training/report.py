"""Run reports: `report.json` (the schema other tools read), `report.md` (tables), `accuracy.png`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from tafl.training.longtail import DISTRIBUTION_NAMES

SHORT = {"forward50": "F50", "forward25": "F25", "forward10": "F10", "forward5": "F5", "forward2": "F2",
         "uniform": "Uni", "backward2": "B2", "backward5": "B5", "backward10": "B10", "backward25": "B25",
         "backward50": "B50"}


def pct(v: float | None) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.2f}"


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def write_report(out: Path, report: dict[str, Any], outputs: dict[str, Any] | None = None) -> None:
    """report.json, report.md, accuracy.png; with test outputs also confusion.png and roc.png."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", report)
    (out / "report.md").write_text(render_markdown(report))
    plot_accuracy(out / "accuracy.png", {report.get("label") or report["method"]: report})
    if outputs is not None:
        names = report.get("class_names") or [str(i) for i in range(outputs["probs"].shape[1])]
        plot_confusion(out / "confusion.png", np.asarray(report["confusion_matrix"]), names)
        plot_roc(out / "roc.png", outputs["probs"], outputs["labels"], names)


def plot_confusion(path: Path, cm: np.ndarray, names: list[str]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(names), 1.0 + 0.7 * len(names)))
    rows = cm / np.clip(cm.sum(1, keepdims=True), 1, None)
    ax.imshow(rows, cmap="Blues", vmin=0, vmax=1)
    for i in range(len(names)):
        for j in range(len(names)):
            ax.text(j, i, str(int(cm[i, j])), ha="center", va="center",
                    color="white" if rows[i, j] > 0.5 else "black", fontsize=8)
    short = [n if len(n) <= 14 else n[:13] + "…" for n in names]
    ax.set_xticks(range(len(names)), short, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(names)), short, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true (test split; colour = row share)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_roc(path: Path, probs: np.ndarray, labels: np.ndarray, names: list[str]) -> None:
    from sklearn.metrics import auc, roc_curve

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    for c, name in enumerate(names):
        if not (labels == c).any() or (labels == c).all():
            continue
        fpr, tpr, _ = roc_curve(labels == c, probs[:, c])
        ax.plot(fpr, tpr, label=f"{name[:24]} (AUC {auc(fpr, tpr):.2f})")
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title("one-vs-rest ROC per class (test split)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def distribution_table(rows: dict[str, dict[str, Any]], key: str = "accuracy") -> list[str]:
    head = "| | " + " | ".join(SHORT[n] for n in DISTRIBUTION_NAMES) + " | Avg |"
    lines = [head, "|" + "---|" * (len(DISTRIBUTION_NAMES) + 2)]
    for label, rep in rows.items():
        vals = [rep["test_distributions"][n][key] for n in DISTRIBUTION_NAMES]
        good = [v for v in vals if v is not None]
        avg = sum(good) / len(good) if good else None
        lines.append(f"| {label} | " + " | ".join(pct(v) for v in vals) + f" | {pct(avg)} |")
    return lines


def gap_table(dists: dict[str, dict[str, Any]]) -> list[str]:
    """The gap to the oracle with its bootstrap interval, beside the finest difference the test split can show."""
    if not all(dists.get(n, {}).get("gap") for n in DISTRIBUTION_NAMES):
        return []  # reports written before the gap was recorded
    n = dists[DISTRIBUTION_NAMES[0]]["gap"]["n"]
    reps = dists[DISTRIBUTION_NAMES[0]]["gap"]["replicates"]
    gaps = [dists[k]["gap"] for k in DISTRIBUTION_NAMES]
    lines = ["", f"Gap to the oracle at n = {n} (oracle − EM {n}, points), its 90 % interval (a paired bootstrap over "
             f"the test images, {reps} replicates) and `one image`: the most one test image moves the distribution's "
             "accuracy. A gap whose interval reaches 0 is not one these images can show.", "",
             "| | " + " | ".join(SHORT[k] for k in DISTRIBUTION_NAMES) + " |",
             "|" + "---|" * (len(DISTRIBUTION_NAMES) + 1),
             "| gap | " + " | ".join(pct(g["value"]) for g in gaps) + " |",
             "| 90 % interval | " + " | ".join(f"{pct(g['lo'])} – {pct(g['hi'])}" for g in gaps) + " |",
             "| one image | " + " | ".join(pct(dists[k].get("one_image")) for k in DISTRIBUTION_NAMES) + " |"]
    return lines


def site_table(r: dict[str, Any]) -> list[str]:
    """The per-site section (--client-column): each site's own test rows, its real case mix, at the model's own
    rule, at the site's own training mix, adapted to the mix estimated from that site's unlabeled images, and at
    the site's true mix."""
    sites = r.get("sites")
    if not sites:
        return []
    lines = ["", "## Per site: each site's own test images (%)", "",
             f"Pooled test split, balanced accuracy at the model's own rule: **{pct(r['pooled_balanced_accuracy'])}**. "
             "Per site: accuracy / balanced accuracy at the model's own rule, at the site's own training mix "
             "(`prior=site`: no test image used), adapted to the case mix estimated from the site's unlabeled test "
             "images, and at the site's true mix (the oracle).", "",
             "| site | test images | own | site | adapted | oracle | estimate's TV |", "|---|---|---|---|---|---|---|"]

    def cell(d: dict[str, float] | None) -> str:
        return f"{pct(d['accuracy'])} / {pct(d['balanced_accuracy'])}" if d else "—"

    for name, s in sites.items():
        lines.append(f"| {name} | {s['n_test']} | {cell(s['own'])} | {cell(s.get('site'))} | {cell(s['adapted'])} | "
                     f"{cell(s['oracle'])} | {s['estimate_tv']:.3f} |")
    m = r.get("site_mean") or {}
    if m:
        lines.append(f"| mean over sites | | {cell(m['own'])} | {cell(m.get('site'))} | {cell(m['adapted'])} | "
                     f"{cell(m['oracle'])} | |")
    if r.get("sites_without_test"):
        lines += ["", f"Sites without test rows (not evaluated): {', '.join(r['sites_without_test'])}."]
    return lines


def calibration_text(pa: dict[str, Any]) -> str:
    """How the report's posteriors are calibrated, and whether the validation check shipped the fit."""
    cal = pa["calibration"]
    check = cal.get("fit", {}).get("check") or {}
    how = (f"calibrated ({cal['kind']}, T {cal['temperature']:.3f}, fitted federatedly on "
           f"{cal.get('fit', {}).get('images', '?')} held-out client images)" if pa.get("calibrated")
           else "uncalibrated (no calibration round; `--calibration vector --calib-holdout 0.1`)")
    if check.get("checked") and check.get("shipped"):
        how += (f", checked on {check['images']} validation images: NLL {check['nll_uncalibrated']:.4f} "
                f"uncalibrated, {check['nll_calibrated']:.4f} calibrated")
    elif check.get("checked"):
        how = f"uncalibrated: {check['why']}"
    return how


def render_markdown(r: dict[str, Any]) -> str:
    lines = [f"# {r['method']} on {r['dataset']}", ""]
    lines += [f"Kept model: round {r.get('selected_round')} ({r.get('selection', 'last')}); "
              f"mean prior-weighted accuracy over the eleven distributions **{pct(r['average_accuracy'])} %**.", ""]
    dec = r.get("decision")
    if dec:
        sc, at = dec.get("scores", {}), f"{dec['tau']:.1f}"
        lines += [f"Operating point: label = argmax(z − τ·log π) with τ **{dec['tau']:.1f}**, chosen on "
                  f"{dec.get('validation_images', '?')} validation images by {dec.get('criterion', '')} "
                  f"({pct(sc.get(at))} % against {pct(sc.get('0.0'))} % at the argmax); every "
                  "label below is decided there, the probabilities are the model's.", ""]
    lines += ["## Accuracy per test distribution (%)", "",
              "Prior-weighted = Σ_c π_c·acc_c on the whole test split (docs/design.md §3); sampled = the paper's "
              "subset accuracy.", ""]
    lines += distribution_table({"prior-weighted": r, "sampled": {"test_distributions": {
        n: {"accuracy": d["sampled_accuracy"]} for n, d in r["test_distributions"].items()}}})
    lines += ["", "| distribution | accuracy | sampled | n | head | middle | tail |", "|---|---|---|---|---|---|---|"]
    for n in DISTRIBUTION_NAMES:
        d = r["test_distributions"][n]
        lines.append(f"| {n} | {pct(d['accuracy'])} | {pct(d['sampled_accuracy'])} | {d['n']} | {pct(d['head'])} | "
                     f"{pct(d['middle'])} | {pct(d['tail'])} |")
    if r.get("experts"):
        lines += ["", "## Experts (prior-weighted accuracy, %)", ""]
        lines += distribution_table({name: {"test_distributions": e} for name, e in r["experts"].items()})
    pa = r.get("prior_adaptation")
    if pa:
        how = calibration_text(pa)
        from tafl.prior import PriorEstimator

        est = pa.get("estimator") or {}
        chosen = (f", the smoothing chosen on {est.get('validation_images')} validation images" if
                  est.get("chosen") == "validation" else "")
        lines += ["", "## Prior-aware inference (%)", "",
                  f"Posteriors: {pa['posteriors']}, {how}. `EM n`: the decision adapted to the class prior estimated "
                  f"from n unlabeled test images drawn with the distribution's prior (mean of {pa['draws']} draws) by "
                  f"{PriorEstimator.from_dict(est).describe()}{chosen}; `oracle`: adapted to the true prior; "
                  "`calibrated`: the calibrated posteriors' own argmax.", ""]
        rows = {"plain rule": r, "calibrated": {"test_distributions": {
            n: {"accuracy": d.get("calibrated")} for n, d in r["test_distributions"].items()}}}
        for size in pa["sizes"]:
            rows[f"EM {size}"] = {"test_distributions": {n: {"accuracy": d["adaptive"][str(size)]["accuracy"]}
                                                         for n, d in r["test_distributions"].items()}}
            rows[f"estimate TV, {size}"] = {"test_distributions": {n: {"accuracy": d["adaptive"][str(size)]["tv"]}
                                                                  for n, d in r["test_distributions"].items()}}
        rows["oracle"] = {"test_distributions": {n: {"accuracy": d.get("oracle")}
                                                 for n, d in r["test_distributions"].items()}}
        lines += distribution_table(rows)
        lines += gap_table(r["test_distributions"])
    lines += site_table(r)
    v = r.get("validation")
    if v and v.get("distribution_accuracy"):
        lines += ["", "## Validation split (%)", "",
                  f"Accuracy {pct(v['accuracy'])}, balanced accuracy {pct(v['balanced_accuracy'])}; prior-weighted "
                  "accuracy per distribution:", ""]
        lines += distribution_table({"validation": {"test_distributions": {
            n: {"accuracy": a} for n, a in v["distribution_accuracy"].items()}}})
    m = r["uniform_metrics"]
    lines += ["", "## Metrics (%)", "", "| test mix | accuracy | macro F1 | precision | recall | specificity | AUC |",
              "|---|---|---|---|---|---|---|",
              f"| uniform prior | {pct(r['test_distributions']['uniform']['accuracy'])} | {pct(m['macro_f1'])} | "
              f"{pct(m['precision'])} | {pct(m['recall'])} | {pct(m['specificity'])} | {pct(m['auc'])} |"]
    nm = r.get("natural_metrics")
    if nm:
        lines.append(f"| the test split as it comes | {pct(nm['accuracy'])} | {pct(nm['macro_f1'])} | "
                     f"{pct(nm['precision'])} | {pct(nm['recall'])} | {pct(nm['specificity'])} | {pct(nm['auc'])} |")
    names = r.get("class_names", [])
    if names:
        lines += ["", "## Per class", "", "| class | train rank | train count | test count | accuracy | recall (uniform) |",
                  "|---|---|---|---|---|---|"]
        for c, name in enumerate(names):
            lines.append(f"| {name} | {r['class_ranks'][c]} | {r['train_class_counts'][c]} | "
                         f"{r['test_class_counts'][c]} | {pct(r['per_class_accuracy'][c])} | "
                         f"{pct(m['per_class']['recall'][c])} |")
    lines += sets_lines(r.get("conformal"))
    if r.get("privacy"):
        from tafl.privacy_text import privacy_lines

        lines += ["", "## Privacy", ""] + privacy_lines(r["privacy"])
    t, cm = r.get("timing", {}), r.get("communication", {})
    if t:
        lines += ["", "## Cost", "", "| " + " | ".join(t) + " |", "|" + "---|" * len(t),
                  "| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in t.values()) + " |"]
    if cm:
        lines += ["", f"Communication: uplink {cm.get('uplink_bytes', 0) / 1e6:.2f} MB, downlink "
                      f"{cm.get('downlink_bytes', 0) / 1e6:.2f} MB over {r.get('rounds_run', '?')} rounds."]
    hist = r.get("history", [])
    if hist:
        lines += ["", "## Rounds", "", "| round | clients | loss | val acc | val balanced acc | seconds |",
                  "|---|---|---|---|---|---|"]
        for h in hist:
            lines.append(f"| {h['round']} | {len(h.get('clients', []))} | {_f(h.get('loss'))} | {pct(h.get('val_acc'))} | "
                         f"{pct(h.get('val_bacc'))} | {_f(h.get('seconds'))} |")
    return "\n".join(lines) + "\n"


def sets_lines(c: dict[str, Any] | None) -> list[str]:
    """The conformal prediction sets (tafl.training.sets) in the markdown report: per level, coverage and mean set
    size on the test split as it comes and at the worst of the eleven mixes, class-conditional and marginal."""
    if not c:
        return []
    if not c.get("fitted"):
        return ["", "## Prediction sets", "", f"None fitted: {c.get('why', 'unknown')}."]
    lines = ["", "## Prediction sets", "",
             f"Class-conditional conformal sets from {c['calibration_images']} calibration images "
             f"({c['source']}); the marginal variant uses one threshold for every class. "
             + ("Each class's coverage reaches its level on average over the calibration rows' draw."
                if c.get("confidence") is None else
                f"Each class's coverage reaches its level with probability {c['confidence']:g} over the calibration "
                "rows' draw (a class with too few rows for that is in every set)."), "",
             "| level | sets | coverage | mean size | lowest coverage over the eleven mixes |", "|---|---|---|---|---|"]
    for level, entry in c.get("levels", {}).items():
        for variant, v in entry.items():
            if variant != "site_aware":
                lines.append(f"| {level} | {variant.replace('_', '-')} | {pct(v['coverage'])} | {v['size']:.2f} | "
                             f"{pct(v['lowest_mix_coverage'])} |")
    level = "0.9"  # tafl.training.sets.REPORT_LEVEL
    entry = c.get("levels", {}).get(level) or {}
    if "site_aware" in entry:  # each site's test images under the federation's thresholds and under the site's own
        fed = entry["class_conditional"].get("sites", {})
        lines += ["", f"Per site at {level}: the federation's thresholds against each site's own.", "",
                  "| site | test images | federation: coverage / size | the site's own: coverage / size |",
                  "|---|---|---|---|"]
        for name, v in entry["site_aware"]["sites"].items():
            f = fed.get(name, {})
            lines.append(f"| {name} | {v['images']} | {pct(f.get('coverage'))} / {_f(f.get('size'))} | "
                         f"{pct(v['coverage'])} / {v['size']:.2f} |")
    return lines


def _f(v: float | None) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def plot_accuracy(path: Path, reports: dict[str, dict[str, Any]], key: str = "accuracy") -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = list(range(len(DISTRIBUTION_NAMES)))
    for label, rep in reports.items():
        y = [rep["test_distributions"][n][key] for n in DISTRIBUTION_NAMES]
        ax.plot(x, [math.nan if v is None else 100 * v for v in y], marker="o", label=label)
    ax.set_xticks(x, [SHORT[n] for n in DISTRIBUTION_NAMES])
    ax.set_xlabel("test distribution (forward = training prior, backward = reversed)")
    ax.set_ylabel("prior-weighted accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
