"""HTTP pieces every route of the service shares: the JSON response that survives NaN, the error answer, the bearer
check, capped body reads, header-safe names and the audit line. No service state lives here."""

from __future__ import annotations

import hmac
import logging
import math
import os
import re
import time
from typing import Any
from urllib.parse import quote

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse as _StarletteJSON

from tafl.errors import BadRequest, PayloadTooLarge, TaflError, Unauthorized

audit_log = logging.getLogger("tafl.audit")
TRUE, FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off", ""})
BODY_SLACK = 64 * 1024  # a multipart envelope's own bytes past the upload limit


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class JSONResponse(_StarletteJSON):
    """Starlette's JSON response written by orjson (a tenth of the standard library's time for a prediction's body,
    ~2 µs against ~18), where a NaN or infinity (a package's stored metrics, a degenerate estimate) becomes null
    instead of failing the request with a 500. What orjson cannot write (an integer past 64 bits) goes through
    Starlette's own encoder."""

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
        except TypeError:  # orjson.JSONEncodeError
            return super().render(finite(content))


def request_id() -> str:
    """16 random hex digits (64 bits); os.urandom directly, as a UUID object costs more than the id is worth."""
    return os.urandom(8).hex()


def header_value(text: str) -> str:
    """A header-safe form of a name (class, model): printable ASCII as is, anything else percent-encoded
    (UTF-8), so a non-Latin class name neither fails the response nor loses its identity."""
    if text.isascii() and text.isprintable():
        return text
    return quote(text, safe=" !#$&'()*+,-./:;<=>?@[]^_`{|}~")


def check_auth(request: Request, token: str | None, what: str = "this endpoint") -> None:
    """Unauthorized unless the request carries `Authorization: Bearer <token>` (no token: open)."""
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized(f"{what} needs 'Authorization: Bearer <token>' with the service's token")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with a 413 as soon as it passes `limit` (plus a multipart envelope's slack)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + BODY_SLACK:
        raise PayloadTooLarge(f"the upload is {int(declared) / 2**20:.1f} MiB; the limit is {limit / 2**20:.0f} MiB")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + BODY_SLACK:
            raise PayloadTooLarge(f"the upload exceeds the {limit / 2**20:.0f} MiB limit")
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # noqa: SLF001 - Starlette parses the form from the cached body
    return body


def flag(value: Any, name: str) -> bool:
    v = str(value).strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise BadRequest(f"option '{name}' must be true or false, got {str(value)[:20]!r}")


def error_status(exc: Exception) -> tuple[int, str, str]:
    """(status, code, message) of a failure: tafl's errors carry their 4xx/5xx; anything else is a 500 whose
    message names nothing from the request."""
    if isinstance(exc, TaflError):
        status = exc.status if 400 <= exc.status <= 599 else 500
        return status, type(exc).__name__, exc.message
    return 500, "InternalError", "the service failed on this request; it has been logged"


def error_response(exc: Exception, rid: str) -> JSONResponse:
    status, code, msg = error_status(exc)
    resp = JSONResponse({"error": {"status": status, "code": code, "message": msg}, "request_id": rid}, status)
    resp.headers["X-Request-ID"] = rid
    if status == 503:
        resp.headers["Retry-After"] = "1"
    return resp


def audit(**fields: Any) -> None:
    """One JSON line per request in the audit log (no patient data: ids, model, label, status, timing)."""
    line = orjson.dumps({"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}, default=str)
    audit_log.info(line.decode())


CONTROL = re.compile("[\x00-\x1f\x7f]")  # C0 controls and DEL: one C-level scan per request path


class ControlCharacterGuard:
    """ASGI middleware over the whole BentoML app: a request whose path holds a control character (a percent-
    encoded newline, say) is answered 400 in the service's JSON error shape. BentoML mounts the app with a
    pattern that does not match a newline, so such a path otherwise falls through to BentoML's plain-text 404,
    which no route documents. Paths under /v2 get the Open Inference Protocol's {"error": "..."} instead."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        found = CONTROL.search(path)
        if found is None:
            await self.app(scope, receive, send)
            return
        message = (f"the request path holds a control character (U+{ord(found.group()):04X}); "
                   "no route, model name or version contains one")
        rid = request_id()
        if path == "/v2" or path.startswith("/v2/"):  # the Open Inference Protocol's error shape
            resp: _StarletteJSON = JSONResponse({"error": message}, 400, headers={"X-Request-ID": rid})
        else:
            resp = error_response(BadRequest(message), rid)
        await resp(scope, receive, send)
