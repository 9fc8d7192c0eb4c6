"""Valid-input throughput of two code versions of the service, side by side in one run.

    python benchmarks/serving_ab.py --base TREE_A --new TREE_B PKG [--rounds 3] [--seconds 10]

TREE_A / TREE_B are checkouts of the repository (e.g. `git worktree add /tmp/base <commit>`). Each round
starts `bentoml serve` from each tree in turn (cwd and PYTHONPATH set to it, the same package, the same
settings) and drives it with wrk at concurrency 32 posting one 28x28 DermaMNIST PNG (docs/results.md, "The first service measurement"), then
with wrk at concurrency 32 posting a real 1024x1024 MR DICOM (../shared/data/dicom/MR2_UNCR.dcm); with
`--inputs sr`, pydicom's CT_small answered as a DICOM SR (format=sr). The ratio new / base per round and its median
say whether a change moved the valid-input throughput (issue 15: within 5 %). Alternating the two trees
within each round spreads the machine's drift over both. Writes benchmarks/results/serving_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from serving_bench import images, wrk_load  # noqa: E402
from tafl.procs import free_port, stop_group, wait_http  # noqa: E402

SHARED = REPO.parent / "shared" / "data"


def start(tree: Path, pkg: Path, home: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree), TAFL_PACKAGES=str(pkg), BENTOML_HOME=str(home),
               BENTOML_DO_NOT_TRACK="True", TAFL_MAX_UPLOAD_MB="8")
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bentoml", "serve", "tafl.serving.service:TaflService",
                                 "--host", "127.0.0.1", "--port", str(port)], cwd=tree, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz", timeout=180, proc=proc, name=f"the service from {tree}")
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("package")
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", default=str(REPO))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serving_ab"))
    ap.add_argument("--inputs", default="png,dicom", help="png, dicom and/or sr (pydicom's CT_small answered as a "
                    "DICOM SR, format=sr)")
    ns = ap.parse_args()
    trees = {"base": Path(ns.base).resolve(), "new": Path(ns.new).resolve()}
    pkg = Path(ns.package).resolve()
    png = images(1)[0]
    dicom = SHARED / "dicom" / "MR2_UNCR.dcm"  # an uncompressed 1024x1024 MR (the DICOM path of docs/results.md, "Soak and where a decode runs")
    from pydicom.data import get_testdata_file

    every = {"png": lambda: png, "dicom": dicom.read_bytes,
             "sr": lambda: Path(get_testdata_file("CT_small.dcm")).read_bytes()}
    inputs = {k: every[k]() for k in ns.inputs.split(",")}
    fields = {"sr": {"format": "sr"}}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(ns.rounds):
            order = ["base", "new"] if rnd % 2 == 0 else ["new", "base"]
            for which in order:
                proc, url = start(trees[which], pkg, Path(tmp) / f"home_{which}", Path(tmp) / f"{which}.log")
                try:
                    for kind, data in inputs.items():
                        wrk_load(url, data, 8, seconds=2, fields=fields.get(kind))  # warm-up
                        r = wrk_load(url, data, 32, seconds=ns.seconds, fields=fields.get(kind))
                        rows.append({"round": rnd, "tree": which, "input": kind, **r})
                        print(f"round {rnd} {which:4s} {kind:5s} {r.get('throughput_img_s', float('nan')):7.1f} img/s "
                              f"p99 {r.get('p99_ms', float('nan')):.1f} ms", flush=True)
                finally:
                    stop_group(proc)
    ratios = {}
    for kind in inputs:
        per = []
        for rnd in range(ns.rounds):
            b = next(r for r in rows if r["round"] == rnd and r["tree"] == "base" and r["input"] == kind)
            n = next(r for r in rows if r["round"] == rnd and r["tree"] == "new" and r["input"] == kind)
            per.append(n["throughput_img_s"] / b["throughput_img_s"])
        ratios[kind] = {"per_round": per, "median": statistics.median(per)}
    res = {"date": time.strftime("%Y-%m-%d"), "package": str(pkg.name), "trees": {k: str(v) for k, v in trees.items()},
           "rows": rows, "ratio_new_over_base": ratios}
    out = Path(ns.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    md = [f"# Service throughput, two code versions side by side ({res['date']}, wrk c=32, {ns.seconds} s a cell)", "",
          f"base: `{trees['base']}`; new: `{trees['new']}`; package `{pkg.name}`.", "",
          "| input | round | base img/s | new img/s | new / base |", "|---|---|---|---|---|"]
    for kind in inputs:
        for rnd in range(ns.rounds):
            b = next(r for r in rows if r["round"] == rnd and r["tree"] == "base" and r["input"] == kind)
            n = next(r for r in rows if r["round"] == rnd and r["tree"] == "new" and r["input"] == kind)
            md.append(f"| {kind} | {rnd} | {b['throughput_img_s']:.0f} | {n['throughput_img_s']:.0f} | "
                      f"{n['throughput_img_s'] / b['throughput_img_s']:.3f} |")
        md.append(f"| {kind} | median | | | **{ratios[kind]['median']:.3f}** |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
