"""Owns job update and delete in the database: a validated JobPatch applied in one
version-conditional transaction (with the next run recomputed and the payload of runs
already claimed kept), and delete (the job stops like a cancelled one and leaves the lists).

Why the version matters: a dispatcher claims a due run with the version it read, so once an
update or delete commits, a claim made from an older read matches nothing. A run claimed
before the update keeps the target copied into its outbox row at claim time; its payload
is read at delivery, so an update that changes the payload first copies the old stored
payload into that run's outbox row or queue message: every run is delivered entirely under
the old definition or entirely under the new one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from schedctl.core import errors
from schedctl.domain.jobpatch import JobPatch
from schedctl.domain.models import Job, JobStatus
from schedctl.scheduling.schedules import AfterSchedule, schedule_to_dict
from schedctl.scheduling.windows import fire_time
from schedctl.storage.backend.dialect import Lock, dialect_of
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store
from schedctl.storage.jobs import job_lookup
from schedctl.storage.jobs.job_create import count_metrics_jobs, metrics_bound_error
from schedctl.storage.jobs.jobs import JobRepo, reschedule_values, write_job
from schedctl.storage.jobs.payloads import encode_payload
from schedctl.storage.pipeline import dependencies

UPDATABLE = frozenset({JobStatus.active, JobStatus.paused, JobStatus.completed})


def update_job(
    store: Store,
    job_id: str,
    parse: Callable[[Job, datetime], JobPatch],
    tenant_id: str | None,
    *,
    if_version: int | None,
    actor: str,
    metrics_max_jobs: int | None = None,
) -> Job:
    """Apply the patch `parse` makes of the locked job at the database's now (so merged
    values, like a retry policy or a cron expression kept under a new zone, come from the
    version being replaced); Conflict if the job is not at `if_version` (when given) or
    cannot change (cancelled). The audit entry names the changed fields, never the payload."""
    repo = JobRepo(store)
    with store.tx() as connection:
        job = _live(repo, connection, job_id, tenant_id, if_version)
        now = db_now(connection)
        patch = parse(job, now)
        if job.status not in UPDATABLE:
            raise errors.Conflict(
                f"cannot update job {job_id}: it is {job.status.value}", field="status"
            )
        changes = _values(job, patch, now)
        if patch.name is not None:
            # a clear error first; the unique index is the final word (see write_job)
            job_lookup.check_name_free(
                connection, job.tenant_id, patch.name, except_job_id=job.job_id
            )
        if patch.after is not None:
            # resolved and cycle-checked again here, so a concurrent update cannot slip in
            dependencies.replace(connection, job.job_id, job.tenant_id, patch.after)
        if patch.has_payload:
            _keep_claimed_payloads(connection, job_id)
        if patch.metrics and not job.metrics and metrics_max_jobs is not None:
            _check_metrics_bound(connection, job.tenant_id, metrics_max_jobs)
        detail: dict[str, Any] = {"fields": list(patch.fields)}
        # a schedule-only change is the reschedule it always was, in the audit log too
        action = "reschedule" if patch.fields == ("schedule",) else "update"
        if patch.schedule is not None:
            detail["schedule"] = schedule_to_dict(patch.schedule)
        write_job(connection, job, changes, now, actor=actor, action=action, detail=detail)
        return repo._get(connection, job_id, tenant_id)


def delete_job(
    store: Store,
    job_id: str,
    tenant_id: str | None,
    *,
    if_version: int | None,
    actor: str,
) -> Job:
    """Delete: no run is claimed after this commits, runs waiting for delivery are skipped
    as for a cancel, and the job answers NotFound from then on (its run history stays)."""
    repo = JobRepo(store)
    with store.tx() as connection:
        job = _live(repo, connection, job_id, tenant_id, if_version)
        now = db_now(connection)
        changes = {"status": JobStatus.deleted.value, "next_run_at": None, "next_fire_at": None}
        write_job(connection, job, changes, now, actor=actor, action="delete")
        return repo._get(connection, job_id, tenant_id)


def _live(
    repo: JobRepo,
    connection: Connection,
    job_id: str,
    tenant_id: str | None,
    if_version: int | None,
) -> Job:
    job = repo._get(connection, job_id, tenant_id, lock=True)
    if job.status is JobStatus.deleted:
        raise errors.NotFound(f"no job {job_id!r}", field="job_id")
    if if_version is not None and job.version != if_version:
        raise errors.Conflict(
            f"job {job_id} is at version {job.version}, not {if_version}: it changed since "
            "it was read; read it again",
            field="version",
        )
    return job


def _values(job: Job, patch: JobPatch, now: datetime) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if patch.name is not None:
        values["name"] = patch.name
    if patch.target is not None:
        values["target_type"] = patch.target.type.value
        values["target"] = patch.target.address
    if patch.has_payload:
        values["payload"] = encode_payload(patch.payload)
    if patch.retry is not None:
        values["max_attempts"] = patch.retry.max_attempts
        values["retry_base_seconds"] = patch.retry.base_delay_seconds
        values["retry_max_seconds"] = patch.retry.max_delay_seconds
    if patch.misfire_policy is not None:
        values["misfire_policy"] = patch.misfire_policy.value
    for key in (
        "grace_seconds",
        "window_seconds",
        "max_concurrency",
        "timeout_seconds",
        "metrics",
    ):
        value = getattr(patch, key)
        if value is not None:
            values[key] = value
    if patch.run is not None:
        values.update(patch.run.columns())
    window = patch.window_seconds if patch.window_seconds is not None else job.window_seconds
    if patch.after is not None:
        values.update(_after_values(job))
    elif patch.schedule is not None:
        values.update(reschedule_values(job, patch.schedule, window, now))
    elif patch.window_seconds is not None and job.next_fire_at is not None:
        # the fire time is the next run spread over the window: a new window moves it
        assert job.next_run_at is not None
        values["next_fire_at"] = fire_time(job.job_id, job.next_run_at, window)
    return values


def _check_metrics_bound(connection: Connection, tenant_id: str, bound: int) -> None:
    """Refuse (naming `metrics`) one more job with metrics = true over the bound. The
    tenant's row lock serializes this with the tenant's creates and other such updates."""
    t = schema.tenants
    # as a create's quota take: FOR NO KEY UPDATE (other writers' key checks pass)
    dialect_of(connection).lock_rows(
        connection, select(t.c.tenant_id).where(t.c.tenant_id == tenant_id), Lock.no_key_update
    )
    refused = metrics_bound_error(count_metrics_jobs(connection, tenant_id), bound)
    if refused is not None:
        raise refused


def _after_values(job: Job) -> dict[str, Any]:
    """A job given `after` becomes (or stays) a dependent job: no time of its own; its
    runs come from its upstream jobs' successes."""
    status = JobStatus.paused if job.status is JobStatus.paused else JobStatus.active
    return {
        "schedule": json.dumps(schedule_to_dict(AfterSchedule())),
        "status": status.value,
        "next_run_at": None,
        "next_fire_at": None,
    }


def _keep_claimed_payloads(connection: Connection, job_id: str) -> None:
    """Copy the current stored payload into the job's claimed, undelivered runs that have
    no copy yet (a run keeps the first definition it was claimed under)."""
    stored = connection.execute(
        select(schema.jobs.c.payload).where(schema.jobs.c.job_id == job_id)
    ).scalar_one()
    for table in (schema.outbox, schema.queue_messages):
        connection.execute(
            update(table)
            .where(table.c.job_id == job_id, table.c.payload.is_(None))
            .values(payload=stored)
        )
