"""Owns the API's error answers: every error, FastAPI's and Starlette's own included, is
`{"error": {"code", "message", "field"}}` with the status and code schedctl.core.errors gives
its class; quota refusals carry Retry-After and are counted per tenant."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.exceptions import HTTPException as StarletteHTTPException

from schedctl.core import errors
from scheduled_d.api.auth import Caller

log = logging.getLogger("scheduled_d.api")

API_QUOTA_REJECTIONS = Counter(
    "scheduled_api_quota_rejections_total",
    "Job creations refused by a tenant quota (429).",
    ["tenant", "quota"],
)


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "field": field}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def sched_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.SchedError)
    headers: dict[str, str] = {}
    if isinstance(exc, errors.QuotaExceeded):
        headers["Retry-After"] = str(exc.retry_after)
        caller = getattr(request.state, "caller", None)
        if isinstance(caller, Caller):
            API_QUOTA_REJECTIONS.labels(caller.tenant.name, exc.field or "quota").inc()
    if isinstance(exc, errors.Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="scheduled"'
    if exc.http_status >= 500:
        # the details (a database's host and port, the driver's message) are the log's; the
        # body says only the public message, whoever asks
        log.error("%s %s failed: %s: %s", request.method, request.url.path, exc.code, exc.message)
    return error_response(
        exc.http_status, exc.code, exc.public_message, field=exc.field, headers=headers
    )


def validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    field = None
    for item in exc.errors():
        # loc is ("query", "limit"): the field is "limit", as jobspec would name it; the
        # input itself is left out of the message
        parts = [str(p) for p in item.get("loc", ())]
        if parts and parts[0] in {"query", "path", "header", "body"}:
            parts = parts[1:]
        location = ".".join(parts) or "request"
        field = field or location
        problems.append(f"{location}: {item.get('msg', 'invalid')}")
    invalid = errors.ValidationError
    message = "; ".join(problems) or "invalid request"
    return error_response(invalid.http_status, invalid.code, message, field=field)


def http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    kind = errors.from_status(exc.status_code)
    # Starlette raises 400, 401, 404, 405, 413 and 415 here, each with a class of its own
    code = kind.code if kind is not None and exc.status_code < 500 else "http_error"
    return error_response(exc.status_code, code, message, headers=exc.headers)


def install_handlers(app: FastAPI) -> None:
    """Every error answered as {"error": {...}}: ours, FastAPI's validation, Starlette's HTTP."""
    app.add_exception_handler(errors.SchedError, sched_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
