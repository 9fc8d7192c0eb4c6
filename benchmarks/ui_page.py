"""The page for people (GET /, tafl/serving/ui.py): how long it takes to render, and whether it costs /predict.

    python benchmarks/ui_page.py PKG_A PKG_B [--rounds 3] [--seconds 10] [--renders 50]

1. Render time, with both packages loaded in one worker: GET / (the whole page, no token) and GET /ui/panel,
   `--renders` times each, one after another, after 150 predictions so that the live mix and the case-mix
   estimate are drawn too. Both the client's wall time and the service's own `Server-Timing: render` are
   recorded; the very first render (templates compiled, card Markdown rendered and cached) is reported apart.
   Target: under 300 ms.
2. /predict throughput with and without the page: each round starts two fresh services, one whose page is
   never requested and one whose page is loaded before the burst and again once a second during it, and drives
   each with wrk at concurrency 32 posting one 28x28 DermaMNIST PNG (docs/results.md, "The first service measurement"; a digits PNG when
   ../shared/data is absent), alternating which goes first. The ratio page / no page per round and its median
   say whether the page costs /predict anything (target: within noise).

Writes benchmarks/results/ui_page.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from serving_bench import wrk_load  # noqa: E402
from tafl.serving.launch import ServerProcess  # noqa: E402

SHARED = REPO.parent / "shared" / "data"


def test_png() -> tuple[bytes, str]:
    if (SHARED / "medmnist" / "dermamnist.npz").is_file():
        from serving_bench import images

        return images(1)[0], "28x28 RGB PNG (DermaMNIST test)"
    from tests.conftest import digit_png

    return digit_png(0), "64x64 grey PNG (scikit-learn digits)"


def server_ms(resp: httpx.Response) -> float:
    timing = resp.headers.get("server-timing", "")
    return float(timing.split("dur=", 1)[1]) if "dur=" in timing else float("nan")


def summary(values: list[float]) -> dict:
    v = sorted(values)
    return {"n": len(v), "p50_ms": statistics.median(v), "p95_ms": v[min(len(v) - 1, int(0.95 * len(v)))],
            "max_ms": v[-1], "mean_ms": statistics.fmean(v)}


def render_times(url: str, n: int, png: bytes, models: list[str]) -> dict:
    out: dict = {}
    with httpx.Client(timeout=30) as c:
        first = c.get(url + "/")
        out["first_render"] = {"wall_ms": first.elapsed.total_seconds() * 1000, "server_ms": server_ms(first),
                               "bytes": len(first.content)}
        for i in range(150):  # the live mix and the estimate (it needs 100 images) on the page too
            r = c.post(url + "/predict", files={"file": ("x.png", png, "image/png")},
                       data={"model": models[i % len(models)]})
            r.raise_for_status()
        time.sleep(1.0)  # the estimate is refreshed in its own thread
        for path in ("/", "/ui/panel"):
            wall, server = [], []
            for _ in range(n):
                t0 = time.perf_counter()
                r = c.get(url + path)
                wall.append(1000 * (time.perf_counter() - t0))
                server.append(server_ms(r))
                r.raise_for_status()
            # the SVGs are the two charts per model and the heatmap's legend; a plain summary opens each model
            out[path] = {"wall": summary(wall), "server": summary(server), "bytes": len(r.content),
                         "svg_charts": r.text.count("<svg"), "plain_summaries": r.text.count('<div class="summary"'),
                         "estimate_shown": "drift distance" in r.text}
    return out


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the service's process tree (the `bentoml serve` parent, its worker, any
    decoder processes) so far."""
    import psutil

    total = 0.0
    leader = psutil.Process(pid)
    for p in [leader, *leader.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def burst(srv, png: bytes, seconds: int, with_page: bool) -> dict:
    url = srv.url
    stop = threading.Event()
    views = [0]

    def viewer() -> None:  # a person with the page open who reloads it once a second
        with httpx.Client(timeout=30) as c:
            while not stop.wait(1.0):
                c.get(url + "/").raise_for_status()
                views[0] += 1

    if with_page:
        with httpx.Client(timeout=30) as c:
            for _ in range(5):
                c.get(url + "/").raise_for_status()
                c.get(url + "/ui/panel").raise_for_status()
                c.get(url + "/ui/static/ui.js").raise_for_status()
    wrk_load(url, png, 8, seconds=2)  # warm-up
    t = threading.Thread(target=viewer, daemon=True)
    cpu0 = tree_cpu_s(srv.proc.pid)
    if with_page:
        t.start()
    try:
        r = wrk_load(url, png, 32, seconds=seconds)
    finally:
        stop.set()
        if with_page:
            t.join()
    cpu = tree_cpu_s(srv.proc.pid) - cpu0
    served = r.get("throughput_img_s", float("nan")) * seconds  # wrk's rate over its run
    # the service's CPU per /predict answered, the page views during the burst included: robust to the other
    # work on a shared machine, which moves throughput far more than it moves the CPU a request costs
    return {**r, "page_views_during": views[0], "service_cpu_s": cpu, "service_cpu_ms_per_predict": 1000 * cpu / served}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--renders", type=int, default=50)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ui_page"))
    ns = ap.parse_args()
    pkgs = [str(Path(p).resolve()) for p in ns.packages]
    png, png_what = test_png()
    from tafl.packaging import load_package

    names = [load_package(p).name for p in pkgs]
    with tempfile.TemporaryDirectory() as tmp:
        with ServerProcess(pkgs, env={"BENTOML_HOME": f"{tmp}/home_render"}, log_path=Path(tmp) / "render.log") as srv:
            render = render_times(srv.url, ns.renders, png, names)
        print(json.dumps(render, indent=1), flush=True)
        rows = []
        for rnd in range(ns.rounds):
            order = [False, True] if rnd % 2 == 0 else [True, False]
            for with_page in order:
                home = Path(tmp) / f"home_{rnd}_{int(with_page)}"
                with ServerProcess(pkgs[:1], env={"BENTOML_HOME": str(home)}, log_path=Path(tmp) / "ab.log") as srv:
                    r = burst(srv, png, ns.seconds, with_page)
                rows.append({"round": rnd, "page": with_page, **r})
                print(f"round {rnd} page={with_page!s:5s} {r.get('throughput_img_s', float('nan')):7.1f} img/s "
                      f"p99 {r.get('p99_ms', float('nan')):.1f} ms views {r['page_views_during']} "
                      f"cpu {r['service_cpu_ms_per_predict']:.2f} ms/predict", flush=True)
    ratios, cpu_ratios = [], []
    for rnd in range(ns.rounds):
        a = next(r for r in rows if r["round"] == rnd and not r["page"])
        b = next(r for r in rows if r["round"] == rnd and r["page"])
        ratios.append(b["throughput_img_s"] / a["throughput_img_s"])
        cpu_ratios.append(b["service_cpu_ms_per_predict"] / a["service_cpu_ms_per_predict"])
    res = {"date": time.strftime("%Y-%m-%d"), "packages": [f"{load_package(p).name} {load_package(p).version}"
                                                           for p in pkgs],
           "image": png_what, "render": render, "predict_rows": rows, "ratio_page_vs_none": ratios,
           "ratio_median": statistics.median(ratios), "cpu_per_predict_ratio_page_vs_none": cpu_ratios,
           "cpu_ratio_median": statistics.median(cpu_ratios), "targets": {"render_ms": "< 300", "ratio": "within noise"}}
    out = Path(ns.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    page, panel = render["/"], render["/ui/panel"]
    lines = [f"# The page for people ({res['date']}; {', '.join(res['packages'])} loaded in one worker)", "",
             "`python benchmarks/ui_page.py PKG_A PKG_B` on this machine (2 cores shared with the client). "
             f"Render: {ns.renders} sequential requests each after 150 predictions (live mix and case-mix estimate "
             "drawn); wall = the client's time for the whole response, server = the service's Server-Timing.", "",
             "| request | wall p50 ms | wall p95 ms | wall max ms | server p50 ms | server max ms | bytes | SVGs | "
             "plain summaries |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in (("GET /", page), ("GET /ui/panel", panel)):
        lines.append(f"| {name} | {r['wall']['p50_ms']:.1f} | {r['wall']['p95_ms']:.1f} | {r['wall']['max_ms']:.1f} | "
                     f"{r['server']['p50_ms']:.1f} | {r['server']['max_ms']:.1f} | {r['bytes']} | {r['svg_charts']} | "
                     f"{r['plain_summaries']} |")
    fr = render["first_render"]
    lines += ["", f"First render after start (templates compiled, cards rendered and cached): {fr['wall_ms']:.1f} ms "
                  f"wall, {fr['server_ms']:.1f} ms in the service. Case-mix estimate drawn: {page['estimate_shown']}. "
                  "Target < 300 ms.", "",
              f"## /predict with and without the page ({res['packages'][0]}, wrk c=32, {ns.seconds} s, {png_what})", "",
              "'page': the page and its panel loaded five times before the burst and GET / once a second during it; "
              "'none': never requested. A fresh service for each run; the order alternates per round.", "",
              "| round | page | img/s | p50 ms | p99 ms | errors | page views during | service CPU ms per /predict |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {'page' if r['page'] else 'none'} | {r['throughput_img_s']:.0f} | "
                     f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} | {r['page_views_during']} | "
                     f"{r['service_cpu_ms_per_predict']:.2f} |")
    lines += ["", "Throughput ratio page / none per round: " + ", ".join(f"{x:.3f}" for x in ratios)
              + f"; median **{res['ratio_median']:.3f}**.",
              "Service CPU per /predict, page / none per round (the page views' own CPU included): "
              + ", ".join(f"{x:.3f}" for x in cpu_ratios) + f"; median **{res['cpu_ratio_median']:.3f}**."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
