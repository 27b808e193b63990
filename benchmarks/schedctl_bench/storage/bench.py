"""Owns the benchmarks' direct reads and writes: bulk loads that bypass the per-job API
cost, the raw counts and timings a benchmark reports, and removing what it made. Only
`schedctl bench` uses these; a scheduler never does."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    Table,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    select,
    text,
    update,
)

from schedctl.scheduling.schedules import OnceSchedule, schedule_to_dict
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import new_job_id
from schedctl.storage.jobs.quotas import forget_quota_use
from schedctl.storage.pipeline.once_rows import once_job_row

# rows per INSERT statement of a bulk load
CHUNK = 2000


def insert_jobs(store: Store, rows: Sequence[Mapping[str, Any]]) -> None:
    """Job rows as they are, in one transaction."""
    with store.tx() as connection:
        for start in range(0, len(rows), CHUNK):
            connection.execute(schema.jobs.insert(), list(rows[start : start + CHUNK]))
        for tenant_id in sorted({str(row["tenant_id"]) for row in rows}):
            forget_quota_use(connection, tenant_id)  # written without a create


def insert_claimed(
    store: Store,
    job_id: str,
    tenant_id: str,
    target: tuple[str, str],
    times: Sequence[datetime],
    *,
    now: datetime,
    job: Mapping[str, Any] | None = None,
) -> None:
    """Runs of `job_id` at `times` as a claim at `now` leaves them (run and outbox rows,
    dispatched, attempt 1, due now) for `target` (its type and address), and the `job` row
    first when given, in one transaction."""
    claims = [_claimed_run(job_id, tenant_id, at, 0, "manual", target, now) for at in times]
    with store.tx() as connection:
        if job is not None:
            connection.execute(schema.jobs.insert().values(**job))
            forget_quota_use(connection, tenant_id)  # written without a create
        _insert_claims(connection, claims)


def set_tenant_columns(store: Store, tenant_id: str, values: Mapping[str, Any]) -> None:
    """Overwrite tenant columns directly (a benchmark's unpaced tenant), no audit entry."""
    with store.tx() as connection:
        connection.execute(
            update(schema.tenants).where(schema.tenants.c.tenant_id == tenant_id).values(**values)
        )


def move_jobs_due(store: Store, tenant_id: str, due_at: datetime) -> None:
    """Every job of the tenant due (and firing) at `due_at`; a one-time job's stored time
    becomes `due_at` too, so its claim completes it as a real one-time job's would (not
    advances it to the time it was loaded with)."""
    jobs = schema.jobs
    once_at_due = json.dumps(schedule_to_dict(OnceSchedule(due_at)))  # as jobs store it
    with store.tx() as connection:
        connection.execute(
            update(jobs)
            .where(jobs.c.tenant_id == tenant_id)
            .values(
                next_run_at=due_at,
                next_fire_at=due_at,
                schedule=case(
                    (jobs.c.schedule.like('{"kind": "once"%'), once_at_due),
                    else_=jobs.c.schedule,
                ),
            )
        )


def tenant_name(store: Store, tenant_id: str) -> str:
    with store.read() as connection:
        return str(
            connection.execute(
                select(schema.tenants.c.name).where(schema.tenants.c.tenant_id == tenant_id)
            ).scalar_one()
        )


def count_runs(store: Store, tenant_id: str, *, status: str | None = None) -> int:
    """The tenant's runs (claimed ones), or only those in `status`."""
    runs = schema.runs
    query = select(func.count()).select_from(runs).where(runs.c.tenant_id == tenant_id)
    if status is not None:
        query = query.where(runs.c.status == status)
    with store.read() as connection:
        return int(connection.execute(query).scalar_one())


def claim_times(store: Store, tenant_id: str) -> list[tuple[datetime | None, datetime | None]]:
    """(fire_at, dispatched_at) of every run of the tenant."""
    runs = schema.runs
    with store.read() as connection:
        rows = connection.execute(
            select(runs.c.fire_at, runs.c.dispatched_at).where(runs.c.tenant_id == tenant_id)
        ).all()
    return [(f, d) for f, d in rows]


def start_times(store: Store, tenant_id: str) -> list[tuple[datetime, datetime]]:
    """(scheduled_at, started_at) of every started run of the tenant."""
    runs = schema.runs
    with store.read() as connection:
        rows = connection.execute(
            select(runs.c.scheduled_at, runs.c.started_at).where(
                runs.c.tenant_id == tenant_id, runs.c.started_at.is_not(None)
            )
        ).all()
    return [(at, started) for at, started in rows]


def succeeded_attempts(
    store: Store, tenant_id: str
) -> list[tuple[str | None, datetime, datetime | None]]:
    """(worker, scheduled_at, started_at) of every succeeded attempt of the tenant's runs."""
    a, r = schema.run_attempts, schema.runs
    with store.read() as connection:
        rows = connection.execute(
            select(a.c.worker, r.c.scheduled_at, a.c.started_at)
            .select_from(
                a.join(r, and_(a.c.job_id == r.c.job_id, a.c.scheduled_at == r.c.scheduled_at))
            )
            .where(r.c.tenant_id == tenant_id, a.c.status == "succeeded")
        ).all()
    return [(w, at, started) for w, at, started in rows]


def last_dispatched(store: Store, tenant_id: str) -> datetime | None:
    runs = schema.runs
    with store.read() as connection:
        value = connection.execute(
            select(func.max(runs.c.dispatched_at)).where(runs.c.tenant_id == tenant_id)
        ).scalar_one()
    return value if isinstance(value, datetime) else None


def partition_owners(store: Store) -> dict[int, tuple[str | None, int]]:
    """partition -> (owner, epoch)."""
    p = schema.partitions
    with store.read() as connection:
        rows = connection.execute(select(p.c.partition, p.c.owner, p.c.epoch)).all()
    return {int(partition): (owner, int(epoch)) for partition, owner, epoch in rows}


def outbox_left(store: Store, job_id: str) -> int:
    outbox = schema.outbox
    with store.read() as connection:
        return int(
            connection.execute(
                select(func.count()).select_from(outbox).where(outbox.c.job_id == job_id)
            ).scalar_one()
        )


def outbox_holds(store: Store, job_id: str) -> bool:
    """Whether any of the job's runs is still in the outbox: a look at one row, where a
    count would read them all (the bench polls this while the relay it measures runs, on
    the same cores)."""
    return _has_job_rows(store, schema.outbox, job_id)


def any_attempt(store: Store, job_id: str) -> bool:
    """Whether any run of the job has a recorded attempt (one index probe)."""
    return _has_job_rows(store, schema.run_attempts, job_id)


def _has_job_rows(store: Store, table: Table, job_id: str) -> bool:
    with store.read() as connection:
        return bool(
            connection.execute(select(exists().where(table.c.job_id == job_id))).scalar_one()
        )


def database_settings(store: Store) -> str:
    """The durability settings a figure was measured under."""
    if store.dialect.embedded:
        return "sqlite (WAL, synchronous=NORMAL)"
    with store.read() as connection:
        fsync = connection.execute(text("SHOW fsync")).scalar_one()
        sync = connection.execute(text("SHOW synchronous_commit")).scalar_one()
    return f"postgres (fsync={fsync}, synchronous_commit={sync})"


@dataclass(frozen=True)
class ServerSessions:
    """A database server's view of its client sessions: the process serving this
    connection, the address the server answered on (None: a Unix socket), and each client
    session's server process id with its application_name."""

    own_pid: int
    server_address: str | None
    sessions: dict[int, str]


def _server_sessions(store: Store) -> ServerSessions | None:
    """The server's client sessions (Postgres); None for a file of this machine (SQLite)."""
    if store.dialect.embedded:
        return None
    with store.read() as connection:
        own_pid, address = connection.exec_driver_sql(
            "SELECT pg_backend_pid(), host(inet_server_addr())"
        ).one()
        rows = connection.exec_driver_sql(
            "SELECT pid, application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND backend_type = 'client backend'"
        ).all()
    return ServerSessions(int(own_pid), address, {int(pid): str(name or "") for pid, name in rows})


def local_backends(store: Store) -> dict[int, str] | None:
    """The database's client sessions as {server process id: application_name}, when its
    server runs on this machine (its processes are this machine's); None otherwise."""
    seen = _server_sessions(store)
    if seen is None or seen.server_address not in (None, "127.0.0.1", "::1"):
        return None
    try:
        with open(f"/proc/{seen.own_pid}/cmdline", "rb") as cmdline:
            if not cmdline.read().startswith(b"postgres"):
                return None  # another machine's process numbers
    except OSError:
        return None
    return seen.sessions


def delete_queue_messages(store: Store, queue: str) -> None:
    with store.tx() as connection:
        connection.execute(
            delete(schema.queue_messages).where(schema.queue_messages.c.queue == queue)
        )


def delete_tenant(store: Store, tenant_id: str) -> None:
    """A benchmark tenant and everything it made: jobs, their runs and attempts, outbox rows,
    queue messages, dead letters, workers, tokens, audit rows."""
    a, j = schema.run_attempts, schema.jobs
    with store.tx() as connection:
        # attempts are keyed by run, not tenant: those of the tenant's jobs
        connection.execute(
            delete(a).where(a.c.job_id.in_(select(j.c.job_id).where(j.c.tenant_id == tenant_id)))
        )
        for table in (
            schema.alerts,
            schema.alert_settings,
            schema.job_dependencies,
            schema.dead_letters,
            schema.workers,
            schema.outbox,
            schema.queue_messages,
            schema.runs,
            schema.jobs,
            schema.api_tokens,
            schema.audit_log,
            schema.tenants,
        ):
            connection.execute(delete(table).where(table.c.tenant_id == tenant_id))


def attempt_seconds(store: Store, job_id: str) -> list[float]:
    """How long each recorded attempt of the job's runs took (started to finished)."""
    attempts = schema.run_attempts
    with store.read() as connection:
        rows = connection.execute(
            select(attempts.c.started_at, attempts.c.finished_at).where(attempts.c.job_id == job_id)
        ).all()
    return [
        (finished - started).total_seconds()
        for started, finished in rows
        if started is not None and finished is not None
    ]


def run_statuses(store: Store, job_id: str) -> dict[str, int]:
    """The job's runs counted by status."""
    runs = schema.runs
    with store.read() as connection:
        rows = connection.execute(
            select(runs.c.status, func.count())
            .where(runs.c.job_id == job_id)
            .group_by(runs.c.status)
        ).all()
    return {str(status): int(count) for status, count in rows}


def run_stages(
    store: Store, tenant_id: str
) -> list[tuple[str, datetime, datetime | None, datetime | None, datetime | None]]:
    """(run key's job_id, scheduled_at, dispatched_at, started_at, finished_at) of every run
    of the tenant: the run history a whole-path benchmark measures."""
    r = schema.runs
    with store.read() as connection:
        rows = connection.execute(
            select(
                r.c.job_id, r.c.scheduled_at, r.c.dispatched_at, r.c.started_at, r.c.finished_at
            ).where(r.c.tenant_id == tenant_id)
        ).all()
    return [(j, at, d, s, f) for j, at, d, s, f in rows]


def extra_executions(store: Store, tenant_id: str) -> int:
    """Attempts of the tenant's runs beyond the first that ran to success: a run executed
    more than once."""
    a, r = schema.run_attempts, schema.runs
    per_run = (
        select(func.count().label("n"))
        .select_from(
            a.join(r, and_(a.c.job_id == r.c.job_id, a.c.scheduled_at == r.c.scheduled_at))
        )
        .where(r.c.tenant_id == tenant_id, a.c.status == "succeeded")
        .group_by(a.c.job_id, a.c.scheduled_at)
        .subquery()
    )
    with store.read() as connection:
        value = connection.execute(
            select(func.coalesce(func.sum(per_run.c.n - 1), 0)).where(per_run.c.n > 1)
        ).scalar_one()
    return int(value)


def queued_since(
    store: Store, tenant_id: str, after_id: int, limit: int
) -> list[tuple[int, str, datetime]]:
    """(id, job_id, scheduled_at) of the tenant's queue messages with an id above
    `after_id`, in id order: the runs in the built-in queue now."""
    m = schema.queue_messages
    with store.read() as connection:
        rows = connection.execute(
            select(m.c.id, m.c.job_id, m.c.scheduled_at)
            .where(m.c.tenant_id == tenant_id, m.c.id > after_id)
            .order_by(m.c.id)
            .limit(limit)
        ).all()
    return [(int(i), j, at) for i, j, at in rows]


def jobs_of(store: Store, tenant_id: str) -> list[str]:
    """The tenant's job ids, in id order."""
    j = schema.jobs
    with store.read() as connection:
        rows = connection.execute(
            select(j.c.job_id).where(j.c.tenant_id == tenant_id).order_by(j.c.job_id)
        ).all()
    return [job_id for (job_id,) in rows]


def set_jobs_due(store: Store, due: Sequence[tuple[str, datetime]]) -> None:
    """Each job (id) due and firing at its own instant, in one transaction."""
    with store.tx() as connection:
        if store.dialect.embedded:
            _set_jobs_due_each(connection, due)
        else:
            _set_jobs_due_arrays(connection, due)


def _set_jobs_due_arrays(connection: Connection, due: Sequence[tuple[str, datetime]]) -> None:
    # Postgres: one UPDATE from arrays per 40,000 (an executemany of single-row updates is
    # a round trip each)
    for start in range(0, len(due), 40_000):
        chunk = due[start : start + 40_000]
        connection.execute(
            text(
                "UPDATE jobs SET next_run_at = d.at, next_fire_at = d.at"
                " FROM unnest(CAST(:ids AS text[]), CAST(:ats AS timestamptz[]))"
                " AS d(job_id, at) WHERE jobs.job_id = d.job_id"
            ),
            {"ids": [job_id for job_id, _ in chunk], "ats": [at for _, at in chunk]},
        )


def _set_jobs_due_each(connection: Connection, due: Sequence[tuple[str, datetime]]) -> None:
    # SQLite: an executemany in process, 2,000 rows a call
    j = schema.jobs
    statement = (
        update(j)
        .where(j.c.job_id == bindparam("b_job_id"))
        .values(next_run_at=bindparam("b_at"), next_fire_at=bindparam("b_at"))
    )
    for start in range(0, len(due), 2000):
        connection.execute(
            statement,
            [{"b_job_id": job_id, "b_at": at} for job_id, at in due[start : start + 2000]],
        )


def insert_claimed_once_jobs(
    store: Store, tenant_id: str, target: tuple[str, str], count: int, *, now: datetime
) -> None:
    """`count` one-time jobs of `target` (its type and address), each with its run as a
    claim leaves it (run and outbox row, dispatched, attempt 1, due now), in one
    transaction: a backlog of many jobs' runs, one each, ready to be relayed."""
    jobs = [
        once_job_row(
            new_job_id(),
            tenant_id,
            now,
            target=target,
            name="bench",
            partitions=store.partition_count,
            now=now,
            request_hash="bench",
            claimed=True,
        )
        for _ in range(count)
    ]
    claims = [
        _claimed_run(job["job_id"], tenant_id, now, job["partition"], "schedule", target, now)
        for job in jobs
    ]
    with store.tx() as connection:
        for start in range(0, count, CHUNK):
            connection.execute(schema.jobs.insert(), jobs[start : start + CHUNK])
        _insert_claims(connection, claims)


def _claimed_run(
    job_id: str,
    tenant_id: str,
    at: datetime,
    partition: int,
    trigger: str,
    target: tuple[str, str],
    now: datetime,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run of `job_id` at `at` and its outbox row as a claim at `now` leaves them
    (dispatched, attempt 1, available now) for `target` (its type and address)."""
    target_type, address = target
    run = {
        "job_id": job_id,
        "scheduled_at": at,
        "tenant_id": tenant_id,
        "partition": partition,
        "trigger": trigger,
        "status": "dispatched",
        "attempt": 1,
        "fire_at": at,
        "dispatched_at": now,
    }
    outbox = {
        "job_id": job_id,
        "scheduled_at": at,
        "tenant_id": tenant_id,
        "target_type": target_type,
        "target": address,
        "attempt": 1,
        "available_at": now,
        "created_at": now,
    }
    return run, outbox


def _insert_claims(
    connection: Connection, claims: Sequence[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    """Run and outbox rows as _claimed_run makes them, CHUNK of each to a statement."""
    for start in range(0, len(claims), CHUNK):
        part = claims[start : start + CHUNK]
        connection.execute(schema.runs.insert(), [run for run, _ in part])
        connection.execute(schema.outbox.insert(), [outbox for _, outbox in part])
