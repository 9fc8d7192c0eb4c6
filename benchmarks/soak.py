"""Soak: a real `bentoml serve` under a sustained mix of valid and hostile uploads (issue 15 item 6).

    python benchmarks/soak.py [PKG] [--seconds 60] [--clients 32]
        (default PKG: benchmarks/out/pkg_gtafl_s1, else the newest package under benchmarks/out)

`--clients` asyncio clients post for `--seconds` a mix of valid images (DermaMNIST test PNGs, the same
as JPEG, the real DICOMs in ../shared/data/dicom) and hostile ones (the crafted corpus of
tests/hostile_corpus.py: decompression bombs, inflating transfer syntaxes, expanding LUTs, frames that
disagree with their header, deep sequences, plus random bytes, truncations, oversized bodies and batches
past the request's frame cap), while a separate process polls /healthz every 50 ms. Every valid answer is
checked against the package run in-process on the same decoded frames. Resident memory of the server's
process tree is sampled throughout (growth = end of the run minus after warm-up).

Targets: zero 5xx, /healthz p99 < 200 ms, memory growth < 300 MB, every valid request answered correctly.
The load generator shares the 2 cores with the service. Writes benchmarks/results/soak.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import psutil
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.imaging import decode_image  # noqa: E402
from tafl.packaging import load_package  # noqa: E402
from tafl.serving.launch import ServerProcess  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
MAX_UPLOAD_MB = 8


def valid_inputs(n_png: int = 40) -> list[tuple[str, bytes, str]]:
    z = np.load(SHARED / "medmnist" / "dermamnist.npz")
    out = []
    for i, a in enumerate(z["test_images"][:n_png]):
        for fmt, media in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
            buf = io.BytesIO()
            Image.fromarray(a).save(buf, fmt)
            out.append((f"derm{i}.{fmt.lower()}", buf.getvalue(), media))
    for p in sorted((SHARED / "dicom").glob("*.dcm")):
        data = p.read_bytes()
        if len(data) <= MAX_UPLOAD_MB * 2**20:
            out.append((p.name, data, "application/dicom"))
    return out


def hostile_inputs() -> list[tuple[str, bytes, str]]:
    from tests.hostile_corpus import corpus

    rng = random.Random(0)
    out = [(name, data, "application/octet-stream") for name, data in corpus().items()]
    out += [("random.bin", bytes(rng.getrandbits(8) for _ in range(4096)), "application/octet-stream"),
            ("text.txt", b"hello, this is not an image\n" * 50, "text/plain")]
    return out


def expected(pkg, items: list[tuple[str, bytes, str]]) -> tuple[dict[str, list[int]], list[tuple[str, bytes, str]]]:
    """In-process labels per file (one per frame) for the valid files the decoder accepts."""
    session = pkg.session()
    labels, kept = {}, []
    for name, data, media in items:
        try:
            frames = decode_image(data, max_bytes=MAX_UPLOAD_MB * 2**20).frames
        except Exception:  # noqa: BLE001 - a shared DICOM the service refuses is not a valid input here
            continue
        labels[name] = [int(v) for v in pkg.run(session, frames)["label"]]
        kept.append((name, data, media))
    return labels, kept


def health_poller(url: str, seconds: float) -> tuple[list[float], int]:
    """GET /healthz every 50 ms for `seconds`: latencies (ms) and failures."""
    lat, fails = [], 0
    stop = time.perf_counter() + seconds
    with httpx.Client(timeout=10) as c:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            try:
                ok = c.get(f"{url}/healthz").status_code == 200
            except httpx.HTTPError:
                ok = False
            lat.append(1000 * (time.perf_counter() - t))
            fails += not ok
            time.sleep(0.05)
    return lat, fails


def tree_rss(pid: int) -> int:
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def rss_by_role(pid: int) -> dict[str, float]:
    """The server tree's resident MB by role: the BentoML arbiter, its workers, the workers' decoder processes
    (spawned by multiprocessing), and anything else (circus, Prometheus): where a growth lives."""
    out: Counter = Counter()
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    for q in procs:
        try:
            cmd, rss = " ".join(q.cmdline()), q.memory_info().rss
        except psutil.Error:
            continue
        role = ("workers" if "_bentoml_impl.worker.service" in cmd else
                "decoders" if "multiprocessing" in cmd else
                "arbiter" if q.pid == pid or "bentoml_main" in cmd else "other")
        out[role] += rss / 2**20
    return {k: round(v) for k, v in sorted(out.items())}


async def soak(url: str, pid: int, valid, hostile, labels, seconds: float, clients: int) -> dict:
    stop = time.perf_counter() + seconds
    codes: Counter = Counter()
    kinds: Counter = Counter()
    wrong: list[str] = []
    health: list[float] = []
    health_fail = 0
    rss: list[int] = []
    rng = random.Random(1)

    async def worker(k: int) -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            while time.perf_counter() < stop:
                roll = rng.random()
                if roll < 0.6:  # one valid image
                    name, data, media = rng.choice(valid)
                    r = await c.post(f"{url}/predict", files={"file": (name, data, media)})
                    kind = "valid"
                    if r.status_code == 200:
                        body = r.json()
                        got = [f["label"] for f in body["frames"]] if "frames" in body else [body["label"]]
                        if got != labels[name]:
                            wrong.append(name)
                elif roll < 0.7:  # a valid batch
                    picks = rng.sample(valid, 4)
                    r = await c.post(f"{url}/predict/batch", files=[("file", p) for p in picks])
                    kind = "valid-batch"
                    if r.status_code == 200:
                        for (name, _, _), item in zip(picks, r.json()["results"]):
                            got = [f["label"] for f in item["frames"]] if "frames" in item else [item.get("label")]
                            if got != labels[name]:
                                wrong.append(name)
                elif roll < 0.95:  # one hostile file, as multipart or as a raw body
                    name, data, media = rng.choice(hostile)
                    if rng.random() < 0.5:
                        r = await c.post(f"{url}/predict", files={"file": (name, data, media)})
                    else:
                        r = await c.post(f"{url}/predict", content=data, headers={"content-type": "application/dicom"})
                    kind = "hostile"
                elif roll < 0.98:  # over the upload limit
                    r = await c.post(f"{url}/predict", files={"file": ("big.png", b"\0" * (MAX_UPLOAD_MB + 1) * 2**20,
                                                                       "image/png")})
                    kind = "oversized"
                else:  # a batch past the request's frame cap
                    r = await c.post(f"{url}/predict/batch",
                                     files=[("file", rng.choice(valid)[:2] + ("image/png",)) for _ in range(64)])
                    kind = "big-batch"
                codes[(kind, r.status_code)] += 1
                kinds[kind] += 1

    async def poll_health() -> None:  # in its own process: the load clients' own work must not delay it
        nonlocal health_fail
        loop = asyncio.get_running_loop()
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            lat, fails = await loop.run_in_executor(None, pool.apply, health_poller, (url, seconds))
        health.extend(lat)
        health_fail += fails

    async def sample_memory() -> None:
        while time.perf_counter() < stop:
            rss.append(tree_rss(pid))
            await asyncio.sleep(0.5)

    t0 = time.perf_counter()
    roles_start = rss_by_role(pid)
    await asyncio.gather(*(worker(k) for k in range(clients)), poll_health(), sample_memory())
    wall = time.perf_counter() - t0
    rss.append(tree_rss(pid))
    roles_end = rss_by_role(pid)
    h = sorted(health)
    return {
        "seconds": wall, "clients": clients,
        "requests": sum(kinds.values()), "by_kind": dict(kinds),
        "statuses": {f"{k}:{s}": n for (k, s), n in sorted(codes.items())},
        "status_5xx": sum(n for (_, s), n in codes.items() if s >= 500),
        "valid_wrong": len(wrong), "valid_wrong_files": sorted(set(wrong))[:20],
        "valid_not_200": sum(n for (k, s), n in codes.items() if k.startswith("valid") and s != 200),
        "healthz": {"polls": len(h), "failed": health_fail, "p50_ms": statistics.median(h),
                    "p99_ms": h[min(len(h) - 1, int(0.99 * len(h)))], "max_ms": h[-1]},
        "rss_mb": {"start": rss[0] / 2**20, "peak": max(rss) / 2**20, "end": rss[-1] / 2**20,
                   "growth": (rss[-1] - rss[0]) / 2**20,
                   "every_5s": [round(v / 2**20) for v in rss[::10]]},
        "rss_by_role_mb": {"start": roles_start, "end": roles_end},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("package", nargs="?")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak"))
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra service environment")
    ns = ap.parse_args()
    pkg_dir = Path(ns.package) if ns.package else REPO / "benchmarks" / "out" / "pkg_gtafl_s1"
    pkg = load_package(pkg_dir)
    valid, hostile = valid_inputs(), hostile_inputs()
    labels, valid = expected(pkg, valid)
    print(f"soak: {len(valid)} valid inputs ({sum(m == 'application/dicom' for _, _, m in valid)} DICOM), "
          f"{len(hostile)} hostile, {ns.clients} clients for {ns.seconds:g} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"BENTOML_HOME": str(Path(tmp) / "home"), "TAFL_MAX_UPLOAD_MB": str(MAX_UPLOAD_MB),
               "TAFL_AUDIT_LOG": str(Path(tmp) / "audit.jsonl"), **dict(e.split("=", 1) for e in ns.env)}
        with ServerProcess([str(pkg_dir)], env=env, log_path=Path(tmp) / "service.log") as srv:
            warm = asyncio.run(soak(srv.url, srv.proc.pid, valid, hostile, labels, min(10.0, ns.seconds / 6), 4))
            res = asyncio.run(soak(srv.url, srv.proc.pid, valid, hostile, labels, ns.seconds, ns.clients))
            log = (Path(tmp) / "service.log").read_text(errors="replace")
        res["warmup_requests"] = warm["requests"]
        res["tracebacks_in_service_log"] = log.count("Traceback")
    res.update(package=f"{pkg.name} {pkg.version}", service_env=ns.env, date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count(),
               targets={"status_5xx": 0, "healthz_p99_ms": 200, "rss_growth_mb": 300, "valid_wrong": 0})
    res["met"] = {"no_5xx": res["status_5xx"] == 0, "healthz_p99": res["healthz"]["p99_ms"] < 200,
                  "rss_growth": res["rss_mb"]["growth"] < 300,
                  "valid_correct": res["valid_wrong"] == 0 and res["valid_not_200"] == 0}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    h, m = res["healthz"], res["rss_mb"]
    md = [f"# Soak ({res['date']}, {res['cpus']} cores, {res['package']}"
          f"{', ' + ' '.join(ns.env) if ns.env else ''})", "",
          f"{ns.clients} clients for {res['seconds']:.0f} s: {res['requests']} requests "
          f"({', '.join(f'{k} {v}' for k, v in res['by_kind'].items())}).", "",
          "| measure | value | target |", "|---|---|---|",
          f"| 5xx answers | {res['status_5xx']} | 0 |",
          f"| valid answers wrong / not 200 | {res['valid_wrong']} / {res['valid_not_200']} | 0 |",
          f"| /healthz p50 / p99 / max (ms) | {h['p50_ms']:.1f} / {h['p99_ms']:.1f} / {h['max_ms']:.1f} | p99 < 200 |",
          f"| /healthz polls failed | {h['failed']} of {h['polls']} | 0 |",
          f"| server RSS start / peak / end (MB) | {m['start']:.0f} / {m['peak']:.0f} / {m['end']:.0f} | |",
          f"| RSS growth (MB) | {m['growth']:.0f} | < 300 |",
          f"| RSS every 5 s (MB) | {' '.join(map(str, m['every_5s']))} | |",
          "| RSS by role, start → end (MB) | " + ", ".join(
              f"{k} {res['rss_by_role_mb']['start'].get(k, 0)} → {v}" for k, v in res["rss_by_role_mb"]["end"].items())
          + " | |",
          f"| tracebacks in the service log | {res['tracebacks_in_service_log']} | 0 |", "",
          "Statuses: " + ", ".join(f"{k} ×{v}" for k, v in res["statuses"].items())]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(res["met"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
