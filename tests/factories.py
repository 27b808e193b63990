"""Test data: tenants and jobs written straight through the repositories, and bulk loads."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, update

from schedctl.domain.models import JobSpec, RetryPolicy, Target, TargetType
from schedctl.domain.runpolicy import DEFAULT_RUN_POLICY, RunPolicy
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import IntervalSchedule, OnceSchedule, Schedule
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl_bench.storage.bulk import insert_once_jobs


def make_tenant(store: Store, name: str = "acme") -> str:
    tenant_id = f"tenant-{name}"
    with store.tx() as connection:
        insert_tenant_row(connection, tenant_id, name, created_at=datetime.now(UTC))
    return tenant_id


def set_tenant(store: Store, tenant_id: str, **values: Any) -> None:
    """Write tenant columns straight to the row: also values past what the API accepts."""
    with store.tx() as connection:
        connection.execute(
            update(schema.tenants).where(schema.tenants.c.tenant_id == tenant_id).values(**values)
        )


# -- raw rows: only the columns of the first revision, so migration tests can write them at
# any revision (the repositories write the newest schema's)


def insert_tenant_row(
    connection: Connection,
    tenant_id: str,
    name: str,
    *,
    created_at: datetime,
    quota: int = 1_000_000,
    signing_secret: str = "secret",
) -> None:
    connection.execute(
        schema.tenants.insert().values(
            tenant_id=tenant_id,
            name=name,
            signing_secret=signing_secret,
            max_jobs=quota,
            create_rate_per_minute=quota,
            dispatch_rate_per_second=quota,
            allow_list="[]",
            created_at=created_at,
        )
    )


def insert_cron_job_row(
    connection: Connection,
    job_id: str,
    tenant_id: str,
    *,
    queue: str,
    at: datetime,
    name: str = "nightly",
    status: str = "active",
) -> None:
    """A nightly (02:00 UTC) job `name` of `tenant_id` on `queue`, due at `at`."""
    connection.execute(
        schema.jobs.insert().values(
            job_id=job_id,
            tenant_id=tenant_id,
            name=name,
            schedule=json.dumps({"kind": "cron", "cron": "0 2 * * *", "timezone": "UTC"}),
            target_type="queue",
            target=queue,
            payload="{}",
            max_attempts=3,
            retry_base_seconds=1.0,
            retry_max_seconds=60.0,
            misfire_policy="run_once",
            grace_seconds=60,
            window_seconds=0,
            max_concurrency=1,
            timeout_seconds=0,
            status=status,
            next_run_at=at,
            next_fire_at=at,
            partition=7,
            version=1,
            request_hash="h",
            created_at=at,
            updated_at=at,
        )
    )


def insert_queue_message_row(
    connection: Connection, job_id: str, tenant_id: str, *, queue: str, at: datetime
) -> None:
    """The first attempt of `job_id`'s run at `at` on `queue`, available and written at `at`."""
    connection.execute(
        schema.queue_messages.insert().values(
            queue=queue,
            job_id=job_id,
            scheduled_at=at,
            tenant_id=tenant_id,
            attempt=1,
            available_at=at,
            created_at=at,
        )
    )


def spec(
    schedule: Schedule,
    *,
    queue: str = "q",
    misfire: MisfirePolicy = MisfirePolicy.run_once,
    grace: int = 60,
    window: int = 0,
    max_attempts: int = 3,
    max_concurrency: int = 1,
    timeout: int = 0,
    payload: Any = None,
    name: str = "job",
    end_at: datetime | None = None,
    run: RunPolicy = DEFAULT_RUN_POLICY,
) -> JobSpec:
    return JobSpec(
        name=name,
        schedule=schedule,
        target=Target(TargetType.queue, name=queue),
        payload={} if payload is None else payload,
        retry=RetryPolicy(max_attempts=max_attempts, base_delay_seconds=0.1, max_delay_seconds=1),
        misfire_policy=misfire,
        grace_seconds=grace,
        window_seconds=window,
        max_concurrency=max_concurrency,
        timeout_seconds=timeout,
        start_at=None,
        end_at=end_at,
        idempotency_key=None,
        request_hash=hashlib.sha256(name.encode()).hexdigest(),
        run=run,
    )


def create_job(store: Store, tenant_id: str, job_spec: JobSpec) -> str:
    # names are unique per tenant: the default name gets the id's suffix, as with no name
    auto = job_spec.name == "job"
    job, _ = JobRepo(store).create(tenant_id, job_spec, actor="test", auto_name=auto)
    return job.job_id


def once_at(at: datetime, **kwargs: Any) -> JobSpec:
    return spec(OnceSchedule(run_at=at), **kwargs)


def every(seconds: int, anchor: datetime, **kwargs: Any) -> JobSpec:
    return spec(IntervalSchedule(every_seconds=seconds, anchor=anchor), **kwargs)


def bulk_once_jobs(
    store: Store, tenant_id: str, times: list[datetime], *, queue: str = "q"
) -> list[str]:
    """Insert many one-time jobs in few statements (for index and batch tests)."""
    return insert_once_jobs(store, tenant_id, times, queue=queue)


def move_next_run(store: Store, job_id: str, at: datetime) -> None:
    """Set the job's next run and fire time to `at`: how a test makes a job due (or missed)."""
    with store.tx() as connection:
        connection.execute(
            schema.jobs.update()
            .where(schema.jobs.c.job_id == job_id)
            .values(next_run_at=at, next_fire_at=at)
        )


def ago(seconds: float) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)


def ahead(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)
