"""The CUDA path on a GPU machine: ONNX Runtime's CUDA provider and the service on a GPU, against the CPU provider.

    python benchmarks/cuda_check.py PKG [PKG ...] [--out DIR] [--service] [--requests 400]

For each package: a session with tafl's default providers (CUDA first) and one with the CPU provider alone, on
the same images (random uint8 images through the package's own preprocessing). Reports which providers ONNX
Runtime actually used, the largest difference of every float output between CUDA and CPU, the agreement of every
integer output (labels, expert labels), and throughput at batch 1 and 64 on both, interleaved in one process
(ratios; one machine, one run). With --service: `bentoml serve` with all the packages on 127.0.0.1 (GPU
allocation on, as the service is declared), GET /models (the providers the service reports), POST /predict of the
same PNGs compared with the in-process CUDA answers, and N requests at concurrency 32 against in-process CUDA
throughput on the same decoded images. Writes DIR/cuda_check.{json,md} (default benchmarks/results).
This is a device-machine script (tafl's CPU machines have no GPU): it exits 3 where no CUDA provider is usable.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.packaging.package import load_package  # noqa: E402


def _pngs(n: int, size: int, channels: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        shape = (size, size) if channels == 1 else (size, size, 3)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _images(pngs: list[bytes]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(b)) for b in pngs]


def _median_rate(fn, n_images: int, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return n_images / statistics.median(ts)


def check_package(path: str, repeats: int) -> dict:
    cpu_pkg, gpu_pkg = load_package(path), load_package(path)
    cpu = cpu_pkg.session(["CPUExecutionProvider"])
    gpu = gpu_pkg.session()  # tafl's default: CUDA first, CPU second
    used = gpu.get_providers()
    p = gpu_pkg.preprocess
    imgs = _images(_pngs(64, max(p.size, 64), p.channels, seed=1))
    x = p(imgs)  # the package's own preprocessing: float32 NCHW
    out_c, out_g = cpu_pkg.run(cpu, x), gpu_pkg.run(gpu, x)
    diffs, agree = {}, {}
    for name, a in out_c.items():
        b = out_g[name]
        if np.issubdtype(a.dtype, np.floating):
            diffs[name] = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        else:
            agree[name] = float(np.mean(a == b))
    rates = {}
    for batch in (1, 64):
        xb = x[:batch]
        for _ in range(3):  # warm-up (CUDA kernels, cuDNN algorithm search)
            cpu_pkg.run(cpu, xb), gpu_pkg.run(gpu, xb)
        rc, rg = [], []
        for _ in range(repeats):  # interleaved, so machine noise hits both
            rc.append(_median_rate(lambda: cpu_pkg.run(cpu, xb), batch, 1))
            rg.append(_median_rate(lambda: gpu_pkg.run(gpu, xb), batch, 1))
        rates[f"batch{batch}"] = {"cpu_images_per_s": statistics.median(rc), "cuda_images_per_s": statistics.median(rg),
                                  "cuda_over_cpu": statistics.median(rg) / statistics.median(rc)}
    return {"path": path, "name": gpu_pkg.name, "version": gpu_pkg.version, "method": gpu_pkg.metadata.get("method"),
            "backbone": gpu_pkg.metadata.get("backbone"), "size": p.size, "providers_used": used,
            "cuda_used": "CUDAExecutionProvider" in used, "max_abs_diff": diffs, "agreement": agree, "throughput": rates}


async def _load(url: str, pngs: list[bytes], n: int, conc: int) -> tuple[float, int]:
    import httpx

    sem = asyncio.Semaphore(conc)
    errors = 0

    async def one(client, i):
        nonlocal errors
        async with sem:
            r = await client.post(url, files={"file": (f"{i}.png", pngs[i % len(pngs)], "image/png")})
            errors += r.status_code != 200

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=conc)) as client:
        await asyncio.gather(*(one(client, i) for i in range(conc)))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(n)))
        return n / (time.perf_counter() - t0), errors


def check_service(paths: list[str], n_requests: int, log: Path) -> dict:
    import httpx

    from tafl.serving.launch import ServerProcess

    env = {"BENTOML_HOME": str(log.parent / "bentoml_home")}
    out: dict = {}
    with ServerProcess(paths, env=env, log_path=log) as srv:
        models = httpx.get(srv.url + "/models", timeout=30).json()["models"]
        out["models"] = [{"name": m.get("name"), "version": m.get("version"), "providers": m.get("providers")}
                         for m in models]
        by_name = {load_package(p).name: p for p in paths}
        for m in models:
            pkg = load_package(by_name[m["name"]])
            sess = pkg.session()
            p = pkg.preprocess
            pngs = _pngs(16, max(p.size, 64), p.channels, seed=2)
            x = p(_images(pngs))
            ref = pkg.run(sess, x)
            worst, same = 0.0, 0
            for i, b in enumerate(pngs):
                r = httpx.post(srv.url + "/predict", params={"model": m["name"]},
                               files={"file": (f"{i}.png", b, "image/png")}, timeout=60)
                r.raise_for_status()
                body = r.json()
                res = body["results"][0] if "results" in body else body
                probs = np.asarray(_probs(res, pkg), np.float64)
                worst = max(worst, float(np.max(np.abs(probs - ref["probs"][i]))))
                same += int(res["label"]) == int(ref["label"][i])
            rate, errors = asyncio.run(_load(srv.url + f"/predict?model={m['name']}", pngs, n_requests, 32))
            t_in = _median_rate(lambda: pkg.run(sess, p(_images(pngs * 2))), 32, 20)
            out[m["name"]] = {"predict_vs_inprocess_cuda_max_abs_diff": worst, "label_agreement": same / len(pngs),
                              "c32_requests_per_s": rate, "errors": errors, "inprocess_cuda_images_per_s": t_in,
                              "service_over_inprocess": rate / t_in}
    return out


def _probs(body: dict, pkg) -> list[float]:
    probs = body["probabilities"]
    if isinstance(probs, dict):
        return [probs[c] for c in pkg.metadata["class_names"]]
    return probs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="+")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--service", action="store_true")
    ap.add_argument("--requests", type=int, default=400)
    ns = ap.parse_args()
    import onnxruntime as ort

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"onnxruntime": ort.__version__, "available_providers": ort.get_available_providers(),
                    "date": time.strftime("%Y-%m-%d %H:%M"), "packages": [], "errors": []}
    try:
        import torch

        result["torch"] = torch.__version__
        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001 - informative only
        result["torch"] = f"unavailable: {exc}"
    for path in ns.packages:
        try:
            result["packages"].append(check_package(path, ns.repeats))
        except Exception as exc:  # noqa: BLE001 - one package's failure is reported, the rest still run
            result["errors"].append(f"{path}: {type(exc).__name__}: {exc}")
        (out / "cuda_check.json").write_text(json.dumps(result, indent=1, default=str))
    if ns.service:
        try:
            result["service"] = check_service(ns.packages, ns.requests, out / "service.log")
        except Exception as exc:  # noqa: BLE001
            result["errors"].append(f"service: {type(exc).__name__}: {exc}")
    (out / "cuda_check.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))
    return 0 if any(p["cuda_used"] for p in result["packages"]) else 3


if __name__ == "__main__":
    raise SystemExit(main())
