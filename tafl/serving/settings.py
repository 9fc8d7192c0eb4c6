"""The service's settings, read once from the TAFL_* environment (docs/guide.md lists each): upload and decode
limits, batching, the request timeout, tokens and the package list. A bad value is a ConfigError naming its
variable, raised before anything starts (`check_service_env`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tafl.errors import ConfigError
from tafl.serving.decoding import default_processes
from tafl.settings import DEFAULT_MAX_UPLOAD_MB, env_float, env_int, prior_adaptive_mode, upload_limit

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "tafl-model:latest"


@dataclass
class Settings:
    packages: list[str]
    token: str | None = None  # bearer token for /predict, /heatmap, /models; None: open
    admin_token: str | None = None  # bearer token for /admin/reload (TAFL_ADMIN_TOKEN only); None: reload disabled
    package_root: str | None = None  # folders /admin/reload may load lie inside it; None: BentoML tags only
    max_upload_bytes: int = int(DEFAULT_MAX_UPLOAD_MB * 2**20)
    max_pixels: int = 50_000_000
    max_frames: int = 64
    max_batch_files: int = 64  # images in one /predict/batch request
    timeout_s: float = 30.0
    max_batch: int = 64
    batch_wait_ms: float = 2.0
    ort_threads: int | None = None  # ONNX Runtime's threads per model call; None: its own, or cores // lanes
    model_lanes: int | None = None  # model calls in flight at once per model; None: chosen (tafl.serving.tuning)
    workers: int = 1  # BentoML worker processes (TAFL_WORKERS, else chosen), each with every package, loop and GIL
    workers_from: str = "default"  # "TAFL_WORKERS", or why the service chose that count (its plan)
    lanes_from: str = "default"  # "TAFL_MODEL_LANES", or why the service chose its lanes (its plan)
    audit_path: str | None = None
    prior_window: int = 500  # calibrated probability vectors kept per model for the case-mix estimate
    prior_refresh: int = 50  # served images between two estimates
    prior_min_images: int = 100  # fewer images behind the estimate: prior=adaptive falls back to the source prior
    site_mix: str | None = None  # this site's own class counts (tafl.prior.parse_site_mix): the estimator's centre
    site: str | None = None  # TAFL_SITE: the training site this service answers for (its own prediction-set thresholds)
    prior_adaptive: str = "checked"  # TAFL_PRIOR_ADAPTIVE: checked (each package's validation check decides) or always
    max_request_frames: int = 256  # decoded frames in one request, all its files together (/predict/batch)
    max_request_pixels: int = 100_000_000  # decoded pixels in one request, all its files together
    decode_processes: int = field(default_factory=default_processes)  # DICOM decoder processes; 0: threads

    @classmethod
    def from_env(cls, workers: int | None = None) -> Settings:
        """The settings in the TAFL_* environment variables; a bad number is a ConfigError naming its variable
        (tafl.settings). `workers`: the process's own count where TAFL_WORKERS (the service's) does not apply, as
        for the DICOM listener, which is one process whatever the service runs."""
        env = os.environ
        # commas only: a BentoML tag `name:version` contains os.pathsep on POSIX. Unset, the service
        # serves the store model bentofile.yaml bundles (`bentoml serve tafl:latest` does not apply
        # the bento's envs outside a container)
        refs = [r.strip() for r in env.get("TAFL_PACKAGES", DEFAULT_PACKAGE).split(",") if r.strip()]
        token = env.get("TAFL_API_TOKEN") or None
        # what the service chose at start (tafl.serving.tuning); a process of its own count (the listener) has none
        plan = handed_plan() if workers is None else None
        if workers is None:
            workers = service_workers()
            workers_from = "TAFL_WORKERS" if env_int("TAFL_WORKERS", 0, minimum=0) else \
                plan.workers_from if plan is not None else "default"
        else:
            workers_from = "this process alone"
        lanes = env_int("TAFL_MODEL_LANES", 0, minimum=0) or None
        lanes_from = "TAFL_MODEL_LANES" if lanes else "default"
        if lanes is None and plan is not None:
            lanes, lanes_from = plan.lanes, plan.lanes_from
        # the admin token never falls back to the API token: a client that may predict may not swap the model
        return cls(packages=refs, token=token, admin_token=env.get("TAFL_ADMIN_TOKEN") or None,
                   package_root=env.get("TAFL_PACKAGE_ROOT", "").strip() or None,
                   max_upload_bytes=upload_limit(),
                   max_pixels=env_int("TAFL_MAX_PIXELS", 50_000_000),
                   max_frames=env_int("TAFL_MAX_FRAMES", 64),
                   max_batch_files=env_int("TAFL_MAX_BATCH_FILES", 64),
                   timeout_s=env_float("TAFL_REQUEST_TIMEOUT_S", 30.0),
                   max_batch=env_int("TAFL_MAX_BATCH", 64),
                   batch_wait_ms=env_float("TAFL_BATCH_WAIT_MS", 2.0, inclusive=True),
                   ort_threads=env_int("TAFL_ORT_THREADS", 0, minimum=0) or None,  # unset: ORT's own or cores//lanes
                   model_lanes=lanes, workers=workers, workers_from=workers_from, lanes_from=lanes_from,
                   audit_path=env.get("TAFL_AUDIT_LOG") or None,
                   prior_window=env_int("TAFL_PRIOR_WINDOW", 500),
                   prior_refresh=env_int("TAFL_PRIOR_REFRESH", 50),
                   prior_min_images=env_int("TAFL_PRIOR_MIN_IMAGES", 100),
                   site_mix=env.get("TAFL_SITE_MIX", "").strip() or None,
                   site=env.get("TAFL_SITE", "").strip() or None,
                   prior_adaptive=prior_adaptive_mode(),
                   max_request_frames=env_int("TAFL_MAX_REQUEST_FRAMES", 256),
                   max_request_pixels=env_int("TAFL_MAX_REQUEST_PIXELS", 100_000_000),
                   # per worker: the default pool is shared out among the workers (at least one each)
                   decode_processes=env_int("TAFL_DECODE_PROCESSES",
                                            max(1, default_processes() // workers), minimum=0))


MAX_WORKERS = 64


def service_workers() -> int:
    """The service's worker processes: TAFL_WORKERS, else the count the service chose at start (its plan, handed to
    its workers in TAFL_SERVING_PLAN: tafl.serving.tuning), else 1. Each loads every package and runs its own event
    loop and batcher, so per-request Python work spreads over the cores instead of queueing on one interpreter lock
    (docs/results.md, "The worker's heap"); each also costs the packages' memory once more."""
    n = env_int("TAFL_WORKERS", 0, minimum=0)
    if n > MAX_WORKERS:
        raise ConfigError(f"TAFL_WORKERS must be at most {MAX_WORKERS}, got {n}")
    if n == 0 and os.environ.get("TAFL_WORKERS", "").strip():
        raise ConfigError("TAFL_WORKERS must be positive, got '0'")
    if n:
        return n
    plan = handed_plan()
    return plan.workers if plan is not None else 1


def _plan_inputs() -> tuple[list[str], int | None, int | None, bool]:
    """What decides the service's plan: the packages, TAFL_WORKERS, TAFL_MODEL_LANES and whether reloads are on."""
    refs = [r.strip() for r in os.environ.get("TAFL_PACKAGES", DEFAULT_PACKAGE).split(",") if r.strip()]
    return (refs, env_int("TAFL_WORKERS", 0, minimum=0) or None, env_int("TAFL_MODEL_LANES", 0, minimum=0) or None,
            bool(os.environ.get("TAFL_ADMIN_TOKEN")))


def handed_plan():
    """The plan the service chose at start for these settings (TAFL_SERVING_PLAN), or None: none was handed on, or
    one chosen for other packages or settings (a program that imported the service, then started another)."""
    from tafl.serving.tuning import PLAN_ENV, Plan, plan_key

    raw = os.environ.get(PLAN_ENV, "").strip()
    if not raw:
        return None
    try:
        plan = Plan.from_json(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{PLAN_ENV} is not a plan tafl wrote ({exc}); unset it") from None
    return plan if plan.key == plan_key(*_plan_inputs()) else None


def service_plan():
    """The service's plan (tafl.serving.tuning.Plan): the one handed on, or chosen now for TAFL_PACKAGES from
    TAFL_WORKERS, TAFL_MODEL_LANES, TAFL_ADMIN_TOKEN, the packages' measured cost and this machine, and handed on in
    TAFL_SERVING_PLAN to the processes started after it (BentoML's workers)."""
    from tafl.serving import tuning

    plan = handed_plan()
    if plan is not None:
        return plan
    refs, workers, lanes, reloads = _plan_inputs()
    gpu = tuning.gpu_present()
    costs = [] if (workers and lanes) or gpu else tuning.measure_refs(refs)  # what is set needs no measuring
    plan = tuning.choose(costs, cores=tuning.cpu_cores(), gpu=gpu, reloads=reloads, available_mb=tuning.available_mb(),
                         set_workers=workers, set_lanes=lanes, key=tuning.plan_key(refs, workers, lanes, reloads))
    os.environ[tuning.PLAN_ENV] = plan.to_json()
    log.info("serving with %d worker(s): %s; %d model call(s) in flight per model: %s", plan.workers,
             plan.workers_from, plan.lanes, plan.lanes_from)
    return plan


def max_concurrency() -> int:
    """TAFL_MAX_CONCURRENCY (default 128): requests in flight past which BentoML answers 429."""
    return env_int("TAFL_MAX_CONCURRENCY", 128)


def check_service_env() -> Settings:
    """Every TAFL_* setting the service reads at start, checked: the Settings, TAFL_MAX_CONCURRENCY and
    TAFL_PRIOR_ADAPTIVE. ConfigError (one line naming the variable) on the first bad one; `tafl serve`
    calls it before anything starts, the service module when BentoML imports it."""
    settings = Settings.from_env()  # TAFL_PRIOR_ADAPTIVE among them
    max_concurrency()
    return settings
