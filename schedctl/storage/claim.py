"""The claim: due jobs -> runs + outbox rows, in one fenced, version-conditional transaction.

One batch is one transaction that (1) proves each partition's fencing epoch, (2) advances
every job on the version it was read at, and (3) inserts the run rows, unique on
(job_id, scheduled_at), and the outbox rows. A stale reader, a paused former owner or a
cancel that committed first all make the conditional update match nothing, so nothing
is claimed twice. On Postgres each step is one statement over arrays (unnest), so a batch
of thousands of runs is a handful of round trips.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from schedctl.models import JobStatus, RunStatus, RunTrigger
from schedctl.scheduling.misfire import MisfirePolicy, plan_claim
from schedctl.scheduling.schedules import Schedule, schedule_from_dict
from schedctl.scheduling.windows import fire_time
from schedctl.storage import schema
from schedctl.storage.store import Store

# Postgres codes for a batch that lost a lock race: nothing was committed, reload and retry
RETRYABLE_PGCODES = {"40P01", "40001"}


@dataclass(frozen=True)
class DueJob:
    """What a dispatcher read about a due job; claiming succeeds only at this version."""

    job_id: str
    tenant_id: str
    partition: int
    version: int
    schedule: Schedule
    next_run_at: datetime
    next_fire_at: datetime
    misfire_policy: MisfirePolicy
    grace_seconds: int
    window_seconds: int
    end_at: datetime | None
    target_type: str
    target: str


@dataclass
class ClaimResult:
    dispatched: list[tuple[str, datetime]] = field(default_factory=list)
    skipped: int = 0
    completed: int = 0
    stale: int = 0  # jobs whose version moved on (claimed elsewhere, cancelled, changed)
    fenced: set[int] = field(default_factory=set)  # partitions whose epoch is not ours
    aborted: bool = False  # lost a lock race; nothing committed
    # the claimed recurring jobs as they are now, so a dispatcher can keep them in memory
    advanced: list[DueJob] = field(default_factory=list)


_DUE_COLUMNS = [
    schema.jobs.c.job_id,
    schema.jobs.c.tenant_id,
    schema.jobs.c.partition,
    schema.jobs.c.version,
    schema.jobs.c.schedule,
    schema.jobs.c.next_run_at,
    schema.jobs.c.next_fire_at,
    schema.jobs.c.misfire_policy,
    schema.jobs.c.grace_seconds,
    schema.jobs.c.window_seconds,
    schema.jobs.c.end_at,
    schema.jobs.c.target_type,
    schema.jobs.c.target,
]


def due_query(partitions: Collection[int], before: datetime, limit: int) -> Any:
    """Jobs due before `before` in `partitions`: a range read per partition of the
    (partition, next_fire_at) index. Always filtered by partition, even when one process
    owns them all, so that there is one plan and it never scans the table."""
    return (
        select(*_DUE_COLUMNS)
        .where(
            schema.jobs.c.partition.in_(sorted(partitions)),
            schema.jobs.c.next_fire_at <= before,
            schema.jobs.c.status == "active",
        )
        .order_by(schema.jobs.c.next_fire_at)
        .limit(limit)
    )


def _due_from_row(r: Any) -> DueJob:
    return DueJob(
        job_id=r["job_id"],
        tenant_id=r["tenant_id"],
        partition=r["partition"],
        version=r["version"],
        schedule=schedule_from_dict(json.loads(r["schedule"])),
        next_run_at=r["next_run_at"],
        next_fire_at=r["next_fire_at"],
        misfire_policy=MisfirePolicy(r["misfire_policy"]),
        grace_seconds=r["grace_seconds"],
        window_seconds=r["window_seconds"],
        end_at=r["end_at"],
        target_type=r["target_type"],
        target=r["target"],
    )


class Claimer:
    def __init__(self, store: Store, owner: str) -> None:
        self.store = store
        self.owner = owner

    def load_due(
        self, partitions: Collection[int], before: datetime, limit: int = 1000
    ) -> list[DueJob]:
        """Due jobs of these partitions, earliest first."""
        if not partitions:
            return []
        with self.store.read() as connection:
            rows = connection.execute(due_query(partitions, before, limit)).mappings().all()
        return [_due_from_row(r) for r in rows]

    def load_jobs(
        self, job_ids: Collection[str], partitions: Collection[int], before: datetime
    ) -> list[DueJob]:
        """These jobs, if they are in `partitions` and due before `before` (notifications)."""
        if not job_ids or not partitions:
            return []
        query = due_query(partitions, before, len(job_ids)).where(
            schema.jobs.c.job_id.in_(sorted(set(job_ids)))
        )
        with self.store.read() as connection:
            rows = connection.execute(query).mappings().all()
        return [_due_from_row(r) for r in rows]

    def claim(self, due: Sequence[DueJob], epochs: Mapping[int, int], now: datetime) -> ClaimResult:
        """Claim one batch; `epochs` maps each owned partition to the epoch it was won with."""
        result = ClaimResult()
        if not due:
            return result
        try:
            with self.store.tx() as connection:
                self._claim(connection, due, epochs, now, result)
        except DBAPIError as exc:
            code = getattr(exc.orig, "sqlstate", None)
            if code not in RETRYABLE_PGCODES:
                raise
            return ClaimResult(aborted=True)
        return result

    def _claim(
        self,
        connection: Connection,
        due: Sequence[DueJob],
        epochs: Mapping[int, int],
        now: datetime,
        result: ClaimResult,
    ) -> None:
        result.fenced = self._check_epochs(connection, {d.partition for d in due}, epochs)
        batch = sorted((d for d in due if d.partition not in result.fenced), key=lambda d: d.job_id)
        if not batch:
            return
        plans = {
            d.job_id: plan_claim(
                d.schedule,
                d.next_run_at,
                now,
                d.misfire_policy,
                grace_seconds=d.grace_seconds,
                window_seconds=d.window_seconds,
                end=d.end_at,
            )
            for d in batch
        }
        updates = [
            {
                "job_id": d.job_id,
                "version": d.version,
                "next_run_at": plans[d.job_id].next_run_at,
                "next_fire_at": (
                    fire_time(d.job_id, nxt, d.window_seconds)
                    if (nxt := plans[d.job_id].next_run_at) is not None
                    else None
                ),
                "status": (
                    JobStatus.active.value
                    if plans[d.job_id].next_run_at is not None
                    else JobStatus.completed.value
                ),
            }
            for d in batch
        ]
        advanced = self._advance_jobs(connection, updates, now)
        result.stale = len(batch) - len(advanced)
        run_rows: list[dict[str, Any]] = []
        for d in batch:
            if d.job_id not in advanced:
                continue
            plan = plans[d.job_id]
            if plan.next_run_at is None:
                result.completed += 1
            else:
                result.advanced.append(
                    replace(
                        d,
                        version=d.version + 1,
                        next_run_at=plan.next_run_at,
                        next_fire_at=fire_time(d.job_id, plan.next_run_at, d.window_seconds),
                    )
                )
            epoch = epochs[d.partition]
            for nominal in plan.skipped:
                run_rows.append(self._run_row(d, nominal, now, epoch, RunStatus.skipped))
            for nominal in plan.dispatch:
                run_rows.append(self._run_row(d, nominal, now, epoch, RunStatus.dispatched))
        inserted = self._insert_runs(connection, run_rows)
        by_job = {d.job_id: d for d in batch}
        outbox_rows = []
        for job_id, scheduled_at, status in inserted:
            if status == RunStatus.skipped.value:
                result.skipped += 1
                continue
            d = by_job[job_id]
            result.dispatched.append((job_id, scheduled_at))
            outbox_rows.append(
                {
                    "job_id": job_id,
                    "scheduled_at": scheduled_at,
                    "tenant_id": d.tenant_id,
                    "target_type": d.target_type,
                    "target": d.target,
                    "attempt": 1,
                    "available_at": now,
                    "created_at": now,
                }
            )
        if outbox_rows:
            connection.execute(schema.outbox.insert(), outbox_rows)

    @staticmethod
    def _run_row(
        d: DueJob, nominal: datetime, now: datetime, epoch: int, status: RunStatus
    ) -> dict[str, Any]:
        dispatched = status is RunStatus.dispatched
        return {
            "job_id": d.job_id,
            "scheduled_at": nominal,
            "tenant_id": d.tenant_id,
            "partition": d.partition,
            "trigger": RunTrigger.schedule.value,
            "status": status.value,
            "attempt": 1 if dispatched else 0,
            "fire_at": fire_time(d.job_id, nominal, d.window_seconds),
            "dispatched_at": now if dispatched else None,
            "finished_at": None if dispatched else now,
            "epoch": epoch,
            "job_version": d.version,
        }

    def _check_epochs(
        self, connection: Connection, partitions: set[int], epochs: Mapping[int, int]
    ) -> set[int]:
        query = select(schema.partitions.c.partition, schema.partitions.c.epoch).where(
            schema.partitions.c.partition.in_(sorted(partitions))
        )
        if self.store.is_postgres:
            # a new owner's epoch write waits for this claim to commit, and a claim that
            # starts after that write sees the new epoch: there is no window between them
            query = query.with_for_update(read=True)
        stored = {int(p): int(e) for p, e in connection.execute(query).all()}
        return {p for p in partitions if p not in epochs or stored.get(p) != epochs[p]}

    def _advance_jobs(
        self, connection: Connection, updates: list[dict[str, Any]], now: datetime
    ) -> set[str]:
        if self.store.is_postgres:
            statement = text(
                """
                UPDATE jobs AS j
                   SET next_run_at = v.next_run_at,
                       next_fire_at = v.next_fire_at,
                       status = v.status,
                       version = j.version + 1,
                       updated_at = :now
                  FROM unnest(CAST(:job_ids AS text[]), CAST(:versions AS bigint[]),
                              CAST(:next_run_ats AS timestamptz[]),
                              CAST(:next_fire_ats AS timestamptz[]), CAST(:statuses AS text[]))
                       AS v(job_id, version, next_run_at, next_fire_at, status)
                 WHERE j.job_id = v.job_id AND j.version = v.version AND j.status = 'active'
             RETURNING j.job_id
                """
            )
            rows = connection.execute(
                statement,
                {
                    "now": now,
                    "job_ids": [u["job_id"] for u in updates],
                    "versions": [u["version"] for u in updates],
                    "next_run_ats": [u["next_run_at"] for u in updates],
                    "next_fire_ats": [u["next_fire_at"] for u in updates],
                    "statuses": [u["status"] for u in updates],
                },
            )
            return {r[0] for r in rows}
        advanced: set[str] = set()
        jobs = schema.jobs
        for u in updates:
            outcome = connection.execute(
                update(jobs)
                .where(
                    jobs.c.job_id == u["job_id"],
                    jobs.c.version == u["version"],
                    jobs.c.status == JobStatus.active.value,
                )
                .values(
                    next_run_at=u["next_run_at"],
                    next_fire_at=u["next_fire_at"],
                    status=u["status"],
                    version=jobs.c.version + 1,
                    updated_at=now,
                )
            )
            if outcome.rowcount == 1:
                advanced.add(u["job_id"])
        return advanced

    def _insert_runs(
        self, connection: Connection, rows: list[dict[str, Any]]
    ) -> list[tuple[str, datetime, str]]:
        """Insert run rows, skipping any (job_id, scheduled_at) that exists; returns those
        inserted."""
        if not rows:
            return []
        if self.store.is_postgres:
            columns = list(rows[0].keys())
            casts = {
                "job_id": "text",
                "scheduled_at": "timestamptz",
                "tenant_id": "text",
                "partition": "integer",
                "trigger": "text",
                "status": "text",
                "attempt": "integer",
                "fire_at": "timestamptz",
                "dispatched_at": "timestamptz",
                "finished_at": "timestamptz",
                "epoch": "bigint",
                "job_version": "bigint",
            }
            arrays = ", ".join(f"CAST(:{c} AS {casts[c]}[])" for c in columns)
            statement = text(
                f"INSERT INTO runs ({', '.join(columns)}) SELECT * FROM unnest({arrays}) "
                "ON CONFLICT DO NOTHING RETURNING job_id, scheduled_at, status"
            )
            result = connection.execute(statement, {c: [r[c] for r in rows] for c in columns})
            return [(r[0], r[1], r[2]) for r in result]
        inserted = []
        for row in rows:
            outcome = connection.execute(
                sqlite.insert(schema.runs).values(**row).on_conflict_do_nothing()
            )
            if outcome.rowcount == 1:
                inserted.append((row["job_id"], row["scheduled_at"], row["status"]))
        return inserted
