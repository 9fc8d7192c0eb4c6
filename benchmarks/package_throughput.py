"""ONNX Runtime throughput of two or more model packages side by side (interleaved in one process).

    python benchmarks/package_throughput.py PKG [PKG ...] [--batch 32] [--threads 2] [--repeats 30]
                                            [--name package_throughput]

Each package runs its whole graph (probabilities, label, heatmap) on the same random batch at
its own input size; the passes alternate between packages so machine noise hits all alike. Reports
images/s (median over repeats) and each package's ratio to the first. Writes
benchmarks/results/<name>.{json,md}. Used for issue 16: the conv-tokenizer ViT-DAFL package against
the patch-embedding one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.packaging.package import load_package  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="+")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--name", default="package_throughput")
    ns = ap.parse_args()
    rng = np.random.default_rng(0)
    items = []
    for path in ns.packages:
        pkg = load_package(path)
        p = pkg.preprocess
        x = rng.standard_normal((ns.batch, p.channels, p.size, p.size)).astype(np.float32)
        sess = pkg.session(providers=["CPUExecutionProvider"], threads=ns.threads)
        pkg.run(sess, x)  # warm-up
        items.append({"path": str(path), "name": pkg.name, "version": pkg.version, "size": p.size,
                      "model": pkg.metadata.get("model_config", {}), "pkg": pkg, "sess": sess, "x": x, "t": []})
    for _ in range(ns.repeats):
        for it in items:
            t0 = time.perf_counter()
            it["pkg"].run(it["sess"], it["x"])
            it["t"].append(time.perf_counter() - t0)
    base = None
    rows = []
    for it in items:
        ips = ns.batch / statistics.median(it["t"])
        base = base or ips
        rows.append({k: it[k] for k in ("path", "name", "version", "size", "model")} |
                    {"images_per_s": ips, "ratio_to_first": ips / base})
    res = REPO / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"{ns.name}.json").write_text(json.dumps({"batch": ns.batch, "threads": ns.threads, "rows": rows}, indent=1,
                                                    default=str))
    lines = [f"# Package throughput, batch {ns.batch}, {ns.threads} threads, ONNX Runtime CPU (interleaved)", "",
             "| package | input | images/s | ratio to the first |", "|---|---|---|---|"]
    for r in rows:
        tok = r["model"].get("tokenizer", "") if isinstance(r["model"], dict) else ""
        lines.append(f"| {r['path']} ({tok or 'n/a'}) | {r['size']} px | {r['images_per_s']:.0f} | "
                     f"{r['ratio_to_first']:.3f} |")
    (res / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
