"""Job lifecycle in the database: create (idempotent), read, list, cancel, pause, resume,
reschedule, trigger and run history; every change bumps the version and writes the audit log."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from schedctl.core import errors
from schedctl.domain.models import (
    CreateOutcome,
    Job,
    JobSpec,
    JobStatus,
    Page,
    Run,
    RunStatus,
    RunTrigger,
)
from schedctl.scheduling.schedules import (
    AfterSchedule,
    OnceSchedule,
    Schedule,
    first_occurrence,
    next_occurrence,
    schedule_to_dict,
)
from schedctl.scheduling.timeparse import format_instant
from schedctl.scheduling.windows import fire_time
from schedctl.storage.backend.dialect import OUTBOX_WORD, dialect_of
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.cursors import MAX_PAGE, check_page_limit, decode_cursor, encode_cursor
from schedctl.storage.db.rows import job_from_row, run_from_row, run_query
from schedctl.storage.db.store import Store
from schedctl.storage.jobs import job_lookup
from schedctl.storage.jobs.changes import notify_job_change
from schedctl.storage.jobs.job_create import (
    Admit,
    NewJob,
    create_jobs,
    new_job_id,
    partition_of,
)
from schedctl.storage.jobs.quotas import SLOT_HOLDERS, take_slot
from schedctl.storage.records.audit import audit

# MAX_PAGE (defined in cursors.py) is re-exported: the API takes its page bound from here
__all__ = [
    "MAX_PAGE",
    "CreateOutcome",
    "JobRepo",
    "NewJob",
    "new_job_id",
    "partition_of",
    "reschedule_values",
    "write_job",
]


def write_job(
    connection: Connection,
    job: Job,
    changes: dict[str, Any],
    now: datetime,
    *,
    actor: str,
    action: str,
    detail: dict[str, Any] | None = None,
) -> None:
    """Write a change of the job read (and locked) as `job`, bump its version, wake the
    dispatchers if it has a fire time, and audit it. Conflict if the job changed since."""
    # version-conditional: a claim that read the old version commits nothing
    try:
        result = connection.execute(
            update(schema.jobs)
            .where(schema.jobs.c.job_id == job.job_id, schema.jobs.c.version == job.version)
            .values(version=job.version + 1, updated_at=now, **changes)
        )
    except IntegrityError as exc:
        if changes.get("name") is not None and job_lookup.is_name_conflict(exc):
            # a concurrent rename or create took the name after the check
            raise job_lookup.name_conflict(str(changes["name"])) from exc
        raise
    if result.rowcount != 1:
        raise errors.Conflict(
            f"job {job.job_id} changed while being updated; try again", field="version"
        )
    if job.status.value not in SLOT_HOLDERS and changes.get("status") in SLOT_HOLDERS:
        take_slot(connection, job.tenant_id)  # refused over max_jobs
    if changes.get("next_fire_at") is not None:
        notify_job_change(connection, job.job_id, job.partition)
    audit(
        connection,
        at=now,
        tenant_id=job.tenant_id,
        actor=actor,
        action=action,
        job_id=job.job_id,
        detail=detail,
    )


def reschedule_values(job: Job, schedule: Schedule, window: int, now: datetime) -> dict[str, Any]:
    """The columns a new schedule sets (a reschedule, or an update with a schedule): the
    next run from now; a paused job stays paused, any other becomes active again."""
    if isinstance(schedule, OnceSchedule) and schedule.run_at <= now:
        raise errors.ValidationError("run_at is in the past", field="run_at")
    next_run = first_occurrence(schedule, now, start=job.start_at, end=job.end_at)
    if next_run is None:
        raise errors.ValidationError(
            "the schedule has no run between its start and end", field="schedule"
        )
    status = JobStatus.paused if job.status is JobStatus.paused else JobStatus.active
    return {
        "schedule": json.dumps(schedule_to_dict(schedule)),
        "status": status.value,
        "next_run_at": next_run,
        "next_fire_at": (
            fire_time(job.job_id, next_run, window) if status is JobStatus.active else None
        ),
    }


# the states each change of state may start from
_CHANGE_FROM: dict[str, set[JobStatus]] = {
    "cancel": {JobStatus.active, JobStatus.paused, JobStatus.completed},
    "pause": {JobStatus.active},
    "resume": {JobStatus.paused},
    "reschedule": {JobStatus.active, JobStatus.paused, JobStatus.completed},
}


# what each change writes to the job's row, from the job and the database's now
def _cancelled(job: Job, now: datetime) -> dict[str, Any]:
    return {"status": JobStatus.cancelled.value, "next_run_at": None, "next_fire_at": None}


def _paused(job: Job, now: datetime) -> dict[str, Any]:
    return {"status": JobStatus.paused.value, "next_fire_at": None}


def _resumed(job: Job, now: datetime) -> dict[str, Any]:
    if isinstance(job.schedule, OnceSchedule):
        # a one-time job whose time passed while paused is due now, and its
        # misfire policy decides whether it still runs
        next_run: datetime | None = job.schedule.run_at
    else:
        next_run = first_occurrence(job.schedule, now, start=job.start_at, end=job.end_at)
    if isinstance(job.schedule, AfterSchedule):
        # a dependent job has no time of its own: active again, runs on upstreams
        return {"status": JobStatus.active.value, "next_run_at": None}
    if next_run is None:
        return {"status": JobStatus.completed.value, "next_run_at": None}
    return {
        "status": JobStatus.active.value,
        "next_run_at": next_run,
        "next_fire_at": fire_time(job.job_id, next_run, job.window_seconds),
    }


PAUSED_SKIPS = 100  # the paused times a resume records as skipped runs, at most


def _record_paused_skips(connection: Connection, job: Job, now: datetime) -> None:
    """At a resume, record the times the job missed while paused as skipped runs with the
    reason, so `schedctl logs` and `job why` say why they did not run (the first
    PAUSED_SKIPS of them: bounded whatever the pause's length). A one-time job's time is
    not among them: a resume makes it due, and its misfire policy decides."""
    if job.next_run_at is None or isinstance(job.schedule, OnceSchedule | AfterSchedule):
        return
    times: list[datetime] = []
    at: datetime | None = job.next_run_at
    while at is not None and at < now and len(times) < PAUSED_SKIPS:
        times.append(at)
        at = next_occurrence(job.schedule, at, end=job.end_at)
    if not times:
        return
    more = at is not None and at < now
    reason = "job paused at this time (resumed at " + format_instant(now) + ")"
    if more:
        reason += f"; the first {PAUSED_SKIPS} paused times are recorded"
    statement = dialect_of(connection).insert(schema.runs).on_conflict_do_nothing()
    inserted = []
    for scheduled_at in times:  # at most PAUSED_SKIPS, once per resume
        row = connection.execute(
            statement.values(
                job_id=job.job_id,
                scheduled_at=scheduled_at,
                tenant_id=job.tenant_id,
                partition=job.partition,
                trigger=RunTrigger.schedule.value,
                status=RunStatus.skipped.value,
                attempt=0,
                fire_at=scheduled_at,
                finished_at=now,
                error=reason,
                job_version=job.version,
            ).returning(schema.runs.c.job_id)  # rowcount: none for a partitioned table
        ).first()
        if row is not None:
            inserted.append((job.job_id, scheduled_at, "skipped (paused)"))
    if inserted:
        from schedctl.storage.pipeline import dependencies

        # as a misfire skip: the dependents' runs of a skipped upstream run are skipped
        dependencies.on_settled(connection, succeeded=(), ended=inserted, now=now)


class JobRepo:
    def __init__(self, store: Store) -> None:
        self.store = store

    # -- create ----------------------------------------------------------------------

    def create(
        self,
        tenant_id: str,
        spec: JobSpec,
        *,
        actor: str,
        admit: Admit | None = None,
        auto_name: bool = False,
    ) -> tuple[Job, bool]:
        """Insert a job; with an idempotency key already used, return that job (created=False)
        if the request was the same and raise Conflict if it was not. `admit` (the quota
        checks) runs in the same transaction before the insert, so it is atomic with it. A
        name another job of the tenant (not deleted) has is Conflict naming `name`; with
        `auto_name` (no name was given) the default name gets a suffix from the new id, so
        it never collides. A batch of one of `create_many`."""
        (outcome,) = self.create_many(
            tenant_id, [NewJob(spec, auto_name=auto_name)], actor=actor, admit=admit
        )
        if outcome.error is not None:
            raise outcome.error
        assert outcome.job is not None
        return outcome.job, outcome.created

    def create_many(
        self,
        tenant_id: str,
        items: Sequence[NewJob],
        *,
        actor: str,
        admit: Admit | None = None,
        metrics_max_jobs: int | None = None,
    ) -> list[CreateOutcome]:
        """Up to MAX_BATCH jobs in one transaction, one CreateOutcome each
        (storage/jobs/job_create.py)."""
        return create_jobs(
            self.store,
            tenant_id,
            items,
            actor=actor,
            admit=admit,
            metrics_max_jobs=metrics_max_jobs,
        )

    # -- read --------------------------------------------------------------------------

    def get(self, job_id: str, tenant_id: str | None = None) -> Job:
        with self.store.read() as connection:
            return self._get(connection, job_id, tenant_id)

    def _get(
        self, connection: Connection, job_id: str, tenant_id: str | None, *, lock: bool = False
    ) -> Job:
        query = select(schema.jobs).where(schema.jobs.c.job_id == job_id)
        if tenant_id is not None:
            query = query.where(schema.jobs.c.tenant_id == tenant_id)
        if lock:
            query = dialect_of(connection).lock(query)
        row = connection.execute(query).mappings().first()
        if row is None:
            # the same answer for "absent" and "another tenant's": ids are not an oracle
            raise errors.NotFound(f"no job {job_id!r}", field="job_id")
        return job_from_row(row)

    def list(
        self,
        *,
        tenant_id: str | None = None,
        status: JobStatus | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        limit = check_page_limit(limit)
        query = select(schema.jobs).order_by(schema.jobs.c.job_id).limit(limit + 1)
        if tenant_id is not None:
            query = query.where(schema.jobs.c.tenant_id == tenant_id)
        if status is not None:
            query = query.where(schema.jobs.c.status == status.value)
        else:
            # deleted jobs leave the lists; status=deleted still finds them (run history)
            query = query.where(schema.jobs.c.status != JobStatus.deleted.value)
        if cursor:
            (after,) = decode_cursor(cursor, 1)
            query = query.where(schema.jobs.c.job_id > after)
        with self.store.read() as connection:
            rows = connection.execute(query).mappings().all()
        items = tuple(job_from_row(r) for r in rows[:limit])
        next_cursor = encode_cursor(items[-1].job_id) if len(rows) > limit else None
        return Page(items, next_cursor)

    # -- changes -----------------------------------------------------------------------

    def cancel(self, job_id: str, tenant_id: str | None = None, *, actor: str) -> Job:
        return self._change(job_id, tenant_id, actor=actor, action="cancel", values=_cancelled)

    def pause(self, job_id: str, tenant_id: str | None = None, *, actor: str) -> Job:
        return self._change(job_id, tenant_id, actor=actor, action="pause", values=_paused)

    def resume(self, job_id: str, tenant_id: str | None = None, *, actor: str) -> Job:
        return self._change(job_id, tenant_id, actor=actor, action="resume", values=_resumed)

    def reschedule(
        self,
        job_id: str,
        schedule: Schedule,
        tenant_id: str | None = None,
        *,
        actor: str,
    ) -> Job:
        return self._change(
            job_id,
            tenant_id,
            actor=actor,
            action="reschedule",
            values=lambda job, now: reschedule_values(job, schedule, job.window_seconds, now),
            detail={"schedule": schedule_to_dict(schedule)},
        )

    def _change(
        self,
        job_id: str,
        tenant_id: str | None,
        *,
        actor: str,
        action: str,
        values: Any,
        detail: dict[str, Any] | None = None,
    ) -> Job:
        with self.store.tx() as connection:
            job = self._get(connection, job_id, tenant_id, lock=True)
            if job.status is JobStatus.deleted:
                raise errors.NotFound(f"no job {job_id!r}", field="job_id")
            if job.status not in _CHANGE_FROM[action]:
                raise errors.Conflict(
                    f"cannot {action} job {job_id}: it is {job.status.value}", field="status"
                )
            now = db_now(connection)
            write_job(
                connection, job, values(job, now), now, actor=actor, action=action, detail=detail
            )
            if action == "resume":
                _record_paused_skips(connection, job, now)
            return self._get(connection, job_id, tenant_id)

    def trigger(self, job_id: str, tenant_id: str | None = None, *, actor: str) -> Run:
        """A manual run now: its own run record, delivered like any other."""
        with self.store.tx() as connection:
            job = self._get(connection, job_id, tenant_id)
            if job.status is JobStatus.deleted:
                raise errors.NotFound(f"no job {job_id!r}", field="job_id")
            if job.status is JobStatus.cancelled:
                raise errors.Conflict(
                    f"cannot trigger job {job_id}: it is cancelled", field="status"
                )
            now = db_now(connection)
            connection.execute(
                schema.runs.insert().values(
                    job_id=job_id,
                    scheduled_at=now,
                    tenant_id=job.tenant_id,
                    partition=job.partition,
                    trigger=RunTrigger.manual.value,
                    status=RunStatus.dispatched.value,
                    attempt=1,
                    fire_at=now,
                    dispatched_at=now,
                    job_version=job.version,
                )
            )
            connection.execute(
                schema.outbox.insert().values(
                    job_id=job_id,
                    scheduled_at=now,
                    tenant_id=job.tenant_id,
                    target_type=job.target.type.value,
                    target=job.target.address,
                    attempt=1,
                    available_at=now,
                    created_at=now,
                )
            )
            self.store.dialect.notify_ready(connection, {OUTBOX_WORD})  # a relay, at once
            audit(
                connection,
                at=now,
                tenant_id=job.tenant_id,
                actor=actor,
                action="trigger",
                job_id=job_id,
            )
            return run_from_row(connection.execute(run_query(job_id, now)).mappings().one())

    # -- run history -------------------------------------------------------------------

    def runs(
        self,
        job_id: str,
        tenant_id: str | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Newest first; the cursor is the last scheduled_at seen."""
        limit = check_page_limit(limit)
        with self.store.read() as connection:
            self._get(connection, job_id, tenant_id)
            query = (
                select(schema.runs)
                .where(schema.runs.c.job_id == job_id)
                .order_by(schema.runs.c.scheduled_at.desc())
                .limit(limit + 1)
            )
            if cursor:
                (before,) = decode_cursor(cursor, 1)
                try:
                    before_at = datetime.fromisoformat(before)
                except ValueError as exc:
                    raise errors.ValidationError(
                        "not a cursor this server issued", field="cursor"
                    ) from exc
                query = query.where(schema.runs.c.scheduled_at < before_at)
            rows = connection.execute(query).mappings().all()
        items = tuple(run_from_row(r) for r in rows[:limit])
        next_cursor = (
            encode_cursor(items[-1].scheduled_at.isoformat()) if len(rows) > limit else None
        )
        return Page(items, next_cursor)
