"""Owns the API's outermost layer: the request size limit (checked before a body is read
whole), the request metrics by route template, and the JSON 500 for any unexpected
exception, logged without SQL parameters (which hold payloads); the console's Server-Timing
header."""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schedctl.core import errors
from schedctl.core.errors import RequestTooLarge
from schedctl.storage.db.engine import first_line, is_database_error
from scheduled_d.api.errors import error_response

log = logging.getLogger("scheduled_d.api")

# by route template, never by raw path (ids) or tenant on the request metrics: bounded labels
API_REQUESTS = Counter(
    "scheduled_api_requests_total",
    "Tenant API requests answered, by route and status.",
    ["method", "route", "status"],
)
API_LATENCY = Histogram(
    "scheduled_api_request_seconds",
    "Time to answer a tenant API request.",
    ["method", "route"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


class Guard:
    """Outermost of the app's own layers: refuses bodies over the size limit before they are
    read whole, and turns any unexpected exception into a JSON 500 logged without SQL
    parameters (which hold payloads). Starlette's own last-resort handler would re-raise
    it for the server to log, message and all."""

    def __init__(self, app: ASGIApp, max_request_bytes: int) -> None:
        self.app = app
        self.limit = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        began = time.perf_counter()

        def record(status: int) -> None:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = str(scope.get("method", ""))
            API_REQUESTS.labels(method, template, str(status)).inc()
            API_LATENCY.labels(method, template).observe(time.perf_counter() - began)

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                # counted before the client can see the answer, so a scrape right after
                # a response always includes it
                record(int(message["status"]))
                if str(scope.get("path", "")).startswith("/ui"):
                    message = _with_server_timing(message, time.perf_counter() - began)
            await send(message)

        try:
            await self._guarded(scope, receive, send_tracking, lambda: started)
        finally:
            if not started:
                record(500)

    async def _guarded(
        self, scope: Scope, receive: Receive, send: Send, started: Callable[[], bool]
    ) -> None:
        too_large = RequestTooLarge(
            f"the request body is over the limit of {self.limit} bytes", field="body"
        )
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self._send_error(send, too_large, close=True)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise too_large
            return message

        try:
            await self.app(scope, counting_receive, send)
        except RequestTooLarge as exc:
            if not started():
                await self._send_error(send, exc, close=True)
        except Exception as exc:
            _log_internal(scope, exc)
            if not started():
                internal = errors.SchedError
                response = error_response(
                    internal.http_status, internal.code, "internal error (logged)"
                )
                await response(scope, receive, send)

    @staticmethod
    async def _send_error(send: Send, exc: errors.SchedError, *, close: bool) -> None:
        body = json.dumps(
            {"error": {"code": exc.code, "message": exc.message, "field": exc.field}}
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if close:
            # the unread rest of the body is still on its way: do not reuse the connection
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": exc.http_status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _log_internal(scope: Scope, exc: BaseException) -> None:
    # SQLAlchemy's message carries the statement's parameters: log the driver's first line
    if is_database_error(exc):
        message = first_line(exc)
    else:
        message = str(exc).splitlines()[0][:300] if str(exc) else ""
    frames = "".join(traceback.format_tb(exc.__traceback__))
    log.error(
        "internal error on %s %s: %s: %s\n%s",
        scope.get("method"),
        scope.get("path"),
        type(exc).__name__,
        message,
        frames,
    )


def _with_server_timing(message: Message, seconds: float) -> Message:
    """The console's responses say the server's own time to their first byte (a
    Server-Timing header, `app;dur=` milliseconds): what `schedctl bench console` reports
    as server time, and what a browser's developer tools show next to the network time."""
    headers = [
        *message.get("headers", ()),
        (b"server-timing", f"app;dur={seconds * 1000:.1f}".encode()),
    ]
    return {**message, "headers": headers}
