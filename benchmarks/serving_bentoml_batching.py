"""tafl's /predict against a plain BentoML service with BentoML's own adaptive batching, same package, side by side.

    python benchmarks/serving_bentoml_batching.py PKG [--rounds 3] [--seconds 10]

Issue 36 asked whether BentoML's `@bentoml.api(batchable=True)` with its own multipart input is cheaper than tafl's
batcher and upload path. Each round starts tafl's service (three model lanes, TAFL_MODEL_LANES=3, and every check)
and the plain
service of benchmarks/bentoml_plain_service.py (BentoML's batching, nothing else), drives each with wrk at
concurrency 32 posting one 28x28 DermaMNIST PNG for `--seconds`, and measures the in-process ceiling (decode +
preprocess + ONNX Runtime, two threads, batched by 32) after them. The plain service answers only the label and
probabilities, so it does less per request than tafl. Writes benchmarks/results/serving_bentoml_batching_NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from serving_bench import images, in_process, wrk_load  # noqa: E402
from tafl.packaging import load_package  # noqa: E402
from tafl.procs import free_port, stop_group, wait_http  # noqa: E402
from tafl.serving.launch import ServerProcess  # noqa: E402


def plain_service(pkg: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), PLAIN_PKG=str(pkg), BENTOML_DO_NOT_TRACK="True")
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bentoml", "serve", "bentoml_plain_service:Plain", "--host",
                                 "127.0.0.1", "--port", str(port)], cwd=REPO / "benchmarks", env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz", timeout=180, proc=proc, name="the plain BentoML service")
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10)
    ns = ap.parse_args()
    pkg = Path(ns.package).resolve()
    meta = load_package(pkg).metadata
    data = images(256)
    logs = REPO / "benchmarks" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {"tafl /predict": [], "plain BentoML, batchable=True": []}
    ceilings = []
    for r in range(ns.rounds):
        with ServerProcess([str(pkg)], env={"BENTOML_DO_NOT_TRACK": "True", "TAFL_MODEL_LANES": "3"},
                           log_path=logs / "serving_bentoml_batching.log") as srv:
            wrk_load(srv.url, data[0], 32, seconds=3)
            rows["tafl /predict"].append(wrk_load(srv.url, data[0], 32, seconds=ns.seconds))
        proc, url = plain_service(pkg, logs / "serving_bentoml_plain.log")
        try:  # BentoML names the multipart field after the API's parameter
            wrk_load(url, data[0], 32, seconds=3, field="images")
            rows["plain BentoML, batchable=True"].append(wrk_load(url, data[0], 32, seconds=ns.seconds,
                                                                  field="images"))
        finally:
            stop_group(proc, 10)
        ceilings.append(in_process(pkg, data)["throughput_img_s"])
        if not all(v[-1] for v in rows.values()):
            sys.exit("wrk is not installed (apt-get install wrk)")
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]['throughput_img_s']:.0f} img/s" for k, v in rows.items())
              + f", ceiling {ceilings[-1]:.0f}", flush=True)
    ceiling = statistics.median(ceilings)
    first = rows["tafl /predict"]
    summary = {k: {"median_img_s": statistics.median(x["throughput_img_s"] for x in v),
                   "ratio": statistics.median(x["throughput_img_s"] for x in v) / ceiling,
                   "vs_tafl_same_round": statistics.median(x["throughput_img_s"] / f["throughput_img_s"]
                                                           for x, f in zip(v, first)),
                   "median_p99_ms": statistics.median(x["p99_ms"] for x in v),
                   "errors": sum(x["errors"] for x in v)} for k, v in rows.items()}
    out = {"date": time.strftime("%Y-%m-%d"), "package": f"{meta['name']} {meta['version']}", "method": meta["method"],
           "backbone": meta.get("backbone"), "concurrency": 32, "seconds": ns.seconds, "ceilings_img_s": ceilings,
           "rounds": rows, "summary": summary}
    res = REPO / "benchmarks" / "results"
    stem = f"serving_bentoml_batching_{meta['name']}"
    (res / f"{stem}.json").write_text(json.dumps(out, indent=2))
    lines = [f"# tafl against BentoML's own batching: {out['package']} ({meta['method']}, {meta.get('backbone')}), "
             f"{out['date']}", "",
             f"wrk at concurrency 32 for {ns.seconds} s per service and round, {ns.rounds} rounds. Ratio: median "
             f"images/s over the median in-process ceiling ({ceiling:.0f} img/s).", "",
             "| service | img/s | ratio to in-process | against tafl, same round | p99 ms | errors | img/s per round |",
             "|---|---|---|---|---|---|---|"]
    for k, s in summary.items():
        per = ", ".join(f"{x['throughput_img_s']:.0f}" for x in rows[k])
        lines.append(f"| {k} | {s['median_img_s']:.0f} | **{s['ratio']:.2f}** | {s['vs_tafl_same_round']:.2f}× | "
                     f"{s['median_p99_ms']:.0f} | {s['errors']} | {per} |")
    (res / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
