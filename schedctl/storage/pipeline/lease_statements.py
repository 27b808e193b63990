"""Owns the statements of a worker's lease on the built-in queue (storage/pipeline/queue.py),
Postgres's and SQLite's side by side: the ready messages a lease may take, the serialization
of the job slots, the held counts, the marking of leased messages and their runs, and the
held messages a settle locks. Rows come as LeaseCandidate and HeldMessage.

admission.py's lease_slots decides, under the slot lock, what a lease takes. The candidate
statements repeat its rule as a filter because they have a LIMIT: filtered after it, a job
at its limit with a backlog would fill every fetch and hide the runs behind it. A test
(test_the_candidate_statement_admits_what_lease_slots_acts_on) keeps the two equal."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

from sqlalchemy import Integer, and_, bindparam, cast, func, or_, select, update
from sqlalchemy.engine import Connection

from schedctl.domain.models import RunStatus
from schedctl.storage.backend.dialect import Dialect, dialect_of
from schedctl.storage.backend.dialect_postgres import RUNS_SPAN, pg_keyed, pg_rows, runs_span
from schedctl.storage.db import schema
from schedctl.storage.pipeline.settle_statements import settle_statements


class LeaseCandidate(NamedTuple):
    """A ready message and its job's policy and status (the message's payload snapshot,
    else the job's)."""

    id: int
    job_id: str
    scheduled_at: datetime
    attempt: int
    max_attempts: int
    retry_base_seconds: float
    retry_max_seconds: float
    max_concurrency: int
    timeout_seconds: int
    payload: str  # coalesce(the message's snapshot, the job's)
    status: str
    # the run policy (runpolicy.py): overlap is admitted in queue.py, the limits go to the run
    overlap: str
    memory_max: int | None
    cpu_weight: int | None
    tasks_max: int | None


class HeldMessage(NamedTuple):
    """A held message, its job's retry policy (None without a job row) and its owner."""

    id: int
    queue: str
    job_id: str
    scheduled_at: datetime
    tenant_id: str
    attempt: int
    max_attempts: int | None
    retry_base_seconds: float | None
    retry_max_seconds: float | None
    lease_owner: str | None


# A message a lease takes: (message id, job_id, scheduled_at, attempt).
LeasedRow = tuple[int, str, datetime, int]


@dataclass(frozen=True)
class LeaseMark:
    """What a lease writes on its messages and runs: the holder, until when it holds them,
    and the runs' start (the database's now). `owner` is one holder for every message, or
    each message's own (in the order of the leased rows): an API lease's owner holds a
    digest of that lease's own secret."""

    owner: str | Sequence[str]
    leased_until: datetime
    now: datetime


class LeaseStatements(Protocol):
    """A lease's statements on one backend; each runs inside the caller's transaction."""

    def lock_job_slots(self, connection: Connection, job_ids: Sequence[str]) -> None:
        """Serialize the worker leases of these jobs until commit, without locking job rows."""
        ...

    def lease_candidates(
        self, connection: Connection, tenant_id: str, queue: str, fetch: int
    ) -> tuple[datetime, list[LeaseCandidate]]:
        """The database's now and up to `fetch` ready messages of the tenant's queue that
        their job's max_concurrency may admit, oldest first, locked (others' skipped)."""
        ...

    def leased_counts(self, connection: Connection, job_ids: Sequence[str]) -> dict[str, int]:
        """Messages of each job held (leased_until set, expired or not); jobs without any
        are absent. Read after lock_job_slots, so a concurrent lease's commit is seen."""
        ...

    def mark_leased(
        self, connection: Connection, leases: Sequence[LeasedRow], mark: LeaseMark
    ) -> None:
        """Lease the messages (id, job_id, scheduled_at, attempt) to `owner` and mark their
        runs running (attempt, started_at now, the previous outcome cleared)."""
        ...

    def held_messages(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime, list[HeldMessage]]:
        """The database's now and the held (leased) messages among `ids`, in id order,
        locked (waiting for another holder)."""
        ...


class _Postgres:
    def lock_job_slots(self, connection: Connection, job_ids: Sequence[str]) -> None:
        # Transaction-scoped advisory locks on a hash of each job id, not job row locks:
        # they conflict only with other leases (taken in sorted order, so leases never
        # deadlock each other), never with the claim's, a cancel's or an update's row
        # locks. Taken in hash order (the lock keys' order, whatever collides); a hash
        # collision only serializes two jobs' leases a little more.
        pg_rows(
            connection,
            "SELECT pg_advisory_xact_lock(h) FROM (SELECT DISTINCT"
            " hashtextextended(k, 0) AS h FROM unnest(CAST(%(keys)b AS text[])) AS k) AS s"
            " ORDER BY h",
            {"keys": [f"lease:{job_id}" for job_id in job_ids]},
        )

    def lease_candidates(
        self, connection: Connection, tenant_id: str, queue: str, fetch: int
    ) -> tuple[datetime, list[LeaseCandidate]]:
        # Planned at each execution, never prepared: a generic plan does not know the LIMIT
        # and was made while the queue looked empty; with 100,000 messages queued it joined
        # and sorted the whole queue (or worse) and two workers stalled for minutes on it.
        rows = pg_rows(
            connection,
            _LEASE_CANDIDATES,
            {"tenant_id": tenant_id, "queue": queue, "fetch": fetch},
            prepare=False,
        )
        if not rows:
            return datetime.now(UTC), []  # nothing is leased: the time is not used
        # the clock column of the first row; scheduled_at as a UTC instant, as the column type
        return rows[0][-1].astimezone(UTC), [
            LeaseCandidate(r[0], r[1], r[2].astimezone(UTC), *r[3:-1]) for r in rows
        ]

    def leased_counts(self, connection: Connection, job_ids: Sequence[str]) -> dict[str, int]:
        return dict(pg_rows(connection, _LEASED_COUNTS, {"job_ids": list(job_ids)}, prepare=False))

    def mark_leased(
        self, connection: Connection, leases: Sequence[LeasedRow], mark: LeaseMark
    ) -> None:
        # unprepared, as lease_candidates: the generic plan made on a near-empty queue
        # joined by seq scans of the queue and today's runs, 6 ms a lease at 60,000 runs
        pg_keyed(
            connection,
            _MARK_LEASED,
            {
                "ids": [x[0] for x in leases],
                "job_ids": [x[1] for x in leases],
                "scheduled_ats": [x[2] for x in leases],
                "attempts": [x[3] for x in leases],
                "owners": (
                    [mark.owner] * len(leases) if isinstance(mark.owner, str) else mark.owner
                ),
                "leased_until": mark.leased_until,
                "now": mark.now,
                **runs_span([x[2] for x in leases]),
            },
        )

    def held_messages(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime, list[HeldMessage]]:
        rows = pg_rows(connection, _HELD_MESSAGES, {"ids": list(ids)}, prepare=False)
        if not rows:
            return dialect_of(connection).now(connection), []
        return rows[0][-1].astimezone(UTC), [
            HeldMessage(r[0], r[1], r[2], r[3].astimezone(UTC), *r[4:-1]) for r in rows
        ]


class _Sqlite:
    def lock_job_slots(self, connection: Connection, job_ids: Sequence[str]) -> None:
        return None

    def lease_candidates(
        self, connection: Connection, tenant_id: str, queue: str, fetch: int
    ) -> tuple[datetime, list[LeaseCandidate]]:
        now = dialect_of(connection).now(connection)
        rows = connection.execute(
            _lease_candidates(),
            {"tenant_id": tenant_id, "queue": queue, "now": now, "fetch": fetch},
        ).all()
        return now, [LeaseCandidate._make(r) for r in rows]

    def leased_counts(self, connection: Connection, job_ids: Sequence[str]) -> dict[str, int]:
        rows = connection.execute(_leased_counts(), {"job_ids": job_ids}).all()
        return {job_id: count for job_id, count in rows}

    def mark_leased(
        self, connection: Connection, leases: Sequence[LeasedRow], mark: LeaseMark
    ) -> None:
        if isinstance(mark.owner, str):
            connection.execute(
                _mark_leased(),
                {
                    "ids": [x[0] for x in leases],
                    "b_leased_until": mark.leased_until,
                    "b_lease_owner": mark.owner,
                },
            )
        else:
            # each message its own owner (an API lease's secret): still one statement, the
            # owners a JSON object by message id
            connection.execute(
                _mark_leased_each(),
                {
                    "b_leased_until": mark.leased_until,
                    "b_owners": json.dumps(
                        {str(x[0]): owner for x, owner in zip(leases, mark.owner, strict=True)}
                    ),
                },
            )
        # the previous attempt's outcome lives on in run_attempts
        settle_statements(dialect_of(connection)).update_runs(
            connection,
            [
                {
                    "job_id": job_id,
                    "scheduled_at": scheduled_at,
                    "status": RunStatus.running.value,
                    "attempt": attempt,
                    "started_at": mark.now,
                    "finished_at": None,
                    "exit_code": None,
                    "error": None,
                    "output_tail": None,
                }
                for _, job_id, scheduled_at, attempt in leases
            ],
        )

    def held_messages(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime, list[HeldMessage]]:
        rows = connection.execute(_held_messages(), {"ids": ids}).all()
        return dialect_of(connection).now(connection), [HeldMessage._make(r) for r in rows]


_STATEMENTS: dict[str, LeaseStatements] = {"postgresql": _Postgres(), "sqlite": _Sqlite()}


def lease_statements(dialect: Dialect) -> LeaseStatements:
    """The lease statements of the dialect's backend."""
    return _STATEMENTS[dialect.name]


# A worker's lease and settle (queue.py), on the driver's cursor: constant texts, arrays in
# binary, planned at each execution (see lease_candidates), and the clock read inside the
# statement that needs it (an initplan: one clock_timestamp() per statement), not in a
# round trip of its own. A message's job is a LATERAL primary-key lookup (LIMIT 1: never
# flattened into a join): planning a join of the queue with jobs costed a merge join by
# reading the ends of jobs_pkey, and where the newest jobs were deleted or updated those
# ends are dead entries, walked at every planning (0.5-2.7 ms a plan, 0.1 now). Updates
# by key also name the keys with `= ANY` on the table's index: planned with the batch's
# real size (128 rows) and stale statistics, a join alone became a hash join over a seq
# scan of the queue and of today's runs (78-160 ms a statement, 350 starts/s).
_LEASE_CANDIDATES = """
SELECT m.id, m.job_id, m.scheduled_at, m.attempt, j.max_attempts, j.retry_base_seconds,
       j.retry_max_seconds, j.max_concurrency, j.timeout_seconds,
       coalesce(m.payload, j.payload), j.status, j.overlap, j.memory_max, j.cpu_weight,
       j.tasks_max, (SELECT clock_timestamp())
  FROM queue_messages AS m
  JOIN LATERAL (SELECT max_attempts, retry_base_seconds, retry_max_seconds, max_concurrency,
                       timeout_seconds, payload, status, overlap, memory_max, cpu_weight,
                       tasks_max
                  FROM jobs WHERE jobs.job_id = m.job_id LIMIT 1) AS j ON true
 WHERE m.tenant_id = %(tenant_id)s AND m.queue = %(queue)s
   AND m.available_at <= (SELECT clock_timestamp())
   AND m.leased_until IS NULL
   AND (j.max_concurrency <= 0
        OR j.overlap = 'allow' OR (j.overlap <> 'queue' AND m.attempt = 1)
        OR (SELECT count(*) FROM queue_messages AS held
             WHERE held.job_id = m.job_id AND held.leased_until IS NOT NULL)
           < j.max_concurrency)
 ORDER BY m.available_at
 LIMIT %(fetch)s
 FOR UPDATE OF m SKIP LOCKED
"""


_LEASED_COUNTS = """
/* leased_counts */
SELECT job_id, count(*) FROM queue_messages
 WHERE job_id = ANY(CAST(%(job_ids)b AS text[])) AND leased_until IS NOT NULL
 GROUP BY job_id
"""


_MARK_LEASED = (
    """
/* mark_leased */
WITH v AS (
    SELECT * FROM unnest(CAST(%(ids)b AS bigint[]), CAST(%(job_ids)b AS text[]),
                         CAST(%(scheduled_ats)b AS timestamptz[]),
                         CAST(%(attempts)b AS integer[]), CAST(%(owners)b AS text[]))
        AS v(id, job_id, scheduled_at, attempt, owner)
), leased AS (
    UPDATE queue_messages
       SET leased_until = CAST(%(leased_until)b AS timestamptz), lease_owner = v.owner
      FROM v WHERE queue_messages.id = v.id
       AND queue_messages.id = ANY(CAST(%(ids)b AS bigint[]))
)
UPDATE runs SET status = 'running', attempt = v.attempt,
                started_at = CAST(%(now)b AS timestamptz), finished_at = NULL,
                exit_code = NULL, error = NULL, output_tail = NULL
  FROM v WHERE runs.job_id = v.job_id AND runs.scheduled_at = v.scheduled_at
   AND runs.job_id = ANY(CAST(%(job_ids)b AS text[]))
"""
    + RUNS_SPAN
)


_HELD_MESSAGES = """
/* held_messages */
SELECT m.id, m.queue, m.job_id, m.scheduled_at, m.tenant_id, m.attempt, j.max_attempts,
       j.retry_base_seconds, j.retry_max_seconds, m.lease_owner, (SELECT clock_timestamp())
  FROM queue_messages AS m
  LEFT JOIN LATERAL (SELECT max_attempts, retry_base_seconds, retry_max_seconds
                       FROM jobs WHERE jobs.job_id = m.job_id LIMIT 1) AS j ON true
 WHERE m.id = ANY(CAST(%(ids)b AS bigint[])) AND m.leased_until IS NOT NULL
 ORDER BY m.id
 FOR UPDATE OF m
"""


@functools.cache
def _lease_candidates() -> Any:
    m, j = schema.queue_messages, schema.jobs
    held = m.alias("held")
    # Held = leased, expired or not: an expired lease's command may still be running
    # until the reaper settles it, and "no overlapping runs" must hold meanwhile.
    in_use = (
        select(func.count())
        .select_from(held)
        .where(held.c.job_id == m.c.job_id, held.c.leased_until.is_not(None))
        .scalar_subquery()
    )
    return (
        select(
            m.c.id,
            m.c.job_id,
            m.c.scheduled_at,
            m.c.attempt,
            j.c.max_attempts,
            j.c.retry_base_seconds,
            j.c.retry_max_seconds,
            j.c.max_concurrency,
            j.c.timeout_seconds,
            # the snapshot of an update made after the claim wins (0009)
            func.coalesce(m.c.payload, j.c.payload),
            j.c.status,
            j.c.overlap,
            j.c.memory_max,
            j.c.cpu_weight,
            j.c.tasks_max,
        )
        .join(j, j.c.job_id == m.c.job_id)
        .where(
            # the (tenant_id, queue, available_at) index: one tenant's queue in due order
            m.c.tenant_id == bindparam("tenant_id"),
            m.c.queue == bindparam("queue"),
            m.c.available_at <= bindparam("now", type_=m.c.available_at.type),
            m.c.leased_until.is_(None),
            # max_concurrency 0 is "no limit" (null in the API)
            # and a first attempt of another overlap policy than queue is admitted (or
            # skipped, or replaces) in queue.py
            or_(
                j.c.max_concurrency <= 0,
                j.c.overlap == "allow",
                and_(j.c.overlap != "queue", m.c.attempt == 1),
                in_use < j.c.max_concurrency,
            ),
        )
        # oldest first along ix_queue_messages_ready, stopping after `fetch` rows (a
        # tie-break on id would sort the whole backlog on every lease)
        .order_by(m.c.available_at)
        .limit(bindparam("fetch"))
    )


@functools.cache
def _leased_counts() -> Any:
    m = schema.queue_messages
    return (
        select(m.c.job_id, func.count())
        .where(m.c.job_id.in_(bindparam("job_ids", expanding=True)), m.c.leased_until.is_not(None))
        .group_by(m.c.job_id)
    )


@functools.cache
def _mark_leased() -> Any:
    m = schema.queue_messages
    return (
        update(m)
        .where(m.c.id.in_(bindparam("ids", expanding=True)))
        .values(
            leased_until=bindparam("b_leased_until", type_=m.c.leased_until.type),
            lease_owner=bindparam("b_lease_owner"),
        )
    )


@functools.cache
def _mark_leased_each() -> Any:
    m = schema.queue_messages
    owners = func.json_each(bindparam("b_owners")).table_valued("key", "value")
    return (
        update(m)
        .where(m.c.id == cast(owners.c.key, Integer))
        .values(
            leased_until=bindparam("b_leased_until", type_=m.c.leased_until.type),
            lease_owner=owners.c.value,
        )
    )


@functools.cache
def _held_messages() -> Any:
    m, j = schema.queue_messages, schema.jobs
    return (
        select(
            m.c.id,
            m.c.queue,
            m.c.job_id,
            m.c.scheduled_at,
            m.c.tenant_id,
            m.c.attempt,
            j.c.max_attempts,
            j.c.retry_base_seconds,
            j.c.retry_max_seconds,
            m.c.lease_owner,
        )
        # outer join: a message whose job row is gone still gets settled (dead-lettered)
        .outerjoin(j, j.c.job_id == m.c.job_id)
        .where(m.c.id.in_(bindparam("ids", expanding=True)), m.c.leased_until.is_not(None))
        .order_by(m.c.id)
    )
