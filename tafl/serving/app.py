"""HTTP routes of the service: /predict, /predict/batch, /heatmap, /models, /admin/reload and /openapi.json,
beside the page (tafl.serving.ui) and the Open Inference Protocol (tafl.serving.oip), as one Starlette app
mounted into the BentoML service (which keeps /healthz, /livez, /readyz and /metrics).

The routes own their request parsing so that every bad input — a missing or misnamed multipart
field, an oversized body, a file that is not an image — is a JSON error with a 4xx status and a
message a person can act on, never a 500 from a validation layer. Uploads are read with a size
cap before parsing; decoding runs in worker threads or processes; the model call goes through the
adaptive batcher. Every route is opened by `endpoint`: request id, auth, the timeout and one audit line
(request id, model version, label, timing) as JSON; patient data (tag values, file names) never reaches
logs or responses. The routes' shared state is the worker's ServingState (tafl.serving.context).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tafl.errors import (BadRequest, ConfigError, OutsideDomain, PayloadTooLarge, ServiceError, TaflError,
                         UnsupportedMedia)
from tafl.packaging.sets import choose_coverage, choose_site
from tafl.serving.context import ServingState
from tafl.serving.decoding import decode_upload
from tafl.serving.http import JSONResponse, audit, check_auth, error_response, flag, header_value, read_body, request_id
from tafl.serving.multipart import parse_simple
from tafl.serving.results import frame_result, overlay_png
from tafl.serving.routing import Call, endpoint
from tafl.serving.runtime import LoadedModel
from tafl.serving.settings import Settings

log = logging.getLogger("tafl.serving")

FORM_MAX_FIELDS = 20  # text fields in one multipart body
FORM_SPARE_FILES = 3  # file parts tolerated past the route's limit, so the error can count them
RAW_TYPES = ("image/png", "image/jpeg", "application/dicom", "application/octet-stream")


# ------------------------------------------------------------------ uploads
async def upload(request: Request, settings: Settings, max_files: int = 1) -> tuple[list[bytes], dict[str, str]]:
    """The files' bytes and the options, from multipart form data (field 'file', repeated for a batch)
    or a raw image body."""
    limit = settings.max_upload_bytes
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    options = {k: v for k, v in request.query_params.items()}
    if ctype == "multipart/form-data":
        body = await read_body(request, limit)
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
        return [await read_body(request, limit)], options
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


# ------------------------------------------------------------------ priors
def prior_choice(model: LoadedModel, options: dict[str, str]) -> tuple[np.ndarray | None, dict[str, Any]]:
    """The request's `prior` (tafl.prior.parse_prior_option, as `tafl score --prior` reads it): train (default,
    stateless), site (this site's own class mix, TAFL_SITE_MIX), adaptive (the model's current case-mix estimate) or
    an explicit prior (comma-separated or a JSON list, one value per class). Returns the graph's log prior ratio
    (None: the plain rule) and the response's `prior` section."""
    from tafl.prior import check_prior, log_prior_ratio, parse_prior_option, total_variation

    option = parse_prior_option(options.get("prior"))
    names = model.package.class_names
    if option.mode == "train":
        sec: dict[str, Any] = {"used": "train"}
        tau = model.package.meta.decision.tau
        if tau:  # the label is the validation-chosen operating point's, not the probabilities' argmax
            sec["operating_point"] = {"tau": tau, "rule": "logit adjustment chosen on validation"}
        return None, sec
    if model.monitor is None:
        raise BadRequest(f"model '{model.name}' {model.package.version} was exported before prior-aware inference; "
                         "re-export it with this tafl to use prior=adaptive or an explicit prior")
    src = model.monitor.source
    if option.mode == "site":
        if model.site_prior is None:
            raise BadRequest("prior=site decides for this site's own class mix, and this service was started "
                             "without one: start it with --site-mix CLASS=COUNT,... (or TAFL_SITE_MIX)")
        q = model.site_prior
        return log_prior_ratio(q, src), {"used": "site", "prior": dict(zip(names, map(float, q)))}
    if option.mode == "adaptive":
        q, n, why = model.monitor.current()
        if q is None:
            return None, {"used": "train", "requested": "adaptive", "fallback": why, "images": n}
        return log_prior_ratio(q, src), {"used": "adaptive", "images": n, "prior": dict(zip(names, map(float, q))),
                                         "shift_from_source": total_variation(q, src)}
    try:
        values = option.values()
    except ValueError:
        raise BadRequest(f"option 'prior' must be train, site, adaptive, or {len(names)} probabilities (one per "
                         f"class: {', '.join(names)}), comma-separated; got {option.text[:40]!r}") from None
    try:
        q = check_prior(values, len(names), "option 'prior'")
    except ConfigError as exc:
        raise BadRequest(f"{exc.message} (classes: {', '.join(names)})") from None
    return log_prior_ratio(q, src), {"used": "explicit", "prior": dict(zip(names, map(float, q)))}


def set_site(st: ServingState, model: LoadedModel, options: dict[str, str]) -> str | None:
    """The training site whose own thresholds make the prediction sets: the request's `site` (a 400 for one the
    package lacks), else the service's TAFL_SITE where the package has it, else none (the federation's)."""
    if "site" in options:
        return choose_site(model.package.meta, options["site"])
    meta = model.package.meta
    return st.settings.site if st.settings.site and meta.sets.fitted and st.settings.site in meta.sets.sites else None


# ------------------------------------------------------------------ one image
@dataclass
class Prediction:
    """One image's answer before it is rendered: the model, the decoded upload, the graph's outputs and the
    request's own facts (the prior section, whether posteriors and a DICOM answer were asked for)."""

    model: LoadedModel
    decoded: Any
    out: dict[str, np.ndarray]
    prior: dict[str, Any]
    posteriors: bool = False
    heatmap: bool = False
    sr_source: bytes | None = None  # the DICOM upload, when the answer is an SR
    not_assessed: bool = False  # an SR that says "not assessed" for an image outside the model's domain
    timing: tuple[float, float, float] = (0.0, 0.0, 0.0)
    results: list[dict[str, Any]] = field(default_factory=list)


async def predict_one(request: Request, call: Call) -> Prediction:
    """Upload -> decode -> model -> per-frame results, for /predict and /heatmap."""
    st = call.state
    files, options = await upload(request, st.settings)
    data = files[0]
    call.audit["bytes"] = len(data)
    model = st.registry.get(options.get("model"))
    call.audit.update(model=model.name, version=model.package.version)
    want_heat = flag(options.get("heatmap", "false"), "heatmap")
    posteriors = flag(options.get("posteriors", "false"), "posteriors")
    abstain = flag(options.get("abstain", "true"), "abstain")
    coverage = choose_coverage(model.package.meta, options.get("coverage"))
    site = set_site(st, model, options)
    from tafl.serving.dicom_results import wants_sr

    sr_source = data if wants_sr(request, options, data) else None  # format=sr: a 415 for a non-DICOM
    if sr_source is not None:  # an SR never files a label for an image outside the model's domain
        abstain = True
    not_assessed = flag(options.get("not_assessed", "false"), "not_assessed")
    ratio, prior = prior_choice(model, options)
    s = st.settings
    t0 = time.perf_counter()
    decoded = await decode_upload(st.decode_pool, data, max_bytes=s.max_upload_bytes,
                                  max_pixels=min(s.max_pixels, s.max_request_pixels),
                                  max_frames=min(s.max_frames, s.max_request_frames))
    st.check_domain(model, decoded)  # a DICOM header that contradicts the trained domain: 422 before the model
    t1 = time.perf_counter()
    out = await st.classify(model, decoded.frames, ratio)
    t2 = time.perf_counter()
    call.audit.update(kind=decoded.kind, frames=len(decoded.frames), prior=prior["used"])
    results = [frame_result(model.package, out, i, posteriors, abstain, coverage, site)
               for i in range(len(decoded.frames))]
    return Prediction(model, decoded, out, prior, posteriors, want_heat, sr_source, not_assessed, (t0, t1, t2),
                      results)


@endpoint("/predict")
async def predict(request: Request, call: Call) -> Response:
    st, p = call.state, await predict_one(request, call)
    model, results, first = p.model, p.results, p.results[0]
    if p.sr_source is not None:  # DICOM SR (+ secondary capture) instead of JSON: tafl.serving.dicom_results
        from tafl.serving.dicom_results import sr_response

        if first["abstained"] and not p.not_assessed:
            st.abstained(model)
            raise OutsideDomain(f"no structured report: {first['reason']}; add not_assessed=true for an SR that "
                                "says the image was not assessed")
        heat = p.out["heatmap"][0] if p.heatmap and not first["abstained"] else None
        resp = await sr_response(model, p.sr_source, first, p.decoded.frames, heat, call.rid, st.decode_pool)
        for r in results:
            st.tally(model, r)
        audit(**call.audit, status=200, format="sr", label=first["label"], class_name=first["class_name"],
              timing_ms=call.ms())
        return resp
    body: dict[str, Any] = {"request_id": call.rid, **first,
                            "model": {"name": model.name, "version": model.package.version,
                                      "method": model.package.meta.method},
                            "input": {"kind": p.decoded.kind, "frames": len(p.decoded.frames),
                                      "size": list(p.decoded.frames[0].shape[:2]), **p.decoded.info},
                            "prior": p.prior}
    if len(results) > 1:
        body["frames"] = [{"frame": i, **r} for i, r in enumerate(results)]
    if p.heatmap and not first["abstained"]:
        heat = p.out["heatmap"][0]
        png = await asyncio.to_thread(overlay_png, p.decoded.frames[0], heat)
        body["heatmap"] = {"png_base64": base64.b64encode(png).decode(), "shape": list(heat.shape),
                           "kind": model.package.meta.heatmap, "frame": 0}
    for r in results:
        st.tally(model, r)
    t0, t1, t2 = p.timing
    body["timing_ms"] = {"decode": 1000 * (t1 - t0), "inference": 1000 * (t2 - t1),
                         "total": 1000 * (time.perf_counter() - call.start)}
    audit(**call.audit, status=200, label=first["label"], class_name=first["class_name"],
          timing_ms=round(body["timing_ms"]["total"], 2))
    return JSONResponse(body, headers={"X-Request-ID": call.rid})


@endpoint("/heatmap")
async def heatmap(request: Request, call: Call) -> Response:
    p = await predict_one(request, call)
    first = p.results[0]
    call.state.tally(p.model, first)
    if first["abstained"]:
        raise OutsideDomain(f"no heatmap: {first['reason']}; add abstain=false to see it anyway")
    png = await asyncio.to_thread(overlay_png, p.decoded.frames[0], p.out["heatmap"][0])
    label, name = first["label"], first["class_name"]
    audit(**call.audit, status=200, label=label, class_name=name, timing_ms=call.ms())
    return Response(png, media_type="image/png",
                    headers={"X-Request-ID": call.rid, "X-Tafl-Label": str(label), "X-Tafl-Class": header_value(name),
                             "X-Tafl-Prior": p.prior["used"],
                             "X-Tafl-Model": header_value(f"{p.model.name}:{p.model.package.version}")})


# ------------------------------------------------------------------ many images
async def decode_batch(st: ServingState, files: list[bytes]) -> list[Any]:
    """Each file decoded (or its error), in order, within the request's admission budget: all files together may
    decode at most `max_request_frames` frames and `max_request_pixels` pixels. A window of files decodes at once
    (twice the decoder processes, so a batch keeps them busy instead of queueing file by file behind other
    requests); each file is bounded by its own caps, so crossing the budget costs at most a window of files
    before the request is refused (413)."""
    s, pool = st.settings, st.decode_pool
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


def _in_domain(st: ServingState, model: LoadedModel, d: Any) -> Any:
    """A decoded file, or the OutsideDomain error its DICOM header earns it (one error per file, as a decode's)."""
    if isinstance(d, Exception):
        return d
    try:
        st.check_domain(model, d)
    except ServiceError as exc:
        return exc
    return d


@endpoint("/predict/batch", timeout_hint="send fewer images")
async def predict_batch(request: Request, call: Call) -> Response:
    """Several images in one request (the field 'file', repeated): one result or error per image, in
    order. Batch scoring uses it to spread the cost of a request over many images."""
    st = call.state
    files, options = await upload(request, st.settings, st.settings.max_batch_files)
    model = st.registry.get(options.get("model"))
    call.audit.update(model=model.name, version=model.package.version, files=len(files),
                      bytes=sum(len(f) for f in files))
    if flag(options.get("heatmap", "false"), "heatmap"):
        raise BadRequest("heatmaps are not returned in batches; call /predict or /heatmap per image")
    ratio, prior = prior_choice(model, options)
    prior["posteriors"] = flag(options.get("posteriors", "false"), "posteriors")
    abstain = flag(options.get("abstain", "true"), "abstain")
    coverage = choose_coverage(model.package.meta, options.get("coverage"))
    site = set_site(st, model, options)
    call.audit["prior"] = prior["used"]
    decoded = [_in_domain(st, model, d) for d in await decode_batch(st, files)]
    frames = [f for d in decoded if not isinstance(d, Exception) for f in d.frames]
    out = await st.classify(model, frames, ratio) if frames else {}
    results, row = [], 0
    for i, d in enumerate(decoded):
        if isinstance(d, Exception):
            results.append({"index": i, "error": {"status": d.status, "code": type(d).__name__, "message": d.message}})
            continue
        per = [frame_result(model.package, out, row + j, prior["posteriors"], abstain, coverage, site)
               for j in range(len(d.frames))]
        row += len(d.frames)
        item = {"index": i, **per[0], "input": {"kind": d.kind, "frames": len(d.frames)}}
        if len(per) > 1:
            item["frames"] = [{"frame": j, **r} for j, r in enumerate(per)]
        results.append(item)
        for r in per:
            st.tally(model, r)
    timing = 1000 * (time.perf_counter() - call.start)
    audit(**call.audit, status=200, errors=sum("error" in r for r in results), timing_ms=round(timing, 2))
    return JSONResponse({"request_id": call.rid, "model": {"name": model.name, "version": model.package.version,
                                                          "method": model.package.meta.method},
                         "prior": prior, "results": results, "timing_ms": {"total": timing}},
                        headers={"X-Request-ID": call.rid})


# ------------------------------------------------------------------ models and reload
@endpoint("/models", audited=False)
async def models(request: Request, call: Call) -> Response:
    # with several workers (TAFL_WORKERS) each answers for itself: its batch sizes and its case-mix window
    st = call.state.settings
    worker = {"workers": st.workers, "workers_from": st.workers_from, "pid": os.getpid()}
    return JSONResponse({"models": call.state.registry.describe(), "worker": worker},
                        headers={"X-Request-ID": call.rid})


@endpoint("/admin/reload", auth=False, timeout=False)
async def reload(request: Request, call: Call) -> Response:
    """Swap in a new package version without a restart; requests in flight finish on the old one.

    Off (403) without TAFL_ADMIN_TOKEN; the API token is not enough (401). The body is {"package": REF}: a
    BentoML tag, or a folder inside TAFL_PACKAGE_ROOT (tafl.serving.runtime.reload_target). No response or
    log line names a host path; a package that fails verification answers 400 and the old version stays."""
    from tafl.errors import Conflict, Forbidden, PackageError
    from tafl.serving.runtime import reload_error, reload_target, scrub_paths

    st = call.state
    usage = 'send JSON: {"package": "<BentoML tag, or a folder under the package root>"}'
    try:
        if st.settings.admin_token is None:
            raise Forbidden("reloading is disabled: this service was started without TAFL_ADMIN_TOKEN (the API "
                            "token does not allow reloads)")
        check_auth(request, st.settings.admin_token, "/admin/reload")
        if st.settings.workers > 1:  # a reload swaps the package in the worker that answers, and only there
            raise Conflict(f"this service runs {st.settings.workers} worker processes (TAFL_WORKERS), and a reload "
                           "would change the model in one of them only; restart the service with the new package, "
                           "or run one worker to reload without a restart")
        body = await read_body(request, 64 * 1024)
        try:
            payload = json.loads(body) if body.strip() else None
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deeply
            raise BadRequest(f"the body is not JSON; {usage}") from None
        if not isinstance(payload, dict):
            raise BadRequest(f"the body is not a JSON object; {usage}")
        if set(payload) - {"package"}:
            raise BadRequest(f"unknown field(s) {sorted(map(str, set(payload) - {'package'}))[:5]}; {usage}")
        target = reload_target(payload.get("package"), st.settings.package_root)
        call.audit["package"] = target.label
        try:
            new, old = await asyncio.to_thread(st.registry.swap, target.ref, target.label)
        except PackageError as exc:
            raise reload_error(exc, target) from None
        except TaflError as exc:
            exc.message = scrub_paths(exc.message, target)
            exc.args = (exc.message,)
            raise
    except TaflError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failure with an unknown message: never let it name a host path
        log.error("reload %s failed: %s", call.rid, type(exc).__name__)
        raise ServiceError("the reload failed; the served models are unchanged") from None
    body = {"request_id": call.rid, "model": new.name, "version": new.package.version,
            "previous_version": old.package.version if old else None, "providers": new.providers,
            "source": target.label, "signed_by": new.package.signed_by}
    audit(**call.audit, status=200, model=new.name, version=new.package.version, timing_ms=call.ms())
    return JSONResponse(body, headers={"X-Request-ID": call.rid})


async def openapi(request: Request) -> Response:
    """The OpenAPI document of these routes (tafl.serving.openapi)."""
    from tafl import __version__
    from tafl.serving.openapi import spec

    return JSONResponse(spec(__version__))


async def not_found(request: Request, exc: Exception) -> Response:
    """A path no route serves: the JSON error, in the Open Inference Protocol's form under /v2."""
    from tafl.errors import NotFound

    rid = request_id()
    msg = "no such route; GET /openapi.json lists them"
    if request.url.path.startswith("/v2/") or request.url.path == "/v2":
        return JSONResponse({"error": msg}, 404, headers={"X-Request-ID": rid})
    return error_response(NotFound(msg), rid)


def create_app() -> Starlette:
    """The service's ASGI app: the REST routes, the Open Inference Protocol's and the page's. Its
    `state.tafl` is set by whoever serves it (tafl.serving.service), once per worker."""
    from tafl.serving import oip, ui

    return Starlette(routes=[
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/predict", predict, methods=["POST"]),
        Route("/predict/batch", predict_batch, methods=["POST"]),
        Route("/heatmap", heatmap, methods=["POST"]),
        Route("/models", models, methods=["GET"]),
        Route("/admin/reload", reload, methods=["POST"]),
        *oip.routes(),
        *ui.routes(),
    ], exception_handlers={404: not_found})
