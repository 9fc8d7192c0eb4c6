"""The serving state object: everything the routes, the page and the OIP routes share in one worker (settings,
loaded models with their batchers and case-mix monitors, the DICOM decoder processes, the /metrics instruments
and the page's caches). The BentoML service creates one in its __init__ and hangs it on the Starlette app
(`app.state.tafl`); routes reach it through `of(request)`. Nothing here lives at module level
(tests/serving/test_structure.py checks that)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import numpy as np
from starlette.requests import Request

from tafl.errors import ServiceError, ServiceUnavailable
from tafl.packaging.domain import in_domain_rows
from tafl.serving.decoding import INLINE_BYTES, DecodePool
from tafl.serving.http import audit_log
from tafl.serving.runtime import LoadedModel, ModelRegistry
from tafl.serving.settings import Settings

log = logging.getLogger("tafl.serving")
STATE_KEY = "tafl"  # the attribute of Starlette's app.state that holds the ServingState
STATIC_CACHE_MAX = 64  # the page's per-package static views kept (reloads leave old versions behind)


class ServingState:
    """One worker's serving state. `counter`, `case_mix`, `case_mix_shift` and `outside` are the service's
    Prometheus instruments (None in a bare app: nothing is published)."""

    def __init__(self, settings: Settings, registry: ModelRegistry, counter: Any = None, case_mix: Any = None,
                 case_mix_shift: Any = None, decode_pool: DecodePool | None = None, outside: Any = None):
        self.settings, self.registry = settings, registry
        self.counter, self.case_mix, self.case_mix_shift = counter, case_mix, case_mix_shift
        self.outside = outside
        self.decode_pool = decode_pool
        self._children: dict[tuple[str, str, str], Any] = {}  # the counter's labelled children, looked up once
        self._published: dict[tuple[str, str], float] = {}  # the estimate each model last published
        self.page_cache: dict[tuple, dict[str, Any]] = {}  # the page's static views (tafl.serving.ui)
        self.page_lock = threading.Lock()
        self.markdown: Any = None  # the page's Markdown renderer, made on first use
        self.templates: Any = None  # the page's Jinja2 environment, made on first use

    @classmethod
    def start(cls, settings: Settings, registry: ModelRegistry, counter: Any = None, case_mix: Any = None,
              case_mix_shift: Any = None, outside: Any = None) -> ServingState:
        """The state of a worker that starts serving: its decoder processes warmed, its audit log opened."""
        pool = DecodePool(settings.decode_processes, deadline=max(1.0, settings.timeout_s / 2))
        pids = pool.warm()
        if pids:
            log.info("DICOM decoding runs in %d decoder process(es)", len(pids))
        logging.getLogger("pydicom").setLevel(logging.ERROR)  # its warnings can quote tag values (patient data)
        if not audit_log.handlers:
            handler: logging.Handler = (logging.FileHandler(settings.audit_path) if settings.audit_path
                                        else logging.StreamHandler())
            handler.setFormatter(logging.Formatter("%(message)s"))
            audit_log.addHandler(handler)
            audit_log.setLevel(logging.INFO)
            audit_log.propagate = False
        return cls(settings, registry, counter, case_mix, case_mix_shift, pool, outside)

    def close(self) -> None:
        """The worker's cleanup at stop: the decoder processes and their queues."""
        pool, self.decode_pool = self.decode_pool, None
        if pool is not None:
            pool.close(wait=True)

    # ---------------------------------------------------------------- metrics
    def count(self, model: LoadedModel, class_name: str) -> None:
        """One more prediction of `class_name` in /metrics."""
        model.answered += 1
        if self.counter is None:
            return
        key = (model.name, model.package.version, class_name)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.counter.labels(model=key[0], version=key[1], class_name=key[2])
        child.inc()

    def check_domain(self, model: LoadedModel, decoded: Any) -> None:
        """The package's header rules (ModelPackage.check_domain); a refusal is counted for /models and /metrics
        (a mis-routed series shows as a rising rate) and raised on. It never enters the case-mix window."""
        try:
            model.package.check_domain(decoded)
        except ServiceError:
            model.outside_domain += 1
            self._outside(model, "header")
            raise

    def abstained(self, model: LoadedModel) -> None:
        """One more image the package's detector put outside its domain (no label), for /models and /metrics."""
        model.abstained += 1
        self._outside(model, "detector")

    def tally(self, model: LoadedModel, result: dict[str, Any]) -> None:
        """Count one frame's answer: its class, or an abstention (also when the label was returned on request)."""
        if result.get("domain", {}).get("in_domain", True):
            self.count(model, result["class_name"])
        else:
            self.abstained(model)

    def _outside(self, model: LoadedModel, by: str) -> None:
        if self.outside is not None:
            self.outside.labels(model=model.name, version=model.package.version, by=by).inc()

    def observe(self, model: LoadedModel, out: dict[str, np.ndarray], ratio: np.ndarray | None) -> None:
        """Feed the served images' calibrated posteriors, under the source prior, to the model's case-mix window,
        and publish a new estimate to /metrics."""
        mon = model.monitor
        if mon is None or "calibrated_probs" not in out or not len(out["calibrated_probs"]):
            return
        p = np.asarray(out["calibrated_probs"], np.float64)
        if ratio is not None:  # these rows were decided under another prior: back to the source prior's posteriors
            r = np.asarray(ratio, np.float64)
            p = p * np.exp(-(r if r.ndim == 1 else r[: len(p)]))
            p /= p.sum(1, keepdims=True)
        keep = in_domain_rows(model.package.meta, out)
        if keep is not None:  # images outside the model's domain say nothing about the case mix it is served
            p = p[keep]
            if not len(p):
                return
        mon.add(p)
        key = (model.name, model.package.version)
        if mon.updated_at and self._published.get(key) != mon.updated_at and self.case_mix is not None:
            self._published[key] = mon.updated_at
            est = mon.estimate
            for name, v in zip(model.package.class_names, est.prior):
                self.case_mix.labels(model=key[0], version=key[1], class_name=name).set(float(v))
            self.case_mix_shift.labels(model=key[0], version=key[1]).set(float(est.shift))

    # ---------------------------------------------------------------- inference
    async def run(self, model: LoadedModel, x: np.ndarray, ratio: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The graph's outputs for a preprocessed batch `x` through the model's batcher; `ratio` (C,) or (N, C):
        the log prior ratio each row is decided under. The case-mix window sees the rows."""
        model.in_flight += 1
        try:
            if ratio is None or np.ndim(ratio) == 1:
                out = await model.batcher.submit(x, ratio)
            else:  # a prior per row: each row its own submission, gathered back in order
                parts = await asyncio.gather(*(model.batcher.submit(x[i:i + 1], ratio[i]) for i in range(len(x))))
                out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        finally:
            model.in_flight -= 1
        try:
            self.observe(model, out, ratio)
        except Exception:  # noqa: BLE001 - the case-mix window is advice; it never fails a prediction
            log.warning("case-mix window update failed", exc_info=True)
        return out

    async def classify(self, model: LoadedModel, frames: list[np.ndarray],
                       ratio: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Decoded frames -> the graph's outputs: the package's preprocessing (in a thread when large), then `run`."""
        pre = model.package.preprocess
        size = sum(f.size for f in frames)
        x = pre(frames) if size <= INLINE_BYTES else await asyncio.to_thread(pre, frames)
        return await self.run(model, x, ratio)


def of(request: Request) -> ServingState:
    """The worker's ServingState, from the request's app; a 503 while the service has not finished starting."""
    st = getattr(request.app.state, STATE_KEY, None)
    if st is None:
        raise ServiceUnavailable("the service is still starting; try again")
    return st
