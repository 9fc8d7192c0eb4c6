"""`tafl compare RUN_DIR...`: several runs side by side in the papers' table layouts.

Table III (accuracy on the eleven distributions and their mean), Table V (head/middle/tail at
forward50, uniform and backward50), Table VI (client, server, GFF, retraining and SimCLR time)
and Table VII (uplink, downlink, extra bytes against FedAvg), plus the paper metrics of the
uniform prior, and one plot with a line per run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tafl.errors import DataError
from tafl.training.report import distribution_table, pct, plot_accuracy

DEFAULT_SWITCHES = {"cr": True, "en": True, "cl": True, "gs": True}


def load_report(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    f = p / "report.json" if p.is_dir() else p
    if not f.is_file():
        raise DataError(f"{p}: no report.json (is it a tafl run folder?)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{f}: not valid JSON ({exc})") from exc


def run_label(rep: dict[str, Any]) -> str:
    label = rep["method"]
    sw = rep.get("switches")
    if rep["method"] == "gtafl" and sw and sw != DEFAULT_SWITCHES:
        off = [k.upper() for k, v in sw.items() if not v]
        label += " −" + ",".join(off)
    if rep.get("simclr_pool", "") and "transductive" in str(rep.get("simclr_pool")):
        label += " (transductive SimCLR)"
    cfg = rep.get("config", {})
    if rep["method"] == "dafl":
        label += f" [{cfg.get('loss', 'dafl')}, {cfg.get('aggregation', 'imbalance')}]"
    return label


def compare(paths: list[str | Path], labels: list[str] | None = None) -> tuple[str, dict[str, dict[str, Any]]]:
    reports = [load_report(p) for p in paths]
    names = labels or [run_label(r) for r in reports]
    if len(names) != len(reports):
        raise DataError(f"{len(names)} labels for {len(reports)} runs")
    seen: dict[str, int] = {}
    uniq = []
    for n in names:  # two runs with the same label stay apart
        seen[n] = seen.get(n, 0) + 1
        uniq.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    runs = dict(zip(uniq, reports))
    datasets = {r["dataset"] for r in reports}
    lines = [f"# Comparison on {', '.join(sorted(datasets))}", "",
             "## Table III — prior-weighted accuracy per test distribution (%)", ""]
    lines += distribution_table(runs)
    lines += ["", "Sampled-subset accuracy (the paper's protocol; noisy on small test classes):", ""]
    lines += distribution_table({n: {"test_distributions": {k: {"accuracy": d["sampled_accuracy"]}
                                                            for k, d in r["test_distributions"].items()}}
                                 for n, r in runs.items()})
    lines += ["", "## Table V — head / middle / tail (%)", "",
              "| method | F50 all | head | middle | tail | Uni all | head | middle | tail | B50 all | head | middle | tail |",
              "|---|" + "---|" * 12]
    for n, r in runs.items():
        cells = []
        for dist in ("forward50", "uniform", "backward50"):
            d = r["test_distributions"][dist]
            cells += [pct(d["accuracy"]), pct(d["head"]), pct(d["middle"]), pct(d["tail"])]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "## Uniform-prior metrics (%)", "", "| method | macro F1 | precision | recall | specificity | AUC |",
              "|---|---|---|---|---|---|"]
    for n, r in runs.items():
        m = r["uniform_metrics"]
        lines.append(f"| {n} | {pct(m['macro_f1'])} | {pct(m['precision'])} | {pct(m['recall'])} | "
                     f"{pct(m['specificity'])} | {pct(m['auc'])} |")
    lines += ["", "## Table VI — time (s, summed over rounds)", "",
              "| method | client | server | GFF opt | retrain | SimCLR | client/CReFF | server/CReFF |",
              "|---|---|---|---|---|---|---|---|"]
    creff = next((r for r in reports if r["method"] == "creff"), None)
    for n, r in runs.items():
        t = r.get("timing", {})
        rc = rs = "—"
        if creff:
            tc = creff.get("timing", {})
            if tc.get("client_s"):
                rc = f"{t.get('client_s', 0) / tc['client_s']:.2f}×"
            if tc.get("server_s"):
                rs = f"{t.get('server_s', 0) / tc['server_s']:.2f}×"
        lines.append(f"| {n} | {_s(t.get('client_s'))} | {_s(t.get('server_s'))} | {_s(t.get('gff_s'))} | "
                     f"{_s(t.get('retrain_s'))} | {_s(t.get('simclr_s'))} | {rc} | {rs} |")
    lines += ["", "## Table VII — communication", "", "| method | uplink MB | downlink MB | extra vs FedAvg MB |",
              "|---|---|---|---|"]
    fedavg = next((r for r in reports if r["method"] == "fedavg"), None)
    for n, r in runs.items():
        c = r.get("communication", {})
        up, down = c.get("uplink_bytes", 0), c.get("downlink_bytes", 0)
        extra = "—"
        if fedavg:
            fc = fedavg.get("communication", {})
            extra = f"{(up + down - fc.get('uplink_bytes', 0) - fc.get('downlink_bytes', 0)) / 1e6:.2f}"
        lines.append(f"| {n} | {up / 1e6:.2f} | {down / 1e6:.2f} | {extra} |")
    if any(r.get("experts") for r in reports):
        lines += ["", "## Experts (prior-weighted accuracy, %)", ""]
        for n, r in runs.items():
            if r.get("experts"):
                lines += [f"**{n}**", ""]
                lines += distribution_table({e: {"test_distributions": d} for e, d in r["experts"].items()})
                lines.append("")
    return "\n".join(lines) + "\n", runs


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def write_comparison(paths: list[str | Path], out_md: Path | None, plot: Path | None,
                     labels: list[str] | None = None) -> str:
    text, runs = compare(paths, labels)
    if out_md:
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.write_text(text)
    if plot:
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_accuracy(plot, runs)
    return text
