"""The OpenAPI 3.0 document of the service's own routes, served at GET /openapi.json.

It states what each route takes (a multipart form with the image in the field `file`, or the raw image
body) and every status it answers with its body, so a client generator, an API gateway or a fuzzer
(tests/serving/test_fuzz.py runs schemathesis against the live service with it) knows the contract.
BentoML's own routes (/healthz, /livez, /readyz, /metrics) are not listed: they are BentoML's.
"""

from __future__ import annotations

from typing import Any

ERROR = {
    "type": "object", "required": ["error", "request_id"],
    "properties": {
        "error": {"type": "object", "required": ["status", "code", "message"],
                  "properties": {"status": {"type": "integer"}, "code": {"type": "string"},
                                 "message": {"type": "string"}}},
        "request_id": {"type": "string"},
    },
}
CLASS_MAP = {"type": "object", "additionalProperties": {"type": "number"}}
EXPERT = {"type": "object", "required": ["name", "label", "class_name", "probability"],
          "properties": {"name": {"type": "string"}, "label": {"type": "integer"}, "class_name": {"type": "string"},
                         "probability": {"type": "number"}}}
DOMAIN = {"type": "object", "required": ["in_domain", "distance", "threshold", "reason"],
          "description": "the learned in-domain detector's verdict (packages that have one): the squared Mahalanobis "
                         "distance of the image's features to the nearest class mean (or, where larger, the energy "
                         "of its logits on that scale) against the package's threshold",
          "properties": {"in_domain": {"type": "boolean"}, "distance": {"type": "number"},
                         "threshold": {"type": "number"}, "reason": {"type": "string"}}}
PREDICTION_SET = {
    "type": "object", "nullable": True, "required": ["coverage", "classes", "labels", "size", "kind"],
    "description": "the conformal prediction set (packages that have one): the classes the model cannot rule out; the "
                   "true class is in it for at least `coverage` of each class's images like the calibration images, "
                   "whatever the case mix. null for an image outside the model's domain",
    "properties": {"coverage": {"type": "number"}, "classes": {"type": "array", "items": {"type": "string"}},
                   "labels": {"type": "array", "items": {"type": "integer"}}, "size": {"type": "integer"},
                   "kind": {"type": "string"}, "calibrated_for": {"type": "string"}, "meaning": {"type": "string"}}}
RESULT = {
    "type": "object", "required": ["abstained", "label", "class_name", "probability", "probabilities", "experts"],
    "description": "abstained true: the image lies outside the model's domain (domain.in_domain false) and there is "
                   "no finding: label, class_name, probability and probabilities are null and `reason` says why. "
                   "With abstain=false such an image keeps its label, marked by outside_domain_note.",
    "properties": {"abstained": {"type": "boolean"},
                   "label": {"type": "integer", "minimum": 0, "nullable": True},
                   "class_name": {"type": "string", "nullable": True},
                   "probability": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
                   "probabilities": {**CLASS_MAP, "nullable": True}, "votes": CLASS_MAP,
                   "experts": {"type": "array", "items": EXPERT},
                   "calibrated_probabilities": CLASS_MAP, "domain": DOMAIN, "reason": {"type": "string"},
                   "prediction_set": PREDICTION_SET,
                   "outside_domain_note": {"type": "string"}},
}
MODEL_REF = {"type": "object", "required": ["name", "version", "method"],
             "properties": {"name": {"type": "string"}, "version": {"type": "string"}, "method": {"type": "string"}}}
PRIOR = {"type": "object", "required": ["used"], "properties": {"used": {"type": "string"}}}
PREDICTION = {
    "allOf": [RESULT, {
        "type": "object", "required": ["request_id", "model", "input", "prior", "timing_ms"],
        "properties": {"request_id": {"type": "string"}, "model": MODEL_REF, "prior": PRIOR,
                       "input": {"type": "object", "required": ["kind", "frames", "size"],
                                 "properties": {"kind": {"type": "string", "enum": ["png", "jpeg", "dicom"]},
                                                "frames": {"type": "integer", "minimum": 1},
                                                "size": {"type": "array", "items": {"type": "integer"}}}},
                       "frames": {"type": "array", "items": RESULT},
                       "heatmap": {"type": "object", "required": ["png_base64", "shape", "kind"],
                                   "properties": {"png_base64": {"type": "string"}, "shape": {"type": "array"},
                                                  "kind": {"type": "string"}}},
                       "timing_ms": {"type": "object"}},
    }],
}
BATCH = {
    "type": "object", "required": ["request_id", "model", "prior", "results"],
    "properties": {"request_id": {"type": "string"}, "model": MODEL_REF, "prior": PRIOR,
                   "results": {"type": "array", "items": {"type": "object", "required": ["index"],
                                                          "properties": {"index": {"type": "integer"},
                                                                         "error": ERROR["properties"]["error"]}}},
                   "timing_ms": {"type": "object"}},
}
OPTIONS = {
    "model": {"type": "string", "description": "the model's name (default: the first package loaded)"},
    "heatmap": {"type": "string", "description": "true: add the heatmap overlay (PNG, base64)"},
    "prior": {"type": "string", "description": "train (default); site (the service's --site-mix); adaptive; or "
                                               "one probability per class, comma-separated"},
    "posteriors": {"type": "string", "description": "true: add the calibrated probabilities under the prior"},
    "abstain": {"type": "string", "description": "true (default): an image outside the model's domain gets no "
                                                "label; false: its label anyway, marked (never for format=sr)"},
    "coverage": {"type": "string", "description": "the prediction set's level, one the package keeps (GET /models: "
                                                  "metadata sets.levels; default: the one chosen at export)"},
    "site": {"type": "string", "description": "a training site whose own thresholds make the prediction set (metadata "
                                              "sets.sites; default: the service's TAFL_SITE, else the federation's)"},
}
BINARY = {"type": "string", "format": "binary"}
FORMAT = {"type": "string", "enum": ["json", "sr"],
          "description": "sr (or Accept: application/dicom): a DICOM Comprehensive SR instead of JSON, with "
                         "heatmap=true also the overlay as a secondary capture (multipart/related); DICOM inputs only. "
                         "An image outside the model's domain gets no SR (422) unless not_assessed=true"}
NOT_ASSESSED = {"type": "string", "description": "with format=sr: true gives an image outside the model's domain an "
                                                 "SR that says 'not assessed: outside the model's domain'"}


def _errors(*codes: int) -> dict[str, Any]:
    why = {400: "a bad option, field or body", 401: "a missing or wrong bearer token",
           403: "reloading is not allowed", 404: "no such model",
           409: "a reload while the service runs several workers (TAFL_WORKERS): restart it instead",
           413: "the upload, image or request is too large",
           415: "not a DICOM, PNG or JPEG",
           422: "an image that cannot be decoded, or outside the model's input domain (its DICOM header; /heatmap "
                "and format=sr also for the learned in-domain score)",
           429: "too many requests in flight", 503: "the request took longer than its deadline"}
    return {str(c): {"description": why[c], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for c in codes}


def _image_body(many: bool) -> dict[str, Any]:
    props: dict[str, Any] = {"file": {"type": "array", "items": BINARY, "minItems": 1} if many else BINARY}
    props.update(OPTIONS)
    content: dict[str, Any] = {"multipart/form-data": {"schema": {"type": "object", "required": ["file"],
                                                                  "properties": props}}}
    if not many:
        props["format"] = FORMAT
        props["not_assessed"] = NOT_ASSESSED
    if not many:  # the raw image as the body, the options in the query
        for media in ("image/png", "image/jpeg", "application/dicom", "application/octet-stream"):
            content[media] = {"schema": BINARY}
    return {"required": True, "content": content}


QUERY = [{"name": k, "in": "query", "required": False, "schema": v} for k, v in OPTIONS.items()]


def spec(version: str) -> dict[str, Any]:
    image_errors = (400, 401, 404, 413, 415, 422, 429, 503)
    return {
        "openapi": "3.0.3",
        "info": {"title": "tafl", "version": version,
                 "description": "Classifies DICOM, PNG and JPEG images with federated long-tail models "
                                "(docs/design.md §7). Every error is JSON with a status, a code and a message."},
        "components": {
            "schemas": {"Error": ERROR, "Prediction": PREDICTION, "Batch": BATCH},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "TAFL_API_TOKEN (routes), TAFL_ADMIN_TOKEN (/admin/reload)"}},
        },
        "security": [{"bearer": []}, {}],
        "paths": {
            "/predict": {"post": {
                "summary": "classify one image: label, probabilities, each expert's vote, optionally the heatmap",
                "parameters": QUERY + [{"name": "format", "in": "query", "required": False, "schema": FORMAT},
                                       {"name": "not_assessed", "in": "query", "required": False,
                                        "schema": NOT_ASSESSED}],
                "requestBody": _image_body(False),
                "responses": {"200": {"description": "the prediction", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Prediction"}},
                    "application/dicom": {"schema": BINARY},
                    "multipart/related": {"schema": BINARY}}},
                    **_errors(*image_errors)}}},
            "/predict/batch": {"post": {
                "summary": "classify several images (the field 'file', repeated): one result or error per image",
                "parameters": [q for q in QUERY if q["name"] != "heatmap"], "requestBody": _image_body(True),
                "responses": {"200": {"description": "one result per image, in order", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Batch"}}}},
                    **_errors(*image_errors)}}},
            "/heatmap": {"post": {
                "summary": "the heatmap overlay of one image as a PNG; the label in X-Tafl-Label / X-Tafl-Class",
                "parameters": QUERY, "requestBody": _image_body(False),
                "responses": {"200": {"description": "the overlay", "content": {"image/png": {"schema": BINARY}}},
                              **_errors(*image_errors)}}},
            "/models": {"get": {
                "summary": "the loaded packages: metadata, card, providers, case-mix estimate",
                "responses": {"200": {"description": "the models", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["models"], "properties": {
                        "models": {"type": "array"},
                        "worker": {"type": "object", "description": "the worker process that answered (TAFL_WORKERS, "
                                   "else chosen at start, and why): batch sizes and the case-mix window are its own",
                                   "properties": {"workers": {"type": "integer"}, "workers_from": {"type": "string"},
                                                  "pid": {"type": "integer"}}}}}}}},
                    **_errors(401)}}},
            "/admin/reload": {"post": {
                "summary": "load a package (a BentoML tag or a folder under the package root) and make it answer",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["package"], "properties": {"package": {"type": "string"}}}}}},
                "responses": {"200": {"description": "the new version answers", "content": {"application/json": {
                    "schema": {"type": "object", "required": ["model", "version"]}}}},
                    **_errors(400, 401, 403, 404, 409, 413, 429, 503)}}},
            **oip_paths(),
        },
    }


OIP_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
TENSOR = {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
    "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}},
    "datatype": {"type": "string", "enum": ["FP32", "INT64"]},
    "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer"},
                                                    "binary_data": {"type": "boolean"}}},
    "data": {"type": "array", "items": {"type": "number"}}}}


def _oip(summary: str, method: str = "get", body: dict[str, Any] | None = None,
         ok: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "tags": ["Open Inference Protocol (KServe v2)"], "responses": {
        "200": ok or {"description": "yes"},
        **{str(c): {"description": d, "content": {"application/json": {"schema": OIP_ERROR}}}
           for c, d in ((400, "a bad request"), (401, "no or a wrong token"), (404, "no such model or version"),
                        (413, "too large"), (429, "too many requests in flight"), (503, "busy or starting"))}}}
    if body is not None:
        op["requestBody"] = body
    return {method: op}


def oip_paths() -> dict[str, Any]:
    """The Open Inference Protocol's routes (tafl.serving.oip)."""
    json_ok = {"description": "the answer", "content": {"application/json": {"schema": {"type": "object"}}}}
    infer_body = {"required": True, "description": "inputs: the package's preprocessed image tensor (FP32, NCHW) "
                  "and optionally log_prior_ratio (FP32, [C] or [N, C]); outputs: which of the graph's outputs to "
                  "return (default all but heatmap). Binary tensors follow the JSON header, whose length is the "
                  "Inference-Header-Content-Length header.", "content": {
                      "application/json": {"schema": {"type": "object", "required": ["inputs"], "properties": {
                          "id": {"type": "string"}, "parameters": {"type": "object"},
                          "inputs": {"type": "array", "items": TENSOR},
                          "outputs": {"type": "array", "items": {"type": "object"}}}}},
                      "application/octet-stream": {"schema": BINARY}}}
    infer_ok = {"description": "the outputs", "content": {
        "application/json": {"schema": {"type": "object", "required": ["model_name", "outputs"], "properties": {
            "model_name": {"type": "string"}, "model_version": {"type": "string"}, "id": {"type": "string"},
            "outputs": {"type": "array", "items": TENSOR}}}},
        "application/octet-stream": {"schema": BINARY}}}
    paths = {
        "/v2": _oip("server metadata: name, version, extensions", ok=json_ok),
        "/v2/health/live": _oip("the server is live"),
        "/v2/health/ready": _oip("the server's models are loaded"),
        "/v2/models/{name}": _oip("a model's metadata: its input and output tensors", ok=json_ok),
        "/v2/models/{name}/ready": _oip("the model is loaded and answers"),
        "/v2/models/{name}/infer": _oip("run the model on preprocessed image tensors", "post", infer_body, infer_ok),
    }
    name = {"name": "name", "in": "path", "required": True, "description": "the model's name",
            "schema": {"type": "string", "pattern": "^[a-z0-9][-._a-z0-9]{0,62}$"}}
    version = {"name": "version", "in": "path", "required": True, "description": "the model's version",
               "schema": {"type": "string", "pattern": "^[0-9A-Za-z][-._+0-9A-Za-z]{0,62}$"}}
    for route in ("/v2/models/{name}", "/v2/models/{name}/ready", "/v2/models/{name}/infer"):
        for op in paths[route].values():
            op["parameters"] = [name]
        versioned = {m: {**op, "parameters": [name, version]} for m, op in paths[route].items()}
        paths[route.replace("{name}", "{name}/versions/{version}")] = versioned
    return paths
