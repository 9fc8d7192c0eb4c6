"""Folder scoring on Ray (`tafl score --engine ray`) against in-process, on N HAM10000 JPEGs (default 10,000).

    python benchmarks/ray_score.py PKG_DIR [N]

Four runs over the same folder (links to the first N files of ../shared/data/ham10000/images, repeated
under new names where N exceeds them), each into a fresh CSV:

  in-process   score_folder(engine="local"), the single-machine `tafl score --package`
               (and once more with one ONNX Runtime thread, as each Ray actor runs)
  ray (cold)   score_folder(engine="ray") with no Ray running: starts a local Ray, scores, stops it (the CLI
               without --address)
  ray (warm)   Ray already running (ray.init first, not timed: the `--address auto` case of a standing
               cluster); the actor pool still starts inside the timed run

For each: wall seconds, images/s, wall per image, the steady rate from the first row written to the last, and
peak memory: the summed RSS of the driver and all its descendant processes (Ray's raylet, GCS, workers),
sampled every 0.2 s (RSS counts shared pages, the object store's too, once per process that maps them: an
upper bound). The in-process and cold-Ray files are compared row by row (labels, probabilities, whole lines).
Target (issue 18): Ray >= 0.8 of the in-process throughput. Writes benchmarks/results/ray_score.{json,md}.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import tafl.clients.score as score_mod  # noqa: E402
from tafl.clients.score import score_folder  # noqa: E402
from tafl.packaging import load_package  # noqa: E402

HAM = Path(os.environ.get("TAFL_SHARED_DATA", REPO.parent / "shared" / "data")) / "ham10000" / "images"


class PeakRSS:
    """The largest summed RSS of this process and its descendants while the block runs."""

    def __init__(self, every: float = 0.2):
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.every)

    def __enter__(self):
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def folder_of(n: int, root: Path) -> Path:
    src = sorted(HAM.glob("*.jpg"))
    if not src:
        sys.exit(f"{HAM} holds no JPEGs")
    folder = root / "imgs"
    folder.mkdir()
    for i in range(n):
        p = src[i % len(src)]
        name = p.name if i < len(src) else f"{p.stem}-r{i // len(src)}{p.suffix}"
        (folder / name).symlink_to(p)
    return folder


def timed(folder: Path, out: Path, pkg: str, batch_size: int, **kw) -> dict:
    first: list[float] = []

    def on_row(_row):
        if not first:
            first.append(time.perf_counter())

    with PeakRSS() as mem:
        t0 = time.perf_counter()
        s = score_folder(folder, out, package=pkg, batch_size=batch_size, progress=False, on_row=on_row, **kw)
        wall = time.perf_counter() - t0
    n = s["images"]
    steady = n / (t0 + wall - first[0]) if first else None
    return {"images": n, "predicted": s["predicted"], "wall_s": round(wall, 2), "images_per_s": round(n / wall, 1),
            "ms_per_image": round(1000 * wall / n, 3), "first_row_after_s": round(first[0] - t0, 2),
            "steady_images_per_s": round(steady, 1) if steady else None, "peak_rss_mib": round(mem.peak / 2**20)}


def lines(path: Path) -> list[str]:
    with open(path, newline="") as fh:
        return fh.read().splitlines()[1:]


def main() -> None:
    pkg = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    batch = 16
    meta = load_package(pkg).metadata
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = folder_of(n, tmp)
        for p in folder.iterdir():  # warm the page cache for every run alike
            p.read_bytes()
        runs = {"in-process": timed(folder, tmp / "local.csv", pkg, batch)}
        print("in-process", runs["in-process"], flush=True)
        # the same with one ORT thread (as each Ray actor has): on this shared 2-core machine ORT's default of one
        # spinning thread per core slowed the in-process run (a check outside this script: 286 vs 460 img/s)
        default_scorer = score_mod.LocalScorer

        class OneThread(default_scorer):
            def __init__(self, package, batch_size, threads=None, **kw):
                super().__init__(package, batch_size, threads=1, **kw)

        score_mod.LocalScorer = OneThread
        try:
            runs["in-process, 1 ORT thread"] = timed(folder, tmp / "local1.csv", pkg, batch)
        finally:
            score_mod.LocalScorer = default_scorer
        print("in-process 1 thread", runs["in-process, 1 ORT thread"], flush=True)
        runs["ray (cold: starts and stops a local Ray)"] = timed(folder, tmp / "ray.csv", pkg, batch, engine="ray")
        print("ray cold", runs["ray (cold: starts and stops a local Ray)"], flush=True)
        t0 = time.perf_counter()
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
        ray_start = time.perf_counter() - t0
        try:
            runs["ray (warm: a running Ray)"] = timed(folder, tmp / "warm.csv", pkg, batch, engine="ray")
        finally:
            ray.shutdown()
        print("ray warm", runs["ray (warm: a running Ray)"], flush=True)

        a, b = lines(tmp / "local.csv"), lines(tmp / "ray.csv")
        ra = {r["path"]: r for r in csv.DictReader(open(tmp / "local.csv", newline=""))}
        rb = {r["path"]: r for r in csv.DictReader(open(tmp / "ray.csv", newline=""))}
        same_labels = sum(ra[p]["label"] == rb[p]["label"] for p in ra if p in rb)
        dprob = max((abs(float(ra[p]["probability"]) - float(rb[p]["probability"])) for p in ra
                     if p in rb and ra[p]["probability"]), default=0.0)
        compare = {"rows_in_process": len(a), "rows_ray": len(b), "distinct_paths_ray": len(rb),
                   "identical_labels": same_labels, "max_probability_difference": dprob,
                   "identical_lines_sorted": sorted(a) == sorted(b),
                   "identical_lines": len(set(a) & set(b))}
    base = runs["in-process"]["images_per_s"]
    for r in runs.values():
        r["vs_in_process"] = round(r["images_per_s"] / base, 2)
        r["steady_vs_in_process"] = round(r["steady_images_per_s"] / runs["in-process"]["steady_images_per_s"], 2)
        r["overhead_ms_per_image"] = round(r["ms_per_image"] - runs["in-process"]["ms_per_image"], 3)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "images": n, "batch_size": batch,
              "model": f"{meta['name']} {meta['version']} ({meta['backbone']}, "
                       f"{meta['input']['shape'][-1]}px, {meta['input']['shape'][1]} channel(s))",
              "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end (shared)",
              "ray": ray.__version__, "ray_init_s": round(ray_start, 2), "runs": runs, "compare": compare,
              "target": "ray images/s >= 0.8 x in-process"}
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray_score.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Folder scoring on Ray vs in-process ({result['date']}, {n} HAM10000 JPEGs, {result['model']})", "",
          f"Machine: {result['machine']}; Ray {result['ray']}; `ray.init` of a local instance took "
          f"{result['ray_init_s']} s (the warm run starts after it).", "",
          "| run | wall s | images/s | × in-process | ms/image | overhead ms/image | first row after s | "
          "steady images/s | steady × | peak RSS MiB (driver + Ray) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        md.append(f"| {name} | {r['wall_s']} | {r['images_per_s']} | {r['vs_in_process']} | {r['ms_per_image']} | "
                  f"{r['overhead_ms_per_image']} | {r['first_row_after_s']} | {r['steady_images_per_s']} | "
                  f"{r['steady_vs_in_process']} | {r['peak_rss_mib']} |")
    c = compare
    md += ["", f"Same answers (in-process vs cold Ray): {c['rows_ray']} rows vs {c['rows_in_process']} "
               f"({c['distinct_paths_ray']} distinct paths), identical labels {c['identical_labels']}/"
               f"{c['rows_in_process']}, largest probability difference {c['max_probability_difference']:.2g}, "
               f"identical lines {c['identical_lines']}/{c['rows_in_process']} (sorted files identical: "
               f"{c['identical_lines_sorted']}).", "",
           "Steady = images from the first row written to the last, over that time (leaves out Ray's start and "
           "the actor pool's start). Peak RSS sums every process's resident set (shared pages once per process).",
           ""]
    (out / "ray_score.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
