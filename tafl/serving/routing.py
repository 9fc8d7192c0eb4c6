"""The one wrapper every route of the service opens with (`endpoint`): a request id, the worker's ServingState,
the bearer check, the request timeout, and every failure turned into the JSON error answer with one audit line.
The REST routes (tafl.serving.app), the Open Inference Protocol's (tafl.serving.oip) and the page's
(tafl.serving.ui) use it."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from tafl.errors import ServiceUnavailable
from tafl.serving.context import ServingState, of
from tafl.serving.http import audit, check_auth, error_response, error_status, request_id

log = logging.getLogger("tafl.serving")


@dataclass
class Call:
    """One request's facts while a route answers it: its id, start time, audit fields and the worker's state."""

    rid: str
    start: float
    audit: dict[str, Any]
    state: ServingState | None = None

    def ms(self) -> float:
        return round(1000 * (time.perf_counter() - self.start), 2)


Handler = Callable[[Request, Call], Awaitable[Response]]


def endpoint(route: str, *, auth: bool = True, audited: bool = True, timeout: bool = True,
             timeout_hint: str = "try again", what: str = "this endpoint",
             on_error: Callable[[Exception, Call], Response] | None = None) -> Callable[[Handler], Callable[[Request], Awaitable[Response]]]:
    """A Starlette endpoint from `handler(request, call)`: a request id, the worker's state, the API token's
    check (`auth`), the request timeout (TAFL_REQUEST_TIMEOUT_S; `timeout=False` for work that must not be cut
    off half done, like a reload), and every failure turned into the JSON
    error answer with one audit line (`audited`; routes that only read, like /models, write none). `on_error`
    renders the error in another protocol's form (the Open Inference Protocol's {"error": ...})."""

    def wrap(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(handler)
        async def run(request: Request) -> Response:
            rid = request_id()
            call = Call(rid, time.perf_counter(), {"request_id": rid, "route": route})
            try:
                call.state = st = of(request)
                if auth:
                    check_auth(request, st.settings.token, what)
                # no extra task per request, unlike wait_for
                async with asyncio.timeout(st.settings.timeout_s if timeout else None):
                    return await handler(request, call)
            except asyncio.TimeoutError:
                limit = call.state.settings.timeout_s if call.state else 0
                exc: Exception = ServiceUnavailable(f"the request took longer than {limit:g} s; {timeout_hint}")
            except Exception as e:  # noqa: BLE001 - every failure becomes a JSON answer
                exc = e
            return fail(exc, call, audited, on_error)

        return run

    return wrap


def fail(exc: Exception, call: Call, audited: bool = True,
         render: Callable[[Exception, Call], Response] | None = None) -> Response:
    """The error answer for `exc`: a 4xx/5xx JSON body (`render`'s form where given; a 499 without a body when the
    client left), logged when it is the service's fault, and one audit line."""
    if isinstance(exc, ClientDisconnect):  # nobody is left to answer: no 500, no traceback, one audit line
        log.info("request %s: the client disconnected before its upload was complete", call.rid)
        if audited:
            audit(**call.audit, status=499, error="ClientDisconnected", timing_ms=call.ms())
        return Response(status_code=499, headers={"X-Request-ID": call.rid})
    resp = render(exc, call) if render is not None else error_response(exc, call.rid)
    if resp.status_code >= 500 and not isinstance(exc, ServiceUnavailable):
        log.error("request %s failed: %s", call.rid, type(exc).__name__, exc_info=exc)
    if audited:
        audit(**call.audit, status=resp.status_code, error=error_status(exc)[1], timing_ms=call.ms())
    return resp
