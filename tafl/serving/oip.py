"""The Open Inference Protocol (KServe v2; what Triton, KServe, Seldon MLServer and their clients speak) beside the
service's own routes: any `tritonclient.http` or KServe v2 caller can use a tafl package.

    GET  /v2                                   server metadata (name, version, extensions)
    GET  /v2/health/live, /v2/health/ready     liveness; readiness (the models are loaded)
    GET  /v2/models/{name}[/versions/{v}]      model metadata: the input tensor and the graph's named outputs
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer

`infer` takes the package's preprocessed input tensor (FP32, NCHW at the package's image size: decode, channels,
resize, scale and normalise as metadata.json's input.preprocess says) and the optional `log_prior_ratio` input
(FP32, [C] or [N, C]: log q − log source prior, the explicit prior /predict's `prior=` sets), and returns the
graph's named outputs: label, probs, expert_labels, expert_probs, votes, calibrated_probs, domain_distance, and
heatmap only when `outputs` names it; with a package's in-domain detector also `in_domain` (BOOL, the distance
within the package's threshold: false means the label is no finding; the threshold is in the model's metadata); with
a package's prediction sets also `conformal_scores` and `prediction_set` (BOOL [N, C], the set at the export's
coverage; all false for an image outside the domain). Tensors travel as JSON `data` or with the binary-data extension (`binary_data_size`,
`binary_data`, `binary_data_output`, the Inference-Header-Content-Length header). The rows go through the same
batcher, case-mix window and /metrics counter as /predict's images, under the same token and request limits.
Errors answer {"error": "..."} with a 4xx, as the protocol says.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tafl.errors import BadRequest, NotFound, PayloadTooLarge, ServiceUnavailable
from tafl.packaging.domain import in_domain_rows
from tafl.packaging.sets import MASK
from tafl.serving.context import of
from tafl.serving.http import JSONResponse, audit, error_status, read_body
from tafl.serving.routing import Call, endpoint
from tafl.serving.runtime import LoadedModel

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ("binary_tensor_data",)
PRIOR_INPUT = "log_prior_ratio"
ON_REQUEST = ("heatmap",)
IN_DOMAIN = "in_domain"  # (N,) BOOL, the service's own output beside the graph's: domain_distance within threshold  # outputs returned only when `outputs` names them
# the protocol's type names for numpy's
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.int64): "INT64",
             np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "UINT8"}
NUMPY = {v: k for k, v in DATATYPES.items()}
META_TYPES = {"float32": "FP32", "int64": "INT64", "bool": "BOOL"}


def _oip_error(exc: Exception, call: Call) -> Response:
    status, _, message = error_status(exc)
    resp = JSONResponse({"error": message}, status, headers={"X-Request-ID": call.rid})
    if status == 503:
        resp.headers["Retry-After"] = "1"
    return resp


def oip_endpoint(route: str, **kw):
    return endpoint(route, on_error=_oip_error, **kw)


def _model(request: Request, call: Call) -> LoadedModel:
    """The model the path names (and its version, when it names one): a 404 otherwise."""
    name = request.path_params["name"]
    try:
        model = call.state.registry.get(name)
    except NotFound:
        raise NotFound(f"no model named '{name}'; loaded: {', '.join(call.state.registry.order)}") from None
    version = request.path_params.get("version")
    if version not in (None, "", model.package.version):
        raise NotFound(f"model '{name}' serves version {model.package.version}, not {version}")
    return model


# ------------------------------------------------------------------ metadata and health
def server_metadata() -> dict[str, Any]:
    from tafl import __version__

    return {"name": "tafl", "version": __version__, "extensions": list(EXTENSIONS)}


def model_metadata(model: LoadedModel) -> dict[str, Any]:
    """The model's tensors as the protocol describes them (-1: any batch size)."""
    meta = model.package.meta
    spec = meta.input
    inputs = [{"name": spec.name, "datatype": "FP32",
               "shape": [-1 if not isinstance(d, int) else d for d in spec.shape]}]
    if meta.prior is not None:  # graphs that decide under another prior take it as a second, optional input
        inputs.append({"name": PRIOR_INPUT, "datatype": "FP32", "shape": [-1, len(model.package.class_names)],
                       "parameters": {"optional": True, "description": "log q - log source prior; [C] or [N, C]"}})
    outputs = [{"name": o.name, "datatype": META_TYPES.get(o.dtype, o.dtype.upper()),
                "shape": [-1 if not isinstance(d, int) else d for d in o.shape]} for o in meta.outputs]
    params: dict[str, Any] = {"class_names": model.package.class_names, "method": meta.method,
                              "preprocess": spec.preprocess.to_json()}
    threshold = meta.domain.detector.threshold
    if threshold is not None:  # the service's verdict on the graph's domain_distance, as an output of its own
        outputs.append({"name": IN_DOMAIN, "datatype": "BOOL", "shape": [-1],
                        "parameters": {"description": f"domain_distance <= {threshold:.6g}: the image lies in the "
                                                      "model's domain; false: treat the label as no finding"}})
        params["domain_threshold"] = threshold
    return {"name": model.name, "versions": [model.package.version], "platform": "onnxruntime_onnx",
            "inputs": inputs, "outputs": outputs, "parameters": params}


async def server(request: Request) -> Response:
    return JSONResponse(server_metadata())


async def live(request: Request) -> Response:
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    """Ready once this worker's models are loaded (its state is set after they are)."""
    try:
        of(request)
    except ServiceUnavailable as exc:
        return JSONResponse({"error": exc.message}, 503, headers={"Retry-After": "1"})
    return Response(status_code=200)


@oip_endpoint("/v2/models/{name}", audited=False)
async def metadata(request: Request, call: Call) -> Response:
    return JSONResponse(model_metadata(_model(request, call)))


@oip_endpoint("/v2/models/{name}/ready", audited=False)
async def model_ready(request: Request, call: Call) -> Response:
    _model(request, call)
    return Response(status_code=200)


# ------------------------------------------------------------------ infer
def _shape(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in value):
        raise BadRequest(f"{what}: 'shape' must be a list of non-negative integers")
    return value


def parse_request(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The request's JSON header and its input tensors by name, from JSON `data` or the binary-data extension."""
    if header_length is not None:
        if not header_length.strip().isdigit() or int(header_length) > len(body):
            raise BadRequest(f"{HEADER_LENGTH} must be the JSON header's byte length, within the body")
        n = int(header_length)
        head, rest = body[:n], memoryview(body)[n:]
    else:
        head, rest = body, memoryview(b"")
    try:
        req = json.loads(head)
    except (ValueError, RecursionError):
        raise BadRequest("the request is not JSON (with binary tensors, Inference-Header-Content-Length gives the "
                         "JSON header's length)") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or not req["inputs"]:
        raise BadRequest("the request needs 'inputs': a list of tensors {name, shape, datatype, data}")
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for i, t in enumerate(req["inputs"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise BadRequest(f"inputs[{i}] must be an object with a 'name'")
        name = t["name"]
        shape = _shape(t.get("shape"), f"input '{name}'")
        dtype = NUMPY.get(t.get("datatype"))
        if dtype is None:
            raise BadRequest(f"input '{name}': datatype {str(t.get('datatype'))[:20]!r} is not supported; send FP32")
        count = math.prod(shape)
        params = t.get("parameters") or {}
        if not isinstance(params, dict):
            raise BadRequest(f"input '{name}': 'parameters' must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size != count * dtype.itemsize or offset + size > len(rest):
                raise BadRequest(f"input '{name}': binary_data_size {size!r} does not match its shape {shape} of "
                                 f"{t['datatype']} or the bytes sent")
            arr = np.frombuffer(rest[offset:offset + size], dtype=dtype).reshape(shape)
            offset += size
        else:
            data = t.get("data")
            if data is None:
                raise BadRequest(f"input '{name}' has neither 'data' nor parameters.binary_data_size")
            try:
                arr = np.asarray(data, dtype=dtype)
            except (ValueError, TypeError, RecursionError, OverflowError):
                raise BadRequest(f"input '{name}': 'data' must be numbers") from None
            if arr.size != count:
                raise BadRequest(f"input '{name}': {arr.size} values for shape {shape}")
            arr = arr.reshape(shape)
        if name in tensors:
            raise BadRequest(f"input '{name}' is given twice")
        tensors[name] = arr
    if offset != len(rest):
        raise BadRequest(f"{len(rest) - offset} bytes after the last binary input")
    return req, tensors


def check_inputs(model: LoadedModel, tensors: dict[str, np.ndarray], max_rows: int) -> tuple[np.ndarray, Any]:
    """The image batch and the prior ratio (None, [C] or [N, C]) the graph runs on, checked against the package."""
    meta = model.package.meta
    spec = meta.input
    names = {spec.name} | ({PRIOR_INPUT} if meta.prior is not None else set())
    unknown = sorted(set(tensors) - names)
    if unknown:
        raise BadRequest(f"unknown input(s) {unknown[:5]}; model '{model.name}' takes {sorted(names)}")
    if spec.name not in tensors:
        raise BadRequest(f"input '{spec.name}' is missing")
    x = tensors[spec.name]
    want = [d if isinstance(d, int) else None for d in spec.shape]
    if x.dtype != np.float32 or x.ndim != len(want) or any(w is not None and w != d for w, d in zip(want, x.shape)):
        shown = ["N" if w is None else w for w in want]
        raise BadRequest(f"input '{spec.name}' must be FP32 of shape {shown} (the package's preprocessed "
                         f"images); got {DATATYPES.get(x.dtype, str(x.dtype))} {list(x.shape)}")
    if not 1 <= len(x) <= max_rows:
        raise PayloadTooLarge(f"{len(x)} rows in one request; send 1 to {max_rows}") if len(x) else \
            BadRequest("the input holds no rows")
    if not np.isfinite(x).all():
        raise BadRequest(f"input '{spec.name}' holds NaN or infinite values")
    ratio = tensors.get(PRIOR_INPUT)
    if ratio is not None:
        c = len(model.package.class_names)
        if ratio.dtype != np.float32 or ratio.shape not in ((c,), (1, c), (len(x), c)):
            raise BadRequest(f"input '{PRIOR_INPUT}' must be FP32 of shape [{c}], [1, {c}] or [{len(x)}, {c}]")
        if not np.isfinite(ratio).all():
            raise BadRequest(f"input '{PRIOR_INPUT}' holds NaN or infinite values")
        ratio = ratio.reshape(c) if ratio.shape[0] == 1 or ratio.ndim == 1 else ratio
        if ratio.ndim == 2 and (ratio == ratio[:1]).all():
            ratio = ratio[0]
    return np.ascontiguousarray(x), ratio


def requested_outputs(req: dict[str, Any], available: list[str]) -> list[tuple[str, bool]]:
    """(name, binary) of each output to return: those `outputs` names, else every output but the heatmap."""
    params = req.get("parameters") or {}
    default_binary = bool(params.get("binary_data_output", False)) if isinstance(params, dict) else False
    asked = req.get("outputs")
    if asked is None:
        return [(n, default_binary) for n in available if n not in ON_REQUEST]
    if not isinstance(asked, list):
        raise BadRequest("'outputs' must be a list of {name, parameters}")
    out = []
    for i, o in enumerate(asked):
        if not isinstance(o, dict) or o.get("name") not in available:
            named = (o or {}).get("name") if isinstance(o, dict) else o
            raise BadRequest(f"outputs[{i}]: unknown output {str(named)[:40]!r}; the graph's outputs are {available}")
        p = o.get("parameters") or {}
        out.append((o["name"], bool(p.get("binary_data", default_binary)) if isinstance(p, dict) else default_binary))
    return out


def render(model: LoadedModel, req: dict[str, Any], out: dict[str, np.ndarray],
           wanted: list[tuple[str, bool]], rid: str) -> Response:
    """The protocol's answer: outputs as JSON `data`, or after the JSON header as raw bytes (binary extension)."""
    head: dict[str, Any] = {"model_name": model.name, "model_version": model.package.version,
                            "id": str(req.get("id", rid)), "outputs": []}
    blobs = []
    for name, binary in wanted:
        arr = np.ascontiguousarray(out[name])
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        t: dict[str, Any] = {"name": name, "datatype": DATATYPES.get(arr.dtype, "FP32"), "shape": list(arr.shape)}
        if binary:
            blob = arr.tobytes()
            t["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            t["data"] = arr.reshape(-1).tolist()
        head["outputs"].append(t)
    headers = {"X-Request-ID": rid}
    if not blobs:
        return JSONResponse(head, headers=headers)
    header = json.dumps(head, separators=(",", ":")).encode()
    return Response(b"".join([header, *blobs]), media_type="application/octet-stream",
                    headers={**headers, HEADER_LENGTH: str(len(header))})


@oip_endpoint("/v2/models/{name}/infer")
async def infer(request: Request, call: Call) -> Response:
    st = call.state
    model = _model(request, call)
    call.audit.update(model=model.name, version=model.package.version, protocol="oip-v2")
    body = await read_body(request, st.settings.max_upload_bytes)
    call.audit["bytes"] = len(body)
    req, tensors = parse_request(body, request.headers.get(HEADER_LENGTH))
    x, ratio = check_inputs(model, tensors, st.settings.max_request_frames)  # /predict/batch's frame budget
    keep_known = model.package.meta.domain.detector.threshold is not None
    available = [o.name for o in model.package.meta.outputs] + ([IN_DOMAIN] if keep_known else [])
    wanted = requested_outputs(req, available)
    out = await st.run(model, x, ratio)
    keep = in_domain_rows(model.package.meta, out)
    if keep is not None:
        out = dict(out, **{IN_DOMAIN: keep})
        if MASK in out:  # an image outside the domain has no set: its row of the mask is all false
            out[MASK] = out[MASK] & keep[:, None]
    names = model.package.class_names
    for i, label in enumerate(out["label"]):
        if keep is None or keep[i]:
            st.count(model, names[int(label)])
        else:
            st.abstained(model)
    audit(**call.audit, status=200, rows=len(x), prior="explicit" if ratio is not None else "train",
          timing_ms=call.ms())
    return render(model, req, out, wanted, call.rid)


async def unknown(request: Request) -> Response:
    return JSONResponse({"error": "no such route of the Open Inference Protocol; GET /openapi.json lists them"}, 404)


def routes() -> list[Route]:
    return [
        Route("/v2", server, methods=["GET"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2/models/{name}", metadata, methods=["GET"]),
        Route("/v2/models/{name}/versions/{version}", metadata, methods=["GET"]),
        Route("/v2/models/{name}/ready", model_ready, methods=["GET"]),
        Route("/v2/models/{name}/versions/{version}/ready", model_ready, methods=["GET"]),
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
        # anything else under /v2 answers the protocol's JSON error (BentoML's own 404 is plain text)
        Route("/v2/{rest:path}", unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]),
    ]
