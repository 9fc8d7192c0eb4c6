"""How a service runs when nobody said: worker processes and model lanes chosen from each package's measured cost
and this machine's cores, so that the default is the fast setting.

What decides (docs/results.md, "Serving defaults"): every /predict request costs its worker's event loop about
REQUEST_CORE_MS of one core in Python (upload, decode, batcher, JSON, audit line), under one interpreter lock.
- A *cheap* model, whose image costs ONNX Runtime less than CHEAP_FACTOR × that, is bound by the event loop: two
  worker processes (each its own loop and lock) with two lanes each served a ViT-tiny 1.3× the images of one worker
  with three lanes on 2 cores.
- A *compute-bound* model (a ResNet-8) is bound by the cores: one worker with three lanes (model calls in flight at
  once, each with cores ÷ 3 threads) kept them busy, and two workers only lengthened its tail (p99 615 ms).
- A second worker is only chosen where reloads are off (`/admin/reload` changes one worker, so it needs one:
  TAFL_ADMIN_TOKEN unset), where the machine has at least 2 cores, and where the memory for it is free
  (WORKER_MB each, what one reached under the soak). On a GPU nothing was measured: one worker, one lane.
- TAFL_WORKERS and TAFL_MODEL_LANES, where set, decide instead; the plan says which setting came from where.

The cost is measured here, at start: ONNX Runtime on one thread, a batch of MEASURE_BATCH zeros, the best of a few
runs after a warm-up (about 0.1 s for a ResNet-8). The process that first chooses (the BentoML arbiter, or `tafl
serve`'s check) measures in a child process, so that ONNX Runtime never loads into it, and hands the plan on in
PLAN_ENV: the workers BentoML starts read it there and measure nothing. A package loaded later (a reload) is measured
where it loads. `python -m tafl.serving.measure REF ...` prints the costs as JSON (what that child runs).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

REQUEST_CORE_MS = 0.6  # the event loop's CPU per /predict request, measured per thread from /proc (docs/results.md, "The worker's heap")
CHEAP_FACTOR = 2.0  # a model under CHEAP_FACTOR × REQUEST_CORE_MS an image is bound by the event loop
WORKER_MB = 1024  # memory a worker may come to hold (one reached ~1,000 MB under the soak): a second needs it free
CPU_LANES = 3  # lanes of one worker on a CPU of 2+ cores (3 > 2 on the ResNet-8 in three runs of four)
WORKER_LANES = 2  # lanes of each worker where there are two
MEASURE_BATCH = 16
PLAN_ENV = "TAFL_SERVING_PLAN"  # the chosen plan, as JSON, handed from the process that chose to the workers


@dataclass(frozen=True)
class ModelCost:
    """One package's cost on this machine: ONNX Runtime's CPU time per image on one thread, batched."""

    sha256: str  # model.onnx's, from the package's SHA256SUMS: what identifies the graph
    name: str
    core_ms: float  # ms of one core per image, in a batch of MEASURE_BATCH

    @property
    def cheap(self) -> bool:
        return self.core_ms < CHEAP_FACTOR * REQUEST_CORE_MS


@dataclass(frozen=True)
class Plan:
    """Worker processes and the lanes of each model, with why (shown in /models and the log)."""

    workers: int
    lanes: int
    workers_from: str  # "TAFL_WORKERS", or why this count was chosen
    lanes_from: str  # "TAFL_MODEL_LANES", or the rule that chose them
    costs: dict[str, float] = field(default_factory=dict)  # package name -> core-ms an image, as measured at start
    gpu: bool = False
    key: str = ""  # the settings it was chosen for (plan_key): a plan handed on under other settings is not used

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        return cls(workers=int(d["workers"]), lanes=int(d["lanes"]), workers_from=str(d["workers_from"]),
                   lanes_from=str(d["lanes_from"]), costs={str(k): float(v) for k, v in d.get("costs", {}).items()},
                   gpu=bool(d.get("gpu", False)), key=str(d.get("key", "")))


def model_lanes(workers: int, *, gpu: bool = False, cores: int | None = None) -> tuple[int, str]:
    """The lanes rule: one on a GPU or a single core; two in each of several workers; three in one worker."""
    cores = cpu_cores() if cores is None else cores
    if gpu:
        return 1, "a GPU: one model call at a time (several were not measured on a GPU)"
    if cores < 2:
        return 1, "one core: one model call at a time"
    if workers > 1:
        return WORKER_LANES, f"{workers} workers on {cores} cores: {WORKER_LANES} model calls in flight in each"
    return CPU_LANES, f"one worker on {cores} cores: {CPU_LANES} model calls in flight keep them busy"


def plan_key(refs: list[str], set_workers: int | None, set_lanes: int | None, reloads: bool) -> str:
    """What a plan was chosen for: the packages and the settings that decide it."""
    return json.dumps([refs, set_workers, set_lanes, reloads], separators=(",", ":"))


def choose(costs: list[ModelCost], *, cores: int, gpu: bool = False, reloads: bool = False,
           available_mb: float | None = None, set_workers: int | None = None,
           set_lanes: int | None = None, key: str = "") -> Plan:
    """The plan for these packages on this machine (see the module docstring); settings given decide."""
    limit = CHEAP_FACTOR * REQUEST_CORE_MS
    dear = [c for c in costs if not c.cheap]
    if set_workers:
        workers, workers_from = set_workers, "TAFL_WORKERS"
    elif gpu:
        workers, workers_from = 1, "a GPU: one worker holds it (several were not measured on a GPU)"
    elif cores < 2:
        workers, workers_from = 1, "one core"
    elif not costs:
        workers, workers_from = 1, "no package could be measured"
    elif dear:
        workers, workers_from = 1, (f"{dear[0].name} costs {dear[0].core_ms:.2f} core-ms an image (at least "
                                    f"{limit:.1f}): the cores bound it, not the event loop")
    elif reloads:
        workers, workers_from = 1, "reloads are on (TAFL_ADMIN_TOKEN): /admin/reload needs one worker"
    elif available_mb is not None and available_mb < 2 * WORKER_MB:
        workers, workers_from = 1, f"{available_mb:.0f} MB free, under the {2 * WORKER_MB} MB two workers may hold"
    else:
        top = max(costs, key=lambda c: c.core_ms)
        workers, workers_from = 2, (f"every model is cheap ({top.name}: {top.core_ms:.2f} core-ms an image, under "
                                    f"{limit:.1f}): the event loop bounds it, and two workers have one each")
    lanes, lanes_from = (set_lanes, "TAFL_MODEL_LANES") if set_lanes else model_lanes(workers, gpu=gpu, cores=cores)
    return Plan(workers=workers, lanes=lanes, workers_from=workers_from, lanes_from=lanes_from,
                costs={c.name: round(c.core_ms, 4) for c in costs}, gpu=gpu, key=key)


# ------------------------------------------------------------------ measuring
def measure(pkg: Any, session: Any | None = None) -> ModelCost:
    """`pkg`'s cost (tafl.packaging.ModelPackage): its graph on one ONNX Runtime thread, MEASURE_BATCH zero images,
    the best of three runs after one warm-up. `session`: one already built with one thread (else one is built)."""
    if session is None:
        session = pkg.session(["CPUExecutionProvider"], threads=1)
    spec = session.get_inputs()[0]
    shape = [MEASURE_BATCH] + [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape[1:]]
    feed = {spec.name: np.zeros(shape, np.float32)}
    names = [o.name for o in session.get_outputs()]
    session.run(names, feed)
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()  # the calling thread is ONNX Runtime's one thread here: its CPU, not the wall
        session.run(names, feed)
        best = min(best, time.thread_time() - t0)
    return ModelCost(sha256=pkg.files["model.onnx"], name=pkg.name, core_ms=1000 * best / MEASURE_BATCH)


def measure_refs(refs: list[str]) -> list[ModelCost]:
    """Each package's cost, measured in a child process (so that ONNX Runtime stays out of this one). A package that
    does not load is skipped here: the service's own load reports it."""
    cmd = [sys.executable, "-m", "tafl.serving.measure", *refs]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        rows = json.loads(res.stdout or "[]") if res.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("could not measure the packages' cost (%s); serving with one worker", exc)
        return []
    if res.returncode != 0:
        log.info("could not measure the packages' cost (%s); serving with one worker",
                 (res.stderr or "").strip().splitlines()[-1:] or "no output")
    return [ModelCost(**r) for r in rows]


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def gpu_present() -> bool:
    """Whether ONNX Runtime's CUDA provider can run here: an NVIDIA driver and the onnxruntime-gpu build (asked
    without importing ONNX Runtime, which the choosing process keeps out)."""
    from importlib import metadata

    from tafl.packaging.package import cuda_driver_present

    try:
        metadata.version("onnxruntime-gpu")
    except metadata.PackageNotFoundError:
        return False
    return cuda_driver_present()


def available_mb() -> float | None:
    try:
        import psutil

        return psutil.virtual_memory().available / 2**20
    except Exception:  # noqa: BLE001 - no reading: no memory rule
        return None
