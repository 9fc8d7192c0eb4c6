"""The model side of the service: loaded packages, ONNX Runtime sessions and adaptive batching.

`ModelRegistry` loads packages by folder or BentoML model tag (TAFL_PACKAGES), verifies them with
the packaging loader, and runs each in ONNX Runtime with the CUDA provider first and the CPU
provider second; the providers actually in use are logged and reported. `Batcher` is the
adaptive batching of the model call: requests queue per model; the dispatcher takes whatever is
waiting (up to `max_batch` images, waiting at most `max_wait_ms` for company), so an idle service
answers a lone request at once while a busy one forms larger batches on its own. A new package
version can be swapped in while the old one finishes its in-flight requests (`swap`).
No torch here: serving runs ONNX Runtime only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tafl.errors import NotFound, PackageError
from tafl.packaging.package import ModelPackage, load_package

log = logging.getLogger("tafl.serving")


def resolve_package(ref: str) -> ModelPackage:
    """A folder path, or a BentoML model tag (`name` or `name:version`)."""
    p = Path(ref).expanduser()
    if p.is_dir():
        return load_package(p)
    if "/" in ref or ref.startswith("."):
        raise PackageError(f"model package folder not found: {ref}")
    from tafl.packaging.store import from_bentoml

    return from_bentoml(ref if ":" in ref else f"{ref}:latest")


class Batcher:
    """Adaptive batching of one model's calls."""

    def __init__(self, run, max_batch: int = 64, max_wait_ms: float = 2.0):
        self.run = run  # (N, C, H, W) float32 -> dict of arrays with N rows
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tafl-infer")
        self.batch_sizes: list[int] = []  # the last few, for /models
        self.isolated_failures = 0  # failed batches re-run request by request

    async def submit(self, x: np.ndarray, prior_ratio: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The model's outputs for x; `prior_ratio` (C,) decides these images for another prior (the graph's
        log_prior_ratio input), while the rest of their batch keeps its own. A submission of more than
        `max_batch` images is split into chunks of at most `max_batch`, so no model call grows past it."""
        if self.task is None or self.task.done():
            self.queue = asyncio.Queue()
            self.task = asyncio.get_running_loop().create_task(self._loop())
        loop = asyncio.get_running_loop()
        futs = []
        for start in range(0, max(len(x), 1), self.max_batch):
            fut: asyncio.Future = loop.create_future()
            await self.queue.put((x[start:start + self.max_batch], prior_ratio, fut))
            futs.append(fut)
        if len(futs) == 1:
            return await futs[0]
        try:
            parts = [await f for f in futs]
        finally:
            for f in futs:  # a cancelled request leaves no chunk waiting for the model
                f.cancel()
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    async def _loop(self) -> None:
        assert self.queue is not None
        loop = asyncio.get_running_loop()
        carry = None  # a submission that did not fit the last batch opens the next one
        while True:
            items = [carry if carry is not None else await self.queue.get()]
            carry = None
            rows = len(items[0][0])
            deadline = loop.time() + self.max_wait
            while rows < self.max_batch:
                try:
                    nxt = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        nxt = await asyncio.wait_for(self.queue.get(), left)
                    except asyncio.TimeoutError:
                        break
                if rows + len(nxt[0]) > self.max_batch:  # no model call grows past max_batch
                    carry = nxt
                    break
                items.append(nxt)
                rows += len(nxt[0])
            live = [(x, r, f) for x, r, f in items if not f.done()]  # a timed-out request no longer waits
            if not live:
                continue
            batch = np.concatenate([x for x, _, _ in live])
            ratios = None
            if any(r is not None for _, r, _ in live):  # one prior row per image; zeros keep the plain rule
                C = len(next(r for _, r, _ in live if r is not None))
                ratios = np.concatenate([np.broadcast_to(np.zeros(C, np.float32) if r is None else
                                                         np.asarray(r, np.float32), (len(x), C)) for x, r, _ in live])
            self.batch_sizes = (self.batch_sizes + [len(batch)])[-100:]
            try:
                out = await loop.run_in_executor(self.pool, self.run, batch, ratios)
            except Exception as exc:  # noqa: BLE001
                if len(live) == 1:
                    live[0][2].done() or live[0][2].set_exception(exc)
                else:  # one request's images must not fail the others batched with it: run each alone
                    self.isolated_failures += 1
                    log.warning("a batch of %d requests failed (%s); running them one by one", len(live),
                                type(exc).__name__)
                    for x, r, f in live:
                        await self._run_alone(loop, x, r, f)
                continue
            start = 0
            for x, _, f in live:
                n = len(x)
                if not f.done():
                    f.set_result({k: v[start:start + n] for k, v in out.items()})
                start += n

    async def _run_alone(self, loop, x: np.ndarray, r: np.ndarray | None, f: asyncio.Future) -> None:
        if f.done():
            return
        ratios = None if r is None else np.broadcast_to(np.asarray(r, np.float32), (len(x), len(r))).copy()
        try:
            out = await loop.run_in_executor(self.pool, self.run, x, ratios)
        except Exception as exc:  # noqa: BLE001 - this request's own failure
            f.done() or f.set_exception(exc)
        else:
            f.done() or f.set_result(out)


class PriorMonitor:
    """The case mix a model is served, estimated from a window of its recent calibrated probability vectors
    (tafl.prior.em_prior; no image is kept). `add` is cheap and runs on the event loop; the EM runs in its own
    thread every `refresh` images, so estimation never blocks or fails a prediction."""

    def __init__(self, source: np.ndarray, window: int = 500, refresh: int = 50, min_images: int = 100):
        from collections import deque

        self.source = source / source.sum()
        self.window, self.refresh, self.min_images = max(1, window), max(1, refresh), max(1, min_images)
        self.rows: deque = deque(maxlen=self.window)
        self.lock = threading.Lock()
        self.since = 0
        self.estimate: Any = None  # tafl.prior.PriorEstimate of the last refresh
        self.updated_at: float | None = None
        self.running = False
        self.errors = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tafl-prior")

    def add(self, probs_source: np.ndarray) -> None:
        """Calibrated posteriors under the source prior, one row per served image."""
        with self.lock:
            self.rows.extend(np.asarray(probs_source, np.float64))
            self.since += len(probs_source)
            due = self.since >= self.refresh and not self.running
            if due:
                self.running, self.since = True, 0
                snapshot = np.stack(self.rows)
        if due:
            self.pool.submit(self._refresh, snapshot)

    def _refresh(self, rows: np.ndarray) -> None:
        from tafl.prior import em_prior

        try:
            est = em_prior(rows, self.source)
            with self.lock:
                self.estimate, self.updated_at = est, time.time()
        except Exception:  # noqa: BLE001 - an estimate is advice; it never fails the service
            self.errors += 1
            log.warning("case-mix estimate failed; the previous one stays", exc_info=True)
        finally:
            with self.lock:
                self.running = False

    def current(self) -> tuple[np.ndarray | None, int, str | None]:
        """(the estimated prior or None, images behind it, why it is not used)."""
        with self.lock:
            est = self.estimate
        if est is None:
            return None, 0, f"no estimate yet (it needs {self.min_images} served images)"
        if est.images < self.min_images:
            return None, est.images, f"{est.images} served images are too few for an estimate (needs {self.min_images})"
        return est.prior, est.images, None

    def describe(self) -> dict[str, Any]:
        with self.lock:
            est, at, n = self.estimate, self.updated_at, len(self.rows)
        return {"source_prior": [float(v) for v in self.source], "window": self.window, "refresh": self.refresh,
                "min_images": self.min_images, "images_in_window": n,
                "estimate": est.to_dict() if est is not None else None,
                "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)) if at else None}


@dataclass
class LoadedModel:
    package: ModelPackage
    session: Any
    batcher: Batcher
    providers: list[str]
    source: str
    loaded_at: float = field(default_factory=time.time)
    in_flight: int = 0
    monitor: PriorMonitor | None = None  # the served case mix, for packages whose graph takes a prior

    @property
    def name(self) -> str:
        return self.package.name

    def describe(self) -> dict[str, Any]:
        sizes = self.batcher.batch_sizes
        return {"name": self.name, "version": self.package.version, "source": self.source,
                "providers": self.providers, "metadata": self.package.metadata, "card": self.package.card,
                "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.loaded_at)),
                "recent_batch_sizes": {"count": len(sizes), "mean": float(np.mean(sizes)) if sizes else None,
                                       "max": max(sizes) if sizes else None},
                "case_mix": self.monitor.describe() if self.monitor else None}


class ModelRegistry:
    def __init__(self, refs: list[str], *, providers: list[str] | None = None, threads: int | None = None,
                 max_batch: int = 64, max_wait_ms: float = 2.0, prior_window: int = 500, prior_refresh: int = 50,
                 prior_min_images: int = 100):
        self.prior_window, self.prior_refresh, self.prior_min_images = prior_window, prior_refresh, prior_min_images
        if not refs:
            raise PackageError("no model packages configured: set TAFL_PACKAGES to package folders or BentoML tags")
        self.providers = providers or ["CUDAExecutionProvider", "CPUExecutionProvider"]
        self.threads, self.max_batch, self.max_wait_ms = threads, max_batch, max_wait_ms
        self.models: dict[str, LoadedModel] = {}
        self.order: list[str] = []
        self.lock = threading.Lock()
        for ref in refs:
            m = self._load(ref)
            if m.name in self.models:
                raise PackageError(f"two packages are named '{m.name}'; give them distinct names at export")
            self.models[m.name] = m
            self.order.append(m.name)

    def _load(self, ref: str) -> LoadedModel:
        pkg = resolve_package(ref)
        session = pkg.session(self.providers, self.threads)
        used = session.get_providers()
        log.info("loaded model package %s %s from %s; ONNX Runtime providers in use: %s", pkg.name, pkg.version, ref,
                 used)
        if "CUDAExecutionProvider" in self.providers and "CUDAExecutionProvider" not in used:
            log.info("%s runs on the CPU (no usable CUDA provider)", pkg.name)
        input_name = pkg.metadata["input"]["name"]
        out_names = [o.name for o in session.get_outputs()]

        # an input with a default is an overridable initializer to ONNX Runtime, not one of its inputs
        takes_prior = "prior" in pkg.metadata and any(
            i.name == "log_prior_ratio" for i in [*session.get_inputs(), *session.get_overridable_initializers()])

        def run(batch: np.ndarray, ratios: np.ndarray | None = None) -> dict[str, np.ndarray]:
            feed = {input_name: batch}
            if ratios is not None and takes_prior:
                feed["log_prior_ratio"] = ratios
            return dict(zip(out_names, session.run(out_names, feed)))

        monitor = PriorMonitor(np.asarray(pkg.metadata["prior"]["source_prior"], np.float64), self.prior_window,
                               self.prior_refresh, self.prior_min_images) if takes_prior else None
        return LoadedModel(pkg, session, Batcher(run, self.max_batch, self.max_wait_ms), used, ref, monitor=monitor)

    def get(self, name: str | None) -> LoadedModel:
        with self.lock:
            if not name:
                return self.models[self.order[0]]
            if name not in self.models:
                raise NotFound(f"no model named '{name}'; loaded: {', '.join(self.order)}")
            return self.models[name]

    def swap(self, ref: str) -> tuple[LoadedModel, LoadedModel | None]:
        """Load a package and make it answer for its name; requests already holding the old one finish on it."""
        new = self._load(ref)
        with self.lock:
            old = self.models.get(new.name)
            self.models[new.name] = new
            if new.name not in self.order:
                self.order.append(new.name)
        log.info("model %s now answers with version %s (was %s)", new.name, new.package.version,
                 old.package.version if old else "none")
        return new, old

    def describe(self) -> list[dict[str, Any]]:
        with self.lock:
            return [self.models[n].describe() for n in self.order]
