"""Where a request's time goes in the service: py-spy samples the BentoML worker while wrk posts one PNG at
concurrency 32 (issue 36). Reports the share of samples per thread (the event loop against ONNX Runtime's
calls) and, inside the event loop, the inclusive and self share per file, BentoML's middleware and tafl's code
apart. Needs `wrk` (Debian) and `py-spy` (pip) on the machine.

    python benchmarks/serving_profile.py PKG [--seconds 15] [--name serving_profile]

Writes benchmarks/results/<name>.md and the raw collapsed stacks beside it (<name>.txt).
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.serving.launch import ServerProcess  # noqa: E402

BOUNDARY = "tafl-bench-boundary"


def _body() -> bytes:
    z = np.load(REPO.parent / "shared" / "data" / "medmnist" / "dermamnist.npz")
    buf = io.BytesIO()
    Image.fromarray(z["test_images"][0]).save(buf, "PNG")
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode() + buf.getvalue() + f"\r\n--{BOUNDARY}--\r\n".encode()


def _file(frame: str) -> str:
    m = re.search(r"\((.*?):\d+\)", frame)
    p = m.group(1) if m else frame
    return re.sub(r".*/site-packages/", "", p).replace(str(REPO) + "/", "")


def summarise(raw: str) -> dict:
    threads, inc, self_ = collections.Counter(), collections.Counter(), collections.Counter()
    total = loop = 0
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        frames, k = stack.split(";"), int(n)
        total += k
        on_loop = frames[0].startswith("_run_module_as_main")
        threads["event loop" if on_loop else "ONNX Runtime calls (worker threads)"
                if any("onnxruntime" in f for f in frames) else "other threads"] += k
        if on_loop:
            loop += k
            files = [_file(f) for f in frames]
            for f in set(files):
                inc[f] += k
            self_[files[-1]] += k
    return {"total": total, "loop": loop, "threads": threads, "inclusive": inc, "self": self_}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package")
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--name", default="serving_profile")
    ns = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not shutil.which("wrk") or not Path(spy).exists():
        sys.exit("needs wrk (apt-get install wrk) and py-spy (pip install py-spy)")
    res = REPO / "benchmarks" / "results"
    tmp = Path(tempfile.mkdtemp())
    (tmp / "body.bin").write_bytes(_body())
    (tmp / "post.lua").write_text(f'local f = io.open("{tmp}/body.bin", "rb")\nwrk.method = "POST"\n'
                                  f'wrk.body = f:read("*all")\nwrk.headers["Content-Type"] = '
                                  f'"multipart/form-data; boundary={BOUNDARY}"\n')
    raw_path = res / f"{ns.name}.txt"
    with ServerProcess([ns.package], log_path=tmp / "service.log") as srv:
        worker = max(psutil.Process(srv.proc.pid).children(recursive=True), key=lambda p: p.memory_info().rss)
        load = subprocess.Popen(["wrk", "-t1", "-c32", f"-d{ns.seconds + 10}s", "-s", str(tmp / "post.lua"),
                                 srv.url + "/predict"], stdout=subprocess.PIPE, text=True)
        time.sleep(5)
        subprocess.run([spy, "record", "-p", str(worker.pid), "-d", str(ns.seconds), "-r", "200", "-f", "raw",
                        "-o", str(raw_path), "--nonblocking"], check=True, capture_output=True)
        wrk_out = load.communicate()[0]
    rps = re.search(r"Requests/sec:\s+([\d.]+)", wrk_out)
    s = summarise(raw_path.read_text())
    idle = s["self"].get("asyncio/runners.py", 0)  # the loop waiting in select: not work
    busy = max(1, s["loop"] - idle)
    lines = [f"# Where a request's time goes: {Path(ns.package).name}, wrk c = 32, py-spy {ns.seconds} s at 200 Hz",
             "", f"wrk: {float(rps.group(1)) if rps else float('nan'):.0f} requests/s while sampled. "
             f"{s['total']} samples; the event loop's {s['loop']}, of which {idle} waiting in select "
             f"(asyncio/runners.py), so {busy} busy.", "", "| thread | share of samples |", "|---|---|"]
    lines += [f"| {k} | {v / s['total']:.1%} |" for k, v in s["threads"].most_common()]
    lines += ["", "Inside the event loop, share of its busy samples (inclusive: the file is on the stack):", "",
              "| file | inclusive | self |", "|---|---|---|"]
    for f, v in s["inclusive"].most_common():
        if f in ("asyncio/runners.py", "<frozen runpy>", "click/core.py", "uvicorn/server.py", "uvicorn/_compat.py",
                 "_bentoml_impl/worker/service.py") or v / busy < 0.02:
            continue
        lines.append(f"| {f} | {v / busy:.1%} | {s['self'].get(f, 0) / busy:.1%} |")
    (res / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
