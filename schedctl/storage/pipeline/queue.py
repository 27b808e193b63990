"""The built-in queue: relaying outbox rows into queue messages, leases with a visibility
timeout, heartbeats, ack/fail with retry and dead letters, and reaping of expired leases.

Every operation is one transaction. On Postgres the row selections use
`FOR UPDATE SKIP LOCKED`, so any number of relays and workers run side by side without
taking the same row; on SQLite the store's transactions are `BEGIN IMMEDIATE`, i.e.
already serialized. A message is identified by its id, its lease owner and its attempt:
once a lease expired and was reaped, the former holder's ack, fail or heartbeat matches
nothing and changes nothing.

A queue belongs to a tenant: it is identified by (tenant, name), so a worker leases only
its own tenant's messages. Settling (attempts, retries, dead letters, cancelled runs) is
the settle module's, shared with the outbox relay.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, bindparam, case, delete, func, literal, select, update
from sqlalchemy.engine import Connection, RowMapping

from schedctl.core import errors
from schedctl.domain.leasing import Beat, Finish, Settlement, Settles
from schedctl.domain.models import EVERY_HOST_QUEUE_PREFIX, RunStatus, TargetType, run_key
from schedctl.domain.runpolicy import SKIPPED_OVERLAP, Overlap, RunLimits
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.backend.dialect import dialect_of, queue_word
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store, is_lock_race
from schedctl.storage.jobs.payloads import decode_payload
from schedctl.storage.pipeline.admission import (
    held_from_message,
    lease_slots,
    overlap_on_arrival,
    replace_running,
)
from schedctl.storage.pipeline.lease_statements import (
    HeldMessage,
    LeaseMark,
    lease_statements,
)
from schedctl.storage.pipeline.settle import (
    CANCELLED_ERROR,
    CANCELLED_RUNNING_ERROR,
    HOST_NOT_LIVE_ERROR,
    LOST_ERROR,
    MAX_OUTPUT_CHARS,
    STOPPED_JOB_STATUSES,
    AttemptResult,
    Ending,
    Held,
    clip,
    id_in,
    lost,
    run_by_key,
    settle,
    skip_cancelled,
)
from schedctl.storage.pipeline.workers import live_queues

__all__ = [
    "CANCELLED_ERROR",
    "CANCELLED_RUNNING_ERROR",
    "LOST_ERROR",
    "MAX_OUTPUT_TAIL_CHARS",
    "Beat",
    "Lease",
    "QueueDepth",
    "QueueRepo",
    "QueueStat",
]

MAX_OUTPUT_TAIL_CHARS = MAX_OUTPUT_CHARS

# A message and its job's retry policy: what a lease, a settle and a held lease each read.
_MESSAGE_COLUMNS = tuple(
    schema.queue_messages.c[name]
    for name in ("id", "queue", "job_id", "scheduled_at", "tenant_id", "attempt")
)
_RETRY_COLUMNS = tuple(
    schema.jobs.c[name] for name in ("max_attempts", "retry_base_seconds", "retry_max_seconds")
)


@dataclass(frozen=True)
class Lease:
    """One message held by a worker until `leased_until` (extended by heartbeats)."""

    message_id: int
    queue: str
    job_id: str
    scheduled_at: datetime
    tenant_id: str
    attempt: int
    max_attempts: int
    retry_base_seconds: float
    retry_max_seconds: float
    timeout_seconds: int  # 0 = no timeout
    payload: Any
    owner: str
    leased_until: datetime
    run_limits: RunLimits | None = None  # the job's cgroup limits (runpolicy.py)

    @property
    def idempotency_key(self) -> str:
        """`JOB_ID:SCHEDULED_AT` (RFC 3339 UTC with Z), the same for every attempt."""
        return run_key(self.job_id, self.scheduled_at)

    def __repr__(self) -> str:
        # never the payload: leases end up in logs and tracebacks
        return (
            f"Lease(message_id={self.message_id}, queue={self.queue!r}, job_id={self.job_id!r}, "
            f"scheduled_at={format_instant(self.scheduled_at)}, attempt={self.attempt})"
        )


@dataclass(frozen=True)
class QueueDepth:
    ready: int  # available now, not leased
    delayed: int  # waiting for a retry backoff to pass
    leased: int  # held by a worker (including expired leases not reaped yet)

    @property
    def total(self) -> int:
        return self.ready + self.delayed + self.leased


@dataclass(frozen=True)
class QueueStat:
    """The depth of one tenant's queue."""

    tenant_id: str
    tenant: str  # the tenant's name (its id if the tenant row is gone)
    queue: str
    depth: QueueDepth
    # how long the oldest ready message has been ready (0: none is); live workers: 0008
    oldest_ready_seconds: float = 0.0


class QueueRepo(Settles[Lease]):
    """The built-in queue over the `outbox`, `queue_messages`, `runs`, `run_attempts` and
    `dead_letters` tables."""

    def __init__(self, store: Store, *, rng: random.Random | None = None) -> None:
        self.store = store
        self._rng = rng

    # -- relay: outbox -> queue ----------------------------------------------------------

    def move_outbox(self, limit: int = 500, *, exclude_tenants: Collection[str] = ()) -> int:
        """Move due outbox rows of queue targets into queue messages; returns how many
        were delivered to a queue. Runs of jobs cancelled meanwhile are skipped instead.
        Rows of `exclude_tenants` (tenants whose queue is a RabbitMQ broker) stay.

        Five statements per batch whatever its size: the clock, a read of the rows, one of
        their jobs' statuses, and the move itself set-based inside the database (INSERT ...
        SELECT from the outbox, then DELETE), so no row's columns or payload travel to
        Python and back; per-row inserts were most of the relay's time in a burst."""
        o, j = schema.outbox, schema.jobs
        if not self._worth_writing(
            lambda now: select(o.c.id).where(
                o.c.target_type == TargetType.queue.value, o.c.available_at <= now
            )
        ):
            return 0
        with self.store.tx() as connection:
            now = db_now(connection)
            query = (
                select(o.c.id, o.c.job_id, o.c.scheduled_at, o.c.tenant_id, o.c.target)
                .where(o.c.target_type == TargetType.queue.value, o.c.available_at <= now)
                # due order is the order of ix_outbox_type_available: no sort of the backlog
                .order_by(o.c.available_at)
                .limit(limit)
            )
            if exclude_tenants:
                query = query.where(o.c.tenant_id.not_in(sorted(exclude_tenants)))
            query = self.store.dialect.lock(query, skip_locked=True)
            rows = connection.execute(query).mappings().all()
            if not rows:
                return 0
            # Two single-table reads, not a join or a subquery per row: a plan made while
            # the tables were small (psycopg prepares repeated statements, which keep their
            # plan) costs at worst one scan per batch here; the joined read, once, ran far
            # longer after a burst's load.
            jobs = {
                job_id: (status, overlap)
                for job_id, status, overlap in connection.execute(
                    select(j.c.job_id, j.c.status, j.c.overlap).where(
                        self.store.dialect.text_in(j.c.job_id, "job_ids")
                    ),
                    {"job_ids": sorted({r["job_id"] for r in rows})},
                ).all()
            }
            statuses = {job_id: status for job_id, (status, _) in jobs.items()}
            deliver = [r for r in rows if statuses.get(r["job_id"]) not in STOPPED_JOB_STATUSES]
            # a run comes due here: skip or replace (overlap) as it does, not once a busy
            # worker gets to it (the lease admits the same again, for runs due together)
            overlapping = {k for k, (_, o) in jobs.items() if o in (Overlap.SKIP, Overlap.REPLACE)}
            if overlapping and deliver:
                deliver = overlap_on_arrival(connection, o, deliver, jobs, overlapping, now)
            cancelled = [r for r in rows if statuses.get(r["job_id"]) in STOPPED_JOB_STATUSES]
            absent = _hosts_not_live(connection, deliver, now)
            if absent:
                deliver = [r for r in deliver if r["id"] not in absent]
                skip_cancelled(
                    connection,
                    o,
                    [(r["id"], r["job_id"], r["scheduled_at"]) for r in rows if r["id"] in absent],
                    now=now,
                    error=HOST_NOT_LIVE_ERROR,
                )
            if deliver:
                _queue_rows(connection, [r["id"] for r in deliver], now)
                self.store.dialect.notify_ready(
                    connection, {queue_word(r["tenant_id"], r["target"]) for r in deliver}
                )
            skip_cancelled(
                connection,
                o,
                [(r["id"], r["job_id"], r["scheduled_at"]) for r in cancelled],
                now=now,
            )
            return len(deliver)

    # -- workers ---------------------------------------------------------------------------

    def lease(
        self,
        queue: str,
        owner: str | Callable[[], str],
        lease_seconds: float,
        limit: int = 1,
        *,
        tenant_id: str,
    ) -> list[Lease]:
        """Lease up to `limit` ready messages of the tenant's `queue`, oldest first, never
        more messages of one job at a time than its max_concurrency; marks their runs
        running. Another tenant's queue of the same name is another queue.

        `owner` holds every lease (a direct worker's id), or is called once for each lease
        taken for that lease's own owner (the API's leases, each with its own secret)."""
        if lease_seconds <= 0:
            raise errors.ValidationError("must be positive", field="lease_seconds")
        if limit < 1:
            return []
        try:
            with self.store.tx() as connection:
                return self._lease(connection, queue, owner, lease_seconds, limit, tenant_id)
        except errors.StoreUnavailable as exc:
            if _is_retryable(exc):
                return []  # lost a lock race; nothing committed, the next poll tries again
            raise

    def _lease(
        self,
        connection: Connection,
        queue: str,
        owner: str | Callable[[], str],
        lease_seconds: float,
        limit: int,
        tenant_id: str,
    ) -> list[Lease]:
        m = schema.queue_messages
        statements = lease_statements(self.store.dialect)
        # a few more than asked: several may belong to one job with a single slot left.
        # Only a few: each row is read, loaded and locked (SKIP LOCKED hides it from other
        # workers until this commits), and a job at its limit is filtered out by the query
        # itself, so a short lease only means the next call takes the rest
        now, found = statements.lease_candidates(
            connection, tenant_id, queue, limit + min(limit // 4, 100) + 4
        )
        if not found:
            return []
        cancelled = [c for c in found if c.status in STOPPED_JOB_STATUSES]
        if cancelled:
            # queued but not started: a cancelled job's runs are not run
            skip_cancelled(
                connection, m, [(c.id, c.job_id, c.scheduled_at) for c in cancelled], now=now
            )
            found = [c for c in found if c.status not in STOPPED_JOB_STATUSES]
            if not found:
                return []
        # Serialize the slot count per job: a second worker waits here and then counts the
        # first one's committed lease, so two cannot both take the last slot. Jobs without
        # a limit (max_concurrency 0) have no slots to count: when all are such, two
        # statements fewer.
        slots = {c.id: lease_slots(c) for c in found}
        job_ids = sorted({c.job_id for c in found if slots[c.id] > 0})
        counts: dict[str, int] = {}
        if job_ids:
            statements.lock_job_slots(connection, job_ids)
            counts = statements.leased_counts(connection, job_ids)
        leased_until = now + timedelta(seconds=lease_seconds)
        leases: list[Lease] = []
        skipped: list[tuple[int, str, datetime]] = []
        replacing: dict[str, datetime] = {}  # job -> the scheduled_at of the run replacing
        for c in found:
            if len(leases) >= limit:
                break
            job_id, max_concurrency = c.job_id, slots[c.id]
            if max_concurrency > 0:
                in_use = counts.get(job_id, 0)
                if in_use >= max_concurrency:
                    # a first attempt of a skip job is skipped, of a replace job replaces
                    # the running run (it starts at a next lease, once that one is gone);
                    # anything else waits for a slot
                    if c.overlap == Overlap.SKIP and c.attempt == 1:
                        skipped.append((c.id, job_id, c.scheduled_at))
                    elif (
                        c.overlap == Overlap.REPLACE and c.attempt == 1 and job_id not in replacing
                    ):
                        replacing[job_id] = c.scheduled_at
                    continue
                counts[job_id] = in_use + 1
            leases.append(
                Lease(
                    message_id=c.id,
                    queue=queue,
                    job_id=job_id,
                    scheduled_at=c.scheduled_at,
                    tenant_id=tenant_id,
                    attempt=c.attempt,
                    max_attempts=c.max_attempts,
                    retry_base_seconds=c.retry_base_seconds,
                    retry_max_seconds=c.retry_max_seconds,
                    timeout_seconds=c.timeout_seconds,
                    payload=decode_payload(c.payload),
                    owner=owner if isinstance(owner, str) else owner(),
                    leased_until=leased_until,
                    run_limits=(
                        RunLimits(c.memory_max, c.cpu_weight, c.tasks_max)
                        if (c.memory_max, c.cpu_weight, c.tasks_max) != (None,) * 3
                        else None
                    ),
                )
            )
        if skipped:
            skip_cancelled(connection, m, skipped, now=now, error=SKIPPED_OVERLAP)
        if replacing:
            replace_running(connection, replacing, now)
        if leases:
            # one statement for the batch on Postgres (arrays), not two per message
            statements.mark_leased(
                connection,
                [(x.message_id, x.job_id, x.scheduled_at, x.attempt) for x in leases],
                LeaseMark(
                    owner if isinstance(owner, str) else [x.owner for x in leases],
                    leased_until,
                    now,
                ),
            )
        return leases

    def heartbeat(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend the lease; False when it is no longer ours (expired and reaped or taken)."""
        return self.beat(lease, lease_seconds) is not Beat.lost

    def beat(self, lease: Lease, lease_seconds: float, output_tail: str | None = None) -> Beat:
        """Extend the lease and look at the job: lost, cancelled (stop the command) or
        extended. One short transaction; the worker calls it every few seconds. An
        `output_tail` (the output so far) goes to the running run's row, where
        `schedctl logs --follow` reads it before the run finishes."""
        m = schema.queue_messages
        with self.store.tx() as connection:
            now = db_now(connection)
            result = connection.execute(
                update(m)
                .where(_ours(lease))
                .values(leased_until=now + timedelta(seconds=lease_seconds))
            )
            if result.rowcount != 1:
                return Beat.lost
            if output_tail is not None:
                r = schema.runs
                connection.execute(
                    update(r)
                    .where(
                        r.c.job_id == lease.job_id,
                        r.c.scheduled_at == lease.scheduled_at,
                        r.c.status == RunStatus.running.value,
                    )
                    .values(output_tail=clip(output_tail, MAX_OUTPUT_CHARS))
                )
            status = connection.execute(
                select(schema.jobs.c.status).where(schema.jobs.c.job_id == lease.job_id)
            ).scalar_one_or_none()
            return Beat.cancelled if status in STOPPED_JOB_STATUSES else Beat.extended

    def beat_many(
        self, items: Sequence[tuple[Lease, str | None]], lease_seconds: float
    ) -> list[Beat]:
        """`beat` for many (lease, output_tail) in one transaction and a few statements
        (a worker's heartbeats due together): per item, lost, cancelled or extended."""
        if not items:
            return []
        m, r = schema.queue_messages, schema.runs
        with self.store.tx() as connection:
            now = db_now(connection)
            query = (
                select(m.c.id, m.c.lease_owner, m.c.attempt)
                .where(
                    m.c.id.in_({lease.message_id for lease, _ in items}),
                    m.c.leased_until.is_not(None),
                )
                .order_by(m.c.id)  # in id order, as settling locks them: no deadlock
            )
            # locked as beat's UPDATE would: a reaper settling one of them is waited for
            held = {
                (row.id, row.lease_owner, row.attempt)
                for row in connection.execute(self.store.dialect.lock(query, of=m))
            }
            # same id, owner and attempt (see _ours)
            ours = [
                (lease, tail)
                for lease, tail in items
                if (lease.message_id, lease.owner, lease.attempt) in held
            ]
            if not ours:
                return [Beat.lost] * len(items)
            connection.execute(
                update(m)
                .where(m.c.id.in_({lease.message_id for lease, _ in ours}))
                .values(leased_until=now + timedelta(seconds=lease_seconds))
            )
            tails = [
                {
                    "b_job_id": lease.job_id,
                    "b_scheduled_at": lease.scheduled_at,
                    "b_output_tail": clip(tail, MAX_OUTPUT_CHARS),
                }
                for lease, tail in ours
                if tail is not None
            ]
            if tails:
                connection.execute(
                    update(r)
                    .where(*run_by_key(), r.c.status == RunStatus.running.value)
                    .values(output_tail=bindparam("b_output_tail")),
                    tails,
                )
            j = schema.jobs
            statuses = dict(
                connection.execute(
                    select(j.c.job_id, j.c.status).where(
                        j.c.job_id.in_({lease.job_id for lease, _ in ours})
                    )
                ).all()
            )
        extended = {lease.message_id for lease, _ in ours}
        return [
            Beat.lost
            if lease.message_id not in extended
            else Beat.cancelled
            if statuses.get(lease.job_id) in STOPPED_JOB_STATUSES
            else Beat.extended
            for lease, _ in items
        ]

    # ack, fail and stop_cancelled come from Settles: a success drops the message; a failure
    # is retried after a backoff or, with the attempts used up, dead-lettered; a cancelled
    # run's stopped attempt is recorded as failed and neither retried nor dead-lettered (the
    # cancel asked for exactly this)

    def settle(self, lease: Lease, settlement: Settlement) -> bool:
        """Settle the lease's attempt if the lease is still ours; False (and nothing
        changed) otherwise."""
        return self.finish_many([(lease, attempt_of(lease, settlement))])[0]

    def finish_many(self, items: Sequence[tuple[Lease, AttemptResult]]) -> list[bool]:
        """Settle many leases' attempts in one transaction (a worker's group commit): for
        each, True when it was settled, False (and nothing changed for it) when the lease
        was no longer ours. `AttemptResult.worker` is the lease owner.

        Idempotent: a settle whose commit answer was lost (the connection dropped during
        COMMIT, as in a database failover) raised StoreUnavailable with its outcome
        unknown; its caller settles again, and an attempt found already recorded by this
        owner is answered True (recorded) without recording it twice."""
        if not items:
            return []
        with self.store.tx() as connection:
            now, rows = lease_statements(self.store.dialect).held_messages(
                connection, sorted({lease.message_id for lease, _ in items})
            )
            found = {row.id: (held_from_message(row), row.lease_owner) for row in rows}
            ours: list[tuple[Held, AttemptResult]] = []
            settled: list[bool] = []
            for lease, attempt in items:
                row = found.pop(lease.message_id, None)
                # same id, owner and attempt (see _ours); popped, so a lease listed twice
                # is settled once
                mine = row is not None and row[1] == lease.owner and row[0].attempt == lease.attempt
                if mine and row is not None:
                    ours.append((row[0], attempt))
                settled.append(mine)
            if ours:
                settle(connection, ours, now=now, rng=self._rng)
            unmatched = [i for i, mine in enumerate(settled) if not mine]
            if unmatched:
                for i in _already_recorded(connection, [items[i] for i in unmatched]):
                    settled[unmatched[i]] = True
            return settled

    def expire_leases(self, limit: int = 500) -> int:
        """Settle messages whose lease ran out (their worker died or lost the database):
        the attempt is recorded as lost and the run retried per its policy. Any worker or
        relay may call this for every queue of every tenant. Returns how many were settled."""
        m, r = schema.queue_messages, schema.runs
        if not self._worth_writing(
            lambda now: select(m.c.id).where(m.c.leased_until.is_not(None), m.c.leased_until < now)
        ):
            return 0
        with self.store.tx() as connection:
            now = db_now(connection)
            expired = self._held(
                connection,
                [m.c.leased_until.is_not(None), m.c.leased_until < now],
                order_by=m.c.leased_until,
                limit=limit,
                skip_locked=True,
            )
            if not expired:
                return 0
            started = {
                (row.job_id, row.scheduled_at): row.started_at
                for row in connection.execute(
                    # both keys: a recurring job's whole history is not read for one run
                    select(r.c.job_id, r.c.scheduled_at, r.c.started_at).where(
                        r.c.job_id.in_({h.job_id for h, _ in expired}),
                        r.c.scheduled_at.in_({h.scheduled_at for h, _ in expired}),
                    )
                )
            }
            settle(
                connection,
                [
                    (
                        held,
                        lost(
                            started_at=started.get((held.job_id, held.scheduled_at)),
                            now=now,
                            worker=owner,
                        ),
                    )
                    for held, owner in expired
                ],
                now=now,
                rng=self._rng,
            )
            return len(expired)

    # -- observability ---------------------------------------------------------------------

    def stats(self) -> list[QueueStat]:
        """Ready, delayed and leased message counts and the oldest ready message's age per
        tenant and queue (queues with messages only), by tenant name and queue name."""
        m, t = schema.queue_messages, schema.tenants
        with self.store.read() as connection:
            now = db_now(connection)
            unleased = m.c.leased_until.is_(None)
            ready = and_(unleased, m.c.available_at <= now)
            rows = connection.execute(
                select(
                    m.c.tenant_id,
                    t.c.name,
                    m.c.queue,
                    func.sum(case((ready, 1), else_=0)),
                    func.sum(case((and_(unleased, m.c.available_at > now), 1), else_=0)),
                    func.sum(case((unleased, 0), else_=1)),
                    func.min(m.c.available_at).filter(ready),
                )
                .select_from(m.outerjoin(t, t.c.tenant_id == m.c.tenant_id))
                .group_by(m.c.tenant_id, t.c.name, m.c.queue)
            ).all()
        stats = [
            QueueStat(
                tenant_id=str(tenant_id),
                tenant=str(name if name is not None else tenant_id),
                queue=str(q),
                depth=QueueDepth(ready=int(r or 0), delayed=int(d or 0), leased=int(le or 0)),
                oldest_ready_seconds=max(0.0, (now - oldest).total_seconds()) if oldest else 0.0,
            )
            for tenant_id, name, q, r, d, le, oldest in rows
        ]
        return sorted(stats, key=lambda s: (s.tenant, s.queue))

    def depths(self) -> dict[tuple[str, str], int]:
        """Messages per (tenant name, queue), whatever their state (see `stats`)."""
        return {(s.tenant, s.queue): s.depth.total for s in self.stats()}

    # -- internals -------------------------------------------------------------------------

    def _worth_writing(self, rows: Callable[[datetime], Select[Any]]) -> bool:
        """Whether a write transaction could find work: on a database with one writer at a
        time (SQLite), a read without the write lock says whether `rows(now)` finds any
        (pollers that mostly find nothing then no longer queue for the lock); elsewhere
        True, unread."""
        if not self.store.dialect.single_writer:
            return True
        with self.store.read() as connection:
            return connection.execute(rows(db_now(connection)).limit(1)).first() is not None

    def _held(
        self,
        connection: Connection,
        conditions: Sequence[Any],
        *,
        order_by: Any = None,
        limit: int | None = None,
        skip_locked: bool = False,
    ) -> list[tuple[Held, str | None]]:
        """Messages matching `conditions` with their job's retry policy, and their lease
        owner; locked on Postgres. With skip_locked, rows another transaction holds are
        left to it (the reaper: another reaper is settling them already); without, the
        caller waits and then sees the row as that transaction left it (fail: a reaper
        that won the race makes it not ours)."""
        m, j = schema.queue_messages, schema.jobs
        query = (
            select(*_MESSAGE_COLUMNS, *_RETRY_COLUMNS, m.c.lease_owner)
            # outer join: a message whose job row is gone still gets settled (dead-lettered)
            .outerjoin(j, j.c.job_id == m.c.job_id)
            .where(*conditions)
            .order_by(order_by if order_by is not None else m.c.id)
        )
        if limit is not None:
            query = query.limit(limit)
        query = self.store.dialect.lock(query, skip_locked=skip_locked, of=m)
        # the columns are HeldMessage's, by name: one Held of a held message for both
        return [
            (held_from_message(HeldMessage(**r._asdict())), r.lease_owner)
            for r in connection.execute(query).all()
        ]

    # -- tenant workers over the REST API --------------------------------------------------

    def held_lease(self, message_id: int, owner: str, tenant_id: str) -> Lease | None:
        """The lease `owner` holds on message `message_id` of `tenant_id`, as `lease`
        returned it (without the payload), or None: no such message, another tenant's,
        another owner's (or the same run leased again after this lease expired and was
        reaped). Expired leases not reaped yet are still held, as for `beat`."""
        m, j = schema.queue_messages, schema.jobs
        with self.store.read() as connection:
            row = (
                connection.execute(
                    select(
                        *_MESSAGE_COLUMNS, *_RETRY_COLUMNS, m.c.leased_until, j.c.timeout_seconds
                    )
                    .join(j, j.c.job_id == m.c.job_id)
                    .where(
                        m.c.id == message_id,
                        m.c.tenant_id == tenant_id,
                        m.c.lease_owner == owner,
                        m.c.leased_until.is_not(None),
                    )
                )
                .mappings()
                .one_or_none()
            )
        if row is None:
            return None
        return Lease(
            message_id=row["id"],
            queue=row["queue"],
            job_id=row["job_id"],
            scheduled_at=row["scheduled_at"],
            tenant_id=row["tenant_id"],
            attempt=row["attempt"],
            max_attempts=row["max_attempts"],
            retry_base_seconds=row["retry_base_seconds"],
            retry_max_seconds=row["retry_max_seconds"],
            timeout_seconds=row["timeout_seconds"],
            payload=None,
            owner=owner,
            leased_until=row["leased_until"],
        )


_ENDINGS = {
    Finish.succeeded: Ending.succeeded,
    Finish.failed: Ending.retryable,
    Finish.cancelled: Ending.stopped,
}


def _hosts_not_live(connection: Connection, rows: Sequence[RowMapping], now: datetime) -> set[int]:
    """The outbox ids of every-host runs whose host has no live worker now: they are skipped,
    not queued, so an every-host job runs on the hosts that are up at its time."""
    every = [r for r in rows if str(r["target"]).startswith(EVERY_HOST_QUEUE_PREFIX)]
    if not every:
        return set()
    live = live_queues(connection, {(r["tenant_id"], r["target"]) for r in every}, now)
    return {r["id"] for r in every if (r["tenant_id"], r["target"]) not in live}


def _queue_rows(connection: Connection, ids: Sequence[int], now: datetime) -> None:
    """Outbox rows `ids` (locked by the caller) -> ready queue messages, in the database."""
    o, m = schema.outbox, schema.queue_messages
    picked = select(
        o.c.target,
        o.c.job_id,
        o.c.scheduled_at,
        o.c.tenant_id,
        o.c.attempt,
        literal(now, m.c.available_at.type),
        literal(now, m.c.created_at.type),
        o.c.payload,
    ).where(id_in(connection, o.c.id, ids))
    insert = dialect_of(connection).insert(m)
    columns = ["queue", "job_id", "scheduled_at", "tenant_id", "attempt", "available_at"]
    # a replay after a crash between insert and delete never duplicates a run
    connection.execute(
        insert.from_select([*columns, "created_at", "payload"], picked).on_conflict_do_nothing(
            index_elements=["job_id", "scheduled_at"]
        )
    )
    connection.execute(delete(o).where(id_in(connection, o.c.id, ids)))


def attempt_of(lease: Lease, settlement: Settlement) -> AttemptResult:
    """The attempt a worker's settlement of `lease` records."""
    return AttemptResult(
        _ENDINGS[settlement.finish],
        settlement.started_at,
        settlement.finished_at,
        lease.owner,
        error=settlement.error,
        exit_code=settlement.exit_code,
        output_tail=settlement.output_tail,
    )


def _ours(lease: Lease) -> Any:
    """The message is still this lease's: same id, owner and attempt. The attempt guards
    against the same owner having re-leased the message after its earlier lease expired."""
    m = schema.queue_messages
    return and_(
        m.c.id == lease.message_id,
        m.c.lease_owner == lease.owner,
        m.c.attempt == lease.attempt,
        m.c.leased_until.is_not(None),
    )


def _is_retryable(exc: BaseException) -> bool:
    return is_lock_race(exc)


def _already_recorded(
    connection: Connection, items: Sequence[tuple[Lease, AttemptResult]]
) -> list[int]:
    """The positions in `items` whose attempt is already recorded as this lease owner's
    own outcome (a run_attempts row of that attempt by that owner, not the reaper's
    `lost`): an earlier settle of it committed though its caller never heard so."""
    ra = schema.run_attempts
    rows = connection.execute(
        select(ra.c.job_id, ra.c.scheduled_at, ra.c.attempt, ra.c.worker).where(
            ra.c.job_id.in_({lease.job_id for lease, _ in items}),
            ra.c.scheduled_at.in_({lease.scheduled_at for lease, _ in items}),
            ra.c.status != RunStatus.lost.value,
        )
    ).all()
    recorded = {(row[0], row[1], row[2], row[3]) for row in rows}
    return [
        i
        for i, (lease, attempt) in enumerate(items)
        if attempt.ending is not Ending.lost
        and (lease.job_id, lease.scheduled_at, lease.attempt, (attempt.worker or "")[:200])
        in recorded
    ]
