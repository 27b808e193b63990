"""Owns the tenant workers' routes of the REST API: lease runs of the caller's built-in queue,
heartbeat, ack and fail them (`scheduled-d worker --api URL`, schedctl.clients.queue_client), and
lease and finish the command alerts of a queue's jobs (a host worker's alert_command).

A lease id is `MESSAGE_ID.SECRET`: the secret is 128 random bits the API generated for that
one lease (each lease of a call has its own, so holding one lease's id acts on no other),
and the message's lease owner is `api:TOKEN_ID:DIGEST` (a SHA-256 digest of the secret:
the owner shows in the run history, the secret never does). A lease is looked up
by message id AND the caller's tenant AND that owner, so a lease id cannot be guessed or
forged from a message id, another tenant's lease is 404 (the same as one that does not
exist), and a lease that expired and was handed to another worker is 404 too (a worker
treats it as lost). The semantics are QueueRepo's, the direct worker's: heartbeats extend the
visibility timeout and report a cancel; an expired lease is settled as lost by the reaper
(the relay's, or a direct worker's) and the run redelivered per its retry policy.

Included by scheduled_d.api.create_app; bodies are parsed by scheduled_d.api.auth.json_body (a
malformed body is a 400) and checked by the pydantic models here (invalid input is a 422).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Path, Request
from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from schedctl.app.service import Scheduler
from schedctl.core import errors, limits
from schedctl.domain.alerts.model import COMMAND
from schedctl.domain.leasing import Beat, Finish, Settlement
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.pipeline.queue import Lease, QueueRepo
from schedctl.storage.pipeline.workers import api_worker, record_presence
from schedctl.storage.records import alerts as alert_store
from scheduled_d.api.auth import Caller, CallerDep, SchedulerDep, json_body
from scheduled_d.api.schemas import error_responses

MAX_LEASES_PER_CALL = 100
MAX_LEASE_SECONDS = 3600
DEFAULT_LEASE_SECONDS = 30
# what a worker may keep of a run's output ([[worker]] output_bytes); the request size limit
# (at least 1 MiB, scheduled_d.api) bounds the body too: the worker cuts its tail to fit
MAX_OUTPUT_TAIL_CHARS = limits.MAX_OUTPUT_BYTES
MAX_ERROR_CHARS = 4096
_LEASE_ID = re.compile(r"([0-9]{1,18})\.([0-9a-f]{32})")
_QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}")
_M = TypeVar("_M", bound=BaseModel)


# -- bodies --------------------------------------------------------------------------


def _lease_seconds(description: str) -> Any:
    return Field(default=DEFAULT_LEASE_SECONDS, ge=1, le=MAX_LEASE_SECONDS, description=description)


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit: int = Field(default=1, ge=1, le=MAX_LEASES_PER_CALL, description="Runs at most.")
    lease_seconds: float = _lease_seconds(
        "Visibility timeout: the run is redelivered if not extended by then."
    )


def _storable(value: str | None) -> str | None:
    """Text the database can hold: JSON can spell NUL, which Postgres text refuses; it
    becomes U+FFFD (pydantic already refuses unpaired surrogates: a 422)."""
    if value is None:
        return None
    return value.replace("\x00", "\ufffd")


Storable = Annotated[str, AfterValidator(_storable)]


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_seconds: float = _lease_seconds("The lease is extended to now plus this.")
    output_tail: Storable | None = Field(
        default=None,
        max_length=MAX_OUTPUT_TAIL_CHARS,
        description="The output so far (shown by `schedctl logs` while the run runs).",
    )


class AckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    exit_code: int | None = Field(default=None, ge=0, le=255)
    output_tail: Storable | None = Field(
        default=None, max_length=MAX_OUTPUT_TAIL_CHARS, description="The end of the output."
    )
    started_at: AwareDatetime
    finished_at: AwareDatetime


class FailRequest(AckRequest):
    error: Storable = Field(min_length=1, max_length=MAX_ERROR_CHARS)
    cancelled: bool = Field(
        default=False,
        description=(
            "The command was stopped because the job was cancelled: recorded as failed, "
            "never retried or dead-lettered."
        ),
    )


# -- responses ------------------------------------------------------------------------


class LeaseOut(BaseModel):
    lease_id: str = Field(description="Heartbeat, ack or fail the run with this id.")
    queue: str
    job_id: str
    scheduled_at: str
    idempotency_key: str = Field(description="JOB_ID:SCHEDULED_AT, the same for every attempt.")
    attempt: int
    max_attempts: int
    timeout_seconds: int = Field(description="0: no timeout.")
    payload: Any = Field(description="The job's JSON payload.")
    leased_until: str


class LeasePage(BaseModel):
    items: list[LeaseOut]


class HeartbeatOut(BaseModel):
    status: Literal["extended", "lost", "cancelled"] = Field(
        description="cancelled: the lease was extended but the job was cancelled: stop the "
        "command and fail the lease with cancelled=true."
    )


class SettledOut(BaseModel):
    status: Literal["succeeded", "failed", "stopped"]


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """schemas.error_responses, with 404 said of leases rather than jobs."""
    result = error_responses(*codes)
    if 404 in result:
        result[404] = {
            **result[404],
            "description": "No such lease held by the caller's token (expired and "
            "redelivered, settled, or another tenant's); for a queue: no such route",
        }
    return result


def _schema(model: type[BaseModel], *, required: bool) -> dict[str, Any]:
    schema = model.model_json_schema()
    schema.pop("title", None)
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": schema}},
        }
    }


def _parse(model: type[_M], body: Any) -> _M:
    try:
        return model.model_validate(body)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise errors.ValidationError(str(first.get("msg", "invalid")), field=field) from None


async def optional_body(request: Request) -> Any:
    """The JSON body, or {} when there is none."""
    raw = await request.body()
    if not raw.strip():
        return {}
    return await json_body(request)


OptionalBodyDep = Annotated[Any, Depends(optional_body)]
BodyDep = Annotated[Any, Depends(json_body)]
QueuePath = Annotated[str, Path(description="The queue's name (a queue target's name).")]
LeasePath = Annotated[str, Path(description="A lease_id from POST /v1/queues/{name}/leases.")]

router = APIRouter(prefix="/v1", tags=["workers"])
_F = TypeVar("_F", bound=Callable[..., Any])


def _post(
    path: str, out: type[BaseModel], summary: str, *, body: type[BaseModel], body_required: bool
) -> Callable[[_F], _F]:
    """router.post with what every route here shares: its error responses and its body's
    schema (the body is parsed in the route, so FastAPI does not document it by itself)."""
    return router.post(
        path,
        response_model=out,
        summary=summary,
        responses=_responses(400, 404, 413, 415, 422),
        openapi_extra=_schema(body, required=body_required),
    )


def _lease_out(lease: Lease, secret: str) -> dict[str, Any]:
    return {
        "lease_id": f"{lease.message_id}.{secret}",
        "queue": lease.queue,
        "job_id": lease.job_id,
        "scheduled_at": format_instant(lease.scheduled_at),
        "idempotency_key": lease.idempotency_key,
        "attempt": lease.attempt,
        "max_attempts": lease.max_attempts,
        "timeout_seconds": lease.timeout_seconds,
        "payload": lease.payload,
        "leased_until": format_instant(lease.leased_until),
    }


def _owner(token_id: str, secret: str) -> str:
    """The lease owner stored for `secret`: only a digest of it, so the run history and the
    database (which show owners) never hold what acts on a lease."""
    digest = hashlib.sha256(secret.encode()).hexdigest()[:32]
    return f"api:{token_id}:{digest}"


def _held(scheduler: Scheduler, caller: Caller, lease_id: str) -> Lease:
    """The caller's lease `lease_id`, or NotFound."""
    match = _LEASE_ID.fullmatch(lease_id)
    lease = None
    if match is not None:
        message_id, secret = int(match.group(1)), match.group(2)
        lease = QueueRepo(scheduler.store).held_lease(
            message_id, _owner(caller.token_id, secret), caller.tenant.tenant_id
        )
    if lease is None:
        raise errors.NotFound(
            "no such lease held by this token: it expired and the run was redelivered, "
            "or it is not this tenant's",
            field="lease_id",
        )
    return lease


@_post(
    "/queues/{name:path}/leases",
    LeasePage,
    "Lease runs of a queue (tenant workers)",
    body=LeaseRequest,
    body_required=False,
)
def lease_runs(
    name: QueuePath, scheduler: SchedulerDep, caller: CallerDep, body: OptionalBodyDep
) -> dict[str, Any]:
    """Up to `limit` ready runs of the caller's queue `name`, oldest first, each held until
    `leased_until` (heartbeat to extend it). Never more runs of one job at once than its
    max_concurrency. An empty list: nothing is ready; poll again."""
    request = _parse(LeaseRequest, body)
    if not _QUEUE_NAME.fullmatch(name):
        raise errors.ValidationError(
            "not a queue name: a letter or digit, then up to 199 of A-Z a-z 0-9 . _ : / -",
            field="name",
        )
    if caller.host is not None:  # a host token: its own queues only
        caller.host.check_queue(name)
    # one secret per lease, drawn only for the leases taken (an empty poll draws none)
    keys: dict[str, str] = {}

    def owner() -> str:
        secret = secrets.token_hex(16)
        held_by = _owner(caller.token_id, secret)
        keys[held_by] = secret
        return held_by

    leases = QueueRepo(scheduler.store).lease(
        name, owner, request.lease_seconds, request.limit, tenant_id=caller.tenant.tenant_id
    )
    record_presence(scheduler.store, *api_worker(caller, name), request.lease_seconds)
    return {"items": [_lease_out(lease, keys[lease.owner]) for lease in leases]}


@_post(
    "/leases/{lease_id}/heartbeat",
    HeartbeatOut,
    "Extend a lease",
    body=HeartbeatRequest,
    body_required=False,
)
def heartbeat(
    lease_id: LeasePath, scheduler: SchedulerDep, caller: CallerDep, body: OptionalBodyDep
) -> dict[str, str]:
    """Extend the lease by `lease_seconds` from now; `cancelled` when the job was cancelled
    (stop the command, then fail the lease with cancelled=true). A 404 means the lease is
    no longer the caller's: stop the command, another worker has the run."""
    request = _parse(HeartbeatRequest, body)
    lease = _held(scheduler, caller, lease_id)
    record_presence(scheduler.store, *api_worker(caller, lease.queue), request.lease_seconds)
    beat = QueueRepo(scheduler.store).beat(lease, request.lease_seconds, request.output_tail)
    if beat is Beat.lost:
        raise _lost()
    return {"status": beat.value}


@_post(
    "/leases/{lease_id}/ack", SettledOut, "The run succeeded", body=AckRequest, body_required=True
)
def ack(
    lease_id: LeasePath, scheduler: SchedulerDep, caller: CallerDep, body: BodyDep
) -> dict[str, str]:
    """Record the run as succeeded with its exit code, output tail and times; the message is
    removed from the queue."""
    request = _parse(AckRequest, body)
    _settle(scheduler, caller, lease_id, request, Finish.succeeded, None)
    return {"status": "succeeded"}


@_post(
    "/leases/{lease_id}/fail",
    SettledOut,
    "The attempt failed",
    body=FailRequest,
    body_required=True,
)
def fail(
    lease_id: LeasePath, scheduler: SchedulerDep, caller: CallerDep, body: BodyDep
) -> dict[str, str]:
    """Record the failed attempt (exit code, output tail, error, times): it is retried per
    the job's retry policy, or dead-lettered when the attempts are used up. With
    `cancelled: true` (the command was stopped because the job was cancelled) it is
    recorded as failed and neither retried nor dead-lettered."""
    request = _parse(FailRequest, body)
    finish = Finish.cancelled if request.cancelled else Finish.failed
    _settle(scheduler, caller, lease_id, request, finish, request.error)
    return {"status": "stopped" if request.cancelled else "failed"}


def _lost() -> errors.NotFound:
    """A lease the caller held but lost while the call ran."""
    return errors.NotFound("the lease expired and the run was redelivered", field="lease_id")


def _settle(
    scheduler: Scheduler,
    caller: Caller,
    lease_id: str,
    request: AckRequest,
    finish: Finish,
    error: str | None,
) -> None:
    """Settle the caller's lease `lease_id` as `request` reports, once its times are
    plausible; NotFound if the lease was lost meanwhile."""
    _check_times(request.started_at, request.finished_at)
    lease = _held(scheduler, caller, lease_id)
    report = (request.exit_code, request.output_tail, request.started_at, request.finished_at)
    if not QueueRepo(scheduler.store).settle(lease, Settlement(finish, error, *report)):
        raise _lost()


def _check_times(started_at: datetime, finished_at: datetime) -> None:
    for field, value in (("started_at", started_at), ("finished_at", finished_at)):
        try:
            year = value.astimezone(UTC).year
        except (OverflowError, ValueError):
            year = 0
        if not 2000 <= year <= 9000:
            raise errors.ValidationError("is not a plausible time", field=field)
    if finished_at < started_at:
        raise errors.ValidationError("is before started_at", field="finished_at")


# -- command alerts (a host worker's alert_command over the API) -----------------------

MAX_ALERTS_PER_CALL = 10
DEFAULT_ALERT_LEASE_SECONDS = 90


class AlertLeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit: int = Field(default=10, ge=1, le=MAX_ALERTS_PER_CALL, description="Alerts at most.")
    lease_seconds: float = Field(
        default=DEFAULT_ALERT_LEASE_SECONDS,
        ge=10,
        le=MAX_LEASE_SECONDS,
        description="The alert is due again if not finished by then.",
    )


class AlertFinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error: Storable | None = Field(
        default=None,
        max_length=MAX_ERROR_CHARS,
        description="Why the alert command failed (null: it succeeded).",
    )


class AlertLeaseOut(BaseModel):
    lease_id: str = Field(description="Finish the alert with this id.")
    job_id: str
    kind: str
    attempt: int
    body: Any = Field(description="The alert (the command's stdin).")


class AlertLeasePage(BaseModel):
    items: list[AlertLeaseOut]


class FinishedOut(BaseModel):
    status: Literal["finished"]


@_post(
    "/queues/{name:path}/alert-leases",
    AlertLeasePage,
    "Lease the command alerts of a queue's jobs (host workers)",
    body=AlertLeaseRequest,
    body_required=False,
)
def lease_alerts(
    name: QueuePath, scheduler: SchedulerDep, caller: CallerDep, body: OptionalBodyDep
) -> dict[str, Any]:
    """Up to `limit` due command alerts (`"command": true`) of the caller's jobs of queue
    `name`: the worker runs its own alert command for each (never one from the alert) and
    finishes it. An alert not finished within `lease_seconds` is due again."""
    request = _parse(AlertLeaseRequest, body)
    if not _QUEUE_NAME.fullmatch(name):
        raise errors.ValidationError("not a queue name", field="name")
    if caller.host is not None:
        caller.host.check_queue(name)
    items: list[dict[str, Any]] = []
    for _ in range(request.limit):
        # one claim per alert, each with a secret of its own: one alert's lease id never
        # settles another's
        secret = secrets.token_hex(16)
        claimed = alert_store.claim(
            scheduler.store,
            (COMMAND,),
            _owner(caller.token_id, secret),
            limit=1,
            lease_seconds=request.lease_seconds,
            destination=name,
            tenant_id=caller.tenant.tenant_id,
        )
        if not claimed:
            break
        alert = claimed[0]
        items.append(
            {
                "lease_id": f"{alert.id}.{secret}",
                "job_id": alert.job_id,
                "kind": alert.kind,
                "attempt": alert.attempt,
                "body": alert.body,
            }
        )
    return {"items": items}


@_post(
    "/alert-leases/{lease_id}/finish",
    FinishedOut,
    "An alert command ran (or failed)",
    body=AlertFinishRequest,
    body_required=False,
)
def finish_alert(
    lease_id: LeasePath, scheduler: SchedulerDep, caller: CallerDep, body: OptionalBodyDep
) -> dict[str, str]:
    """Record the alert as delivered (no `error`) or its attempt as failed: it is retried
    with a backoff and given up after its last attempt. 404: the lease is not the
    caller's (expired, finished, or another tenant's)."""
    request = _parse(AlertFinishRequest, body)
    match = _LEASE_ID.fullmatch(lease_id)
    alert = None
    owner = ""
    if match is not None:
        owner = _owner(caller.token_id, match.group(2))
        alert = alert_store.held_alert(
            scheduler.store, int(match.group(1)), owner, caller.tenant.tenant_id
        )
    if alert is None:
        raise errors.NotFound(
            "no such alert lease held by this token: it expired, was finished, or is not "
            "this tenant's",
            field="lease_id",
        )
    alert_store.finish(scheduler.store, owner, alert, request.error)
    return {"status": "finished"}
