"""Service latency and throughput against ONNX Runtime in-process (the ceiling), and worker memory.

    python benchmarks/serving_bench.py PKG [PKG2]   (default: the DermaMNIST benchmark packages
                                                      exported to benchmarks/out/pkg_*)

28x28 PNGs (DermaMNIST test images) are posted to a real `bentoml serve` on 127.0.0.1 at
concurrency 1, 8 and 32; the ceiling is the same decode + preprocessing + ONNX Runtime work done
in-process, batched by 32. Target (issue 6): at concurrency 32 the service reaches at least 70 % of
the in-process throughput; one worker with two small packages stays under 1 GiB resident.
The load generator shares the 2 cores with the service, which the numbers include.
Writes benchmarks/results/serving.{json,md}.
"""

from __future__ import annotations

import asyncio
import io
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.packaging import load_package  # noqa: E402
from tafl.imaging import decode_image  # noqa: E402
from tafl.serving.launch import ServerProcess  # noqa: E402

N_REQUESTS = 400


def images(n: int) -> list[bytes]:
    z = np.load(REPO.parent / "shared" / "data" / "medmnist" / "dermamnist.npz")
    out = []
    for a in z["test_images"][:n]:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def wrk_load(url: str, data: bytes, concurrency: int, model: str | None = None, seconds: int = 10,
             fields: dict[str, str] | None = None, field: str = "file") -> dict:
    """The same POST with wrk (a C load generator), so the client costs the service little CPU; the image goes in
    the multipart part `field`."""
    import re
    import shutil
    import subprocess
    import tempfile

    if not shutil.which("wrk"):
        return {}
    boundary = "tafl-bench-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"x.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode() + data + "".join(
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}" for k, v in
        (fields or {}).items()).encode() + f"\r\n--{boundary}--\r\n".encode()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "body.bin").write_bytes(body)
        (Path(tmp) / "post.lua").write_text(
            f'local f = io.open("{tmp}/body.bin", "rb")\nwrk.method = "POST"\nwrk.body = f:read("*all")\n'
            f'wrk.headers["Content-Type"] = "multipart/form-data; boundary={boundary}"\n')
        r = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency", "-s",
                            f"{tmp}/post.lua", url + "/predict" + (f"?model={model}" if model else "")], capture_output=True, text=True)

    def ms(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)", r.stdout)
        return float(m[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m[2]] if m else float("nan")

    rps = re.search(r"Requests/sec:\s+([\d.]+)", r.stdout)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", r.stdout)
    return {"concurrency": concurrency, "generator": "wrk", "throughput_img_s": float(rps[1]) if rps else float("nan"),
            "p50_ms": ms("50%"), "p99_ms": ms("99%"), "errors": int(non2xx[1]) if non2xx else 0}


def in_process_single(pkg_dir: Path, data: list[bytes]) -> dict:
    """One image per ONNX Runtime call: what a request costs without HTTP."""
    pkg = load_package(pkg_dir)
    sess = pkg.session(["CPUExecutionProvider"], threads=2)
    pre = pkg.preprocess
    t0 = time.perf_counter()
    for d in data:
        pkg.run(sess, pre.normalize(pre.to_uint8(decode_image(d).frames[0])[None]))
    return {"throughput_img_s": len(data) / (time.perf_counter() - t0), "batch": 1}


def in_process(pkg_dir: Path, data: list[bytes], batch: int = 32) -> dict:
    pkg = load_package(pkg_dir)
    sess = pkg.session(["CPUExecutionProvider"], threads=2)
    pre = pkg.preprocess
    pkg.run(sess, pre.normalize(np.stack([pre.to_uint8(decode_image(d).frames[0]) for d in data[:batch]])))  # warm
    t0 = time.perf_counter()
    for s in range(0, len(data), batch):
        x = pre.normalize(np.stack([pre.to_uint8(decode_image(d).frames[0]) for d in data[s:s + batch]]))
        pkg.run(sess, x)
    dt = time.perf_counter() - t0
    return {"throughput_img_s": len(data) / dt, "batch": batch}


async def load(url: str, data: list[bytes], concurrency: int, model: str | None) -> dict:
    lat: list[float] = []
    errors = 0
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(d: bytes):
            nonlocal errors
            async with sem:
                t = time.perf_counter()
                r = await client.post(url + "/predict", files={"file": ("x.png", d, "image/png")},
                                      data={"model": model} if model else None)
                lat.append(time.perf_counter() - t)
                errors += r.status_code != 200
        await asyncio.gather(*(one(data[i % len(data)]) for i in range(20)))  # warm-up
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(data[i % len(data)]) for i in range(N_REQUESTS)))
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": N_REQUESTS, "errors": errors, "throughput_img_s": N_REQUESTS / wall,
            "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * float(np.percentile(lat, 99))}


def worker_rss_mib(proc: psutil.Process) -> float:
    return max((c.memory_info().rss for c in [proc, *proc.children(recursive=True)]), default=0) / 2**20


def default_packages() -> list[Path]:
    out = REPO / "benchmarks" / "out"
    named = [out / "pkg_gtafl_derma", out / "pkg_dafl_derma"]  # the paper-width ResNet-8 and the small ViT
    return [p for p in named if p.is_dir()] or sorted(out.glob("pkg_*"))[:2]


def main() -> None:
    pkgs = [Path(p) for p in sys.argv[1:]] or default_packages()
    if not pkgs:
        sys.exit("give package folders (tafl export ... --out benchmarks/out/pkg_NAME)")
    data = images(256)
    meta = [load_package(p).metadata for p in pkgs]
    per_model = []
    with ServerProcess([str(p) for p in pkgs], log_path=REPO / "benchmarks" / "out" / "serving_bench.log") as srv:
        ps = psutil.Process(srv.proc.pid)
        rows = [asyncio.run(load(srv.url, data, c, None)) for c in (1, 8, 32)]  # the first package
        for p, m in zip(pkgs, meta):
            # each model side by side with its own ceiling, measured in the same run
            ceiling, single = in_process(p, data), in_process_single(p, data)
            wrk_rows = [r for r in (wrk_load(srv.url, data[0], c, m["name"]) for c in (1, 8, 32)) if r]
            c32 = next((r for r in wrk_rows if r["concurrency"] == 32), None)
            if c32 is None:  # no wrk on this machine: the Python client's numbers
                c32 = rows[-1] if p == pkgs[0] else asyncio.run(load(srv.url, data, 32, m["name"]))
            per_model.append({
                "package": f"{m['name']} {m['version']}", "method": m["method"], "backbone": m.get("backbone"),
                "in_process": ceiling, "in_process_one_image_per_call": single, "service_wrk_client": wrk_rows,
                "ratio_c32_vs_in_process": c32["throughput_img_s"] / ceiling["throughput_img_s"],
                "ratio_c32_vs_in_process_one_per_call": c32["throughput_img_s"] / single["throughput_img_s"],
                # CPU time a request costs beyond the in-process work: both cores are busy in both runs
                "http_overhead_core_ms_per_image": 2000 * (1 / c32["throughput_img_s"] - 1 / ceiling["throughput_img_s"])})
        rss = worker_rss_mib(ps)
        providers = httpx.get(srv.url + "/models").json()["models"][0]["providers"]
    out = {"date": time.strftime("%Y-%m-%d"), "packages": [pm["package"] for pm in per_model],
           "providers": providers, "image": "28x28 RGB PNG (DermaMNIST test)", "models": per_model,
           "service_httpx_client": rows, "ratio_c32_vs_in_process": per_model[0]["ratio_c32_vs_in_process"],
           "largest_process_rss_mib": rss, "targets": {"ratio_c32_vs_in_process": ">= 0.70", "rss_mib": "< 1024"}}
    res = REPO / "benchmarks" / "results"
    (res / "serving.json").write_text(json.dumps(out, indent=2))
    lines = [f"# Serving ({out['date']}, providers {providers}, {', '.join(out['packages'])} loaded in one worker)", "",
             "Each model: the in-process ceiling (decode + preprocess + ONNX Runtime, 2 threads) and the service "
             "under wrk, in the same run. The load generator shares the 2 cores.", ""]
    for pm in per_model:
        ceiling, single = pm["in_process"], pm["in_process_one_image_per_call"]
        lines += [f"## {pm['package']} ({pm['method']}, {pm['backbone']})", "",
                  f"In-process: {ceiling['throughput_img_s']:.0f} img/s batched by 32; "
                  f"{single['throughput_img_s']:.0f} img/s one image per call", "",
                  "| load generator | concurrency | images/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
        for r in pm["service_wrk_client"]:
            lines.append(f"| wrk | {r['concurrency']} | {r['throughput_img_s']:.0f} | {r['p50_ms']:.1f} | "
                         f"{r['p99_ms']:.1f} | {r['errors']} |")
        lines += ["", f"Concurrency 32 / in-process batched: **{pm['ratio_c32_vs_in_process']:.2f}** (target ≥ 0.70); "
                      f"/ one image per call: {pm['ratio_c32_vs_in_process_one_per_call']:.2f}; HTTP and service cost "
                      f"beyond the in-process work: {pm['http_overhead_core_ms_per_image']:.2f} core-ms per image", ""]
    lines += [f"## Python client (httpx on the same 2 cores), {per_model[0]['package']}", "",
              "| concurrency | images/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['throughput_img_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                     f"{r['errors']} |")
    lines += ["", f"Largest service process RSS with both packages loaded: {rss:.0f} MiB (target < 1024)."]
    (res / "serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
