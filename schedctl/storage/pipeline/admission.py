"""Owns who may run as runs reach a job's queue and when they are leased: the overlap
policy's skip and replace on arrival, and the slots a lease of a job may take (0 is no
limit): the rule a lease applies under the slot lock, which both backends' candidate
statements repeat as a filter (lease_statements says why)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.engine import Connection, RowMapping

from schedctl.domain.models import TargetType
from schedctl.domain.runpolicy import SKIPPED_OVERLAP, Overlap
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.backend.dialect import dialect_of
from schedctl.storage.db import schema
from schedctl.storage.pipeline.lease_statements import (
    HeldMessage,
    LeaseCandidate,
    lease_statements,
)
from schedctl.storage.pipeline.settle import (
    AttemptResult,
    Ending,
    Held,
    settle,
    skip_cancelled,
)


def overlap_on_arrival(
    connection: Connection,
    table: Any,
    deliver: list[RowMapping],
    jobs: Mapping[str, tuple[str, str]],
    overlapping: set[str],
    now: datetime,
) -> list[RowMapping]:
    """The runs arriving in the queue of skip and replace jobs with a run still held: a
    skip job's are recorded skipped (and not queued), a replace job's stop the held run."""
    m = schema.queue_messages
    busy = set(
        connection.execute(
            select(m.c.job_id)
            .where(m.c.job_id.in_(sorted(overlapping)), m.c.leased_until.is_not(None))
            .distinct()
        ).scalars()
    )
    if not busy:
        return deliver
    skipped = [r for r in deliver if r["job_id"] in busy and jobs[r["job_id"]][1] == Overlap.SKIP]
    if skipped:
        skip_cancelled(
            connection, table, [(r["id"], r["job_id"], r["scheduled_at"]) for r in skipped],
            now=now, error=SKIPPED_OVERLAP,
        )  # fmt: skip
    replacing: dict[str, datetime] = {}
    for r in deliver:
        if r["job_id"] in busy and jobs[r["job_id"]][1] == Overlap.REPLACE:
            replacing[r["job_id"]] = max(
                r["scheduled_at"], replacing.get(r["job_id"], r["scheduled_at"])
            )
    if replacing:
        replace_running(connection, replacing, now)
    gone = {r["id"] for r in skipped}
    return [r for r in deliver if r["id"] not in gone]


def lease_slots(c: LeaseCandidate) -> int:
    """How many runs of a candidate's job may be held at once for it to be leased: 0 is no
    limit. `allow` has none; a first attempt of `skip` or `replace` one; all else (`queue`,
    a retry) the job's max_concurrency."""
    if c.overlap == Overlap.ALLOW:
        return 0
    if c.overlap != Overlap.QUEUE and c.attempt == 1:
        return 1
    return int(c.max_concurrency)


def replace_running(
    connection: Connection, replacing: Mapping[str, datetime], now: datetime
) -> None:
    """Stop the held runs of these `replace` jobs as a cancel does: their messages leave
    (the worker's next heartbeat finds the lease gone and kills the command) and each run
    is recorded failed, "replaced by the run of <time>", neither retried nor
    dead-lettered. The replacing run stays queued and is leased once the slot is free."""
    m, r = schema.queue_messages, schema.runs
    rows = connection.execute(
        select(m.c.id, r.c.started_at, r.c.output_tail)
        .select_from(
            m.join(r, and_(r.c.job_id == m.c.job_id, r.c.scheduled_at == m.c.scheduled_at))
        )
        .where(m.c.job_id.in_(sorted(replacing)), m.c.leased_until.is_not(None))
    ).all()
    if not rows:
        return
    started = {row[0]: (row[1], row[2]) for row in rows}
    statements = lease_statements(dialect_of(connection))
    _, held_rows = statements.held_messages(connection, sorted(started))
    items: list[tuple[Held, AttemptResult]] = []
    for row in held_rows:
        held = held_from_message(row)
        started_at, tail = started[held.row_id]
        error = f"replaced by the run of {format_instant(replacing[held.job_id])}"
        items.append(
            (
                held,
                AttemptResult(
                    Ending.stopped, started_at, now, row.lease_owner, error=error, output_tail=tail
                ),
            )
        )
    settle(connection, items, now=now)


def held_from_message(row: HeldMessage) -> Held:
    """A Held of a held message (lease_statements' held_messages)."""
    return Held(
        table=schema.queue_messages,
        row_id=row.id,
        job_id=row.job_id,
        scheduled_at=row.scheduled_at,
        tenant_id=row.tenant_id,
        target_type=TargetType.queue.value,
        target=row.queue,
        attempt=row.attempt,
        # no job row: nothing to retry against, so this attempt is the last
        max_attempts=row.max_attempts if row.max_attempts is not None else 0,
        retry_base_seconds=row.retry_base_seconds or 0.0,
        retry_max_seconds=row.retry_max_seconds or 0.0,
    )
