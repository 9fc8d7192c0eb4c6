"""Service throughput at concurrency 32 under settings variants of one package, side by side in one run.

    python benchmarks/serving_lanes.py PKG [--rounds 3] [--seconds 10] [--variants JSON] [--name NAME]

A variant is an environment: TAFL_* settings, or PYTHONPATH naming another checkout of tafl to compare code (run the
script from a folder that holds no `tafl`, since `bentoml serve` puts its working folder first on the path), or
PACKAGE naming another package folder to serve instead of PKG (e.g. the same checkpoint exported with and without
the in-domain detector: `tafl export --domain detector=off`).

Each round starts `bentoml serve` once per variant (its TAFL_* environment, e.g. the model lanes and ONNX Runtime
threads), drives it with wrk at concurrency 32 posting one 28x28 DermaMNIST PNG (docs/results.md, "The first service measurement"; 3 s warm-up, then
`--seconds`), reads the mean batch size from /models, and measures the in-process ceiling (decode + preprocess +
ONNX Runtime on two threads, batched by 32; benchmarks/serving_bench.py) just before and just after, so every ratio
has its own ceiling; a round whose two ceilings differ by more than 1.2x is left out of the per-round ratio (this
machine's ceiling jumps between two states). Variants alternate within a round, which spreads the shared machine's
drift over all of them, in reverse order every other round (none always runs first); the median ratio per variant
is the result. Writes
benchmarks/results/serving_lanes_NAME.{json,md} (NAME: the package's name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from serving_bench import images, in_process, wrk_load  # noqa: E402
from tafl.packaging import load_package  # noqa: E402
from tafl.serving.launch import ServerProcess  # noqa: E402

STEADY = 1.2  # the in-process ceilings before and after a round agree within this factor

VARIANTS = {
    "the default (no TAFL_* setting: chosen at start)": {},
    "1 worker, 1 lane (the default before 2026-12-07)": {"TAFL_WORKERS": "1", "TAFL_MODEL_LANES": "1"},
}
# the settings a variant names, or leaves to the service's choice: none comes from the shell that runs this
SERVING_SETTINGS = ("TAFL_WORKERS", "TAFL_MODEL_LANES", "TAFL_ORT_THREADS", "TAFL_SERVING_PLAN", "TAFL_ADMIN_TOKEN")


def summarize(rows: dict[str, list[dict]], variants: dict[str, dict]) -> dict[str, dict]:
    """Per variant: its median throughput against the median of every round's ceiling (the in-process run does not
    depend on the variant, and one slow ceiling on this shared machine would otherwise make one ratio), and its
    median throughput ratio to the first variant in the same round (the machine's drift cancels)."""
    ceiling = statistics.median(x["ceiling_img_s"] for v in rows.values() for x in v)
    # per round, against the ceiling measured just before and after it, where those two agree: this machine's ceiling
    # has two states about 1.7x apart (docs/results.md, "The worker's heap"), and a round across a change says nothing
    steady = {name: [x["ratio"] for x in v if x.get("steady", True)] for name, v in rows.items()}
    first = next(iter(rows.values()))
    out = {}
    for name, v in rows.items():
        img_s = statistics.median(x["img_s"] for x in v)
        out[name] = {"median_img_s": img_s, "median_ceiling_img_s": ceiling, "ratio": img_s / ceiling,
                     "core_ms_beyond_model": 2000 * (1 / img_s - 1 / ceiling),
                     "vs_first_same_round": statistics.median(x["img_s"] / f["img_s"] for x, f in zip(v, first)),
                     "median_p99_ms": statistics.median(x["p99_ms"] for x in v), "env": variants[name],
                     "steady_rounds": len(steady[name]),
                     "ratio_steady_rounds": statistics.median(steady[name]) if steady[name] else None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--variants", help="JSON: variant name -> TAFL_* environment (default: the chosen default "
                    "and the single call it replaced)")
    ap.add_argument("--name", help="the results' name: benchmarks/results/serving_lanes_NAME.{json,md} (default: the "
                    "package's name)")
    ap.add_argument("--report", metavar="JSON", help="only write the tables again from an earlier run's JSON")
    ns = ap.parse_args()
    if ns.report:
        earlier = json.loads(Path(ns.report).read_text())
        ns.rounds, ns.seconds = len(next(iter(earlier["rounds"].values()))), earlier["seconds"]
        return report(ns, earlier["rounds"], {k: v["env"] for k, v in earlier["summary"].items()},
                      load_package(Path(ns.package).resolve()).metadata, earlier["date"])
    variants = json.loads(ns.variants) if ns.variants else VARIANTS
    for name in SERVING_SETTINGS:
        os.environ.pop(name, None)
    pkg = Path(ns.package).resolve()
    meta = load_package(pkg).metadata
    data = images(256)
    logs = REPO / "benchmarks" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(ns.rounds):
        # odd rounds run the variants in reverse order: none always runs first on a freshly idle machine
        order = list(variants.items()) if r % 2 == 0 else list(reversed(variants.items()))
        for name, env in order:
            vpkg = Path(env["PACKAGE"]).resolve() if "PACKAGE" in env else pkg
            env = {k: v for k, v in env.items() if k != "PACKAGE"}
            before = in_process(vpkg, data)["throughput_img_s"]
            with ServerProcess([str(vpkg)], env=dict(env, BENTOML_DO_NOT_TRACK="True"),
                               log_path=logs / "serving_lanes.log") as srv:
                wrk_load(srv.url, data[0], 32, seconds=3)
                w = wrk_load(srv.url, data[0], 32, seconds=ns.seconds)
                models = httpx.get(srv.url + "/models").json()
                sizes = models["models"][0]["recent_batch_sizes"]
                served_by = {"workers": models["worker"]["workers"], "lanes": models["models"][0]["lanes"]}
            if not w:
                sys.exit("wrk is not installed (apt-get install wrk)")
            after = in_process(vpkg, data)["throughput_img_s"]
            ceiling = (before + after) / 2
            row = {"round": r, "img_s": w["throughput_img_s"], "p50_ms": w["p50_ms"], "p99_ms": w["p99_ms"],
                   "errors": w["errors"], "ceiling_img_s": ceiling, "ratio": w["throughput_img_s"] / ceiling,
                   "ceiling_before": before, "ceiling_after": after,
                   "steady": max(before, after) <= STEADY * min(before, after),
                   "mean_batch": sizes["mean"], **served_by,
                   "core_ms_beyond_model": 2000 * (1 / w["throughput_img_s"] - 1 / ceiling)}
            rows[name].append(row)
            moved = "" if row["steady"] else " (ceiling moved)"
            print(f"round {r} {name}: {row['img_s']:.0f} img/s, ceiling {before:.0f} / {after:.0f}, ratio "
                  f"{row['ratio']:.2f}{moved}, mean batch {row['mean_batch']:.1f}, {row['workers']} worker(s) x "
                  f"{row['lanes']} lane(s)", flush=True)
    return report(ns, rows, variants, meta, time.strftime("%Y-%m-%d"))


def report(ns: argparse.Namespace, rows: dict[str, list[dict]], variants: dict[str, dict], meta: dict,
           date: str) -> int:
    """benchmarks/results/serving_lanes_NAME.{json,md} from the rounds' rows."""
    summary = summarize(rows, variants)
    out = {"date": date, "package": f"{meta['name']} {meta['version']}", "method": meta["method"],
           "backbone": meta.get("backbone"), "concurrency": 32, "seconds": ns.seconds, "rounds": rows,
           "summary": summary}
    res = REPO / "benchmarks" / "results"
    stem = f"serving_lanes_{ns.name or meta['name']}"
    (res / f"{stem}.json").write_text(json.dumps(out, indent=2))
    lines = [f"# Model lanes: {out['package']} ({meta['method']}, {meta.get('backbone')}), {date}", "",
             f"wrk at concurrency 32 for {ns.seconds} s per variant and round, {ns.rounds} rounds, the variants in "
             "turn within each round. Ratio: the variant's median images/s over the median of all rounds' in-process "
             f"ceilings ({next(iter(summary.values()))['median_ceiling_img_s']:.0f} img/s). Per round, steady "
             f"ceiling: the median of each round's images/s over the mean of the ceilings measured just before and "
             f"after it, over the rounds where those two agree within {STEADY}x. Against the first: median over "
             "rounds of images/s divided by the first variant's in the same round.", "",
             "| variant | workers × lanes | img/s | ratio to in-process | per round, steady ceiling (rounds) | "
             "core-ms beyond the model | against the first | p99 ms | img/s per round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        per = ", ".join(f"{x['img_s']:.0f}" for x in rows[name])
        st = "–" if s["ratio_steady_rounds"] is None else f"{s['ratio_steady_rounds']:.2f} ({s['steady_rounds']})"
        shape = f"{rows[name][0].get('workers', '?')} × {rows[name][0].get('lanes', '?')}"
        lines.append(f"| {name} | {shape} | {s['median_img_s']:.0f} | **{s['ratio']:.2f}** | {st} | "
                     f"{s['core_ms_beyond_model']:.2f} | {s['vs_first_same_round']:.2f}× | {s['median_p99_ms']:.0f} | "
                     f"{per} |")
    (res / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
