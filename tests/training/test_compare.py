"""`tafl compare`: repeated seeds of one configuration become one row with mean ± sd; the plot shows the spread."""

from __future__ import annotations

import json
import statistics

import pytest

from tafl.errors import DataError
from tafl.training.compare import compare, run_label, write_comparison
from tafl.training.longtail import DISTRIBUTION_NAMES


def _report(method: str, seed: int, base: float, **cfg) -> dict:
    dists = {n: {"accuracy": base + 0.01 * i, "sampled_accuracy": base, "head": base, "middle": base, "tail": base,
                 "n": 10} for i, n in enumerate(DISTRIBUTION_NAMES)}
    if method == "gtafl":
        cfg = {"expert_form": "shifted", **cfg}  # a run of today's default
    return {"method": method, "dataset": "dermamnist", "config": {"seed": seed, **cfg}, "test_distributions": dists,
            "uniform_metrics": {"macro_f1": base, "precision": base, "recall": base, "specificity": base, "auc": None},
            "timing": {"client_s": 100.0 * seed, "server_s": 10.0}, "communication": {"uplink_bytes": 1e6,
                                                                                      "downlink_bytes": 2e6},
            "switches": {"cr": True, "en": True, "cl": True, "gs": True} if method == "gtafl" else None}


def _write(tmp_path, name, rep):
    d = tmp_path / name
    d.mkdir()
    (d / "report.json").write_text(json.dumps(rep))
    return d


def test_repeated_seeds_become_one_row_with_mean_and_sd(tmp_path):
    runs = [_write(tmp_path, f"g{s}", _report("gtafl", s, b)) for s, b in ((1, 0.40), (2, 0.44), (3, 0.48))]
    runs.append(_write(tmp_path, "c1", _report("creff", 1, 0.30)))
    text, groups = compare(runs)
    assert list(groups) == ["gtafl", "creff"] and len(groups["gtafl"]) == 3
    row = next(line for line in text.splitlines() if line.startswith("| gtafl | 3 (1, 2, 3)"))
    f50 = statistics.mean([40, 44, 48]), statistics.stdev([40, 44, 48])
    assert f"{f50[0]:.2f} ± {f50[1]:.2f}" in row  # forward50 cell: mean ± sample sd of the three seeds
    avg = [100 * (b + 0.05) for b in (0.40, 0.44, 0.48)]  # the mean over the eleven of base + 0.01·i
    assert f"**{statistics.mean(avg):.2f} ± {statistics.stdev(avg):.2f}**" in row
    creff_row = next(line for line in text.splitlines() if line.startswith("| creff | 1 (1)"))
    assert "30.00" in creff_row and "±" not in creff_row  # a single run prints its own numbers
    # time ratios use the group means: gtafl's mean client time 200 s against CReFF's 100 s
    assert "| 2.00× | 1.00× |" in text


def test_labels_separate_ablation_rows_and_the_plot_is_written(tmp_path):
    base = _report("creff", 1, 0.3)
    stats = _report("creff", 1, 0.35, gff_centre=True, final_round_frac=1.0)
    assert run_label(base) == "creff" and run_label(stats) == "creff + statistics"
    nocl = _report("gtafl", 1, 0.4)
    nocl["switches"]["cl"] = False
    assert run_label(nocl) == "gtafl −CL"
    old = _report("gtafl", 1, 0.4)
    del old["config"]["expert_form"]  # a run from before expert_form: each expert its own CE head
    assert run_label(old) == "gtafl [trained experts]"
    assert run_label(_report("gtafl", 1, 0.4, expert_form="trained")) == "gtafl [trained experts]"
    paths = [_write(tmp_path, n, r) for n, r in (("a", base), ("b", stats), ("c", nocl))]
    md, png = tmp_path / "cmp.md", tmp_path / "cmp.png"
    text = write_comparison(paths, md, png)
    assert md.read_text() == text and png.stat().st_size > 1000
    with pytest.raises(DataError, match="2 labels for 3 runs"):
        compare(paths, ["x", "y"])


def test_a_folder_without_a_report_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no report.json"):
        compare([tmp_path])


def test_cli_compare_prints_mean_and_sd_and_writes_the_plot(tmp_path, capsys):
    from tafl.cli import main

    runs = [str(_write(tmp_path, f"r{s}", _report("creff", s, 0.3 + 0.02 * s))) for s in (1, 2, 3)]
    assert main(["compare", *runs, "--out", str(tmp_path / "t.md"), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "| creff | 3 (1, 2, 3) |" in out and "34.00 ± 2.00" in out
    assert (tmp_path / "p.png").stat().st_size > 1000


def _site_report(method: str, seed: int, pooled: float, own: dict[str, float], **cfg) -> dict:
    rep = _report(method, seed, 0.5, **cfg)
    rep["sites"] = {s: {"n_test": 10, "own": {"accuracy": a, "balanced_accuracy": a / 2},
                        "site": {"accuracy": a + 0.005, "balanced_accuracy": a / 2},
                        "adapted": {"accuracy": a + 0.01, "balanced_accuracy": a / 2},
                        "oracle": {"accuracy": a + 0.02, "balanced_accuracy": a / 2}} for s, a in own.items()}
    rep["site_mean"] = {rule: {m: sum(v[rule][m] for v in rep["sites"].values()) / len(own)
                               for m in ("accuracy", "balanced_accuracy")}
                       for rule in ("own", "site", "adapted", "oracle")}
    rep["pooled_balanced_accuracy"] = pooled
    return rep


def test_site_runs_get_a_per_site_table_and_the_decision_names_the_row(tmp_path):
    base = [_site_report("fedavg", s, p, {"north": 0.8, "south": a}, decision="validation")
            for s, p, a in ((1, 0.40, 0.6), (2, 0.44, 0.7))]
    local = _site_report("fedavg", 1, 0.50, {"north": 0.9, "south": 0.5}, decision="validation", local_adjust=1.0)
    plain = _report("fedavg", 1, 0.3)  # a run without sites: no row in the per-site table
    assert run_label(base[0]) == "fedavg + τ on validation"
    assert run_label(local) == "fedavg + local logit adjustment 1 + τ on validation"
    pooled = _report("fedavg", 1, 0.4, decision="validation", centralised=True)
    assert run_label(pooled) == "fedavg [pooled, centralised] + τ on validation"  # not a seed of the FedAvg row
    assert run_label(_report("gtafl", 1, 0.4, calibration="vector")) == "gtafl + vector calibration"
    paths = [_write(tmp_path, f"r{i}", r) for i, r in enumerate([*base, local, plain])]
    text, _ = compare(paths)
    table = text.split("## Per site")[1].split("\n## ")[0]
    assert ("| pooled bal. acc | own | own (bal.) | site | site (bal.) | adapted | adapted (bal.) | oracle | north | "
            "south |") in table
    assert "| 72.50 ± 3.54 | 36.25 ± 1.77 | 73.00 ± 3.54 |" in table  # the site rule: own + 0.5
    row = next(x for x in table.splitlines() if x.startswith("| fedavg + τ on validation | 2 (1, 2) |"))
    # pooled 42 ± 2.83; mean over sites (80+60)/2=70 and (80+70)/2=75 -> 72.50 ± 3.54; south 65.00 ± 7.07
    assert "| 42.00 ± 2.83 | 72.50 ± 3.54 |" in row and row.endswith("| 80.00 ± 0.00 | 65.00 ± 7.07 |")
    assert "| fedavg + local logit adjustment 1 + τ on validation | 1 (1) | 50.00 | 70.00 |" in table
    assert "| fedavg | 1 (1)" not in table
    assert "## Per site" not in compare([paths[-1]])[0]
