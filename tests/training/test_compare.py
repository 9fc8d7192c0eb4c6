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
