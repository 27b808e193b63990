"""Conversions between table rows and the frozen models (and the read of one run's row,
which run_from_row converts)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.engine import RowMapping

from schedctl.domain.models import (
    Job,
    JobStatus,
    RetryPolicy,
    Run,
    RunStatus,
    RunTrigger,
    Target,
    TargetType,
    Tenant,
)
from schedctl.domain.runpolicy import run_policy_from
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import schedule_from_dict
from schedctl.storage.db import schema
from schedctl.storage.jobs.payloads import decode_payload


def as_stored(row: Mapping[Any, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The columns `names` of `row`, for a model that keeps them as stored, under the same
    names (the fields that need a conversion are given next to them)."""
    return {name: row[name] for name in names}


# the jobs columns a Job keeps as stored
JOB_AS_STORED = (
    "job_id",
    "tenant_id",
    "name",
    "grace_seconds",
    "window_seconds",
    "max_concurrency",
    "timeout_seconds",
    "start_at",
    "end_at",
    "next_run_at",
    "next_fire_at",
    "partition",
    "version",
    "idempotency_key",
    "created_at",
    "updated_at",
)
# the runs columns a Run keeps as stored
_RUN_AS_STORED = (
    "job_id",
    "scheduled_at",
    "tenant_id",
    "attempt",
    "fire_at",
    "dispatched_at",
    "started_at",
    "finished_at",
    "exit_code",
    "error",
    "output_tail",
    "epoch",
)

# the tenants columns a Tenant keeps as stored
_TENANT_AS_STORED = (
    "tenant_id",
    "name",
    "max_jobs",
    "create_rate_per_minute",
    "dispatch_rate_per_second",
    "created_at",
)


def target_from_row(target_type: str, address: str) -> Target:
    kind = TargetType(target_type)
    return Target(kind, name=address) if kind is TargetType.queue else Target(kind, url=address)


def job_from_row(row: Mapping[Any, Any]) -> Job:
    return Job(
        schedule=schedule_from_dict(json.loads(row["schedule"])),
        target=target_from_row(row["target_type"], row["target"]),
        payload=decode_payload(row["payload"]),
        retry=RetryPolicy(
            max_attempts=row["max_attempts"],
            base_delay_seconds=row["retry_base_seconds"],
            max_delay_seconds=row["retry_max_seconds"],
        ),
        misfire_policy=MisfirePolicy(row["misfire_policy"]),
        status=JobStatus(row["status"]),
        # a select of named columns may leave it out: false is what a job without it is
        metrics=bool(row.get("metrics", False)),
        run=run_policy_from(row),
        **as_stored(row, JOB_AS_STORED),
    )


def run_query(job_id: str, scheduled_at: datetime) -> Select[Any]:
    """The select of one run's row by its key (the job and the run's nominal time)."""
    runs = schema.runs
    return select(runs).where(runs.c.job_id == job_id, runs.c.scheduled_at == scheduled_at)


def run_from_row(row: RowMapping) -> Run:
    return Run(
        trigger=RunTrigger(row["trigger"]),
        status=RunStatus(row["status"]),
        **as_stored(row, _RUN_AS_STORED),
    )


def tenant_from_row(row: RowMapping) -> Tenant:
    allow: Any = json.loads(row["allow_list"])
    return Tenant(allow_list=tuple(str(a) for a in allow), **as_stored(row, _TENANT_AS_STORED))
