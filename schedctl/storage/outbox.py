"""Owns the outbox as the HTTP and RabbitMQ relays use it -- per-lane claims under a lease,
settling delivery outcomes (one run_attempts row per attempt, retry state kept in the outbox
row, dead letters after the last attempt), routing queue rows of broker tenants -- and the
dead-letter store behind `schedctl dlq` (list, show, replay, purge).

Leases instead of held locks: a claim is one short transaction that moves the row's
`available_at` to the end of a lease and names the relay in `lease_owner`; the slow part
(the HTTP call, the broker confirm) runs outside any transaction, and the outcome is
written by a second short transaction that only applies while the lease is still the
claimer's. A relay that dies mid-delivery leaves rows whose lease simply runs out; the
next claim records the lost attempt, which counts like a failed one (retried per the job's
policy, dead-lettered after the last): at least once, never forever. On Postgres claims
use `FOR UPDATE SKIP LOCKED`, so relays running side by side never take the same row;
SQLite transactions are `BEGIN IMMEDIATE`, i.e. serialized.

Retry state (attempt number, next try in `available_at`, last error) lives in the outbox
row, so retries survive any relay restart and continue with the next attempt number.
Settling itself (attempts, retries, dead letters, cancelled runs) is the settle module's,
shared with the built-in queue.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, select, text, update
from sqlalchemy.engine import Connection, RowMapping

from schedctl import errors, limits
from schedctl.delivery.http import Verdict
from schedctl.delivery.limits import Lane
from schedctl.models import Page, RunStatus
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage import schema
from schedctl.storage.audit import audit
from schedctl.storage.clock import db_now
from schedctl.storage.cursors import MAX_PAGE, decode_cursor, encode_cursor
from schedctl.storage.settle import (
    STOPPED_JOB_STATUSES,
    Attempt,
    Ending,
    Held,
    lost,
    settle,
    skip_cancelled,
)
from schedctl.storage.store import Store

HTTP = "http"
QUEUE = "queue"  # built-in queue, or RabbitMQ before routing
RABBITMQ = "rabbitmq"  # a queue row of a tenant with a broker, routed to its lane
DELIVERY_KINDS = (HTTP, RABBITMQ)
ROUTE_BATCH = 5000


@dataclass(frozen=True)
class TenantSettings:
    """What the relay needs to know about a tenant to pace and route its deliveries."""

    tenant_id: str
    name: str
    rate_per_second: float
    concurrency: int
    broker_url: str | None

    def __repr__(self) -> str:
        # the broker URL may hold a password
        return f"TenantSettings(tenant_id={self.tenant_id!r}, name={self.name!r})"


@dataclass(frozen=True)
class Delivery:
    """One claimed outbox row, with what delivering it needs."""

    outbox_id: int
    lease: str  # the claim's lease token (lease_owner)
    job_id: str
    scheduled_at: datetime
    tenant_id: str
    kind: str  # http | rabbitmq
    target: str  # URL or queue name
    attempt: int
    max_attempts: int
    retry_base_seconds: float
    retry_max_seconds: float
    stored_payload: str = field(repr=False)
    secret: str = field(repr=False)
    allow_list: tuple[str, ...] = field(repr=False)
    broker_url: str | None = field(repr=False)

    @property
    def idempotency_key(self) -> str:
        return f"{self.job_id}:{format_instant(self.scheduled_at)}"

    @property
    def lane(self) -> Lane:
        return Lane(self.tenant_id, self.kind)


@dataclass(frozen=True)
class Outcome:
    """The result of one delivery attempt, to be settled."""

    delivery: Delivery
    verdict: Verdict
    started_at: datetime
    finished_at: datetime
    error: str | None = None
    detail: str | None = None
    retry_after: float | None = None


@dataclass
class ClaimResult:
    deliveries: list[Delivery] = field(default_factory=list)
    cancelled: int = 0  # runs of cancelled jobs, skipped instead of delivered
    lost: int = 0  # expired leases of a relay that stopped: a lost attempt each


@dataclass
class SettleResult:
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    stale: int = 0  # the lease was no longer ours: another relay took over meanwhile


@dataclass(frozen=True)
class DeadLetter:
    id: int
    job_id: str
    scheduled_at: datetime
    tenant_id: str
    tenant: str | None  # name
    target_type: str
    target: str
    attempts: int
    last_error: str | None
    created_at: datetime
    replayed_at: datetime | None

    @property
    def idempotency_key(self) -> str:
        return f"{self.job_id}:{format_instant(self.scheduled_at)}"


class OutboxRepo:
    def __init__(self, store: Store, *, rng: random.Random | None = None) -> None:
        self.store = store
        self._rng = rng

    # -- settings and routing ----------------------------------------------------------------

    def tenant_settings(self) -> list[TenantSettings]:
        t = schema.tenants
        with self.store.read() as connection:
            rows = connection.execute(
                select(
                    t.c.tenant_id,
                    t.c.name,
                    t.c.dispatch_rate_per_second,
                    t.c.delivery_concurrency,
                    t.c.broker_url,
                )
            ).all()
        return [
            TenantSettings(
                tenant_id=r.tenant_id,
                name=r.name,
                rate_per_second=float(r.dispatch_rate_per_second),
                concurrency=int(r.delivery_concurrency),
                broker_url=r.broker_url,
            )
            for r in rows
        ]

    def route_broker_rows(self, tenant_ids: Iterable[str], limit: int = ROUTE_BATCH) -> int:
        """Queue rows of tenants with a broker become RabbitMQ rows (their own lane);
        returns how many were routed. Each tenant is an index range of ix_outbox_lane.

        `tenant_ids` may be a stale list (the relay caches settings for a while): each
        tenant's broker setting is read again inside its routing transaction, under a
        share lock on Postgres. Removing the broker (which turns its RabbitMQ rows back into
        queue rows, under a row lock of the tenant) then either commits first, and nothing
        is routed, or waits for this routing to commit and takes its rows back: no row is
        left in a lane that no relay serves."""
        o, t = schema.outbox, schema.tenants
        routed = 0
        for tenant_id in tenant_ids:
            with self.store.tx() as connection:
                broker = select(t.c.broker_url).where(t.c.tenant_id == tenant_id)
                if self.store.is_postgres:
                    broker = broker.with_for_update(read=True)
                if connection.execute(broker).scalar_one_or_none() is None:
                    continue  # no broker (any more): its queue rows are the built-in queue's
                ids = select(o.c.id).where(o.c.tenant_id == tenant_id, o.c.target_type == QUEUE)
                ids = ids.limit(limit)
                if self.store.is_postgres:
                    ids = ids.with_for_update(skip_locked=True)
                found = [r[0] for r in connection.execute(ids).all()]
                if found:
                    connection.execute(
                        update(o).where(o.c.id.in_(found)).values(target_type=RABBITMQ)
                    )
                routed += len(found)
        return routed

    # -- claiming ----------------------------------------------------------------------------

    def claim(self, caps: Mapping[Lane, int], owner: str, lease_seconds: float) -> ClaimResult:
        """Lease up to caps[lane] due rows of each lane, oldest first; returns them with
        what delivering needs. Rows of cancelled jobs are settled as skipped instead."""
        wanted = {lane: cap for lane, cap in caps.items() if cap > 0}
        if not wanted:
            return ClaimResult()
        if lease_seconds <= 0:
            raise errors.ValidationError("must be positive", field="lease_seconds")
        with self.store.tx() as connection:
            now = db_now(connection)
            rows = self._due_rows(connection, wanted, now)
            if not rows:
                return ClaimResult()
            return self._lease(connection, rows, owner, now, lease_seconds)

    def _due_rows(
        self, connection: Connection, wanted: Mapping[Lane, int], now: datetime
    ) -> list[RowMapping]:
        if self.store.is_postgres:
            lanes = sorted(wanted.items(), key=lambda item: (item[0].tenant_id, item[0].kind))
            # one statement for every lane: a LATERAL range read of ix_outbox_lane each,
            # locking what it takes and skipping rows another relay holds
            statement = text(
                """
                SELECT o.id, o.job_id, o.scheduled_at, o.tenant_id, o.target_type, o.target,
                       o.attempt, o.lease_owner, o.payload
                  FROM unnest(CAST(:tenants AS text[]), CAST(:kinds AS text[]),
                              CAST(:caps AS integer[])) AS l(tenant_id, kind, cap)
                 CROSS JOIN LATERAL (
                        SELECT id, job_id, scheduled_at, tenant_id, target_type, target,
                               attempt, lease_owner, payload
                          FROM outbox
                         WHERE outbox.tenant_id = l.tenant_id
                           AND outbox.target_type = l.kind
                           AND outbox.available_at <= :now
                         ORDER BY outbox.available_at
                         LIMIT l.cap
                           FOR UPDATE SKIP LOCKED) AS o
                """
            ).columns(scheduled_at=schema.outbox.c.scheduled_at.type)
            return list(
                connection.execute(
                    statement,
                    {
                        "tenants": [lane.tenant_id for lane, _ in lanes],
                        "kinds": [lane.kind for lane, _ in lanes],
                        "caps": [cap for _, cap in lanes],
                        "now": now,
                    },
                )
                .mappings()
                .all()
            )
        o = schema.outbox
        rows: list[RowMapping] = []
        for lane, cap in wanted.items():
            rows.extend(
                connection.execute(
                    select(
                        o.c.id,
                        o.c.job_id,
                        o.c.scheduled_at,
                        o.c.tenant_id,
                        o.c.target_type,
                        o.c.target,
                        o.c.attempt,
                        o.c.lease_owner,
                        o.c.payload,
                    )
                    .where(
                        o.c.tenant_id == lane.tenant_id,
                        o.c.target_type == lane.kind,
                        o.c.available_at <= now,
                    )
                    .order_by(o.c.available_at)
                    .limit(cap)
                )
                .mappings()
                .all()
            )
        return rows

    def _lease(
        self,
        connection: Connection,
        rows: Sequence[RowMapping],
        owner: str,
        now: datetime,
        lease_seconds: float,
    ) -> ClaimResult:
        o, j, t = schema.outbox, schema.jobs, schema.tenants
        result = ClaimResult()
        jobs = {
            r.job_id: r
            for r in connection.execute(
                select(
                    j.c.job_id,
                    j.c.status,
                    j.c.payload,
                    j.c.max_attempts,
                    j.c.retry_base_seconds,
                    j.c.retry_max_seconds,
                ).where(j.c.job_id.in_({r["job_id"] for r in rows}))
            ).all()
        }
        tenants = {
            r.tenant_id: r
            for r in connection.execute(
                select(t.c.tenant_id, t.c.signing_secret, t.c.allow_list, t.c.broker_url).where(
                    t.c.tenant_id.in_({r["tenant_id"] for r in rows})
                )
            ).all()
        }
        # one token per claim: settling checks it, so a lease that expired and was claimed
        # again (even by this same relay) is never settled twice
        token = f"{owner}/{now.timestamp():.6f}/{random.getrandbits(32):08x}"
        lease_ids: list[int] = []
        cancelled: list[RowMapping] = []
        lost_rows: list[tuple[Held, Attempt]] = []
        for row in rows:
            job = jobs.get(row["job_id"])
            tenant = tenants.get(row["tenant_id"])
            if job is None or tenant is None or job.status in STOPPED_JOB_STATUSES:
                cancelled.append(row)
                continue
            if row["lease_owner"] is not None:
                # the stopped relay's attempt may or may not have arrived: it counts as an
                # attempt, so a run whose delivery kills its relay every time ends in the
                # dead letters instead of being sent forever
                held = _held(row, job)
                lost_rows.append(
                    (held, lost(started_at=None, now=now, worker=_worker(row["lease_owner"])))
                )
                continue
            lease_ids.append(row["id"])
            result.deliveries.append(
                Delivery(
                    outbox_id=row["id"],
                    lease=token,
                    job_id=row["job_id"],
                    scheduled_at=row["scheduled_at"],
                    tenant_id=row["tenant_id"],
                    kind=row["target_type"],
                    target=row["target"],
                    attempt=row["attempt"],
                    max_attempts=job.max_attempts,
                    retry_base_seconds=job.retry_base_seconds,
                    retry_max_seconds=job.retry_max_seconds,
                    # the snapshot of an update made after the claim wins (0009)
                    stored_payload=row["payload"] if row["payload"] is not None else job.payload,
                    secret=tenant.signing_secret,
                    allow_list=tuple(str(a) for a in json.loads(tenant.allow_list)),
                    broker_url=tenant.broker_url,
                )
            )
        if lease_ids:
            connection.execute(
                update(o)
                .where(o.c.id.in_(lease_ids))
                .values(available_at=now + timedelta(seconds=lease_seconds), lease_owner=token)
            )
        if lost_rows:
            settle(connection, lost_rows, now=now, rng=self._rng)
        skip_cancelled(
            connection,
            o,
            [(r["id"], r["job_id"], r["scheduled_at"]) for r in cancelled],
            now=now,
        )
        result.cancelled = len(cancelled)
        result.lost = len(lost_rows)
        return result

    def release(self, deliveries: Sequence[Delivery]) -> int:
        """Give leases back undelivered (a stopping relay that had not started them)."""
        if not deliveries:
            return 0
        o = schema.outbox
        with self.store.tx() as connection:
            now = db_now(connection)
            released = 0
            for d in sorted(deliveries, key=lambda d: d.outbox_id):  # id order, like settle
                outcome = connection.execute(
                    update(o)
                    .where(o.c.id == d.outbox_id, o.c.lease_owner == d.lease)
                    .values(available_at=now, lease_owner=None)
                )
                released += outcome.rowcount
            return released

    # -- settling ----------------------------------------------------------------------------

    def settle(self, outcomes: Sequence[Outcome]) -> SettleResult:
        """Record a batch of attempt outcomes in one transaction: succeeded rows leave the
        outbox, failures are retried after a backoff (at least the endpoint's Retry-After)
        or, permanent or out of attempts, dead-lettered. Outcomes whose lease is no longer
        theirs change nothing."""
        result = SettleResult()
        if not outcomes:
            return result
        o = schema.outbox
        with self.store.tx() as connection:
            now = db_now(connection)
            query = (
                select(o.c.id, o.c.lease_owner, o.c.attempt)
                .where(o.c.id.in_([x.delivery.outbox_id for x in outcomes]))
                # id order: two settlers (or a settler and a release) lock in one order
                .order_by(o.c.id)
            )
            if self.store.is_postgres:
                query = query.with_for_update()
            held = {r.id: (r.lease_owner, r.attempt) for r in connection.execute(query).all()}
            valid: dict[int, Outcome] = {}
            for x in outcomes:
                if held.get(x.delivery.outbox_id) == (x.delivery.lease, x.delivery.attempt):
                    # one outcome per lease: a second for the same attempt changes nothing
                    valid.setdefault(x.delivery.outbox_id, x)
            result.stale = len(outcomes) - len(valid)
            if not valid:
                return result
            settled = settle(
                connection,
                [(_held_of(x.delivery), _attempt_of(x)) for x in valid.values()],
                now=now,
                rng=self._rng,
            )
            result.succeeded, result.retried, result.dead = (
                settled.succeeded,
                settled.retried,
                settled.dead,
            )
            return result

    # -- observability -----------------------------------------------------------------------

    def depth(self) -> dict[str, dict[str, int]]:
        """Outbox rows per target type: ready (due, not leased), leased, delayed (backoff)."""
        o = schema.outbox
        with self.store.read() as connection:
            now = db_now(connection)
            rows = connection.execute(
                select(
                    o.c.target_type,
                    func.count().filter(and_(o.c.available_at <= now)),
                    func.count().filter(and_(o.c.lease_owner.is_not(None), o.c.available_at > now)),
                    func.count().filter(and_(o.c.lease_owner.is_(None), o.c.available_at > now)),
                ).group_by(o.c.target_type)
            ).all()
        return {
            str(kind): {"ready": int(a or 0), "leased": int(b or 0), "delayed": int(c or 0)}
            for kind, a, b, c in rows
        }

    # -- heartbeat ---------------------------------------------------------------------------

    def extend(self, ids: Sequence[int], owner: str, lease_seconds: float) -> int:
        """Push the leases of these rows to `lease_seconds` from now, in one statement --
        only rows still leased by this relay (a lease token `owner/...` of one of its
        claims): a row whose lease ran out and was claimed by another relay stays theirs.
        Returns the number of leases extended. The relay's heartbeat, for the runs it has
        claimed and not settled yet (waiting for a slot, in flight, being recorded)."""
        if lease_seconds <= 0:
            raise errors.ValidationError("must be positive", field="lease_seconds")
        wanted = sorted(set(ids))
        if not wanted:
            return 0
        o = schema.outbox
        prefix = f"{owner}/"
        with self.store.tx() as connection:
            now = db_now(connection)
            # rows locked in id order like every other multi-row write of the outbox, and
            # those being settled right now skipped (their settle ends the lease anyway): a
            # heartbeat neither waits nor takes part in a deadlock
            mine = (
                connection.execute(
                    select(o.c.id)
                    .where(
                        o.c.id.in_(wanted),
                        func.substr(o.c.lease_owner, 1, len(prefix)) == prefix,
                    )
                    .order_by(o.c.id)
                    .with_for_update(skip_locked=True)
                )
                .scalars()
                .all()
            )
            if not mine:
                return 0
            outcome = connection.execute(
                update(o)
                .where(o.c.id.in_(mine))
                .values(available_at=now + timedelta(seconds=lease_seconds))
            )
            return int(outcome.rowcount)


class DeadLetterRepo:
    """The dead-letter store: runs whose delivery failed for good, with the last error."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def list_letters(
        self,
        *,
        tenant_id: str | None = None,
        job_id: str | None = None,
        include_replayed: bool = False,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Newest first; pass next_cursor back for the following page."""
        if not 1 <= limit <= MAX_PAGE:
            raise errors.ValidationError(f"must be between 1 and {MAX_PAGE}", field="limit")
        d = schema.dead_letters
        query = _select_letters().order_by(d.c.id.desc()).limit(limit + 1)
        if tenant_id is not None:
            query = query.where(d.c.tenant_id == tenant_id)
        if job_id is not None:
            query = query.where(d.c.job_id == job_id)
        if not include_replayed:
            query = query.where(d.c.replayed_at.is_(None))
        if cursor:
            (before,) = decode_cursor(cursor, 1)
            query = query.where(d.c.id < limits.cursor_id(before))
        with self.store.read() as connection:
            rows = connection.execute(query).mappings().all()
        items = tuple(_letter(r) for r in rows[:limit])
        next_cursor = encode_cursor(str(items[-1].id)) if len(rows) > limit else None
        return Page(items, next_cursor)

    def get(self, letter_id: int, tenant_id: str | None = None) -> DeadLetter:
        with self.store.read() as connection:
            return self._get(connection, letter_id, tenant_id)

    @staticmethod
    def _get(connection: Connection, letter_id: int, tenant_id: str | None) -> DeadLetter:
        d = schema.dead_letters
        query = _select_letters().where(d.c.id == letter_id)
        if tenant_id is not None:
            query = query.where(d.c.tenant_id == tenant_id)
        row = connection.execute(query).mappings().first()
        if row is None:
            # the same answer for absent and another tenant's
            raise errors.NotFound(f"no dead letter {letter_id}", field="id")
        return _letter(row)

    def attempts(self, letter: DeadLetter) -> list[dict[str, Any]]:
        """The run's attempt history, oldest first."""
        a = schema.run_attempts
        with self.store.read() as connection:
            rows = (
                connection.execute(
                    select(a)
                    .where(a.c.job_id == letter.job_id, a.c.scheduled_at == letter.scheduled_at)
                    .order_by(a.c.id)
                )
                .mappings()
                .all()
            )
        return [{k: v for k, v in r.items() if k != "id"} for r in rows]

    def replay(self, letter_id: int, *, tenant_id: str | None = None, actor: str) -> DeadLetter:
        """Deliver the run again from its first attempt (a fresh retry budget)."""
        with self.store.tx() as connection:
            letter = self._get(connection, letter_id, tenant_id)
            if letter.replayed_at is not None:
                raise errors.Conflict(
                    f"dead letter {letter_id} was replayed already at "
                    f"{format_instant(letter.replayed_at)}",
                    field="id",
                )
            status = connection.execute(
                select(schema.jobs.c.status).where(schema.jobs.c.job_id == letter.job_id)
            ).scalar_one_or_none()
            if status is None or status in STOPPED_JOB_STATUSES:
                raise errors.Conflict(
                    f"cannot replay dead letter {letter_id}: job {letter.job_id} is {status}",
                    field="status",
                )
            self._requeue(connection, letter, actor=actor)
            return self._get(connection, letter_id, tenant_id)

    def replay_all(self, *, tenant_id: str | None = None, actor: str) -> tuple[int, int]:
        """Replay every pending dead letter (of one tenant); (replayed, skipped because
        their job is cancelled)."""
        d, j = schema.dead_letters, schema.jobs
        replayed = skipped = 0
        after = 0
        while True:
            with self.store.tx() as connection:
                query = (
                    _select_letters()
                    .add_columns(j.c.status.label("job_status"))
                    .outerjoin(j, j.c.job_id == d.c.job_id)
                    .where(d.c.replayed_at.is_(None), d.c.id > after)
                    .order_by(d.c.id)
                    .limit(500)
                )
                if tenant_id is not None:
                    query = query.where(d.c.tenant_id == tenant_id)
                rows = connection.execute(query).mappings().all()
                if not rows:
                    return replayed, skipped
                for row in rows:
                    after = row["id"]
                    if row["job_status"] is None or row["job_status"] in STOPPED_JOB_STATUSES:
                        skipped += 1
                        continue
                    self._requeue(connection, _letter(row), actor=actor)
                    replayed += 1

    @staticmethod
    def _requeue(connection: Connection, letter: DeadLetter, *, actor: str) -> None:
        now = db_now(connection)
        marked = connection.execute(
            update(schema.dead_letters)
            .where(
                schema.dead_letters.c.id == letter.id, schema.dead_letters.c.replayed_at.is_(None)
            )
            .values(replayed_at=now)
        )
        if marked.rowcount != 1:
            raise errors.Conflict(f"dead letter {letter.id} was replayed meanwhile", field="id")
        # RabbitMQ rows go back as queue rows: the tenant's broker setting routes them again
        kind = HTTP if letter.target_type == HTTP else QUEUE
        connection.execute(
            schema.outbox.insert().values(
                job_id=letter.job_id,
                scheduled_at=letter.scheduled_at,
                tenant_id=letter.tenant_id,
                target_type=kind,
                target=letter.target,
                attempt=1,
                available_at=now,
                created_at=now,
            )
        )
        connection.execute(
            update(schema.runs)
            .where(
                schema.runs.c.job_id == letter.job_id,
                schema.runs.c.scheduled_at == letter.scheduled_at,
            )
            .values(
                status=RunStatus.dispatched.value,
                attempt=1,
                dispatched_at=now,
                started_at=None,
                finished_at=None,
                exit_code=None,
                error=None,
                output_tail=None,
            )
        )
        audit(
            connection,
            at=now,
            tenant_id=letter.tenant_id,
            actor=actor,
            action="dlq_replay",
            job_id=letter.job_id,
            detail={"dead_letter": letter.id, "scheduled_at": format_instant(letter.scheduled_at)},
        )

    def purge(self, letter_id: int, *, tenant_id: str | None = None, actor: str) -> None:
        with self.store.tx() as connection:
            letter = self._get(connection, letter_id, tenant_id)
            connection.execute(
                delete(schema.dead_letters).where(schema.dead_letters.c.id == letter_id)
            )
            audit(
                connection,
                at=db_now(connection),
                tenant_id=letter.tenant_id,
                actor=actor,
                action="dlq_purge",
                job_id=letter.job_id,
                detail={"dead_letter": letter_id},
            )

    def purge_all(
        self,
        *,
        tenant_id: str | None = None,
        older_than: timedelta | None = None,
        actor: str,
    ) -> int:
        """Delete dead letters (of one tenant, older than a while); returns how many."""
        d = schema.dead_letters
        with self.store.tx() as connection:
            now = db_now(connection)
            conditions = []
            if tenant_id is not None:
                conditions.append(d.c.tenant_id == tenant_id)
            if older_than is not None:
                conditions.append(d.c.created_at < now - older_than)
            outcome = connection.execute(delete(d).where(*conditions))
            audit(
                connection,
                at=now,
                tenant_id=tenant_id,
                actor=actor,
                action="dlq_purge",
                detail={
                    "count": outcome.rowcount,
                    "older_than_seconds": older_than.total_seconds() if older_than else None,
                },
            )
            return int(outcome.rowcount)


def _select_letters() -> Any:
    d, t = schema.dead_letters, schema.tenants
    return select(d, t.c.name.label("tenant_name")).outerjoin(t, t.c.tenant_id == d.c.tenant_id)


def _letter(row: RowMapping) -> DeadLetter:
    return DeadLetter(
        id=int(row["id"]),
        job_id=row["job_id"],
        scheduled_at=row["scheduled_at"],
        tenant_id=row["tenant_id"],
        tenant=row["tenant_name"],
        target_type=row["target_type"],
        target=row["target"],
        attempts=row["attempts"],
        last_error=row["last_error"],
        created_at=row["created_at"],
        replayed_at=row["replayed_at"],
    )


def _worker(lease: str) -> str:
    """The relay's name from a lease token (`owner/claimed-at/random`)."""
    return lease.rsplit("/", 2)[0]


def _held(row: RowMapping, job: Any) -> Held:
    """A claimed row whose lease expired, with its job's retry policy."""
    return Held(
        table=schema.outbox,
        row_id=row["id"],
        job_id=row["job_id"],
        scheduled_at=row["scheduled_at"],
        tenant_id=row["tenant_id"],
        target_type=row["target_type"],
        target=row["target"],
        attempt=row["attempt"],
        max_attempts=job.max_attempts,
        retry_base_seconds=job.retry_base_seconds,
        retry_max_seconds=job.retry_max_seconds,
    )


def _held_of(delivery: Delivery) -> Held:
    return Held(
        table=schema.outbox,
        row_id=delivery.outbox_id,
        job_id=delivery.job_id,
        scheduled_at=delivery.scheduled_at,
        tenant_id=delivery.tenant_id,
        target_type=delivery.kind,
        target=delivery.target,
        attempt=delivery.attempt,
        max_attempts=delivery.max_attempts,
        retry_base_seconds=delivery.retry_base_seconds,
        retry_max_seconds=delivery.retry_max_seconds,
    )


_ENDINGS = {
    Verdict.succeeded: Ending.succeeded,
    Verdict.retry: Ending.retryable,
    Verdict.failed: Ending.permanent,
}


def _attempt_of(outcome: Outcome) -> Attempt:
    return Attempt(
        _ENDINGS[outcome.verdict],
        outcome.started_at,
        outcome.finished_at,
        _worker(outcome.delivery.lease),
        error=None if outcome.verdict is Verdict.succeeded else outcome.error,
        output_tail=outcome.detail,
        retry_after=outcome.retry_after,
    )
