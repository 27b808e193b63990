"""Owns the API's documented shapes: the response models (job_to_dict and friends fill them),
the hand-written JSON schema of the create and reschedule requests, and the OpenAPI helpers
that attach them and the error answers to a route.

Request bodies are parsed by schedctl.domain.jobspec (the CLI's parser) and only documented here:
the names and bounds come from jobspec and schedctl.core.limits, and tests/unit/test_api_schema.py
proves the two agree field by field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from schedctl.core import limits
from schedctl.domain import jobspec, runpolicy
from schedctl.domain.models import JobStatus
from schedctl.scheduling.misfire import MisfirePolicy


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


class AfterScheduleOut(BaseModel):
    """A dependent job (`after`): no time of its own."""

    kind: Literal["after"]


class BootScheduleOut(BaseModel):
    """An @reboot job of a job file: run by its host's worker once per boot."""

    kind: Literal["boot"]


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
        OnceScheduleOut
        | IntervalScheduleOut
        | CronScheduleOut
        | AfterScheduleOut
        | BootScheduleOut,
        Field(discriminator="kind"),
    ]
    target: Annotated[QueueTargetOut | HttpTargetOut, Field(discriminator="type")]
    payload: Any = Field(description="The job's JSON payload, as submitted.")
    retry: RetryOut
    misfire_policy: Literal["run_once", "skip", "run_all"]
    grace_seconds: int
    window_seconds: int
    max_concurrency: int | None = Field(description="null: no limit.")
    timeout_seconds: int | None
    overlap: Literal["allow", "skip", "queue", "replace"] = Field(
        description="A run due while an earlier one runs: allow, skip, queue, replace."
    )
    memory_max: int | None = Field(description="Bytes (cgroup memory.max); null: none.")
    cpu_weight: int | None = Field(description="cgroup cpu.weight 1-10000; null: none.")
    tasks_max: int | None = Field(description="Processes and threads (pids.max).")
    start_at: str | None
    end_at: str | None
    next_run_at: str | None = Field(description="Nominal UTC time of the next run.")
    next_fire_at: str | None
    partition: int
    version: int
    idempotency_key: str | None
    metrics: bool = Field(
        default=False, description="The job's run counts and durations are on /metrics."
    )
    created_at: str
    updated_at: str


class BatchItemOut(BaseModel):
    """One job of a batch: its index in the request, the status a single POST /v1/jobs
    would have answered (201 created, 200 replayed, 4xx refused), and the job or the error."""

    index: int
    status: int = Field(description="201 created, 200 an idempotent replay, 4xx refused.")
    job: JobOut | None = Field(
        default=None, description="The job (201 and 200), unless Prefer: return=minimal."
    )
    job_id: str | None = Field(
        default=None, description="With Prefer: return=minimal: the job's id (201 and 200)."
    )
    name: str | None = Field(
        default=None, description="With Prefer: return=minimal: the job's name (201 and 200)."
    )
    error: ErrorDetail | None = Field(default=None, description="Why it was refused (4xx).")
    retry_after: int | None = Field(
        default=None, description="With 429: seconds until a retry can succeed."
    )


class BatchOut(BaseModel):
    results: list[BatchItemOut] = Field(description="One per job sent, in the order sent.")


class RunOut(BaseModel):
    job_id: str
    scheduled_at: str
    idempotency_key: str = Field(description="JOB_ID:SCHEDULED_AT, what targets receive.")
    tenant_id: str
    trigger: Literal["schedule", "manual", "upstream", "boot"]
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
    host: str | None = Field(
        default=None, description="A host token's host (null: a tenant token)."
    )
    groups: list[str] = Field(default_factory=list, description="A host token's host groups.")


class Health(BaseModel):
    status: Literal["ok"]


# -- request bodies: parsed by schedctl.domain.jobspec (the CLI's parser); documented here -----

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
        {
            "type": "object",
            "required": ["boot"],
            "additionalProperties": False,
            "description": "An @reboot job of a job file: its host's worker runs it once "
            "per boot and records the run (`schedctl apply` makes it).",
            "properties": {"boot": {"const": True}},
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
                    "pattern": f"^{jobspec.QUEUE_NAME.pattern}$",
                },
            },
        },
        {
            "type": "object",
            "required": ["type", "url"],
            "additionalProperties": False,
            "properties": {
                "type": {"const": "http"},
                "url": {"type": "string", "format": "uri", "maxLength": jobspec.MAX_URL_LENGTH},
            },
        },
    ]
}


def runpolicy_schema() -> dict[str, Any]:
    """The run policy's keys (schedctl/domain/runpolicy.py) in a job body."""
    return {
        "overlap": {
            "enum": [o.value for o in runpolicy.Overlap],
            "description": (
                "A queue job's run due while an earlier run still runs: queue (default: "
                "wait for a max_concurrency slot), allow (start it anyway), skip (record it "
                "skipped), replace (stop the running one, then start it)."
            ),
        },
        "memory_max": {
            "anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}],
            "description": "Each run's memory limit: bytes or '512M', '2G' (cgroup v2).",
        },
        "cpu_weight": {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": runpolicy.MAX_CPU_WEIGHT},
                {"type": "null"},
            ],
            "description": "Each run's cgroup cpu.weight (100 is the default share).",
        },
        "tasks_max": {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": runpolicy.MAX_TASKS},
                {"type": "null"},
            ],
            "description": "Each run's limit of processes and threads (cgroup pids.max).",
        },
    }


JOB_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    # schedule, or after (a dependent job has no schedule of its own), not both
    "required": ["target"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": jobspec.MAX_NAME_LENGTH},
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
        "misfire_policy": {"enum": [policy.value for policy in MisfirePolicy]},
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
        **runpolicy_schema(),
        "start": _INSTANT,
        "end": _INSTANT,
        "idempotency_key": {
            "type": "string",
            "minLength": 1,
            "maxLength": jobspec.MAX_IDEMPOTENCY_KEY_LENGTH,
            "description": "Same as the Idempotency-Key header (which wins if both differ).",
        },
        "metrics": {
            "type": "boolean",
            "description": "Export this job's run counts and durations on /metrics "
            "(default false; at most metrics_max_jobs_per_tenant such jobs per tenant).",
        },
        "alerts": {
            "type": "object",
            "additionalProperties": False,
            "description": "Who is told when runs fail: replaces the tenant's default alerts.",
            "properties": {
                "on": {
                    "type": "array",
                    "items": {"enum": ["dead_letter", "failure"]},
                    "description": "dead_letter (default) and/or failure (every attempt).",
                },
                "webhook": {"type": "string", "description": "Signed like a delivery."},
                "email": {
                    "type": "array",
                    "maxItems": 10,
                    "items": {"type": "string"},
                },
                "command": {
                    "type": "boolean",
                    "description": "Run the queue worker host's alert_command.",
                },
                "no_success": {
                    "type": "string",
                    "description": "Alert once when no run succeeded for this long (PT26H).",
                },
            },
        },
        "after": {
            "type": "array",
            "minItems": 1,
            "maxItems": jobspec.MAX_AFTER,
            "items": {"type": "string", "minLength": 1, "maxLength": jobspec.MAX_NAME_LENGTH},
            "description": (
                "Upstream jobs (ids): run once every one of them succeeded for the same "
                "scheduled_at, with that scheduled_at. Instead of schedule."
            ),
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
BATCH_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["jobs"],
    "additionalProperties": False,
    "properties": {
        "jobs": {
            "type": "array",
            "minItems": 1,
            "maxItems": limits.MAX_BATCH_JOBS,
            "items": JOB_REQUEST_SCHEMA,
            "description": (
                f"1 to {limits.MAX_BATCH_JOBS} job bodies, each as POST /v1/jobs takes it, with "
                "its own idempotency_key; each gets its own result, in the same order."
            ),
        }
    },
}
BATCH_REQUEST_EXAMPLES: dict[str, Any] = {
    "two jobs": {
        "value": {
            "jobs": [
                {
                    "schedule": {"delay": "PT10M"},
                    "target": {"type": "queue", "name": "digest-jobs"},
                    "idempotency_key": "digest-0001",
                },
                {
                    "schedule": {"cron": "0 8 * * MON", "timezone": "Asia/Kolkata"},
                    "target": {"type": "queue", "name": "digest-jobs"},
                    "idempotency_key": "digest-0002",
                },
            ]
        }
    }
}
RESCHEDULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schedule"],
    "additionalProperties": False,
    "properties": {"schedule": _SCHEDULE},
}


def json_request_body(
    schema: dict[str, Any], examples: dict[str, Any] | None = None
) -> dict[str, Any]:
    content: dict[str, Any] = {"schema": schema}
    if examples:
        content["examples"] = examples
    return {"requestBody": {"required": True, "content": {"application/json": content}}}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {
        400: "Malformed request (not JSON, bad header)",
        401: "Missing, invalid or revoked bearer token",
        403: "A host token, outside its host's queues and jobs",
        404: "No such job (or another tenant's)",
        409: "Conflicts with the job's state, or an idempotency key reused for another body",
        413: "Request or payload too large",
        415: "The body is not application/json",
        422: "Invalid input",
        429: "Over a tenant quota",
        503: "The database is unavailable",
    }
    result: dict[int | str, dict[str, Any]] = {}
    for code in (*codes, 401, 403, 503):
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


class DependencyNode(BaseModel):
    """One job in a dependency tree (`after`), with the jobs further up or down."""

    job_id: str
    name: str | None = Field(description="null: the job row is gone.")
    status: str | None
    children: list[DependencyNode]


class DependenciesOut(BaseModel):
    upstream: list[DependencyNode] = Field(description="The jobs this job runs after.")
    downstream: list[DependencyNode] = Field(description="The jobs that run after this job.")


# PATCH /v1/jobs/{id}: any of the create body's fields but start, end and idempotency_key
# (and alerts: they have their own route, PUT /v1/jobs/{id}/alerts); a schedule with only
# a timezone keeps the job's cron expression; `after` gives a dependent job new upstreams
JOB_UPDATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": False,
    "properties": {
        **{
            key: value
            for key, value in JOB_REQUEST_SCHEMA["properties"].items()
            if key not in {"start", "end", "idempotency_key", "alerts"}
        },
        "schedule": {
            "anyOf": [
                _SCHEDULE,
                {
                    "type": "object",
                    "required": ["timezone"],
                    "additionalProperties": False,
                    "properties": {"timezone": {"type": "string", "minLength": 1}},
                },
            ]
        },
    },
}
JOB_UPDATE_EXAMPLES: dict[str, Any] = {
    "new payload and more attempts": {
        "value": {"payload": {"report": "daily"}, "retry": {"max_attempts": 5}}
    },
    "new time zone": {"value": {"schedule": {"timezone": "Europe/Paris"}}},
}
