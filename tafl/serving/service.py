"""The BentoML service (docs/design.md, "The image path and the service"): `bentoml serve tafl.serving.service:TaflService`.

Packages come from TAFL_PACKAGES (folders or BentoML model tags, comma-separated); they are
loaded once per worker, verified, and run in ONNX Runtime (CUDA first, CPU second). The routes
live in `tafl.serving.app` (REST), `tafl.serving.oip` (the Open Inference Protocol) and `tafl.serving.ui` (the
page); their shared state is one ServingState per worker (tafl.serving.context), made here. BentoML adds /healthz,
/livez, /readyz and /metrics, where the `tafl_predicted_class_total` counter shows the test-time class mix per
model.
"""

from __future__ import annotations

import gc
import logging

import bentoml

from tafl.errors import ConfigError
from tafl.procs import bounded_malloc_for_children
from tafl.serving.app import create_app
from tafl.serving.context import STATE_KEY, ServingState
from tafl.serving.http import ControlCharacterGuard
from tafl.serving.runtime import ModelRegistry
from tafl.serving.settings import Settings, check_service_env, max_concurrency, service_plan, service_workers

log = logging.getLogger("tafl.serving")

# A bad TAFL_* setting ends the server here, when `bentoml serve` imports this module and before any worker
# starts, with one line naming the variable (without it a worker died in __init__ with a traceback and was
# restarted every 10 s, for ever). `tafl serve` checks the same before it starts anything (launch.preflight).
try:
    check_service_env()
except ConfigError as _exc:
    log.error("tafl service: %s", _exc.message)  # with no handler configured, logging's last resort prints it
    raise SystemExit(2) from None

PREDICTED = bentoml.metrics.Counter(
    name="tafl_predicted_class",
    documentation="Predictions per model, version and predicted class: the test-time class mix",
    labelnames=["model", "version", "class_name"],
)

CASE_MIX = bentoml.metrics.Gauge(
    name="tafl_case_mix_estimate",
    documentation="The class prior estimated (EM on calibrated posteriors) from the model's recently served images",
    labelnames=["model", "version", "class_name"],
)
CASE_MIX_SHIFT = bentoml.metrics.Gauge(
    name="tafl_case_mix_shift",
    documentation="Total-variation distance of the served case mix's estimate from the model's source prior",
    labelnames=["model", "version"],
)
OUTSIDE_DOMAIN = bentoml.metrics.Counter(
    name="tafl_outside_domain",
    documentation="Images outside the model's input domain: by=header, refused (422) because their DICOM header "
                  "contradicts it; by=detector, the model abstained because its in-domain score lies beyond the "
                  "threshold",
    labelnames=["model", "version", "by"],
)


# Admission: past `max_concurrency` requests in flight BentoML answers 429 at once (its health and metrics
# routes are exempt), so a flood queues no unbounded work; read at import, as the decorator needs it.
MAX_CONCURRENCY = max_concurrency()
# worker processes and model lanes: TAFL_WORKERS and TAFL_MODEL_LANES, else chosen from the packages' measured cost
# and this machine (tafl.serving.tuning). BentoML starts the workers from the decorator, so the choice is made at
# import, in the process that starts them, and handed to them in TAFL_SERVING_PLAN.
if logging.getLogger("tafl").level == logging.NOTSET:  # BentoML shows its own INFO lines only: show tafl's too (the
    logging.getLogger("tafl").setLevel(logging.INFO)   # plan, each package loaded and the providers it runs on)
bounded_malloc_for_children()  # the workers BentoML starts give large buffers back when freed (tafl.procs)
PLAN = service_plan()
WORKERS = service_workers()

# the ASGI app BentoML mounts; its routes are fixed, and its `state.tafl` is the worker's ServingState
APP = create_app()


@bentoml.service(name="tafl", resources={"gpu": 1}, workers=WORKERS,
                 traffic={"timeout": 120, "concurrency": 64, "max_concurrency": MAX_CONCURRENCY},
                 # the audit log already writes one JSON line per request; BentoML's access log and
                 # tracing would cost as much CPU again on a small machine. A sample rate of 0 still
                 # builds a span per request; excluding every URL makes the OpenTelemetry middleware
                 # pass requests straight through (a fifth of the event loop's time at c=32).
                 logging={"access": {"enabled": False}}, tracing={"sample_rate": 0.0, "excluded_urls": [".*"]})
@bentoml.asgi_app(APP, path="/")
class TaflService:
    def __init__(self) -> None:
        settings = Settings.from_env()
        self.registry = ModelRegistry(settings.packages, threads=settings.ort_threads, max_batch=settings.max_batch,
                                      max_wait_ms=settings.batch_wait_ms, prior_window=settings.prior_window,
                                      prior_refresh=settings.prior_refresh, prior_min_images=settings.prior_min_images,
                                      site_mix=settings.site_mix, prior_adaptive=settings.prior_adaptive,
                                      lanes=settings.model_lanes, lanes_from=settings.lanes_from,
                                      workers=settings.workers)
        self.state = ServingState.start(settings, self.registry, PREDICTED, CASE_MIX, CASE_MIX_SHIFT, OUTSIDE_DOMAIN)
        setattr(APP.state, STATE_KEY, self.state)
        # what the worker loaded (BentoML, the packages, ONNX Runtime's Python side: ~150,000 objects) never becomes
        # garbage: frozen, the cyclic collector stops walking it. Each full collection took ~70 ms of the event loop
        # under load, 0.09 ms a request on average (docs/results.md, "The worker's heap"); objects freed by reference count still are.
        gc.collect()
        gc.freeze()
        log.info("tafl service ready with %s (auth %s); %d worker(s): %s; %s model call(s) in flight per model: %s",
                 ", ".join(f"{m['name']} {m['version']}" for m in self.registry.describe()),
                 "on" if settings.token else "off", settings.workers, settings.workers_from,
                 settings.model_lanes or 1, settings.lanes_from)

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        self.state.close()  # the decoder processes and their semaphores go before uvicorn ends the worker


# outside BentoML's router: a path with a control character gets the service's JSON 400, not a plain-text 404
TaflService.add_asgi_middleware(ControlCharacterGuard)
