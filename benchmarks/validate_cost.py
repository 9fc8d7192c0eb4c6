"""What a site's validation costs beside scoring the same folder (issue 55), and what each of the four HAM10000
sites sees when it validates the package on its own test fold.

    python benchmarks/validate_cost.py [--run benchmarks/out/domain_gtafl_sites_s1] [--repeats 3]
        [--core-python .venv-core/bin/python]

The package: the run's checkpoint exported (the recommended GTAFL configuration on the four Fed-ISIC2019 sites of
HAM10000, from benchmarks/domain_detection.py). The folder: the split's test fold (2,003 JPEGs, linked into one
folder). Side by side in one run, alternating, `repeats` times each: `tafl score FOLDER --package PKG` and `tafl
validate PKG FOLDER --labels CSV` (its report's pictures included), each a fresh process; the ratio of the median
times is the target (at most 1.2). Then each site validates on its own test fold, with a criterion taken from
the card (balanced accuracy at least 0.3). `--core-python`: the timed commands run under the core install's
interpreter (no torch; this checkout on its path), as a site would run them. Writes
benchmarks/results/validate_cost.json and .md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPLIT = REPO.parent / "shared" / "data" / "ham10000" / "fed-isic2019" / "split.csv"
IMAGES = REPO.parent / "shared" / "data" / "ham10000" / "images"
TAFL = [sys.executable, "-m", "tafl.cli"]


def test_rows(site: str | None = None) -> list[dict]:
    with open(SPLIT, newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["fold"] == "test" and (site is None or r["center_name"] == site)]


def folder(rows: list[dict], where: Path) -> tuple[Path, Path]:
    """WHERE/img (links to the rows' JPEGs) and WHERE/labels.csv (path, label)."""
    img = where / "img"
    img.mkdir(parents=True)
    for r in rows:
        (img / f"{r['image_id']}.jpg").symlink_to(IMAGES / f"{r['image_id']}.jpg")
    with open(where / "labels.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label"])
        w.writerows([(r["image_id"], r["dx"]) for r in rows])
    return img, where / "labels.csv"


def timed(cmd: list[str], ok: tuple[int, ...] = (0, 1), env: dict | None = None) -> float:
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)} failed: {run.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=str(REPO / "benchmarks" / "out" / "domain_gtafl_sites_s1"),
                   help="a trained run folder (default: benchmarks/out/domain_gtafl_sites_s1)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each command (default 3)")
    p.add_argument("--core-python", help="time the commands under this interpreter (default: this one)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "validate_cost"),
                   help="results path without suffix (default: benchmarks/results/validate_cost)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pkg = tmp / "pkg"
        subprocess.run([*TAFL, "export", str(Path(args.run) / "final.pt"), "--out", str(pkg), "--name",
                        "gtafl-sites"], check=True, capture_output=True)
        img, labels = folder(test_rows(), tmp / "all")
        times: dict[str, list[float]] = {"score": [], "validate": []}
        run_with = [args.core_python, "-m", "tafl.cli"] if args.core_python else TAFL
        env = {**os.environ, "PYTHONPATH": str(REPO)} if args.core_python else None
        for k in range(args.repeats):
            times["score"].append(timed([*run_with, "score", str(img), "--package", str(pkg), "--out",
                                         str(tmp / f"s{k}.csv")], env=env))
            times["validate"].append(timed([*run_with, "validate", str(pkg), str(img), "--labels", str(labels),
                                            "--out", str(tmp / f"v{k}")], env=env))
        ratio = statistics.median(times["validate"]) / statistics.median(times["score"])
        sites = {}
        for site in sorted({r["center_name"] for r in test_rows()}):
            s_img, s_labels = folder(test_rows(site), tmp / site)
            run = subprocess.run([*TAFL, "validate", str(pkg), str(s_img), "--labels", str(s_labels), "--out",
                                  str(tmp / f"rep_{site}"), "--require", "balanced_accuracy>=0.3"],
                                 capture_output=True, text=True)
            rep = json.loads((tmp / f"rep_{site}" / "validation.json").read_text())
            sites[site] = {"exit": run.returncode, "verdict": rep["verdict"], "images": rep["data"]["images"],
                           "balanced_accuracy": rep["rules"]["default"]["balanced_accuracy"],
                           "balanced_accuracy_site": rep["rules"]["site"]["balanced_accuracy"],
                           "accuracy": rep["rules"]["default"]["accuracy"], "refused": rep["refused"]["share"],
                           "ece": rep["calibration"]["ece"],
                           "set_coverage": (rep.get("sets") or {}).get("coverage"),
                           "below_claim": [n for n, v in rep["per_class"].items() if v["below_claim"]]}
    res = {"images": len(test_rows()), "repeats": args.repeats, "python": args.core_python or sys.executable,
           "seconds": times, "ratio_of_medians": ratio,
           "sites": sites}
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Validation against scoring (issue 55)", "",
             f"{res['images']} HAM10000 test images; {args.repeats} alternating runs of each, fresh processes "
             f"({'the core install' if args.core_python else 'the full install'}).", "",
             "| command | seconds (each run) | median |", "| --- | --- | --- |"]
    for k, v in times.items():
        lines.append(f"| tafl {k} | {', '.join(f'{x:.1f}' for x in v)} | {statistics.median(v):.1f} |")
    lines += ["", f"validate / score: **{ratio:.2f}** (target ≤ 1.2)", "",
              "| site | images | exit | balanced accuracy (95%) | at its own mix | refused | ECE | set coverage | "
              "below the card's claim |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def ci(t):
        return "—" if t is None or t[0] is None else f"{100 * t[0]:.1f}% ({100 * t[1]:.1f}–{100 * t[2]:.1f})"

    for site, v in sites.items():
        lines.append(f"| {site} | {v['images']} | {v['exit']} | {ci(v['balanced_accuracy'])} | "
                     f"{ci(v['balanced_accuracy_site'])} | {ci(v['refused'])} | {100 * v['ece']:.1f}% | "
                     f"{ci(v['set_coverage'])} | {', '.join(v['below_claim']) or 'none'} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
