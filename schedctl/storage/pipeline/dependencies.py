"""Owns job dependencies (`after`): the job_dependencies rows, the cycle check, and the
dependent runs that settling an upstream run creates (succeeded) or records skipped
(dead-lettered, skipped, stopped), inside the settling transaction.

A dependent run takes its upstream's scheduled_at, so its key JOB_ID:SCHEDULED_AT is
stable, and it is inserted only if absent: settling twice never makes two runs. With
several upstreams (fan-in) the run is created once all of them have succeeded for that
scheduled_at: the settling transaction locks the dependent job rows (in job_id order, as
the claim does) before reading the other upstreams' runs, so of two upstreams settling at
once the second waits, then sees the first's commit, and exactly one creates the run.
A deleted or cancelled upstream simply produces no more runs, so its dependents get none;
its runs still waiting for delivery are skipped, and so are its dependents' (settle).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, delete, insert, or_, select
from sqlalchemy.engine import Connection

from schedctl.core import errors
from schedctl.domain.models import JobStatus, RunStatus, RunTrigger
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.backend.dialect import OUTBOX_WORD, Lock, dialect_of
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store

# bounds of every walk over the dependency graph (a tenant's jobs; cycles are refused, so
# these only stop a corrupted graph from looping)
MAX_UPSTREAMS = 32
MAX_WALK = 10_000


def add(connection: Connection, job_id: str, tenant_id: str, upstream_ids: Sequence[str]) -> None:
    """Record `job_id` running after `upstream_ids` (jobs of the same tenant). Another
    tenant's or a missing job is NotFound, a cycle a ValidationError, both naming `after`."""
    if not upstream_ids:
        return
    ups = resolve(connection, tenant_id, upstream_ids)
    check_upstreams(connection, job_id, tenant_id, ups)
    connection.execute(
        insert(schema.job_dependencies),
        [{"job_id": job_id, "upstream_job_id": u, "tenant_id": tenant_id} for u in ups],
    )


def replace(
    connection: Connection, job_id: str, tenant_id: str, upstream_ids: Sequence[str]
) -> None:
    """Set `job_id`'s upstreams to exactly `upstream_ids` (an update's `after`)."""
    check_upstreams(connection, job_id, tenant_id, resolve(connection, tenant_id, upstream_ids))
    d = schema.job_dependencies
    connection.execute(delete(d).where(d.c.job_id == job_id))
    add(connection, job_id, tenant_id, upstream_ids)


def resolve(connection: Connection, tenant_id: str, refs: Sequence[str]) -> list[str]:
    """The job ids of `refs` (ids or names of the tenant's jobs not cancelled), sorted;
    an unknown one is NotFound, a name of several jobs a ValidationError, naming `after`."""
    j = schema.jobs
    rows = connection.execute(
        select(j.c.job_id, j.c.name, j.c.status).where(
            j.c.tenant_id == tenant_id, or_(j.c.job_id.in_(refs), j.c.name.in_(refs))
        )
    ).all()
    ids: set[str] = set()
    for ref in refs:
        if any(r.job_id == ref and r.status != JobStatus.deleted.value for r in rows):
            ids.add(ref)  # a deleted job is gone for every lookup, by id too
            continue
        named = sorted(r.job_id for r in rows if r.name == ref and r.status not in _GONE_STATUSES)
        if not named:
            raise errors.NotFound(f"no job {ref!r}", field="after")
        if len(named) > 1:
            raise errors.ValidationError(
                f"{len(named)} jobs are named {ref!r}: give the job id", field="after"
            )
        ids.add(named[0])
    return sorted(ids)


# a name refers to a live job, not to a cancelled (or deleted) one of the same name
_GONE_STATUSES = (JobStatus.cancelled.value, JobStatus.deleted.value)


def check_after(store: Store, job_id: str, tenant_id: str, refs: Sequence[str]) -> list[str]:
    """For an update's `after`: the upstream job ids of `refs`, checked (tenant, existence,
    no cycle through `job_id`) without changing anything. Call `replace` in the update's
    transaction to store them."""
    with store.read() as connection:
        ups = resolve(connection, tenant_id, refs)
        check_upstreams(connection, job_id, tenant_id, ups)
        return ups


def graph(store: Store, job_id: str) -> dict[str, list[Any]]:
    """The job's upstream and downstream jobs as trees (see `tree`)."""
    with store.read() as connection:
        return {
            "upstream": tree(connection, job_id, direction="up"),
            "downstream": tree(connection, job_id, direction="down"),
        }


def check_upstreams(
    connection: Connection, job_id: str, tenant_id: str, upstream_ids: Collection[str]
) -> None:
    """The checks of a create's or an update's `after`: at most MAX_UPSTREAMS jobs, each an
    existing job of the tenant, none of them `job_id` itself or downstream of it."""
    if len(upstream_ids) > MAX_UPSTREAMS:
        raise errors.ValidationError(
            f"at most {MAX_UPSTREAMS} upstream jobs, got {len(upstream_ids)}", field="after"
        )
    j = schema.jobs
    found = set(
        connection.execute(
            select(j.c.job_id).where(
                j.c.job_id.in_(sorted(upstream_ids)),
                j.c.tenant_id == tenant_id,
                j.c.status != JobStatus.deleted.value,
            )
        ).scalars()
    )
    missing = sorted(set(upstream_ids) - found)
    if missing:
        raise errors.NotFound(f"no job {missing[0]}", field="after")
    check_cycle(connection, job_id, upstream_ids)


def check_cycle(connection: Connection, job_id: str, upstream_ids: Collection[str]) -> None:
    """ValidationError (field `after`) when running `job_id` after `upstream_ids` would
    close a cycle: `job_id` is one of them or one of their upstreams, at any depth."""
    d = schema.job_dependencies
    seen: set[str] = set()
    frontier = set(upstream_ids)
    while frontier:
        if job_id in frontier:
            raise errors.ValidationError(
                f"job {job_id} would run after itself (a dependency cycle)", field="after"
            )
        seen |= frontier
        if len(seen) > MAX_WALK:
            raise errors.ValidationError("the dependency graph is too large", field="after")
        rows = connection.execute(
            select(d.c.upstream_job_id).where(d.c.job_id.in_(sorted(frontier)))
        ).scalars()
        frontier = set(rows) - seen


def upstreams(connection: Connection, job_id: str) -> list[str]:
    d = schema.job_dependencies
    return sorted(
        connection.execute(select(d.c.upstream_job_id).where(d.c.job_id == job_id)).scalars()
    )


def downstreams(connection: Connection, job_id: str) -> list[str]:
    d = schema.job_dependencies
    return sorted(
        connection.execute(select(d.c.job_id).where(d.c.upstream_job_id == job_id)).scalars()
    )


def tree(connection: Connection, job_id: str, *, direction: str, depth: int = 8) -> list[Any]:
    """The jobs upstream (direction "up") or downstream ("down") of `job_id` as nested
    [{"job_id", "name", "status", "children": [...]}], at most `depth` levels deep."""
    step = upstreams if direction == "up" else downstreams
    j = schema.jobs

    def walk(current: str, level: int, path: frozenset[str]) -> list[Any]:
        if level >= depth:
            return []
        nodes = []
        for other in step(connection, current):
            row = connection.execute(
                select(j.c.name, j.c.status).where(j.c.job_id == other)
            ).one_or_none()
            nodes.append(
                {
                    "job_id": other,
                    "name": row.name if row is not None else None,
                    "status": row.status if row is not None else None,
                    "children": [] if other in path else walk(other, level + 1, path | {other}),
                }
            )
        return nodes

    return walk(job_id, 0, frozenset({job_id}))


# -- settling ----------------------------------------------------------------------------


def on_settled(
    connection: Connection,
    *,
    succeeded: Iterable[tuple[str, datetime]],
    ended: Iterable[tuple[str, datetime, str]],
    now: datetime,
    edges: Sequence[tuple[str, str]] | None = None,
) -> None:
    """Inside the transaction that recorded them: upstream runs (job_id, scheduled_at)
    that succeeded create their dependents' runs once every upstream of the dependent has
    succeeded for that scheduled_at; runs that ended otherwise (job_id, scheduled_at,
    what: "dead-lettered", "skipped", ...) record their dependents' runs skipped, and so
    on down the chain."""
    done = sorted(set(succeeded))
    failed = sorted(set(ended))
    if not done and not failed:
        return
    if edges is None:  # else read by the caller already (record_outcomes)
        ids = sorted({u for u, _ in done} | {u for u, _, _ in failed})
        edges = connection.execute(_edges_from(), {"ids": ids}).all()
    if not edges:  # the common case: one index read and nothing to do
        return
    if done:
        _create_ready(connection, done, edges, now)
    if failed:
        _skip_down(connection, failed, edges, now)


def edges_out_of(connection: Connection, upstreams: Sequence[str]) -> list[tuple[str, str]]:
    """The dependency edges (job_id, upstream_job_id) out of the jobs `upstreams`."""
    if not upstreams:
        return []
    return [(r[0], r[1]) for r in connection.execute(_edges_from(), {"ids": sorted(upstreams)})]


@functools.cache
def _edges_from() -> Any:
    """The dependency edges out of the upstream jobs `ids` (built once: every settle on
    SQLite reads them)."""
    d = schema.job_dependencies
    return select(d.c.job_id, d.c.upstream_job_id).where(
        d.c.upstream_job_id.in_(bindparam("ids", expanding=True))
    )


def _create_ready(
    connection: Connection,
    done: list[tuple[str, datetime]],
    edges: Sequence[Any],
    now: datetime,
) -> None:
    by_upstream: dict[str, list[str]] = {}
    for dependent, upstream in edges:
        by_upstream.setdefault(upstream, []).append(dependent)
    wanted = sorted({(dep, at) for u, at in done for dep in by_upstream.get(u, [])})
    if not wanted:
        return
    jobs = _lock_jobs(connection, sorted({dep for dep, _ in wanted}))
    d, r = schema.job_dependencies, schema.runs
    needs: dict[str, set[str]] = {}
    for dependent, upstream in connection.execute(
        select(d.c.job_id, d.c.upstream_job_id).where(d.c.job_id.in_(sorted(jobs)))
    ).all():
        needs.setdefault(dependent, set()).add(upstream)
    all_ups = sorted({u for ups in needs.values() for u in ups})
    ats = sorted({at for _, at in wanted})
    succeeded = {
        (row.job_id, row.scheduled_at)
        for row in connection.execute(
            # both keys: a recurring job's whole history is not read
            select(r.c.job_id, r.c.scheduled_at).where(
                r.c.job_id.in_(all_ups),
                r.c.scheduled_at.in_(ats),
                r.c.status == RunStatus.succeeded.value,
            )
        ).all()
    }
    for dependent, at in wanted:
        job = jobs.get(dependent)
        if job is None or job["status"] != JobStatus.active.value:
            continue  # paused, cancelled or gone: no run
        if all((u, at) in succeeded for u in needs.get(dependent, ())):
            _insert_run(connection, job, at, now, skipped_because=None)


def _skip_down(
    connection: Connection,
    failed: list[tuple[str, datetime, str]],
    edges: Sequence[Any],
    now: datetime,
) -> None:
    d, j = schema.job_dependencies, schema.jobs
    frontier = [
        (dependent, at, f"upstream {upstream} {what} for {format_instant(at)}")
        for upstream, at, what in failed
        for dependent, up in edges
        if up == upstream
    ]
    visited = 0
    while frontier and visited < MAX_WALK:
        visited += len(frontier)
        ids = sorted({dep for dep, _, _ in frontier})
        jobs = {
            row["job_id"]: dict(row)
            for row in connection.execute(select(*_JOB_COLUMNS).where(j.c.job_id.in_(ids)))
            .mappings()
            .all()
        }
        skipped: list[tuple[str, datetime]] = []
        for dependent, at, reason in frontier:
            job = jobs.get(dependent)
            if job is None:
                continue
            if _insert_run(connection, job, at, now, skipped_because=reason):
                skipped.append((dependent, at))
        if not skipped:
            return
        below = connection.execute(
            select(d.c.job_id, d.c.upstream_job_id).where(
                d.c.upstream_job_id.in_(sorted({s for s, _ in skipped}))
            )
        ).all()
        frontier = [
            (dependent, at, f"upstream {upstream} skipped for {format_instant(at)}")
            for upstream, at in skipped
            for dependent, up in below
            if up == upstream
        ]


_JOB_COLUMNS = [
    schema.jobs.c.job_id,
    schema.jobs.c.tenant_id,
    schema.jobs.c.partition,
    schema.jobs.c.version,
    schema.jobs.c.status,
    schema.jobs.c.target_type,
    schema.jobs.c.target,
]


def _lock_jobs(connection: Connection, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The dependent job rows, locked in job_id order (the claim's order: no deadlock)."""
    j = schema.jobs
    query = select(*_JOB_COLUMNS).where(j.c.job_id.in_(job_ids)).order_by(j.c.job_id)
    # what the claim takes too; a second settle of another upstream waits here
    query = dialect_of(connection).lock(query, Lock.no_key_update)
    return {row["job_id"]: dict(row) for row in connection.execute(query).mappings().all()}


def _insert_run(
    connection: Connection,
    job: dict[str, Any],
    at: datetime,
    now: datetime,
    *,
    skipped_because: str | None,
) -> bool:
    """Insert the dependent run (job_id, at) unless it exists, with its outbox row when it
    is to be delivered; True when inserted."""
    dispatched = skipped_because is None
    run = {
        "job_id": job["job_id"],
        "scheduled_at": at,
        "tenant_id": job["tenant_id"],
        "partition": job["partition"],
        "trigger": RunTrigger.upstream.value,
        "status": (RunStatus.dispatched if dispatched else RunStatus.skipped).value,
        "attempt": 1 if dispatched else 0,
        "fire_at": now,
        "dispatched_at": now if dispatched else None,
        "finished_at": None if dispatched else now,
        "error": skipped_because,
        "job_version": job["version"],
    }
    statement = dialect_of(connection).insert(schema.runs)
    # RETURNING, not rowcount: psycopg reports no rowcount for a partitioned table's insert
    inserted = connection.execute(
        statement.values(**run).on_conflict_do_nothing().returning(schema.runs.c.job_id)
    ).first()
    if inserted is None:
        return False
    if dispatched:
        connection.execute(
            insert(schema.outbox).values(
                job_id=job["job_id"],
                scheduled_at=at,
                tenant_id=job["tenant_id"],
                target_type=job["target_type"],
                target=job["target"],
                attempt=1,
                available_at=now,
                created_at=now,
            )
        )
        # a relay starts the chained run at once, not at its next poll
        dialect_of(connection).notify_ready(connection, {OUTBOX_WORD})
    return True
