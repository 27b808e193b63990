"""Owns the tenant REST API (`scheduled-d api`): the /v1 routes, bearer-token auth, JSON errors,
request size limits, the OpenAPI document, /healthz, and the uvicorn server that serves them.

Every route is scoped to the tenant of the caller's token: another tenant's job is 404, the
same answer as a job that does not exist. Every error, FastAPI's and Starlette's own
included, is `{"error": {"code", "message", "field"}}`. Payloads are never logged: only the
request line reaches the access log, and internal errors are logged without their SQL
parameters. Endpoints are plain `def`s: FastAPI runs them in its thread pool, which suits the
synchronous store.

Idempotency keys (the Idempotency-Key header, or `idempotency_key` in the body) are stored on
their job's row, unique per tenant, and job rows are never deleted: a key is honoured for as
long as its job exists, which is at least the 24 hours promised (a replay of a cancelled
job's key returns that cancelled job). See schedctl.service.IDEMPOTENCY_KEY_RETENTION.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, BeforeValidator, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schedctl import errors, limits
from schedctl.config import Config
from schedctl.models import JobStatus, Tenant
from schedctl.service import MAX_JOBS_RETRY_AFTER_SECONDS, OverQuota, Scheduler
from schedctl.storage.engine import first_line, is_database_error
from schedctl.storage.jobs import MAX_PAGE
from schedctl.storage.payloads import payload_cipher
from schedctl.storage.status import check_reachable
from schedctl.storage.store import Store
from schedctl.views import job_to_dict, run_to_dict, tenant_to_dict
from scheduled_d import sdnotify
from scheduled_d.metrics import serve_metrics
from scheduled_d.signals import stop_on_signals

log = logging.getLogger(__name__)

API_VERSION = "1"
MIN_REQUEST_BYTES = 1024 * 1024
# JSON escapes can make a payload's request body up to 6x its compact size ("\u0001");
# the request limit leaves room for that, so any payload under its own limit fits
REQUEST_TO_PAYLOAD_RATIO = 8
START_TIMEOUT_SECONDS = 10.0
_JOB_ID = re.compile(r"[0-9a-f]{1,40}")

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
API_QUOTA_REJECTIONS = Counter(
    "scheduled_api_quota_rejections_total",
    "Job creations refused by a tenant quota (429).",
    ["tenant", "quota"],
)


# -- response models (the OpenAPI document; job_to_dict and friends fill them) ---------


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable code, e.g. not_found, conflict.")
    message: str = Field(description="What went wrong, for people.")
    field: str | None = Field(default=None, description="The offending input, if one.")


class ErrorBody(BaseModel):
    error: ErrorDetail


class OnceScheduleOut(BaseModel):
    kind: Literal["once"]
    run_at: str


class IntervalScheduleOut(BaseModel):
    kind: Literal["interval"]
    every_seconds: int
    anchor: str


class CronScheduleOut(BaseModel):
    kind: Literal["cron"]
    cron: str
    timezone: str


class QueueTargetOut(BaseModel):
    type: Literal["queue"]
    name: str


class HttpTargetOut(BaseModel):
    type: Literal["http"]
    url: str


class RetryOut(BaseModel):
    max_attempts: int
    backoff: Literal["exponential"]
    base_delay_seconds: float
    max_delay_seconds: float


class JobOut(BaseModel):
    job_id: str
    tenant_id: str
    name: str
    status: JobStatus
    schedule: Annotated[
        OnceScheduleOut | IntervalScheduleOut | CronScheduleOut, Field(discriminator="kind")
    ]
    target: Annotated[QueueTargetOut | HttpTargetOut, Field(discriminator="type")]
    payload: Any = Field(description="The job's JSON payload, as submitted.")
    retry: RetryOut
    misfire_policy: Literal["run_once", "skip", "run_all"]
    grace_seconds: int
    window_seconds: int
    max_concurrency: int | None = Field(description="null: no limit.")
    timeout_seconds: int | None
    start_at: str | None
    end_at: str | None
    next_run_at: str | None = Field(description="Nominal UTC time of the next run.")
    next_fire_at: str | None
    partition: int
    version: int
    idempotency_key: str | None
    created_at: str
    updated_at: str


class RunOut(BaseModel):
    job_id: str
    scheduled_at: str
    idempotency_key: str = Field(description="JOB_ID:SCHEDULED_AT, what targets receive.")
    tenant_id: str
    trigger: Literal["schedule", "manual"]
    status: Literal["dispatched", "running", "succeeded", "failed", "lost", "skipped", "dead"]
    attempt: int
    fire_at: str | None
    dispatched_at: str | None
    started_at: str | None
    finished_at: str | None
    exit_code: int | None
    error: str | None
    output_tail: str | None
    epoch: int | None


class JobPage(BaseModel):
    items: list[JobOut]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null: end.")


class RunPage(BaseModel):
    items: list[RunOut]
    next_cursor: str | None


class TenantOut(BaseModel):
    tenant_id: str
    name: str
    max_jobs: int
    create_rate_per_minute: int
    dispatch_rate_per_second: int
    allow_list: list[str]
    created_at: str
    token_id: str = Field(description="The id of the token this request used.")


class Health(BaseModel):
    status: Literal["ok"]


# -- request bodies: parsed by schedctl.jobspec (the CLI's parser); documented here -----

_DURATION_PATTERN = (
    r"^(\d+(\.\d+)?|(\d+d)?(\d+h)?(\d+m)?(\d+(\.\d+)?s)?"
    r"|P(\d+W)?(\d+D)?(T(\d+H)?(\d+M)?(\d+([.,]\d+)?S)?)?)$"
)
_DURATION: dict[str, Any] = {
    "description": "Seconds (90), a short form (30s, 10m, 1h30m, 1d) or ISO 8601 (PT10M).",
    "anyOf": [
        {"type": "string", "pattern": _DURATION_PATTERN},
        {"type": "number", "minimum": 0, "maximum": limits.MAX_DURATION_SECONDS},
    ],
}
_INSTANT: dict[str, Any] = {
    "type": "string",
    "format": "date-time",
    "description": "RFC 3339 with an offset, e.g. 2026-10-12T08:00:00+05:30.",
}
_SCHEDULE: dict[str, Any] = {
    "description": "Exactly one of run_at, delay, cron (+ timezone) or every (+ anchor).",
    "oneOf": [
        {
            "type": "object",
            "required": ["run_at"],
            "additionalProperties": False,
            "properties": {"run_at": _INSTANT},
        },
        {
            "type": "object",
            "required": ["delay"],
            "additionalProperties": False,
            "properties": {"delay": _DURATION},
        },
        {
            "type": "object",
            "required": ["cron"],
            "additionalProperties": False,
            "properties": {
                "cron": {"type": "string", "description": "5 fields or @daily-style macro."},
                "timezone": {"type": "string", "description": "IANA zone; default UTC."},
            },
        },
        {
            "type": "object",
            "required": ["every"],
            "additionalProperties": False,
            "properties": {"every": _DURATION, "anchor": _INSTANT},
        },
    ],
}
_TARGET: dict[str, Any] = {
    "oneOf": [
        {
            "type": "object",
            "required": ["type", "name"],
            "additionalProperties": False,
            "properties": {
                "type": {"const": "queue"},
                "name": {
                    "type": "string",
                    "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$",
                },
            },
        },
        {
            "type": "object",
            "required": ["type", "url"],
            "additionalProperties": False,
            "properties": {
                "type": {"const": "http"},
                "url": {"type": "string", "format": "uri", "maxLength": 2048},
            },
        },
    ]
}
JOB_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schedule", "target"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 200},
        "schedule": _SCHEDULE,
        "target": _TARGET,
        "payload": {"description": "Any JSON value, up to the payload size limit."},
        "retry": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "max_attempts": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": limits.MAX_ATTEMPTS,
                },
                "backoff": {"const": "exponential"},
                "base_delay": _DURATION,
                "max_delay": _DURATION,
            },
        },
        "misfire_policy": {"enum": ["run_once", "skip", "run_all"]},
        "grace": _DURATION,
        "window": _DURATION,
        "timeout": _DURATION,
        "max_concurrency": {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": limits.MAX_CONCURRENCY},
                {"type": "null"},
            ],
            "description": "Overlapping runs allowed (default 1); null: no limit.",
        },
        "start": _INSTANT,
        "end": _INSTANT,
        "idempotency_key": {
            "type": "string",
            "minLength": 1,
            "maxLength": 200,
            "description": "Same as the Idempotency-Key header (which wins if both differ).",
        },
    },
}
JOB_REQUEST_EXAMPLES: dict[str, Any] = {
    "weekly": {
        "value": {
            "schedule": {"cron": "0 8 * * MON", "timezone": "Asia/Kolkata"},
            "target": {"type": "queue", "name": "digest-jobs"},
            "payload": {"report": "weekly"},
            "retry": {"max_attempts": 5, "backoff": "exponential"},
            "misfire_policy": "run_once",
            "window": "PT5M",
        }
    },
    "in ten minutes": {
        "value": {
            "schedule": {"delay": "PT10M"},
            "target": {"type": "http", "url": "https://hooks.example.com/run"},
        }
    },
}
RESCHEDULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schedule"],
    "additionalProperties": False,
    "properties": {"schedule": _SCHEDULE},
}


def _json_request(schema: dict[str, Any], examples: dict[str, Any] | None = None) -> dict[str, Any]:
    content: dict[str, Any] = {"schema": schema}
    if examples:
        content["examples"] = examples
    return {"requestBody": {"required": True, "content": {"application/json": content}}}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {
        400: "Malformed request (not JSON, bad header)",
        401: "Missing, invalid or revoked bearer token",
        404: "No such job (or another tenant's)",
        409: "Conflicts with the job's state, or an idempotency key reused for another body",
        413: "Request or payload too large",
        415: "The body is not application/json",
        422: "Invalid input",
        429: "Over a tenant quota",
        503: "The database is unavailable",
    }
    result: dict[int | str, dict[str, Any]] = {}
    for code in (*codes, 401, 503):
        entry: dict[str, Any] = {"model": ErrorBody, "description": descriptions[code]}
        if code == 429:
            entry["headers"] = {
                "Retry-After": {
                    "description": "Seconds until a retry can succeed.",
                    "required": True,
                    "schema": {"type": "integer", "minimum": 1},
                }
            }
        if code == 401:
            entry["headers"] = {
                "WWW-Authenticate": {"required": True, "schema": {"type": "string"}}
            }
        result[code] = entry
    return result


# -- auth and request plumbing -------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    token_id: str

    @property
    def actor(self) -> str:
        """What the audit log records: the token, never the token's secret."""
        return f"token:{self.token_id}"


_bearer = HTTPBearer(auto_error=False, description="The tenant's API token: `st_...`.")


def get_scheduler(request: Request) -> Scheduler:
    scheduler = request.app.state.scheduler
    assert isinstance(scheduler, Scheduler)
    return scheduler


def get_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    if credentials is None:
        raise errors.Unauthorized(
            "send the tenant's API token as 'Authorization: Bearer st_...'", field="token"
        )
    tenant, token_id = get_scheduler(request).tenants.authenticate_tenant(credentials.credentials)
    caller = Caller(tenant, token_id)
    request.state.caller = caller  # for the error handlers' metrics
    return caller


class MalformedRequest(errors.ValidationError):
    """The request is malformed."""

    http_status = 400
    code = "malformed"


class UnsupportedMediaType(errors.ValidationError):
    """The body must be JSON."""

    http_status = 415
    code = "unsupported_media_type"


class RequestTooLarge(errors.PayloadTooLarge):
    """The request body is larger than the limit."""

    code = "request_too_large"


async def json_body(request: Request) -> Any:
    """The request's JSON body. Parsed here rather than by FastAPI so that schedctl.jobspec is
    the one validator (the CLI's), and malformed JSON is a 400, not a 422."""
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(
            f"send the body as Content-Type: application/json, not {media!r}",
            field="content-type",
        )
    raw = await request.body()
    if not raw.strip():
        raise MalformedRequest("the request has no body: send a JSON object", field="body")
    # integers too long for int() and nesting deep enough for a RecursionError are refused
    # naming their field (schedctl.limits), never a 500; malformed JSON is a 400
    return limits.parse_json(raw, "body", malformed=MalformedRequest)


SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
CallerDep = Annotated[Caller, Depends(get_caller)]
BodyDep = Annotated[Any, Depends(json_body)]
JobIdPath = Annotated[str, Path(description="The job id.")]


def _ascii_integer(value: Any) -> Any:
    # pydantic's lax int takes "1.0" and " 1 "; a query integer is ASCII digits (limits)
    if isinstance(value, str) and not (value.isascii() and value.isdigit() and len(value) < 20):
        raise ValueError("must be an integer (ASCII digits)")
    return value


LimitQuery = Annotated[
    int,
    BeforeValidator(_ascii_integer),
    Query(ge=1, le=MAX_PAGE, description=f"Items per page (1-{MAX_PAGE})."),
]
CursorQuery = Annotated[
    str | None,
    Query(max_length=limits.MAX_CURSOR_LENGTH, description="The next_cursor of the previous page."),
]
StatusQuery = Annotated[JobStatus | None, Query(description="Only jobs in this status.")]
IdempotencyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        description=(
            "Same key and same body: the same job again (200). Same key, other body: 409. "
            "Keys are kept as long as their job (at least 24 h)."
        ),
    ),
]


def _job_id(job_id: str) -> str:
    # ids are hex; anything else cannot exist, and must not reach the database as is
    # (Postgres refuses NUL characters in text with an error, not an empty result)
    if not _JOB_ID.fullmatch(job_id):
        raise errors.NotFound(f"no job {job_id!r}", field="job_id")
    return job_id


# -- routes --------------------------------------------------------------------------

router = APIRouter(prefix="/v1")


@router.post(
    "/jobs",
    status_code=201,
    response_model=JobOut,
    summary="Create a job",
    responses={
        201: {
            "description": "Created",
            "headers": {"Location": {"schema": {"type": "string"}, "required": True}},
        },
        200: {"model": JobOut, "description": "The job an earlier request with this key made"},
        **_errors(400, 409, 413, 415, 422, 429),
    },
    openapi_extra=_json_request(JOB_REQUEST_SCHEMA, JOB_REQUEST_EXAMPLES),
)
def create_job(
    response: Response,
    scheduler: SchedulerDep,
    caller: CallerDep,
    body: BodyDep,
    idempotency_key: IdempotencyHeader = None,
) -> dict[str, Any]:
    if isinstance(body, dict) and idempotency_key is not None:
        in_body = body.get("idempotency_key")
        if in_body is not None and in_body != idempotency_key:
            raise errors.ValidationError(
                "the Idempotency-Key header and the body's idempotency_key differ",
                field="idempotency_key",
            )
        body = {**body, "idempotency_key": idempotency_key}
    job, created = scheduler.create_job(caller.tenant, body, actor=caller.actor)
    if created:
        response.headers["Location"] = f"/v1/jobs/{job.job_id}"
    else:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return job_to_dict(job)


@router.get("/jobs", response_model=JobPage, summary="List jobs", responses=_errors(422))
def list_jobs(
    scheduler: SchedulerDep,
    caller: CallerDep,
    cursor: CursorQuery = None,
    limit: LimitQuery = 50,
    status: StatusQuery = None,
) -> dict[str, Any]:
    """Jobs in creation order. A cursor stays valid while jobs are added: new jobs come
    after every job already listed, so no page shifts or repeats."""
    page = scheduler.list_jobs(caller.tenant, status, limit=limit, cursor=cursor)
    return {"items": [job_to_dict(j) for j in page.items], "next_cursor": page.next_cursor}


@router.get("/jobs/{job_id}", response_model=JobOut, summary="One job", responses=_errors(404))
def get_job(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> dict[str, Any]:
    return job_to_dict(scheduler.get_job(_job_id(job_id), caller.tenant))


@router.patch(
    "/jobs/{job_id}",
    response_model=JobOut,
    summary="Reschedule a job",
    responses=_errors(400, 404, 409, 413, 415, 422),
    openapi_extra=_json_request(RESCHEDULE_SCHEMA),
)
def reschedule_job(
    job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep, body: BodyDep
) -> dict[str, Any]:
    """Replace the schedule; the next run is recomputed in the same transaction."""
    job_id = _job_id(job_id)
    if not isinstance(body, Mapping):
        raise errors.ValidationError('must be an object: {"schedule": {...}}', field="body")
    unknown = sorted(str(k) for k in body if k != "schedule")
    if unknown:
        raise errors.ValidationError(
            "unknown key: only the schedule can be changed", field=unknown[0]
        )
    if "schedule" not in body:
        raise errors.ValidationError(
            "is required: one of run_at, delay, cron, every", field="schedule"
        )
    job = scheduler.reschedule_job(job_id, body["schedule"], caller.tenant, actor=caller.actor)
    return job_to_dict(job)


@router.delete(
    "/jobs/{job_id}",
    status_code=204,
    response_class=Response,
    summary="Cancel a job",
    responses={204: {"description": "Cancelled (or already cancelled)"}, **_errors(404, 409)},
)
def cancel_job(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> Response:
    """Cancel all future runs; a run already dispatched still completes. Cancelling a
    cancelled job is a no-op (DELETE is idempotent)."""
    job_id = _job_id(job_id)
    try:
        scheduler.cancel_job(job_id, caller.tenant, actor=caller.actor)
    except errors.Conflict:
        if scheduler.get_job(job_id, caller.tenant).status is not JobStatus.cancelled:
            raise
    return Response(status_code=204)


@router.post(
    "/jobs/{job_id}/pause",
    response_model=JobOut,
    summary="Pause a job",
    responses=_errors(404, 409),
)
def pause_job(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> dict[str, Any]:
    return job_to_dict(scheduler.pause_job(_job_id(job_id), caller.tenant, actor=caller.actor))


@router.post(
    "/jobs/{job_id}/resume",
    response_model=JobOut,
    summary="Resume a paused job",
    responses=_errors(404, 409),
)
def resume_job(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> dict[str, Any]:
    """Continue from the next scheduled time after now."""
    return job_to_dict(scheduler.resume_job(_job_id(job_id), caller.tenant, actor=caller.actor))


@router.post(
    "/jobs/{job_id}/trigger",
    status_code=202,
    response_model=RunOut,
    summary="Run a job now",
    responses=_errors(404, 409),
)
def trigger_job(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> dict[str, Any]:
    """One manual run now, in addition to the schedule; delivered like any other run."""
    run = scheduler.trigger_job(_job_id(job_id), caller.tenant, actor=caller.actor)
    return run_to_dict(run)


@router.get(
    "/jobs/{job_id}/runs",
    response_model=RunPage,
    summary="Run history of a job",
    responses=_errors(404, 422),
)
def job_runs(
    job_id: JobIdPath,
    scheduler: SchedulerDep,
    caller: CallerDep,
    cursor: CursorQuery = None,
    limit: LimitQuery = 50,
) -> dict[str, Any]:
    """Newest first."""
    page = scheduler.runs(_job_id(job_id), caller.tenant, limit=limit, cursor=cursor)
    return {"items": [run_to_dict(r) for r in page.items], "next_cursor": page.next_cursor}


@router.get("/tenant", response_model=TenantOut, summary="The caller's tenant", responses=_errors())
def whoami(caller: CallerDep) -> dict[str, Any]:
    """The tenant the token belongs to, with its quotas."""
    return {**tenant_to_dict(caller.tenant), "token_id": caller.token_id}


def healthz(scheduler: SchedulerDep) -> dict[str, str]:
    """Liveness and database reachability; no token needed. A database that cannot be
    reached is a 503 saying "database unavailable": where it is, and what the driver said,
    go to the log only."""
    check_reachable(scheduler.store)
    return {"status": "ok"}


# -- errors: every one as {"error": {...}} -------------------------------------------


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


def _sched_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.SchedError)
    headers: dict[str, str] = {}
    if isinstance(exc, errors.QuotaExceeded):
        retry = exc.retry_after if isinstance(exc, OverQuota) else MAX_JOBS_RETRY_AFTER_SECONDS
        headers["Retry-After"] = str(retry)
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


def _validation_error(request: Request, exc: Exception) -> JSONResponse:
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
    return error_response(422, "invalid", "; ".join(problems) or "invalid request", field=field)


_HTTP_CODES = {
    400: "malformed",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, message, headers=exc.headers)


class _Guard:
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
                response = error_response(500, "internal", "internal error (logged)")
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


# -- the app ---------------------------------------------------------------------------


def create_app(scheduler: Scheduler, *, max_request_bytes: int | None = None) -> FastAPI:
    """The /v1 API over `scheduler`. max_request_bytes defaults to room for any payload under
    the scheduler's payload limit (at least 1 MiB)."""
    limit = max_request_bytes or max(
        MIN_REQUEST_BYTES, REQUEST_TO_PAYLOAD_RATIO * scheduler.max_payload_bytes
    )
    # SQLAlchemy logs statements with their parameters (payloads) at INFO: a daemon run at
    # SCHEDULED_LOG_LEVEL=DEBUG must still not write payloads to its logs
    logging.getLogger("sqlalchemy.engine").setLevel(logging.WARNING)
    app = FastAPI(
        title="scheduled-d tenant API",
        version=API_VERSION,
        description=(
            "Create and manage scheduled jobs of one tenant. Authenticate with the tenant's "
            "token: `Authorization: Bearer st_...`. Errors are "
            '`{"error": {"code", "message", "field"}}`.'
        ),
        docs_url=None,  # the docs pages load scripts from a CDN; /openapi.json is the doc
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.scheduler = scheduler
    app.include_router(router)
    # -- tenant workers' lease routes (own module) --
    from scheduled_d.api_leases import router as leases_router

    app.include_router(leases_router)
    app.add_api_route(
        "/healthz",
        healthz,
        methods=["GET"],
        response_model=Health,
        summary="Health",
        responses={503: {"model": ErrorBody, "description": "The database is unavailable"}},
    )
    app.add_exception_handler(errors.SchedError, _sched_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(_Guard, max_request_bytes=limit)
    return app


# -- serving ---------------------------------------------------------------------------


def parse_listen(listen: str) -> tuple[str, int]:
    """ "127.0.0.1:8080", "[::1]:8080" or ":8080" (all interfaces) -> (host, port)."""
    host, sep, port_text = listen.strip().rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise errors.ConfigError(
            f"{listen!r} is not HOST:PORT (e.g. 127.0.0.1:8080)", field="api_listen"
        )
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class ApiServer:
    """uvicorn serving create_app(...) from a thread: start() binds (raising ConfigError at
    once if it cannot) and returns when the server accepts connections; stop() drains."""

    def __init__(
        self,
        scheduler: Scheduler,
        listen: str,
        *,
        access_log: bool = True,
        max_request_bytes: int | None = None,
    ) -> None:
        self.host, self._requested_port = parse_listen(listen)
        self.app = create_app(scheduler, max_request_bytes=max_request_bytes)
        self._config = uvicorn.Config(
            self.app,
            log_config=None,  # the process's logging setup, not uvicorn's own
            access_log=access_log,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.port = self._requested_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        # fail now, not on the first job read, when the payload keys are misconfigured
        payload_cipher()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so,
        # and without it Nagle and delayed ACKs add 40 ms to every response
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
        except OSError as exc:
            sock.close()
            raise errors.ConfigError(
                f"cannot listen on {self.host}:{self._requested_port}: {exc.strerror}",
                field="api_listen",
            ) from exc
        self._socket = sock
        self.port = sock.getsockname()[1]
        if not _is_loopback(self.host):
            log.warning(
                "the API listens on %s, beyond this machine, without TLS: put a "
                "TLS-terminating proxy in front of it",
                self.url,
            )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="api", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            raise errors.ConfigError(f"the API server did not start on {self.url}")
        log.info("API listening on %s", self.url)

    def is_serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._server.started

    def stop(self, timeout: float = 15.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the API server did not stop within %.0f s", timeout)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def serve(store: Store, config: Config, stop: threading.Event) -> None:
    """Serve the API on config.api_listen until `stop` is set (the `all` mode's thread)."""
    scheduler = Scheduler(store, max_payload_bytes=config.max_payload_bytes)
    server = ApiServer(scheduler, config.api_listen)
    server.start()
    try:
        stop.wait()
    finally:
        server.stop()


def run(store: Store, config: Config) -> None:
    """The `scheduled-d api` mode: serve until SIGTERM/SIGINT (and /metrics on
    config.metrics_listen, like every mode)."""
    with stop_on_signals() as (stop, force):
        server = ApiServer(
            Scheduler(store, max_payload_bytes=config.max_payload_bytes), config.api_listen
        )
        server.start()
        if config.metrics_listen:
            serve_metrics(config.metrics_listen, server.is_serving, stop)
        sdnotify.announce(f"api: {server.url}", server.is_serving, stop)
        try:
            while not stop.wait(0.5) and not force.is_set():
                pass
        finally:
            server.stop(timeout=1.0 if force.is_set() else 15.0)
