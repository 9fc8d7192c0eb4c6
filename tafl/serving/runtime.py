"""The model side of the service: loaded packages, ONNX Runtime sessions and adaptive batching.

`ModelRegistry` loads packages by folder or BentoML model tag (TAFL_PACKAGES), verifies them with
the packaging loader, and runs each in ONNX Runtime with the CUDA provider first and the CPU
provider second; the providers actually in use are logged and reported. `Batcher` is the
adaptive batching of the model call: requests queue per model; the dispatcher takes whatever is
waiting (up to `max_batch` images, waiting at most `max_wait_ms` for company), so an idle service
answers a lone request at once while a busy one forms larger batches on its own. Up to `lanes` model calls
run at once (TAFL_MODEL_LANES, default 1; each lane then gets cores // lanes ONNX Runtime threads). A new package
version can be swapped in while the old one finishes its in-flight requests (`swap`); what a
reload may load is `reload_target`'s policy (BentoML tags, or folders inside TAFL_PACKAGE_ROOT), and
with TAFL_TRUSTED_KEYS every load verifies the package's Ed25519 signature first.
No torch here: serving runs ONNX Runtime only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tafl.errors import BadRequest, Forbidden, NotFound, PackageError
from tafl.packaging.domain import describe
from tafl.packaging.package import ModelPackage, load_package
from tafl.serving.tuning import cpu_cores

log = logging.getLogger("tafl.serving")


TAG_PART = re.compile(r"^[a-z0-9]([-._a-z0-9]*[a-z0-9])?$")  # BentoML's tag grammar, for a name and a version
TAG_MAX = 63


def is_bentoml_tag(ref: str) -> bool:
    """`name` or `name:version` in BentoML's grammar (lower-case letters, digits, '-', '_', '.'; at most 63
    characters each, starting and ending with a letter or digit)."""
    name, sep, version = ref.partition(":")
    parts = [name, version] if sep else [name]
    return all(len(p) <= TAG_MAX and TAG_PART.match(p) for p in parts)


def resolve_package(ref: str, trusted_keys: Any = None) -> ModelPackage:
    """A folder path, or a BentoML model tag (`name` or `name:version`). `trusted_keys` as in `load_package`
    (None: TAFL_TRUSTED_KEYS)."""
    p = Path(ref).expanduser()
    if p.is_dir():
        return load_package(p, trusted_keys)
    if "/" in ref or ref.startswith("."):
        raise PackageError(f"model package folder not found: {ref}")
    if not is_bentoml_tag(ref):
        raise PackageError(f"{ref[:80]!r} is neither a package folder nor a BentoML model tag (name[:version]: "
                           "lower-case letters, digits, '-', '_', '.')")
    from tafl.packaging.store import from_bentoml

    return from_bentoml(ref if ":" in ref else f"{ref}:latest", trusted_keys)


# ------------------------------------------------------------------ /admin/reload: what may be loaded
@dataclass(frozen=True)
class ReloadTarget:
    ref: str  # what the registry loads: a resolved folder or a tag
    label: str  # what responses, /models and logs show: the tag, or the folder relative to the package root
    root: Path | None = None
    folder: Path | None = None


MAX_REF = 1024
_ABS_PATH = re.compile(r"(?<![\w.\-])(?:[A-Za-z]:)?[/\\][^\s'\"()\[\],;]+")


def reload_target(ref: Any, package_root: str | None) -> ReloadTarget:
    """Check a /admin/reload `package` against the policy: a BentoML tag (name[:version]), or a folder (a value
    with a '/' or starting with '.': relative to TAFL_PACKAGE_ROOT, or absolute) that resolves, symlinks
    followed, inside TAFL_PACKAGE_ROOT, with every file in it inside too. Without a package root only tags
    are accepted. Errors never repeat the path given."""
    if not isinstance(ref, str) or not ref.strip():
        raise BadRequest('send JSON: {"package": "<BentoML tag, or a folder under the package root>"}')
    ref = ref.strip()
    if len(ref) > MAX_REF or "\x00" in ref:
        raise BadRequest("'package' is too long or holds a NUL character")
    if not ("/" in ref or "\\" in ref or ref.startswith((".", "~"))):
        if not is_bentoml_tag(ref):
            raise BadRequest("'package' is not a BentoML model tag: name[:version], lower-case letters, digits, "
                             "'-', '_' and '.', at most 63 characters each (a folder under the package root "
                             "is given with a '/', e.g. ./NAME)")
        return ReloadTarget(ref if ":" in ref else f"{ref}:latest", ref if ":" in ref else f"{ref}:latest")
    if not package_root:
        raise Forbidden("reloading from folders is disabled: this service has no TAFL_PACKAGE_ROOT; send a "
                        "BentoML model tag, or start the service with TAFL_PACKAGE_ROOT")
    if "\\" in ref or ref.startswith("~"):
        raise BadRequest("'package' folders are POSIX paths under the package root ('/', no '\\' or '~')")
    try:
        root = Path(package_root).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):
        raise Forbidden("reloading from folders is disabled: the configured package root is not a folder") from None
    if not root.is_dir():
        raise Forbidden("reloading from folders is disabled: the configured package root is not a folder")
    given = Path(ref)
    try:
        folder = (given if given.is_absolute() else root / given).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, an odd name
        raise BadRequest("'package' does not name a folder under the package root") from None
    if folder == root or not folder.is_relative_to(root):
        raise Forbidden("'package' is not a folder under the package root (after following symlinks and '..'); "
                        "only packages under TAFL_PACKAGE_ROOT may be loaded")
    rel = folder.relative_to(root).as_posix()
    label = f"package-root:{rel}"
    if not folder.is_dir():
        raise PackageError(f"no package folder '{rel}' under the package root")
    try:
        entries = list(folder.iterdir())
        outside = [e for e in entries if not e.resolve().is_relative_to(root)]
    except (OSError, RuntimeError):
        raise PackageError(f"the package folder '{rel}' under the package root cannot be read") from None
    if outside:
        raise Forbidden(f"the package folder '{rel}' holds {len(outside)} link(s) that lead outside the package "
                        "root; packages must lie wholly inside it")
    return ReloadTarget(str(folder), label, root, folder)


def scrub_paths(message: str, target: ReloadTarget | None = None) -> str:
    """`message` without host paths: the target folder becomes its label, the package root a placeholder,
    any other absolute path '<path>'."""
    if target is not None and target.folder is not None:
        message = message.replace(str(target.folder), target.label)
    if target is not None and target.root is not None:
        message = message.replace(str(target.root), "<package root>")
    return _ABS_PATH.sub("<path>", message)


def reload_error(exc: PackageError, target: ReloadTarget) -> PackageError:
    """A reload's PackageError as a message without host paths."""
    what = (f"the package '{target.label.removeprefix('package-root:')}' under the package root"
            if target.folder is not None else f"the BentoML model '{target.label}'")
    reason = scrub_paths(exc.message, target)
    if target.folder is not None:
        reason = reason.replace(f"{target.label}/", "").replace(f"{target.label}: ", "")
    return PackageError(f"{what} was refused: {reason}")


def lane_threads(cores: int, lanes: int, workers: int = 1) -> int | None:
    """ONNX Runtime's intra-op threads for one model call: with several calls at once on the machine (lanes in each of
    the service's workers), the cores shared out among them, at least one each; with a single call, None (ONNX
    Runtime's own choice, every core)."""
    calls = max(1, lanes) * max(1, workers)
    return max(1, cores // calls) if calls > 1 else None


class Batcher:
    """Adaptive batching of one model's calls."""

    def __init__(self, run, max_batch: int = 64, max_wait_ms: float = 2.0, lanes: int = 1):
        self.run = run  # (N, C, H, W) float32 -> dict of arrays with N rows; must allow `lanes` calls at once
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        # model calls in flight at once, each in a thread of its own (`model_lanes`): while one lane runs the
        # model, the next batch forms and starts on another
        self.lanes = max(1, int(lanes))
        self.queue: asyncio.Queue | None = None
        self.slots: asyncio.Semaphore | None = None  # one per lane
        self.task: asyncio.Task | None = None
        self.calls: set[asyncio.Task] = set()  # the model calls running now
        self.queued = 0  # images waiting in the queue
        self.running = 0  # images in the model calls running now
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.lanes, thread_name_prefix="tafl-infer")
        self.batch_sizes: list[int] = []  # the last few, for /models
        self.isolated_failures = 0  # failed batches re-run request by request

    async def submit(self, x: np.ndarray, prior_ratio: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The model's outputs for x; `prior_ratio` (C,) decides these images for another prior (the graph's
        log_prior_ratio input), while the rest of their batch keeps its own. A submission of more than
        `max_batch` images is split into chunks of at most `max_batch`, so no model call grows past it."""
        if self.task is None or self.task.done():
            self.queue, self.slots = asyncio.Queue(), asyncio.Semaphore(self.lanes)
            self.queued = self.running = 0
            self.task = asyncio.get_running_loop().create_task(self._loop())
        loop = asyncio.get_running_loop()
        futs = []
        for start in range(0, max(len(x), 1), self.max_batch):
            fut: asyncio.Future = loop.create_future()
            chunk = x[start:start + self.max_batch]
            self.queued += len(chunk)
            await self.queue.put((chunk, prior_ratio, fut))
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
        assert self.queue is not None and self.slots is not None
        loop = asyncio.get_running_loop()
        carry = None  # a submission that did not fit the last batch opens the next one
        while True:
            await self.slots.acquire()  # a free lane first: while every lane runs, the queue grows the next batch
            try:
                live, carry = await self._collect(loop, carry)
            except BaseException:
                self.slots.release()
                raise
            if not live:
                self.slots.release()
                continue
            n = sum(len(x) for x, _, _ in live)
            self.running += n  # counted now: the next batch's share (`lane_cap`) forms before this call starts
            call = loop.create_task(self._call(loop, live, n))
            self.calls.add(call)  # held until done: the event loop keeps only a weak reference to a task
            call.add_done_callback(self.calls.discard)

    async def _collect(self, loop, carry) -> tuple[list, Any]:
        """The next batch: whatever waits (`carry` first), up to `lane_cap` images, waiting at most `max_wait`
        for company; the submission that did not fit is returned to open the batch after."""
        assert self.queue is not None
        items = [carry if carry is not None else self._take(await self.queue.get())]
        carry = None
        rows = len(items[0][0])
        deadline = loop.time() + self.max_wait
        while rows < self.lane_cap(rows):
            try:
                nxt = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:  # asyncio.timeout: no task per wait, unlike wait_for (a batch waits once per request)
                    async with asyncio.timeout(left):
                        nxt = await self.queue.get()
                except TimeoutError:
                    break
            self._take(nxt)
            if rows + len(nxt[0]) > self.max_batch:  # no model call grows past max_batch
                carry = nxt
                break
            items.append(nxt)
            rows += len(nxt[0])
        return [(x, r, f) for x, r, f in items if not f.done()], carry  # a timed-out request no longer waits

    def _take(self, item: tuple) -> tuple:
        self.queued -= len(item[0])
        return item

    def lane_cap(self, rows: int) -> int:
        """Images the batch forming now may grow to, `rows` of them in hand: `max_batch` with one lane; with several,
        a lane's share of every image in the house (in hand, queued and running), so no lane takes the whole queue
        while another idles - on the CPU each lane is one thread, and every client would wait on it. A lone
        request on an idle service goes at once (its share is itself)."""
        if self.lanes == 1:
            return self.max_batch
        return min(self.max_batch, max(1, -(-(rows + self.queued + self.running) // self.lanes)))

    async def _call(self, loop, live: list, n: int) -> None:
        """One model call on a lane for the batched submissions `live` (`n` images); the lane is free again at its
        end."""
        assert self.slots is not None
        try:
            await self._run_batch(loop, live)
        finally:
            self.running -= n
            self.slots.release()

    async def _run_batch(self, loop, live: list) -> None:
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
            return
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
    (the package's tafl.prior.PriorEstimator; no image is kept). `add` is cheap and runs on the event loop; the EM
    runs in its own thread every `refresh` images, so estimation never blocks or fails a prediction. Under load it
    runs at most every `min_interval` seconds, on the window as it is then: an EM of 500 images takes up to 2 ms, and
    at 1,000 images a second every 50 images it took 3-7 % of the service's throughput (docs/results.md, "The worker's heap")."""

    def __init__(self, source: np.ndarray, window: int = 500, refresh: int = 50, min_images: int = 100,
                 blocked: str | None = None, estimator: Any = None, min_interval: float = 0.5):
        from collections import deque

        from tafl.prior import PriorEstimator

        # the package's estimator (metadata prior.estimator; None: the maximum-likelihood EM)
        self.estimator = estimator if estimator is not None else PriorEstimator.from_dict(None)

        # why prior=adaptive must not decide for this model (tafl.prior.adaptive_check); the estimate is still kept
        # and exported as the case-mix drift signal
        self.blocked = blocked
        self.source = source / source.sum()
        self.window, self.refresh, self.min_images = max(1, window), max(1, refresh), max(1, min_images)
        self.rows: deque = deque(maxlen=self.window)
        self.lock = threading.Lock()
        self.since = 0
        self.estimate: Any = None  # tafl.prior.PriorEstimate of the last refresh
        self.updated_at: float | None = None
        self.running = False
        self.min_interval = max(0.0, min_interval)
        self.last_run = -math.inf  # time.monotonic() of the last estimate's start
        self.errors = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tafl-prior")

    def add(self, probs_source: np.ndarray) -> None:
        """Calibrated posteriors under the source prior, one row per served image."""
        with self.lock:
            self.rows.extend(np.asarray(probs_source, np.float64))
            self.since += len(probs_source)
            due = self.since >= self.refresh and not self.running
            if due:
                self.running = True
        if due:
            self.pool.submit(self._refresh)

    def _refresh(self) -> None:
        try:
            # no sooner than min_interval after the last one; the images served meanwhile are in the window it takes
            wait = self.last_run + self.min_interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self.lock:
                self.since, self.last_run = 0, time.monotonic()
                rows = np.stack(self.rows)
            est = self.estimator.estimate(rows, self.source)
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
        if self.blocked:
            return None, 0 if est is None else est.images, self.blocked
        if est is None:
            return None, 0, f"no estimate yet (it needs {self.min_images} served images)"
        if est.images < self.min_images:
            return None, est.images, f"{est.images} served images are too few for an estimate (needs {self.min_images})"
        return est.prior, est.images, None

    def describe(self) -> dict[str, Any]:
        with self.lock:
            est, at, n = self.estimate, self.updated_at, len(self.rows)
        return {"source_prior": [float(v) for v in self.source], "window": self.window, "refresh": self.refresh,
                "min_images": self.min_images, "images_in_window": n, "adaptive_blocked": self.blocked,
                "estimator": self.estimator.to_dict(),
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
    lanes_from: str = "default"  # why it has its lanes: TAFL_MODEL_LANES, or the rule the service chose by
    monitor: PriorMonitor | None = None  # the served case mix, for packages whose graph takes a prior
    site_prior: np.ndarray | None = None  # prior=site: this site's own mix (TAFL_SITE_MIX), for a prior-taking graph
    answered: int = 0  # images (frames) this worker answered with a label
    outside_domain: int = 0  # images this worker refused by the package's header rules (OutsideDomain)
    abstained: int = 0  # images (frames) the package's in-domain detector put outside its domain

    @property
    def name(self) -> str:
        return self.package.name

    def describe_domain(self) -> dict[str, Any]:
        """The input domain's rule and this worker's counts since it loaded the package: answered (in domain),
        refused by the header rules (422), abstained by the detector, and the share outside of all it was sent."""
        outside = self.outside_domain + self.abstained
        det = self.package.meta.domain.detector
        return {"rule": describe(self.package.meta.domain), "answered": self.answered,
                "refused": self.outside_domain, "abstained": self.abstained,
                "refused_share": self.outside_domain / max(1, self.answered + outside),
                "outside_share": outside / max(1, self.answered + outside),
                "detector": None if det.threshold is None else {"threshold": det.threshold, "keep": det.keep}}

    def headline(self) -> dict[str, Any] | None:
        """The card's headline number with its 95% interval from the test split's size (tafl.intervals), or None."""
        from tafl.intervals import wilson, with_interval

        met = self.package.meta.metrics
        v, n = met.average_accuracy, met.test_images
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return None
        _, lo, hi = wilson(v * n, n) if n else (v, None, None)
        return {"average_accuracy": float(v), "interval": None if lo is None else [lo, hi], "test_images": n,
                "text": with_interval(v, n, 1), "interval_method": "Wilson, 95%, over the test split's images"}

    def describe(self) -> dict[str, Any]:
        sizes = self.batcher.batch_sizes
        return {"name": self.name, "version": self.package.version, "source": self.source,
                "providers": self.providers, "signed_by": self.package.signed_by,
                "metadata": self.package.metadata, "card": self.package.card,
                "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.loaded_at)),
                "recent_batch_sizes": {"count": len(sizes), "mean": float(np.mean(sizes)) if sizes else None,
                                       "max": max(sizes) if sizes else None},
                "lanes": self.batcher.lanes,  # model calls in flight at once (TAFL_MODEL_LANES, or chosen)
                "lanes_from": self.lanes_from,
                "case_mix": self.monitor.describe() if self.monitor else None,
                "domain": self.describe_domain(),
                "headline": self.headline(),
                "site_prior": None if self.site_prior is None else  # what prior=site decides for
                dict(zip(self.package.class_names, map(float, self.site_prior)))}


class ModelRegistry:
    def __init__(self, refs: list[str], *, providers: list[str] | None = None, threads: int | None = None,
                 max_batch: int = 64, max_wait_ms: float = 2.0, prior_window: int = 500, prior_refresh: int = 50,
                 prior_min_images: int = 100, trusted_keys: Any = None, lanes: int | None = None,
                 site_mix: str | None = None, workers: int = 1, lanes_from: str = "default",
                 prior_adaptive: str | None = None):
        from tafl.packaging.signing import load_trusted_keys, trusted_keys_from_env
        from tafl.settings import prior_adaptive_mode

        # read once: every load and reload verifies against the keys the service started with (None:
        # TAFL_TRUSTED_KEYS; with keys, unsigned and tampered packages are refused)
        self.trusted_keys = trusted_keys_from_env() if trusted_keys is None else load_trusted_keys(trusted_keys)
        if self.trusted_keys:
            log.info("packages must be signed by one of %d trusted key(s): %s", len(self.trusted_keys.ids),
                     ", ".join(self.trusted_keys.ids))
        self.prior_window, self.prior_refresh, self.prior_min_images = prior_window, prior_refresh, prior_min_images
        self.site_mix = site_mix  # TAFL_SITE_MIX: this site's class counts, the centre of a `site` estimator
        # TAFL_PRIOR_ADAPTIVE (the service's Settings hand it on; None: read here): checked follows each package's
        # validation check before prior=adaptive adapts, always adapts anyway
        self.prior_adaptive = prior_adaptive_mode() if prior_adaptive is None else prior_adaptive
        if not refs:
            raise PackageError("no model packages configured: set TAFL_PACKAGES to package folders or BentoML tags")
        self.providers = providers or ["CUDAExecutionProvider", "CPUExecutionProvider"]
        self.threads, self.max_batch, self.max_wait_ms = threads, max_batch, max_wait_ms
        self.lanes = lanes  # model calls in flight per model (TAFL_MODEL_LANES, or the service's plan); None: one
        self.lanes_from = lanes_from
        self.workers = max(1, workers)  # worker processes of the service, each with a registry like this one
        self.models: dict[str, LoadedModel] = {}
        self.order: list[str] = []
        self.lock = threading.Lock()
        for ref in refs:
            m = self._load(ref)
            if m.name in self.models:
                raise PackageError(f"two packages are named '{m.name}'; give them distinct names at export")
            self.models[m.name] = m
            self.order.append(m.name)

    def _load(self, ref: str, label: str | None = None) -> LoadedModel:
        """`label`: what logs and /models show for `ref` (a reload's never names a host path)."""
        pkg = resolve_package(ref, self.trusted_keys)
        # several lanes on the CPU: each gets cores // lanes threads (three of one thread served 1.16x the images of
        # one two-thread call on 2 cores, at about 130 MB more resident memory under the soak: docs/results.md, "Model lanes")
        lanes = self.lanes or 1
        threads = self.threads or lane_threads(cpu_cores(), lanes, self.workers)
        session = pkg.session(self.providers, threads)  # from the verified bytes of model.onnx
        used = session.get_providers()
        log.info("loaded model package %s %s from %s (%s); ONNX Runtime providers in use: %s", pkg.name,
                 pkg.version, label or ref, f"signed by key {pkg.signed_by}" if pkg.signed_by else "signature not "
                 "checked: no trusted keys", used)
        if "CUDAExecutionProvider" in self.providers and "CUDAExecutionProvider" not in used:
            log.info("%s runs on the CPU (no usable CUDA provider)", pkg.name)
        input_name = pkg.meta.input.name
        out_names = [o.name for o in session.get_outputs()]

        # an input with a default is an overridable initializer to ONNX Runtime, not one of its inputs
        takes_prior = pkg.meta.prior is not None and any(
            i.name == "log_prior_ratio" for i in [*session.get_inputs(), *session.get_overridable_initializers()])

        def run(batch: np.ndarray, ratios: np.ndarray | None = None) -> dict[str, np.ndarray]:
            feed = {input_name: batch}
            if ratios is not None and takes_prior:
                feed["log_prior_ratio"] = ratios
            return dict(zip(out_names, session.run(out_names, feed)))

        from tafl.errors import ConfigError
        from tafl.prior import PriorEstimator, adaptive_blocked, parse_site_mix, site_prior

        monitor, site_q = None, None
        if takes_prior:
            try:  # a malformed record is the package's fault: refused like any other bad package, not a 500
                estimator = PriorEstimator.from_dict(pkg.meta.prior.estimator.to_json())
            except ConfigError as exc:
                raise PackageError(f"{pkg.name} {pkg.version}: metadata prior.estimator: {exc}") from None
            if self.site_mix:  # a class this model lacks is the setting's fault: a ConfigError naming it
                counts = parse_site_mix(self.site_mix, list(pkg.meta.class_names),
                                        f"TAFL_SITE_MIX for {pkg.name}")
                site_q = site_prior(counts)
                estimator = estimator.for_site(counts)
                if estimator.center != "site":
                    log.info("%s %s: TAFL_SITE_MIX is not used: its case-mix estimate is centred on %s, not on the "
                             "site's mix", pkg.name, pkg.version, estimator.center)
            monitor = PriorMonitor(np.asarray(pkg.meta.prior.source_prior, np.float64), self.prior_window,
                                   self.prior_refresh, self.prior_min_images,
                                   blocked=adaptive_blocked(pkg.meta.prior.adaptive_check, self.prior_adaptive),
                                   estimator=estimator)
        return LoadedModel(pkg, session, Batcher(run, self.max_batch, self.max_wait_ms, lanes), used, label or ref,
                           lanes_from=self.lanes_from, monitor=monitor, site_prior=site_q)

    def get(self, name: str | None) -> LoadedModel:
        with self.lock:
            if not name:
                return self.models[self.order[0]]
            if name not in self.models:
                raise NotFound(f"no model named '{name}'; loaded: {', '.join(self.order)}")
            return self.models[name]

    def swap(self, ref: str, label: str | None = None) -> tuple[LoadedModel, LoadedModel | None]:
        """Load a package and make it answer for its name; requests already holding the old one finish on it.
        A package that fails verification raises before anything changes: the old version keeps answering."""
        new = self._load(ref, label)
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
