"""HTTP routes of the service: /predict, /heatmap, /models and /admin/reload, as a Starlette app
mounted into the BentoML service (which keeps /healthz, /livez, /readyz and /metrics).

The routes own their request parsing so that every bad input — a missing or misnamed multipart
field, an oversized body, a file that is not an image — is a JSON error with a 4xx status and a
message a person can act on, never a 500 from a validation layer. Uploads are read with a size
cap before parsing; decoding runs in worker threads; the model call goes through the adaptive
batcher with a timeout. Each request writes one audit line (request id, model version, label,
timing) as JSON; patient data (tag values, file names) never reaches logs or responses.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hmac
import json
import logging
import os
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse as _StarletteJSON
from starlette.responses import Response
from starlette.routing import Route

from tafl.errors import (BadRequest, ConfigError, PayloadTooLarge, ServiceError, ServiceUnavailable,
                         TaflError, Unauthorized, UnsupportedMedia)
from tafl.imaging.heatmap import overlay, png_bytes
from tafl.serving.decoding import INLINE_BYTES, DecodePool, decode_upload, default_processes
from tafl.serving.multipart import parse_simple
from tafl.serving.runtime import LoadedModel, ModelRegistry
from tafl.settings import env_float, env_int

log = logging.getLogger("tafl.serving")
audit_log = logging.getLogger("tafl.audit")

DEFAULT_PACKAGE = "tafl-model:latest"
FORM_MAX_FIELDS = 20  # text fields in one multipart body
FORM_SPARE_FILES = 3  # file parts tolerated past the route's limit, so the error can count them
RAW_TYPES = ("image/png", "image/jpeg", "application/dicom", "application/octet-stream")
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


@dataclass
class Settings:
    packages: list[str]
    token: str | None = None  # bearer token for /predict, /heatmap, /models; None: open
    admin_token: str | None = None  # bearer token for /admin/reload (TAFL_ADMIN_TOKEN only); None: reload disabled
    package_root: str | None = None  # folders /admin/reload may load lie inside it; None: BentoML tags only
    max_upload_bytes: int = 50 * 2**20
    max_pixels: int = 50_000_000
    max_frames: int = 64
    max_batch_files: int = 64  # images in one /predict/batch request
    timeout_s: float = 30.0
    max_batch: int = 64
    batch_wait_ms: float = 2.0
    ort_threads: int | None = None
    audit_path: str | None = None
    prior_window: int = 500  # calibrated probability vectors kept per model for the case-mix estimate
    prior_refresh: int = 50  # served images between two estimates
    prior_min_images: int = 100  # fewer images behind the estimate: prior=adaptive falls back to the source prior
    max_request_frames: int = 256  # decoded frames in one request, all its files together (/predict/batch)
    max_request_pixels: int = 100_000_000  # decoded pixels in one request, all its files together
    decode_processes: int = field(default_factory=default_processes)  # DICOM decoder processes; 0: threads

    @classmethod
    def from_env(cls) -> Settings:
        """The settings in the TAFL_* environment variables; a bad number is a ConfigError naming its variable
        (tafl.settings)."""
        env = os.environ
        # commas only: a BentoML tag `name:version` contains os.pathsep on POSIX. Unset, the service
        # serves the store model bentofile.yaml bundles (`bentoml serve tafl:latest` does not apply
        # the bento's envs outside a container)
        refs = [r.strip() for r in env.get("TAFL_PACKAGES", DEFAULT_PACKAGE).split(",") if r.strip()]
        token = env.get("TAFL_API_TOKEN") or None
        # the admin token never falls back to the API token: a client that may predict may not swap the model
        return cls(packages=refs, token=token, admin_token=env.get("TAFL_ADMIN_TOKEN") or None,
                   package_root=env.get("TAFL_PACKAGE_ROOT", "").strip() or None,
                   max_upload_bytes=int(env_float("TAFL_MAX_UPLOAD_MB", 50.0) * 2**20),
                   max_pixels=env_int("TAFL_MAX_PIXELS", 50_000_000),
                   max_frames=env_int("TAFL_MAX_FRAMES", 64),
                   max_batch_files=env_int("TAFL_MAX_BATCH_FILES", 64),
                   timeout_s=env_float("TAFL_REQUEST_TIMEOUT_S", 30.0),
                   max_batch=env_int("TAFL_MAX_BATCH", 64),
                   batch_wait_ms=env_float("TAFL_BATCH_WAIT_MS", 2.0, inclusive=True),
                   ort_threads=env_int("TAFL_ORT_THREADS", 0, minimum=0) or None,  # 0 or unset: ONNX Runtime's own
                   audit_path=env.get("TAFL_AUDIT_LOG") or None,
                   prior_window=env_int("TAFL_PRIOR_WINDOW", 500),
                   prior_refresh=env_int("TAFL_PRIOR_REFRESH", 50),
                   prior_min_images=env_int("TAFL_PRIOR_MIN_IMAGES", 100),
                   max_request_frames=env_int("TAFL_MAX_REQUEST_FRAMES", 256),
                   max_request_pixels=env_int("TAFL_MAX_REQUEST_PIXELS", 100_000_000),
                   decode_processes=env_int("TAFL_DECODE_PROCESSES", default_processes(), minimum=0))


def max_concurrency() -> int:
    """TAFL_MAX_CONCURRENCY (default 128): requests in flight past which BentoML answers 429."""
    return env_int("TAFL_MAX_CONCURRENCY", 128)


def check_service_env() -> Settings:
    """Every TAFL_* setting the service reads at start, checked: the Settings, TAFL_MAX_CONCURRENCY and
    TAFL_PRIOR_ADAPTIVE. ConfigError (one line naming the variable) on the first bad one; `tafl serve`
    calls it before anything starts, the service module when BentoML imports it."""
    from tafl.prior import adaptive_blocked

    settings = Settings.from_env()
    max_concurrency()
    adaptive_blocked(None)
    return settings


class State:
    """What the routes share; set once per worker by the BentoML service's __init__."""

    settings: Settings
    registry: ModelRegistry
    counter: Any = None  # prometheus counter of predicted classes
    case_mix: Any = None  # prometheus gauge: the estimated prior per model and class
    case_mix_shift: Any = None  # prometheus gauge: its total-variation distance from the source prior
    decode_pool: DecodePool | None = None  # DICOM decoder processes (tafl.serving.decoding)


state = State()
_counters: dict[tuple[str, str, str], Any] = {}


def _count(model: LoadedModel, class_name: str) -> None:
    """One more prediction of `class_name` in /metrics; the labelled child is looked up once."""
    if state.counter is None:
        return
    key = (model.name, model.package.version, class_name)
    child = _counters.get(key)
    if child is None:
        child = _counters[key] = state.counter.labels(model=key[0], version=key[1], class_name=key[2])
    child.inc()


def configure(settings: Settings, registry: ModelRegistry, counter: Any = None, case_mix: Any = None,
              case_mix_shift: Any = None) -> None:
    state.settings, state.registry, state.counter = settings, registry, counter
    state.case_mix, state.case_mix_shift = case_mix, case_mix_shift
    if state.decode_pool is not None:
        state.decode_pool.close()
    state.decode_pool = DecodePool(settings.decode_processes, deadline=max(1.0, settings.timeout_s / 2))
    pids = state.decode_pool.warm()
    if pids:
        log.info("DICOM decoding runs in %d decoder process(es)", len(pids))
    _counters.clear()
    _published.clear()
    logging.getLogger("pydicom").setLevel(logging.ERROR)  # its warnings can quote tag values (patient data)
    if not audit_log.handlers:
        handler: logging.Handler = (logging.FileHandler(settings.audit_path) if settings.audit_path
                                    else logging.StreamHandler())
        handler.setFormatter(logging.Formatter("%(message)s"))
        audit_log.addHandler(handler)
        audit_log.setLevel(logging.INFO)
        audit_log.propagate = False


def shutdown() -> None:
    """The worker's cleanup at stop (BentoML's on_shutdown hook): the decoder processes and their queues go
    before uvicorn ends the process."""
    pool, state.decode_pool = state.decode_pool, None
    if pool is not None:
        pool.close(wait=True)


# ------------------------------------------------------------------ response helpers
def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class JSONResponse(_StarletteJSON):
    """Starlette's JSON response, but a NaN or infinity (a package's stored metrics, a degenerate estimate) is
    written as null instead of failing the request with a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # "Out of range float values are not JSON compliant"
            return super().render(_finite(content))


def header_value(text: str) -> str:
    """A header-safe form of a name (class, model): printable ASCII as is, anything else percent-encoded
    (UTF-8), so a non-Latin class name neither fails the response nor loses its identity."""
    if text.isascii() and text.isprintable():
        return text
    return quote(text, safe=" !#$&'()*+,-./:;<=>?@[]^_`{|}~")


# ------------------------------------------------------------------ request helpers
def _check_auth(request: Request, token: str | None, what: str = "this endpoint") -> None:
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized(f"{what} needs 'Authorization: Bearer <token>' with the service's token")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + 64 * 1024:
        raise PayloadTooLarge(f"the upload is {int(declared) / 2**20:.1f} MiB; the limit is {limit / 2**20:.0f} MiB")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + 64 * 1024:  # the multipart envelope may add a little
            raise PayloadTooLarge(f"the upload exceeds the {limit / 2**20:.0f} MiB limit")
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # noqa: SLF001 - Starlette parses the form from the cached body
    return body


def _flag(value: Any, name: str) -> bool:
    v = str(value).strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise BadRequest(f"option '{name}' must be true or false, got {str(value)[:20]!r}")


async def _upload(request: Request, max_files: int = 1) -> tuple[list[bytes], dict[str, str]]:
    """The files' bytes and the options, from multipart form data (field 'file', repeated for a batch)
    or a raw image body."""
    limit = state.settings.max_upload_bytes
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    options = {k: v for k, v in request.query_params.items()}
    if ctype == "multipart/form-data":
        body = await _read_body(request, limit)
        simple = parse_simple(request.headers.get("content-type", ""), body,
                              max_parts=max_files + FORM_SPARE_FILES + FORM_MAX_FIELDS,
                              max_part_bytes=limit)
        if simple is not None:
            data = simple.files.get("file", [])
            names = simple.names
            for key, values in simple.fields.items():
                if key != "file":
                    options[key] = values[-1]
        else:  # anything unusual goes through Starlette's full parser
            data, names = await _starlette_form(request, max_files, limit, options)
        if not data:
            raise BadRequest("no file in the multipart field 'file'" +
                             (f" (fields received: {', '.join(sorted(set(names))[:10])})" if names else "") +
                             "; send the image as -F file=@image.dcm")
        if len(data) > max_files:
            raise BadRequest(f"{len(data)} files in one request; send at most {max_files}")
        return data, options
    if ctype in RAW_TYPES or ctype.startswith("image/"):
        return [await _read_body(request, limit)], options
    raise UnsupportedMedia(f"content type '{ctype or 'none'}' is not accepted: send multipart/form-data with the "
                           "image in the field 'file', or the raw image as image/png, image/jpeg or application/dicom")


async def _starlette_form(request: Request, max_files: int, limit: int,
                          options: dict[str, str]) -> tuple[list[bytes], list[str]]:
    try:
        form = await request.form(max_files=max_files + FORM_SPARE_FILES, max_fields=FORM_MAX_FIELDS,
                                  max_part_size=limit)
    except Exception as exc:  # noqa: BLE001 - python-multipart's parse errors
        raise BadRequest(f"the multipart body could not be parsed ({type(exc).__name__}: {str(exc)[:80]}); "
                         "send the image in the form field 'file'") from exc
    try:
        data = [await u.read() for u in form.getlist("file") if not isinstance(u, str)]
        for key, value in form.multi_items():
            if key != "file" and isinstance(value, str):
                options[key] = value
        return data, list(form.keys())
    finally:
        await form.close()


def _error(exc: Exception, rid: str) -> JSONResponse:
    if isinstance(exc, TaflError):  # the status tafl.errors gives the error's class (PackageError: 400, ...)
        status = exc.status if 400 <= exc.status <= 599 else 500
        code, msg = type(exc).__name__, exc.message
    else:
        status, code, msg = 500, "InternalError", "the service failed on this request; it has been logged"
    resp = JSONResponse({"error": {"status": status, "code": code, "message": msg}, "request_id": rid}, status)
    resp.headers["X-Request-ID"] = rid
    if status == 503:
        resp.headers["Retry-After"] = "1"
    return resp


def _audit(**fields: Any) -> None:
    audit_log.info(json.dumps({"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}))


# ------------------------------------------------------------------ priors
_published: dict[tuple[str, str], float] = {}


def _prior_choice(model: LoadedModel, options: dict[str, str]) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The request's `prior`: train (default, stateless), adaptive (the model's current case-mix estimate) or an
    explicit prior (comma-separated or a JSON list, one value per class). Returns the graph's log prior ratio
    (None: the plain rule) and the response's `prior` section."""
    from tafl.prior import check_prior, log_prior_ratio, total_variation

    raw = str(options.get("prior", "train")).strip()
    names = model.package.class_names
    if raw.lower() in ("", "train"):
        sec: dict[str, Any] = {"used": "train"}
        dec = model.package.metadata.get("decision") or {}
        if dec.get("tau"):  # the label is the validation-chosen operating point's, not the probabilities' argmax
            sec["operating_point"] = {"tau": dec["tau"], "rule": "logit adjustment chosen on validation"}
        return None, sec
    if model.monitor is None:
        raise BadRequest(f"model '{model.name}' {model.package.version} was exported before prior-aware inference; "
                         "re-export it with this tafl to use prior=adaptive or an explicit prior")
    src = model.monitor.source
    if raw.lower() == "adaptive":
        q, n, why = model.monitor.current()
        if q is None:
            return None, {"used": "train", "requested": "adaptive", "fallback": why, "images": n}
        return log_prior_ratio(q, src), {"used": "adaptive", "images": n, "prior": dict(zip(names, map(float, q))),
                                         "shift_from_source": total_variation(q, src)}
    try:
        values = json.loads(raw) if raw.startswith("[") else [float(v) for v in raw.split(",")]
    except ValueError:
        raise BadRequest(f"option 'prior' must be train, adaptive, or {len(names)} probabilities (one per class: "
                         f"{', '.join(names)}), comma-separated; got {raw[:40]!r}") from None
    try:
        q = check_prior(values, len(names), "option 'prior'")
    except ConfigError as exc:
        raise BadRequest(f"{exc.message} (classes: {', '.join(names)})") from None
    return log_prior_ratio(q, src), {"used": "explicit", "prior": dict(zip(names, map(float, q)))}


def _observe(model: LoadedModel, out: dict[str, np.ndarray], ratio: np.ndarray | None) -> None:
    """Feed the served images' calibrated posteriors, under the source prior, to the model's case-mix window,
    and publish a new estimate to /metrics."""
    mon = model.monitor
    if mon is None or "calibrated_probs" not in out or not len(out["calibrated_probs"]):
        return
    p = np.asarray(out["calibrated_probs"], np.float64)
    if ratio is not None:  # these rows were decided under another prior: back to the source prior's posteriors
        p = p * np.exp(-np.asarray(ratio, np.float64))
        p /= p.sum(1, keepdims=True)
    mon.add(p)
    key = (model.name, model.package.version)
    if mon.updated_at and _published.get(key) != mon.updated_at and state.case_mix is not None:
        _published[key] = mon.updated_at
        est = mon.estimate
        for name, v in zip(model.package.class_names, est.prior):
            state.case_mix.labels(model=key[0], version=key[1], class_name=name).set(float(v))
        state.case_mix_shift.labels(model=key[0], version=key[1]).set(float(est.shift))


# ------------------------------------------------------------------ inference
async def _off_loop(size: int, fn, *args, **kw):
    """Run `fn` in a worker thread when it is big enough to stall other requests (`size`: the bytes it
    works on), else inline. Decoding has its own rule (tafl.serving.decoding.decode_upload)."""
    if size <= INLINE_BYTES:
        return fn(*args, **kw)
    return await asyncio.to_thread(fn, *args, **kw)


async def _infer(model: LoadedModel, frames: list[np.ndarray],
                 ratio: np.ndarray | None = None) -> dict[str, np.ndarray]:
    pre = model.package.preprocess
    x = await _off_loop(sum(f.size for f in frames), pre, frames)
    model.in_flight += 1
    try:
        out = await model.batcher.submit(x, ratio)
    finally:
        model.in_flight -= 1
    try:
        _observe(model, out, ratio)
    except Exception:  # noqa: BLE001 - the case-mix window is advice; it never fails a prediction
        log.warning("case-mix window update failed", exc_info=True)
    return out


def _frame_result(model: LoadedModel, out: dict[str, np.ndarray], i: int, posteriors: bool = False) -> dict[str, Any]:
    names = model.package.class_names
    label = int(out["label"][i])
    probs = out["probs"][i]
    res: dict[str, Any] = {"label": label, "class_name": names[label], "probability": float(probs[label]),
                           "probabilities": {n: float(p) for n, p in zip(names, probs)}}
    experts = []
    if "expert_labels" in out:
        for e, ename in enumerate(model.package.expert_names):
            el = int(out["expert_labels"][i, e])
            experts.append({"name": ename, "label": el, "class_name": names[el],
                            "probability": float(out["expert_probs"][i, e, el])})
        res["votes"] = {n: float(v) for n, v in zip(names, out["votes"][i])}
    res["experts"] = experts
    if posteriors and "calibrated_probs" in out:  # under the request's prior (prior=train: the source prior)
        res["calibrated_probabilities"] = {n: float(p) for n, p in zip(names, out["calibrated_probs"][i])}
    return res


def _overlay_png(frame: np.ndarray, heat: np.ndarray, max_side: int = 1024) -> bytes:
    h, w = frame.shape[:2]
    if max(h, w) > max_side:  # keep the overlay small for huge images
        from PIL import Image

        s = max_side / max(h, w)
        frame = np.asarray(Image.fromarray(frame).resize((max(1, int(w * s)), max(1, int(h * s)))))
    return png_bytes(overlay(frame, heat))


async def _predict_core(request: Request, rid: str, audit: dict[str, Any]):
    _check_auth(request, state.settings.token)
    files, options = await _upload(request)
    data = files[0]
    audit["bytes"] = len(data)
    model = state.registry.get(options.get("model"))
    audit.update(model=model.name, version=model.package.version)
    want_heat = _flag(options.get("heatmap", "false"), "heatmap")
    from tafl.serving.dicom_results import wants_sr

    sr_source = data if wants_sr(request, options, data) else None  # format=sr: a 415 for a non-DICOM
    ratio, prior = _prior_choice(model, options)
    s = state.settings
    t0 = time.perf_counter()
    decoded = await decode_upload(state.decode_pool, data, max_bytes=s.max_upload_bytes,
                                  max_pixels=min(s.max_pixels, s.max_request_pixels),
                                  max_frames=min(s.max_frames, s.max_request_frames))
    t1 = time.perf_counter()
    out = await _infer(model, decoded.frames, ratio)
    t2 = time.perf_counter()
    audit.update(kind=decoded.kind, frames=len(decoded.frames), prior=prior["used"])
    out["_prior"] = prior  # type: ignore[assignment]  # request facts the routes answer with
    out["_posteriors"] = _flag(options.get("posteriors", "false"), "posteriors")  # type: ignore[assignment]
    out["_sr_source"] = sr_source  # type: ignore[assignment]
    return model, decoded, out, want_heat, (t0, t1, t2)


async def predict(request: Request) -> Response:
    rid = uuid.uuid4().hex[:16]
    start = time.perf_counter()
    audit: dict[str, Any] = {"request_id": rid, "route": "/predict"}
    try:
        async with asyncio.timeout(state.settings.timeout_s):  # no extra task per request, unlike wait_for
            model, decoded, out, want_heat, (t0, t1, t2) = await _predict_core(request, rid, audit)
        results = [_frame_result(model, out, i, bool(out["_posteriors"])) for i in range(len(decoded.frames))]
        if out["_sr_source"] is not None:  # DICOM SR (+ secondary capture) instead of JSON: tafl.serving.dicom_results
            from tafl.serving.dicom_results import sr_response

            resp = await sr_response(model, out["_sr_source"], results[0], decoded.frames,
                                     out["heatmap"][0] if want_heat else None, rid)
            for r in results:
                _count(model, r["class_name"])
            _audit(**audit, status=200, format="sr", label=results[0]["label"], class_name=results[0]["class_name"],
                   timing_ms=round(1000 * (time.perf_counter() - start), 2))
            return resp
        body: dict[str, Any] = {"request_id": rid, **results[0],
                                "model": {"name": model.name, "version": model.package.version,
                                          "method": model.package.metadata["method"]},
                                "input": {"kind": decoded.kind, "frames": len(decoded.frames),
                                          "size": list(decoded.frames[0].shape[:2]), **decoded.info},
                                "prior": out["_prior"]}
        if len(results) > 1:
            body["frames"] = [{"frame": i, **r} for i, r in enumerate(results)]
        if want_heat:
            heat = out["heatmap"][0]
            png = await asyncio.to_thread(_overlay_png, decoded.frames[0], heat)
            body["heatmap"] = {"png_base64": base64.b64encode(png).decode(), "shape": list(heat.shape),
                               "kind": model.package.metadata["heatmap"], "frame": 0}
        for r in results:
            _count(model, r["class_name"])
        body["timing_ms"] = {"decode": 1000 * (t1 - t0), "inference": 1000 * (t2 - t1),
                             "total": 1000 * (time.perf_counter() - start)}
        _audit(**audit, status=200, label=results[0]["label"], class_name=results[0]["class_name"],
               timing_ms=round(body["timing_ms"]["total"], 2))
        resp = JSONResponse(body)
        resp.headers["X-Request-ID"] = rid
        return resp
    except asyncio.TimeoutError:
        exc: Exception = ServiceUnavailable(f"the request took longer than {state.settings.timeout_s:g} s; try again")
    except Exception as e:  # noqa: BLE001 - every failure becomes a JSON answer
        exc = e
    return _fail(exc, rid, audit, start)


def _fail(exc: Exception, rid: str, audit: dict[str, Any], start: float) -> Response:
    if isinstance(exc, ClientDisconnect):  # nobody is left to answer: no 500, no traceback, one audit line
        log.info("request %s: the client disconnected before its upload was complete", rid)
        _audit(**audit, status=499, error="ClientDisconnected", timing_ms=round(1000 * (time.perf_counter() - start), 2))
        return Response(status_code=499, headers={"X-Request-ID": rid})
    resp = _error(exc, rid)
    if resp.status_code >= 500 and not isinstance(exc, ServiceUnavailable):
        log.error("request %s failed: %s", rid, type(exc).__name__, exc_info=exc)
    _audit(**audit, status=resp.status_code, error=json.loads(resp.body)["error"]["code"],
           timing_ms=round(1000 * (time.perf_counter() - start), 2))
    return resp


async def heatmap(request: Request) -> Response:
    rid = uuid.uuid4().hex[:16]
    start = time.perf_counter()
    audit: dict[str, Any] = {"request_id": rid, "route": "/heatmap"}
    try:
        async with asyncio.timeout(state.settings.timeout_s):
            model, decoded, out, _, _ = await _predict_core(request, rid, audit)
        png = await asyncio.to_thread(_overlay_png, decoded.frames[0], out["heatmap"][0])
        label = int(out["label"][0])
        name = model.package.class_names[label]
        _count(model, name)
        _audit(**audit, status=200, label=label, class_name=name, timing_ms=round(1000 * (time.perf_counter() - start), 2))
        return Response(png, media_type="image/png",
                        headers={"X-Request-ID": rid, "X-Tafl-Label": str(label), "X-Tafl-Class": header_value(name),
                                 "X-Tafl-Prior": out["_prior"]["used"],
                                 "X-Tafl-Model": header_value(f"{model.name}:{model.package.version}")})
    except asyncio.TimeoutError:
        exc: Exception = ServiceUnavailable(f"the request took longer than {state.settings.timeout_s:g} s; try again")
    except Exception as e:  # noqa: BLE001
        exc = e
    return _fail(exc, rid, audit, start)


async def _decode_batch(files: list[bytes], s: Settings) -> list[Any]:
    """Each file decoded (or its error), in order, within the request's admission budget: all files together may
    decode at most `max_request_frames` frames and `max_request_pixels` pixels. A window of files decodes at once
    (twice the decoder processes, so a batch keeps them busy instead of queueing file by file behind other
    requests); each file is bounded by its own caps, so crossing the budget costs at most a window of files
    before the request is refused (413)."""
    pool = state.decode_pool
    window = 2 * max(1, pool.processes if pool is not None else 1)
    limits = {"max_bytes": s.max_upload_bytes, "max_pixels": s.max_pixels, "max_frames": s.max_frames}

    async def one(data: bytes):
        try:
            return await decode_upload(pool, data, **limits)
        except ServiceError as exc:
            return exc

    pending = collections.deque(asyncio.ensure_future(one(f)) for f in files[:window])
    rest = iter(files[window:])
    frames_left, pixels_left, out = s.max_request_frames, s.max_request_pixels, []
    try:
        while pending:
            d = await pending.popleft()
            nxt = next(rest, None)
            if nxt is not None:
                pending.append(asyncio.ensure_future(one(nxt)))
            if isinstance(d, ServiceError):
                out.append(d)
                continue
            frames_left -= len(d.frames)
            pixels_left -= sum(int(f.shape[0]) * int(f.shape[1]) for f in d.frames)
            if frames_left < 0 or pixels_left < 0:
                raise PayloadTooLarge(f"the request holds more than {s.max_request_frames} frames or "
                                      f"{s.max_request_pixels:,} pixels in all its images together: send fewer or "
                                      "smaller images per request")
            out.append(d)
    finally:
        for task in pending:
            task.cancel()
    return out


async def predict_batch(request: Request) -> Response:
    """Several images in one request (the field 'file', repeated): one result or error per image, in
    order. Batch scoring uses it to spread the cost of a request over many images."""
    rid = uuid.uuid4().hex[:16]
    start = time.perf_counter()
    audit: dict[str, Any] = {"request_id": rid, "route": "/predict/batch"}
    s = state.settings

    async def core():
        _check_auth(request, s.token)
        files, options = await _upload(request, s.max_batch_files)
        model = state.registry.get(options.get("model"))
        audit.update(model=model.name, version=model.package.version, files=len(files),
                     bytes=sum(len(f) for f in files))
        if _flag(options.get("heatmap", "false"), "heatmap"):
            raise BadRequest("heatmaps are not returned in batches; call /predict or /heatmap per image")
        ratio, prior = _prior_choice(model, options)
        prior["posteriors"] = _flag(options.get("posteriors", "false"), "posteriors")
        audit["prior"] = prior["used"]
        decoded = await _decode_batch(files, s)
        frames = [d.frames for d in decoded if not isinstance(d, Exception)]
        out = await _infer(model, [f for fs in frames for f in fs], ratio) if frames else {}
        return model, decoded, out, prior

    try:
        async with asyncio.timeout(s.timeout_s):
            model, decoded, out, prior = await core()
        results, row = [], 0
        for i, d in enumerate(decoded):
            if isinstance(d, Exception):
                results.append({"index": i, "error": {"status": d.status, "code": type(d).__name__,
                                                      "message": d.message}})
                continue
            per = [_frame_result(model, out, row + j, prior["posteriors"]) for j in range(len(d.frames))]
            row += len(d.frames)
            item = {"index": i, **per[0], "input": {"kind": d.kind, "frames": len(d.frames)}}
            if len(per) > 1:
                item["frames"] = [{"frame": j, **r} for j, r in enumerate(per)]
            results.append(item)
            for r in per:
                _count(model, r["class_name"])
        timing = 1000 * (time.perf_counter() - start)
        _audit(**audit, status=200, errors=sum("error" in r for r in results), timing_ms=round(timing, 2))
        return JSONResponse({"request_id": rid, "model": {"name": model.name, "version": model.package.version,
                                                         "method": model.package.metadata["method"]},
                             "prior": prior, "results": results, "timing_ms": {"total": timing}},
                            headers={"X-Request-ID": rid})
    except asyncio.TimeoutError:
        exc: Exception = ServiceUnavailable(f"the request took longer than {s.timeout_s:g} s; send fewer images")
    except Exception as e:  # noqa: BLE001
        exc = e
    return _fail(exc, rid, audit, start)


async def models(request: Request) -> Response:
    rid = uuid.uuid4().hex[:16]
    try:
        _check_auth(request, state.settings.token)
        return JSONResponse({"models": state.registry.describe()}, headers={"X-Request-ID": rid})
    except Exception as exc:  # noqa: BLE001
        return _error(exc, rid)


async def reload(request: Request) -> Response:
    """Swap in a new package version without a restart; requests in flight finish on the old one.

    Off (403) without TAFL_ADMIN_TOKEN; the API token is not enough (401). The body is {"package": REF}: a
    BentoML tag, or a folder inside TAFL_PACKAGE_ROOT (tafl.serving.runtime.reload_target). No response or
    log line names a host path; a package that fails verification answers 400 and the old version stays."""
    from tafl.errors import PackageError
    from tafl.errors import Forbidden
    from tafl.serving.runtime import reload_error, reload_target, scrub_paths

    rid = uuid.uuid4().hex[:16]
    start = time.perf_counter()
    audit: dict[str, Any] = {"request_id": rid, "route": "/admin/reload"}
    usage = 'send JSON: {"package": "<BentoML tag, or a folder under the package root>"}'
    try:
        if state.settings.admin_token is None:
            raise Forbidden("reloading is disabled: this service was started without TAFL_ADMIN_TOKEN (the API "
                            "token does not allow reloads)")
        _check_auth(request, state.settings.admin_token, "/admin/reload")
        body = await _read_body(request, 64 * 1024)
        try:
            payload = json.loads(body) if body.strip() else None
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deeply
            raise BadRequest(f"the body is not JSON; {usage}") from None
        if not isinstance(payload, dict):
            raise BadRequest(f"the body is not a JSON object; {usage}")
        if set(payload) - {"package"}:
            raise BadRequest(f"unknown field(s) {sorted(map(str, set(payload) - {'package'}))[:5]}; {usage}")
        target = reload_target(payload.get("package"), state.settings.package_root)
        audit["package"] = target.label
        try:
            new, old = await asyncio.to_thread(state.registry.swap, target.ref, target.label)
        except PackageError as exc:
            raise reload_error(exc, target) from None
        except TaflError as exc:
            exc.message = scrub_paths(exc.message, target)
            exc.args = (exc.message,)
            raise
        body = {"request_id": rid, "model": new.name, "version": new.package.version,
                "previous_version": old.package.version if old else None, "providers": new.providers,
                "source": target.label, "signed_by": new.package.signed_by}
        _audit(**audit, status=200, model=new.name, version=new.package.version,
               timing_ms=round(1000 * (time.perf_counter() - start), 2))
        return JSONResponse(body, headers={"X-Request-ID": rid})
    except Exception as exc:  # noqa: BLE001
        if not isinstance(exc, TaflError):  # a failure with an unknown message: never let it name a host path
            log.error("reload %s failed: %s", rid, type(exc).__name__)
            exc = ServiceError("the reload failed; the served models are unchanged")
        return _fail(exc, rid, audit, start)


async def openapi(request: Request) -> Response:
    """The OpenAPI document of these routes (tafl.serving.openapi)."""
    from tafl import __version__
    from tafl.serving.openapi import spec

    return JSONResponse(spec(__version__))


from tafl.serving import ui  # noqa: E402 - the page for people (GET /, /ui/...; issue 19); it reads `state` lazily

app = Starlette(routes=[
    Route("/openapi.json", openapi, methods=["GET"]),
    Route("/predict", predict, methods=["POST"]),
    Route("/predict/batch", predict_batch, methods=["POST"]),
    Route("/heatmap", heatmap, methods=["POST"]),
    Route("/models", models, methods=["GET"]),
    Route("/admin/reload", reload, methods=["POST"]),
    *ui.routes(),
])
