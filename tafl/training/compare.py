"""`tafl compare RUN_DIR...`: several runs side by side in the papers' table layouts.

Runs that share a label (the method and its switches, or `--labels`) are one row: repeated seeds
of the same configuration. Such a row prints mean ± standard deviation (sample sd, n − 1) in every
cell and says how many runs and which seeds it holds; a single run prints its own numbers.
Table III (accuracy on the eleven distributions and their mean), Table V (head/middle/tail at
forward50, uniform and backward50), Table VI (client, server, GFF, retraining and SimCLR time)
and Table VII (uplink, downlink, extra bytes against FedAvg), plus the paper metrics of the
uniform prior, each expert's accuracies, and one plot with a line per row (the band is ± sd).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable

from tafl.errors import DataError
from tafl.training.longtail import DISTRIBUTION_NAMES
from tafl.training.report import SHORT, pyplot

DEFAULT_SWITCHES = {"cr": True, "en": True, "cl": True, "gs": True}
Reports = list[dict[str, Any]]


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
    """The configuration a run stands for: method, ablation switches and the non-default GFF options."""
    label = rep["method"]
    sw = rep.get("switches")
    cfg = rep.get("config", {})
    if cfg.get("centralised"):
        label += " [pooled, centralised]"  # one model on every site's rows: the ceiling, never a federated row
    if rep["method"] == "gtafl" and sw and sw != DEFAULT_SWITCHES:
        off = [k.upper() for k, v in sw.items() if not v]
        label += " −" + ",".join(off)
    if rep["method"] == "creff" and (cfg.get("gff_centre") or cfg.get("bank_init") == "stats"
                                     or (cfg.get("final_round_frac") or 0) > 0):
        label += " + statistics"
    if rep["method"] == "gtafl" and (cfg.get("gff_centre") is False or cfg.get("bank_init") == "stats"):
        label += " [" + ", ".join(([] if cfg.get("gff_centre") is not False else ["raw frame"])
                                  + ([] if cfg.get("bank_init") != "stats" else ["stats banks"])) + "]"
    if rep["method"] == "gtafl" and cfg.get("en", True) and cfg.get("expert_form") != "shifted":
        label += " [trained experts]"  # each expert its own CE head: every run before expert_form existed
    if rep.get("simclr_pool", "") and "transductive" in str(rep.get("simclr_pool")):
        label += " (transductive SimCLR)"
    if rep["method"] == "dafl":
        label += f" [{cfg.get('loss', 'dafl')}, {cfg.get('aggregation', 'imbalance')}]"
    if cfg.get("local_adjust"):
        label += f" + local logit adjustment {cfg['local_adjust']:g}"
    if cfg.get("calibration", "none") != "none":
        label += f" + {cfg['calibration']} calibration"
    if cfg.get("decision", "argmax") != "argmax":
        label += " + τ on validation"
    if cfg.get("dp_epsilon") is not None:
        label += f" [DP ε={cfg['dp_epsilon']:g}]"
    if cfg.get("secure_aggregation"):
        label += " [SecAgg+]"
    return label


def group_runs(reports: Reports, labels: list[str]) -> dict[str, Reports]:
    """Runs grouped by label, in first-seen order; a group's runs must be on one dataset."""
    groups: dict[str, Reports] = {}
    for lab, rep in zip(labels, reports):
        groups.setdefault(lab, []).append(rep)
    for lab, reps in groups.items():
        if len({r["dataset"] for r in reps}) > 1:
            raise DataError(f"runs labelled '{lab}' are on different datasets; give them different --labels")
    return groups


def _values(reps: Reports, get: Callable[[dict[str, Any]], Any]) -> list[float]:
    out = []
    for r in reps:
        try:
            v = get(r)
        except (KeyError, TypeError, IndexError):
            v = None
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            out.append(float(v))
    return out


def cell(reps: Reports, get: Callable[[dict[str, Any]], Any], scale: float = 100.0, digits: int = 2) -> str:
    """One table cell: a run's value, or mean ± sd over a group's runs (— where no run has it)."""
    xs = [scale * x for x in _values(reps, get)]
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def mean_sd(reps: Reports, get: Callable[[dict[str, Any]], Any]) -> tuple[float, float] | None:
    xs = _values(reps, get)
    if not xs:
        return None
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def _avg(r: dict[str, Any], key: str = "accuracy") -> float | None:
    vals = [r["test_distributions"][n][key] for n in DISTRIBUTION_NAMES]
    good = [v for v in vals if v is not None]
    return sum(good) / len(good) if good else None


def _seeds(reps: Reports) -> str:
    seeds = [str(r.get("config", {}).get("seed", "?")) for r in reps]
    return f"{len(reps)} ({', '.join(seeds)})"


def _dist_table(groups: dict[str, Reports], key: str) -> list[str]:
    lines = ["| | runs (seeds) | " + " | ".join(SHORT[n] for n in DISTRIBUTION_NAMES) + " | Avg |",
             "|" + "---|" * (len(DISTRIBUTION_NAMES) + 3)]
    for lab, reps in groups.items():
        cells = [cell(reps, lambda r, n=n: r["test_distributions"][n][key]) for n in DISTRIBUTION_NAMES]
        lines.append(f"| {lab} | {_seeds(reps)} | " + " | ".join(cells) + f" | **{cell(reps, lambda r: _avg(r, key))}** |")
    return lines


def _site_table(groups: dict[str, Reports]) -> list[str]:
    """Runs with --client-column: the pooled balanced accuracy (FLamby's number), the mean over sites of each
    site's own-mix accuracy at the model's own rule, at the site's own training mix, adapted to the mix estimated
    from the site's unlabeled images and at its true mix, and each site's own-rule accuracy."""
    if not any(r.get("sites") for reps in groups.values() for r in reps):
        return []
    site_names = sorted({s for reps in groups.values() for r in reps for s in (r.get("sites") or {})})
    lines = ["", "## Per site — each site's own test images (%)", "",
             "Pooled: balanced accuracy over every site's test images at the model's own rule. Mean over sites: "
             "accuracy (balanced accuracy) on each site's own case mix at the model's own rule, at the site's own "
             "training mix (site: `prior=site`, no test image used), adapted to the mix estimated from the site's "
             "unlabeled test images, and at the site's true mix (oracle). Then each site's own-rule accuracy.", "",
             "| | runs (seeds) | pooled bal. acc | own | own (bal.) | site | site (bal.) | adapted | adapted (bal.) "
             "| oracle | " + " | ".join(site_names) + " |", "|" + "---|" * (10 + len(site_names))]
    for lab, reps in groups.items():
        if not any(r.get("sites") for r in reps):
            continue
        cells = [cell(reps, lambda r: r["pooled_balanced_accuracy"])]
        for rule, metric in (("own", "accuracy"), ("own", "balanced_accuracy"), ("site", "accuracy"),
                             ("site", "balanced_accuracy"), ("adapted", "accuracy"), ("adapted", "balanced_accuracy"),
                             ("oracle", "accuracy")):
            cells.append(cell(reps, lambda r, a=rule, m=metric: r["site_mean"][a][m]))
        cells += [cell(reps, lambda r, s=s: r["sites"][s]["own"]["accuracy"]) for s in site_names]
        lines.append(f"| {lab} | {_seeds(reps)} | " + " | ".join(cells) + " |")
    return lines


def _privacy_table(groups: dict[str, Reports]) -> list[str]:
    """ε per configuration: the target and what the accountant says each run spent (∞: no DP)."""
    lines = ["", "## Privacy", "", "| method | ε target | ε spent (accountant) | δ | noise multiplier (DP-SGD's; lda: its "
             "releases') | secure aggregation |", "|---|---|---|---|---|---|"]
    for lab, reps in groups.items():
        p0 = reps[0].get("privacy") or {}
        if p0.get("epsilon") is None:
            lines.append(f"| {lab} | ∞ | ∞ | — | — | {'yes' if p0.get('secure_aggregation') else 'no'} |")
            continue
        spent = cell(reps, lambda r: r["privacy"]["epsilon"], scale=1, digits=2)
        z = cell(reps, lambda r: r["privacy"]["noise_multiplier"]["max"], scale=1, digits=2)
        lines.append(f"| {lab} | {p0.get('epsilon_target')} | {spent} | {p0.get('delta'):.0e} | {z} | "
                     f"{'yes' if p0.get('secure_aggregation') else 'no'} |")
    return lines


def compare(paths: list[str | Path], labels: list[str] | None = None) -> tuple[str, dict[str, Reports]]:
    reports = [load_report(p) for p in paths]
    names = labels or [run_label(r) for r in reports]
    if len(names) != len(reports):
        raise DataError(f"{len(names)} labels for {len(reports)} runs")
    groups = group_runs(reports, names)
    datasets = {r["dataset"] for r in reports}
    multi = any(len(g) > 1 for g in groups.values())
    lines = [f"# Comparison on {', '.join(sorted(datasets))}", ""]
    if multi:
        lines += ["Runs with the same label are repeated seeds of one configuration: each cell is mean ± sd over "
                  "them (a difference inside the spread is no difference).", ""]
    lines += ["## Table III — prior-weighted accuracy per test distribution (%)", ""]
    lines += _dist_table(groups, "accuracy")
    lines += ["", "Sampled-subset accuracy (the paper's protocol; noisy on small test classes):", ""]
    lines += _dist_table(groups, "sampled_accuracy")
    lines += ["", "## Table V — head / middle / tail (%)", "",
              "| method | F50 all | head | middle | tail | Uni all | head | middle | tail | B50 all | head | middle | tail |",
              "|---|" + "---|" * 12]
    for lab, reps in groups.items():
        cells = [cell(reps, lambda r, d=d, g=g: r["test_distributions"][d][g])
                 for d in ("forward50", "uniform", "backward50") for g in ("accuracy", "head", "middle", "tail")]
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    lines += ["", "## Uniform-prior metrics (%)", "", "| method | macro F1 | precision | recall | specificity | AUC |",
              "|---|---|---|---|---|---|"]
    for lab, reps in groups.items():
        cells = [cell(reps, lambda r, k=k: r["uniform_metrics"][k])
                 for k in ("macro_f1", "precision", "recall", "specificity", "auc")]
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    lines += ["", "## Table VI — time (s, summed over rounds)", "",
              "| method | client | server | GFF opt | retrain | SimCLR | client/CReFF | server/CReFF |",
              "|---|---|---|---|---|---|---|---|"]
    creff = next((g for lab, g in groups.items() if g[0]["method"] == "creff" and "statistics" not in lab), None)
    for lab, reps in groups.items():
        t = [cell(reps, lambda r, k=k: r["timing"][k], scale=1, digits=1)
             for k in ("client_s", "server_s", "gff_s", "retrain_s", "simclr_s")]
        ratios = []
        for k in ("client_s", "server_s"):
            base = mean_sd(creff, lambda r, k=k: r["timing"][k]) if creff else None
            mine = mean_sd(reps, lambda r, k=k: r["timing"][k])
            ratios.append(f"{mine[0] / base[0]:.2f}×" if base and mine and base[0] > 0 else "—")
        lines.append(f"| {lab} | " + " | ".join(t + ratios) + " |")
    lines += ["", "## Table VII — communication", "", "| method | uplink MB | downlink MB | extra vs FedAvg MB |",
              "|---|---|---|---|"]
    fedavg = next((g for g in groups.values() if g[0]["method"] == "fedavg"), None)
    for lab, reps in groups.items():
        up = mean_sd(reps, lambda r: r["communication"]["uplink_bytes"])
        down = mean_sd(reps, lambda r: r["communication"]["downlink_bytes"])
        extra = "—"
        if fedavg and up and down:
            fu = mean_sd(fedavg, lambda r: r["communication"]["uplink_bytes"])
            fd = mean_sd(fedavg, lambda r: r["communication"]["downlink_bytes"])
            if fu and fd:
                extra = f"{(up[0] + down[0] - fu[0] - fd[0]) / 1e6:.2f}"
        lines.append(f"| {lab} | {up[0] / 1e6 if up else 0:.2f} | {down[0] / 1e6 if down else 0:.2f} | {extra} |")
    lines += _privacy_table(groups)
    lines += _site_table(groups)
    if any(r.get("experts") for r in reports):
        lines += ["", "## Experts (prior-weighted accuracy, %)", ""]
        for lab, reps in groups.items():
            names = [e for e in (reps[0].get("experts") or {})]
            if not names:
                continue
            lines += [f"**{lab}**", "", "| expert | " + " | ".join(SHORT[n] for n in DISTRIBUTION_NAMES) + " | Avg |",
                      "|" + "---|" * (len(DISTRIBUTION_NAMES) + 2)]
            for e in names:
                cells = [cell(reps, lambda r, e=e, n=n: r["experts"][e][n]["accuracy"]) for n in DISTRIBUTION_NAMES]
                avg = cell(reps, lambda r, e=e: _avg({"test_distributions": r["experts"][e]}))
                lines.append(f"| {e} | " + " | ".join(cells) + f" | {avg} |")
            lines.append("")
    return "\n".join(lines) + "\n", groups


def plot_groups(path: Path, groups: dict[str, Reports]) -> None:
    """One line per row (mean over its runs) with a ± sd band where a row holds several runs."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = list(range(len(DISTRIBUTION_NAMES)))
    for lab, reps in groups.items():
        stats = [mean_sd(reps, lambda r, n=n: r["test_distributions"][n]["accuracy"]) for n in DISTRIBUTION_NAMES]
        mu = [math.nan if s is None else 100 * s[0] for s in stats]
        sd = [0.0 if s is None else 100 * s[1] for s in stats]
        name = lab if len(reps) == 1 else f"{lab} (n={len(reps)}, ± sd)"
        (line,) = ax.plot(x, mu, marker="o", label=name)
        if len(reps) > 1:
            ax.fill_between(x, [m - s for m, s in zip(mu, sd)], [m + s for m, s in zip(mu, sd)],
                            color=line.get_color(), alpha=0.18, linewidth=0)
    ax.set_xticks(x, [SHORT[n] for n in DISTRIBUTION_NAMES])
    ax.set_xlabel("test distribution (forward = training prior, backward = reversed)")
    ax.set_ylabel("prior-weighted accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_comparison(paths: list[str | Path], out_md: Path | None, plot: Path | None,
                     labels: list[str] | None = None) -> str:
    text, groups = compare(paths, labels)
    if out_md:
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.write_text(text)
    if plot:
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_groups(plot, groups)
    return text
