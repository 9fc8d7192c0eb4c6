"""Run reports: `report.json` (the schema other tools read), `report.md` (tables), `accuracy.png`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

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


def write_report(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", report)
    (out / "report.md").write_text(render_markdown(report))
    plot_accuracy(out / "accuracy.png", {report.get("label") or report["method"]: report})


def distribution_table(rows: dict[str, dict[str, Any]], key: str = "accuracy") -> list[str]:
    head = "| | " + " | ".join(SHORT[n] for n in DISTRIBUTION_NAMES) + " | Avg |"
    lines = [head, "|" + "---|" * (len(DISTRIBUTION_NAMES) + 2)]
    for label, rep in rows.items():
        vals = [rep["test_distributions"][n][key] for n in DISTRIBUTION_NAMES]
        good = [v for v in vals if v is not None]
        avg = sum(good) / len(good) if good else None
        lines.append(f"| {label} | " + " | ".join(pct(v) for v in vals) + f" | {pct(avg)} |")
    return lines


def render_markdown(r: dict[str, Any]) -> str:
    lines = [f"# {r['method']} on {r['dataset']}", ""]
    lines += [f"Kept model: round {r.get('selected_round')} ({r.get('selection', 'last')}); "
              f"mean prior-weighted accuracy over the eleven distributions **{pct(r['average_accuracy'])} %**.", ""]
    lines += ["## Accuracy per test distribution (%)", "",
              "Prior-weighted = Σ_c π_c·acc_c on the whole test split (DESIGN.md §3); sampled = the paper's "
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
    m = r["uniform_metrics"]
    lines += ["", "## Uniform-prior metrics (%)", "", "| macro F1 | precision | recall | specificity | AUC |",
              "|---|---|---|---|---|",
              f"| {pct(m['macro_f1'])} | {pct(m['precision'])} | {pct(m['recall'])} | {pct(m['specificity'])} | "
              f"{pct(m['auc'])} |"]
    names = r.get("class_names", [])
    if names:
        lines += ["", "## Per class", "", "| class | train rank | train count | test count | accuracy | recall (uniform) |",
                  "|---|---|---|---|---|---|"]
        for c, name in enumerate(names):
            lines.append(f"| {name} | {r['class_ranks'][c]} | {r['train_class_counts'][c]} | "
                         f"{r['test_class_counts'][c]} | {pct(r['per_class_accuracy'][c])} | "
                         f"{pct(m['per_class']['recall'][c])} |")
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


def _f(v: float | None) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def plot_accuracy(path: Path, reports: dict[str, dict[str, Any]], key: str = "accuracy") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
