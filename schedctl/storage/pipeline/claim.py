"""The claim: due jobs -> runs + deliveries, in one fenced, version-conditional transaction.

One batch is one transaction that (1) proves each partition's fencing epoch, (2) advances
every job on the version it was read at, and (3) inserts the run rows, unique on
(job_id, scheduled_at), and each dispatched run's delivery: its built-in queue message,
or an outbox row for a relay (claim_statements.queue_target says which). A stale reader,
a paused former owner or a cancel that committed first all make the conditional update
match nothing, so nothing is claimed twice. On Postgres each step is one statement over
arrays (unnest), so a batch of thousands of runs is a handful of round trips
(claim_statements.py: advance_jobs and insert_runs).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import bindparam, select, update
from sqlalchemy.engine import Connection

from schedctl.core import errors
from schedctl.domain.models import (
    EVERY_HOST_QUEUE_PREFIX,
    JobStatus,
    RunStatus,
    RunTrigger,
    TargetType,
)
from schedctl.scheduling.misfire import ClaimPlan, MisfirePolicy, plan_claim
from schedctl.scheduling.schedules import Schedule, schedule_from_dict
from schedctl.scheduling.timeparse import format_instant
from schedctl.scheduling.windows import fire_time
from schedctl.storage.backend.dialect import Dialect, Lock
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store, is_lock_race
from schedctl.storage.pipeline import dependencies
from schedctl.storage.pipeline.claim_statements import claim_statements


class DueJob(NamedTuple):
    """What a dispatcher read about a due job; claiming succeeds only at this version.

    A named tuple, not a dataclass: a burst preloads and claims a whole window of them,
    and a frozen dataclass's __init__ costs one object.__setattr__ per field, on the
    dispatcher's hot path. The fields are in _DUE_COLUMNS's order."""

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
    # dispatched runs whose delivery goes through the outbox (HTTP, RabbitMQ, every-host
    # queues): a relay has work; the claim queued the rest into built-in queues itself
    # (except for a tenant whose queues are a broker: see claim_statements.insert_runs)
    relayed: int = 0
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


def due_query(
    partitions: Collection[int], before: datetime, limit: int, after: datetime | None = None
) -> Any:
    """Jobs due before `before` (and after `after`) in `partitions`: a range read per
    partition of the (partition, next_fire_at) index. Always filtered by partition, even
    when one process owns them all, so that there is one plan and it never scans."""
    query = (
        select(*_DUE_COLUMNS)
        .where(
            schema.jobs.c.partition.in_(sorted(partitions)),
            schema.jobs.c.next_fire_at <= before,
            schema.jobs.c.status == "active",
        )
        .order_by(schema.jobs.c.next_fire_at)
        .limit(limit)
    )
    if after is not None:
        query = query.where(schema.jobs.c.next_fire_at > after)
    return query


# distinct stored schedules parsed and kept: a burst's jobs, or an hourly cron's, share a
# handful of texts, and parsing each row's again dominated a big preload
SCHEDULE_CACHE = 4096


@functools.lru_cache(maxsize=SCHEDULE_CACHE)
def _schedule(stored: str) -> Schedule:
    return schedule_from_dict(json.loads(stored))  # immutable: safe to share


_POLICIES = {p.value: p for p in MisfirePolicy}
_ACTIVE = JobStatus.active.value
_COMPLETED = JobStatus.completed.value


def _due_from_row(r: Any) -> DueJob:
    # unpacked in _DUE_COLUMNS's order: a plain tuple row, no mapping per row
    (
        job_id,
        tenant_id,
        partition,
        version,
        schedule,
        next_run_at,
        next_fire_at,
        misfire_policy,
        grace_seconds,
        window_seconds,
        end_at,
        target_type,
        target,
    ) = r
    return DueJob(
        job_id,
        tenant_id,
        partition,
        version,
        _schedule(schedule),
        next_run_at,
        next_fire_at,
        _POLICIES[misfire_policy],
        grace_seconds,
        window_seconds,
        end_at,
        target_type,
        target,
    )


class Claimer:
    def __init__(self, store: Store, owner: str) -> None:
        self.store = store
        self.owner = owner

    def load_due(
        self,
        partitions: Collection[int],
        before: datetime,
        limit: int = 1000,
        after: datetime | None = None,
    ) -> list[DueJob]:
        """Due jobs of these partitions, earliest first."""
        if not partitions:
            return []
        query = due_query(partitions, before, limit, after)
        with self.store.read() as connection:
            rows = connection.execute(query).all()
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
            rows = connection.execute(query).all()
        return [_due_from_row(r) for r in rows]

    def claim(self, due: Sequence[DueJob], epochs: Mapping[int, int], now: datetime) -> ClaimResult:
        """Claim one batch; `epochs` maps each owned partition to the epoch it was won with."""
        result = ClaimResult()
        if not due:
            return result
        try:
            with self.store.tx() as connection:
                self._claim(connection, due, epochs, now, result)
        except errors.StoreUnavailable as exc:
            # a lost lock race (deadlock, serialization failure), through SQLAlchemy or the
            # raw driver cursor alike: nothing was committed, the dispatcher tries again
            if not is_lock_race(exc):
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
        # One entry per job, the newest version: the memory may hold a job twice (a
        # notification and a load), and two entries of one job in one batch made two
        # outbox rows for its one run on Postgres (the outbox insert joins the batch).
        newest: dict[str, DueJob] = {}
        unfenced = [d for d in due if d.partition not in result.fenced]
        for d in unfenced:
            if d.job_id not in newest or d.version > newest[d.job_id].version:
                newest[d.job_id] = d
        batch = sorted(newest.values(), key=lambda d: d.job_id)
        if not batch:
            return
        # one pass: the plan, the update and the job as it is once advanced (None: its
        # claim completes it); a next fire time is computed once, only for a next run
        plans: list[tuple[DueJob, ClaimPlan, DueJob | None]] = []
        updates: list[dict[str, Any]] = []
        for d in batch:
            plan = plan_claim(
                d.schedule,
                d.next_run_at,
                now,
                d.misfire_policy,
                grace_seconds=d.grace_seconds,
                window_seconds=d.window_seconds,
                end=d.end_at,
            )
            following: DueJob | None = None
            if plan.next_run_at is not None:
                # built whole: _replace goes through _make and a dict
                following = DueJob(
                    job_id=d.job_id,
                    tenant_id=d.tenant_id,
                    partition=d.partition,
                    version=d.version + 1,
                    schedule=d.schedule,
                    next_run_at=plan.next_run_at,
                    next_fire_at=fire_time(d.job_id, plan.next_run_at, d.window_seconds),
                    misfire_policy=d.misfire_policy,
                    grace_seconds=d.grace_seconds,
                    window_seconds=d.window_seconds,
                    end_at=d.end_at,
                    target_type=d.target_type,
                    target=d.target,
                )
            plans.append((d, plan, following))
            updates.append(
                {
                    "job_id": d.job_id,
                    "version": d.version,
                    "next_run_at": plan.next_run_at,
                    "next_fire_at": following.next_fire_at if following is not None else None,
                    "status": _ACTIVE if following is not None else _COMPLETED,
                }
            )
        advanced = self._advance_jobs(connection, updates, now)
        result.stale = len(unfenced) - len(advanced)  # the duplicates are stale too
        run_rows: list[dict[str, Any]] = []
        reasons: dict[tuple[str, datetime], str] = {}
        for d, plan, following in plans:
            if d.job_id not in advanced:
                continue
            if following is None:
                result.completed += 1
            else:
                result.advanced.append(following)
            epoch = epochs[d.partition]
            for nominal in plan.skipped:
                run_rows.append(self._run_row(d, nominal, now, epoch, RunStatus.skipped))
                reasons[(d.job_id, nominal)] = misfire_reason(d, nominal, now, plan)
            for nominal in plan.dispatch:
                run_rows.append(self._run_row(d, nominal, now, epoch, RunStatus.dispatched))
            if plan.dispatch and (
                d.target_type != TargetType.queue.value
                or d.target.startswith(EVERY_HOST_QUEUE_PREFIX)
            ):
                result.relayed += len(plan.dispatch)
        skipped: list[tuple[str, datetime, str]] = []
        for job_id, scheduled_at, status in self._insert_runs(connection, run_rows, now):
            if status == RunStatus.skipped.value:
                result.skipped += 1
                skipped.append((job_id, scheduled_at, "skipped (misfire)"))
            else:
                result.dispatched.append((job_id, scheduled_at))
        if skipped:
            # why each was skipped, for `schedctl logs` and `job why`: a statement of its
            # own, only when a claim skips (after an outage), never on the hot path
            record_skip_reasons(connection, [(j, at, reasons[(j, at)]) for j, at, _ in skipped])
            # a skipped upstream run records its dependents' runs skipped (`after`)
            dependencies.on_settled(connection, succeeded=(), ended=skipped, now=now)

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
            "target_type": d.target_type,
            "target": d.target,
        }

    def _check_epochs(
        self, connection: Connection, partitions: set[int], epochs: Mapping[int, int]
    ) -> set[int]:
        query = _epochs_locked(self.store.dialect)
        stored = {
            int(p): int(e)
            for p, e in connection.execute(query, {"partitions": sorted(partitions)}).all()
        }
        return {p for p in partitions if p not in epochs or stored.get(p) != epochs[p]}

    def _advance_jobs(
        self, connection: Connection, updates: list[dict[str, Any]], now: datetime
    ) -> set[str]:
        return claim_statements(self.store.dialect).advance_jobs(connection, updates, now)

    def _insert_runs(
        self, connection: Connection, rows: list[dict[str, Any]], now: datetime
    ) -> list[tuple[str, datetime, str]]:
        """Insert run rows, skipping any (job_id, scheduled_at) that exists, and the
        delivery of each dispatched one inserted; returns the runs inserted."""
        if not rows:
            return []
        return claim_statements(self.store.dialect).insert_runs(connection, rows, now)


def misfire_reason(d: DueJob, nominal: datetime, now: datetime, plan: ClaimPlan) -> str:
    """Why the misfire policy skipped the run at `nominal`, in an operator's words."""
    late = max(0, int((now - nominal).total_seconds()))
    tolerance = f"the {d.grace_seconds} s grace"
    if d.window_seconds > 0:
        tolerance += f" plus the {d.window_seconds} s window"
    text = f"missed by {late} s, more than {tolerance}; misfire policy {d.misfire_policy.value}"
    if d.misfire_policy is MisfirePolicy.run_once and plan.dispatch:
        text += f" (one catch-up run at {format_instant(plan.dispatch[-1])} instead)"
    return text


def record_skip_reasons(
    connection: Connection, skipped: Sequence[tuple[str, datetime, str]]
) -> None:
    """Record why each (job, scheduled_at) run was skipped in its `error`: the one place a
    skipped run keeps its reason (misfire, overlap, paused, window, host not live), so any
    writer of a skipped run can use it. Only runs still skipped and without a reason."""
    if not skipped:
        return
    r = schema.runs
    connection.execute(
        update(r)
        .where(
            r.c.job_id == bindparam("b_job_id"),
            r.c.scheduled_at == bindparam("b_scheduled_at"),
            r.c.status == RunStatus.skipped.value,
            r.c.error.is_(None),
        )
        .values(error=bindparam("b_error")),
        [
            {"b_job_id": job_id, "b_scheduled_at": at, "b_error": reason[:2000]}
            for job_id, at, reason in skipped
        ],
    )


_EPOCHS_LOCKED: dict[type, Any] = {}


def _epochs_locked(dialect: Dialect) -> Any:
    """The stored epochs of the `partitions` a claim covers, share-locked (built once per
    backend: every claim reads them)."""
    built = _EPOCHS_LOCKED.get(type(dialect))
    if built is None:
        p = schema.partitions
        query = (
            select(p.c.partition, p.c.epoch)
            .where(p.c.partition.in_(bindparam("partitions", expanding=True)))
            # locked in partition order, like every writer of partition rows
            .order_by(p.c.partition)
        )
        # a new owner's epoch write waits for this claim to commit, and a claim that
        # starts after that write sees the new epoch: there is no window between them
        built = _EPOCHS_LOCKED[type(dialect)] = dialect.lock(query, Lock.share)
    return built
