"""Frozen value types shared by the library, CLI and daemons: jobs, runs, targets, policies,
the run key, and the delivery verdicts and lanes that storage records and delivery decides."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from schedctl.domain.runpolicy import DEFAULT_RUN_POLICY, RunPolicy
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import Schedule
from schedctl.scheduling.timeparse import format_instant

if TYPE_CHECKING:
    from schedctl.core.errors import SchedError
    from schedctl.domain.alerts.model import AlertConfig


class JobStatus(enum.StrEnum):
    active = "active"
    paused = "paused"
    cancelled = "cancelled"
    completed = "completed"
    deleted = "deleted"  # stopped like cancelled, out of the lists and lookups (issue 10)


class RunStatus(enum.StrEnum):
    dispatched = "dispatched"  # claimed; on its way to the target
    running = "running"  # a worker holds it
    succeeded = "succeeded"
    failed = "failed"  # the last attempt failed; another is scheduled
    lost = "lost"  # a worker's lease expired; redelivered per the retry policy
    skipped = "skipped"  # missed under the skip / run_once misfire policies
    dead = "dead"  # retries exhausted; in the dead-letter store


class RunTrigger(enum.StrEnum):
    schedule = "schedule"
    manual = "manual"
    upstream = "upstream"  # created by its upstream jobs' success (`after`)
    boot = "boot"  # an @reboot job's run, recorded by its host's worker once it ended


class TargetType(enum.StrEnum):
    """A job's target kind (queue, http), and the outbox's delivery kinds: rabbitmq is a
    queue target of a tenant with a broker, as the relay routes it; never a job's own."""

    queue = "queue"
    http = "http"
    rabbitmq = "rabbitmq"


# A built-in queue named `every:HOST` carries an every-host job file's runs for one host: a run
# reaches it only while a worker of that queue is live (storage/pipeline/queue.py
# move_outbox), so an every-host job runs once on each live host, and a host that is down
# gets no backlog.
EVERY_HOST_QUEUE_PREFIX = "every:"


def run_key(job_id: str, scheduled_at: datetime) -> str:
    """A run's idempotency key, `JOB_ID:SCHEDULED_AT` (RFC 3339 UTC with Z): what every
    target receives, the same for every attempt."""
    return f"{job_id}:{format_instant(scheduled_at)}"


class Verdict(enum.StrEnum):
    """What one delivery attempt came to; delivery decides it, settling records it."""

    succeeded = "succeeded"
    retry = "retry"  # try again after a backoff (and at least retry_after)
    failed = "failed"  # permanent: no retry, straight to the dead letters


@dataclass(frozen=True)
class Lane:
    """Where one tenant's deliveries of one kind (http, rabbitmq) queue up."""

    tenant_id: str
    kind: TargetType


@dataclass(frozen=True)
class Target:
    type: TargetType
    name: str | None = None  # queue name
    url: str | None = None  # http url

    @property
    def address(self) -> str:
        return (self.name if self.type is TargetType.queue else self.url) or ""

    def to_dict(self) -> dict[str, str]:
        key = "name" if self.type is TargetType.queue else "url"
        return {"type": self.type.value, key: self.address}


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    base_delay_seconds: float = 1.0
    max_delay_seconds: float = 300.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_attempts": self.max_attempts,
            "backoff": "exponential",
            "base_delay_seconds": self.base_delay_seconds,
            "max_delay_seconds": self.max_delay_seconds,
        }


@dataclass(frozen=True)
class JobSpec:
    """A validated job definition, before it has an id."""

    name: str
    schedule: Schedule
    target: Target
    payload: Any
    retry: RetryPolicy
    misfire_policy: MisfirePolicy
    grace_seconds: int
    window_seconds: int
    max_concurrency: int
    timeout_seconds: int
    start_at: datetime | None
    end_at: datetime | None
    idempotency_key: str | None
    request_hash: str
    alerts: AlertConfig | None = None  # `"alerts": {...}`, stored in alert_settings
    after: tuple[str, ...] = ()  # upstream job ids: a dependent job (AfterSchedule)
    metrics: bool = False  # per-job run counts and durations on /metrics
    run: RunPolicy = DEFAULT_RUN_POLICY  # overlap and resource limits (runpolicy.py)


@dataclass(frozen=True)
class Job:
    job_id: str
    tenant_id: str
    name: str
    schedule: Schedule
    target: Target
    payload: Any
    retry: RetryPolicy
    misfire_policy: MisfirePolicy
    grace_seconds: int
    window_seconds: int
    max_concurrency: int
    timeout_seconds: int
    start_at: datetime | None
    end_at: datetime | None
    status: JobStatus
    next_run_at: datetime | None
    next_fire_at: datetime | None
    partition: int
    version: int
    idempotency_key: str | None
    created_at: datetime
    updated_at: datetime
    metrics: bool = False  # per-job run counts and durations on /metrics
    run: RunPolicy = DEFAULT_RUN_POLICY  # overlap and resource limits (runpolicy.py)


@dataclass(frozen=True)
class CreateOutcome:
    """One job of a batch create: the job and whether this call created it (else an
    idempotent replay), or the error that refused it."""

    job: Job | None = None
    created: bool = False
    error: SchedError | None = None


@dataclass(frozen=True)
class Run:
    job_id: str
    scheduled_at: datetime
    tenant_id: str
    trigger: RunTrigger
    status: RunStatus
    attempt: int
    fire_at: datetime | None
    dispatched_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    error: str | None
    output_tail: str | None
    epoch: int | None


@dataclass(frozen=True)
class AttemptLog:
    """One attempt of a run: recorded when finished, or running (its output so far)."""

    attempt: int
    status: str
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    error: str | None
    output: str | None


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    name: str
    max_jobs: int
    create_rate_per_minute: int
    dispatch_rate_per_second: int
    allow_list: tuple[str, ...]
    created_at: datetime


@dataclass(frozen=True)
class Page:
    """One page of a cursor-paged listing; next_cursor is None on the last page."""

    items: tuple[Any, ...]
    next_cursor: str | None
