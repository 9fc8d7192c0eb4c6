"""Folder scoring rate: remote (through the service) vs in-process, on 1,000 HAM10000 JPEGs.

    python benchmarks/score_bench.py PKG_DIR

Target (issue 7): remote at least 60 % of in-process. Both score the same folder into fresh result
files; the labels are compared too. Writes benchmarks/results/scoring.{json,md}.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.clients.score import score_folder  # noqa: E402
from tafl.packaging import load_package  # noqa: E402
from tafl.serving.launch import ServerProcess  # noqa: E402

N = 1000


def main() -> None:
    pkg = Path(sys.argv[1])
    src = sorted((REPO.parent / "shared" / "data" / "ham10000" / "images").glob("*.jpg"))[:N]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "imgs"
        folder.mkdir()
        for p in src:
            shutil.copyfile(p, folder / p.name)
        t0 = time.perf_counter()
        score_folder(folder, Path(tmp) / "local.csv", package=str(pkg), batch_size=32, progress=False)
        local_s = time.perf_counter() - t0
        with ServerProcess([str(pkg)]) as srv:
            t0 = time.perf_counter()
            score_folder(folder, Path(tmp) / "remote.csv", url=srv.url, concurrency=4, batch_size=16, progress=False)
            remote_s = time.perf_counter() - t0
        a = {r["path"]: r["class_name"] for r in csv.DictReader(open(Path(tmp) / "local.csv"))}
        b = {r["path"]: r["class_name"] for r in csv.DictReader(open(Path(tmp) / "remote.csv"))}
    same = sum(a[k] == b.get(k) for k in a)
    meta = load_package(pkg).metadata
    out = {"date": time.strftime("%Y-%m-%d"), "package": f"{meta['name']} {meta['version']} ({meta['backbone']}, "
                                                         f"{meta['input']['preprocess']['size']}px)",
           "images": len(src), "in_process_img_s": len(src) / local_s, "remote_img_s": len(src) / remote_s,
           "remote_vs_in_process": local_s / remote_s, "identical_labels": same, "target": ">= 0.60",
           "settings": {"in_process_batch": 32, "remote_concurrency": 4, "remote_images_per_request": 16}}
    res = REPO / "benchmarks" / "results"
    (res / "scoring.json").write_text(json.dumps(out, indent=2))
    text = (f"# Folder scoring ({out['date']}, {out['package']}, {len(src)} HAM10000 JPEGs)\n\n"
            f"| mode | images/s |\n|---|---|\n| in-process (batch 32) | {out['in_process_img_s']:.1f} |\n"
            f"| remote (4 requests of 16 images in flight) | {out['remote_img_s']:.1f} |\n\nremote / in-process = "
            f"{out['remote_vs_in_process']:.2f} (target ≥ 0.60); identical labels {same}/{len(src)}.\n")
    (res / "scoring.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
