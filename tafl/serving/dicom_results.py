"""`POST /predict` answering in DICOM: `format=sr` (or `Accept: application/dicom`) returns the prediction as a
Comprehensive SR (tafl.imaging.dicom_sr); with `heatmap=true` also the overlay as a Secondary Capture, both in
one `multipart/related; type="application/dicom"` body (DICOMweb's form), the SR first.

A non-DICOM input with format=sr is a 415 that says so; a DICOM the service cannot decode gets the 4xx it
gets for JSON (the decoder runs first, with the same limits); one that decodes but lacks the UIDs an SR must
reference is a 422.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from tafl.errors import BadRequest, UnsupportedMedia
from tafl.imaging import is_dicom
from tafl.imaging import dicom_sr
from tafl.serving.decoding import DecodePool
from tafl.serving.results import overlay_frame

DICOM = "application/dicom"


def wants_sr(request: Request, options: dict[str, str], data: bytes) -> bool:
    """Whether the caller asked for DICOM; a 415 when it did for an input that is not DICOM."""
    fmt = str(options.get("format", "")).strip().lower()
    if fmt not in ("", "json", "sr"):
        raise BadRequest(f"option 'format' must be json or sr, got {fmt[:20]!r}")
    accept = request.headers.get("accept", "").lower()
    want = fmt == "sr" or (fmt == "" and DICOM in accept and "application/json" not in accept)
    if want and not is_dicom(data):
        raise UnsupportedMedia("format=sr (a DICOM structured report) needs a DICOM input: the upload is not DICOM; "
                               "send the DICOM instance, or leave out format=sr for a JSON answer")
    return want


def algorithm(model: Any) -> dicom_sr.Algorithm:
    """The SR's algorithm identification for a served model (cached on it)."""
    algo = getattr(model, "_dicom_algorithm", None)
    if algo is None:
        pkg = model.package
        algo = dicom_sr.Algorithm.from_metadata(pkg.meta, pkg.files.get("model.onnx", ""))
        model._dicom_algorithm = algo
    return algo


def render(data: bytes, result: dict[str, Any], algo: dicom_sr.Algorithm, frames: int,
           overlay_rgb: np.ndarray | None) -> list[bytes]:
    """[SR] or [SR, SC] as Part 10 files."""
    source = dicom_sr.read_header(data)
    finding = dicom_sr.Finding.from_result(result, algo.class_names, 1 if frames > 1 else None)
    return dicom_sr.encoded(source, finding, algo, overlay_rgb)


async def sr_response(model: Any, data: bytes, result: dict[str, Any], frames: list[np.ndarray],
                      heat: np.ndarray | None, rid: str, pool: DecodePool | None = None) -> Response:
    """The SR (and SC) answer. highdicom builds an SR in tens of milliseconds of pure Python, holding the GIL: in
    a decoder process (`pool`) the event loop stays free for other requests meanwhile; without one, in a thread."""
    from tafl.imaging.heatmap import overlay

    rgb = None
    if heat is not None:
        rgb = await asyncio.to_thread(overlay, overlay_frame(frames[0]), heat)
    algo = algorithm(model)
    if pool is None:
        parts = await asyncio.to_thread(render, data, result, algo, len(frames), rgb)
    else:
        source = await asyncio.to_thread(dicom_sr.read_header, data)  # the header only: pixels stay here
        finding = dicom_sr.Finding.from_result(result, algo.class_names, 1 if len(frames) > 1 else None)
        parts = await pool.call(functools.partial(dicom_sr.encoded, source, finding, algo, rgb),
                                late="building the structured report took too long; ask for format=json",
                                crashed="building the structured report failed; ask for format=json")
    headers = {"X-Request-ID": rid}
    if len(parts) == 1:
        return Response(parts[0], media_type=DICOM, headers=headers)
    boundary = uuid.uuid4().hex
    body = b"".join(b"--" + boundary.encode() + b"\r\nContent-Type: application/dicom\r\n\r\n" + p + b"\r\n"
                    for p in parts) + b"--" + boundary.encode() + b"--\r\n"
    return Response(body, headers={**headers, "Content-Type":
                                   f'multipart/related; type="{DICOM}"; boundary={boundary}'})
