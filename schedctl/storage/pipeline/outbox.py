"""Owns the outbox as the HTTP and RabbitMQ relays use it -- per-lane claims under a lease,
settling delivery outcomes (one run_attempts row per attempt, retry state kept in the outbox
row, dead letters after the last attempt), routing queue rows of broker tenants . The
dead letters it writes are read and replayed through storage/pipeline/dead_letters.py.

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
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import and_, func, select, update
from sqlalchemy.engine import Connection, RowMapping

from schedctl.core import errors
from schedctl.domain.models import Lane, TargetType, Verdict, run_key
from schedctl.storage.backend.dialect import Lock
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.outbox_statements import OutboxLease, outbox_statements
from schedctl.storage.pipeline.settle import (
    STOPPED_JOB_STATUSES,
    AttemptResult,
    Ending,
    Held,
    id_in,
    lost,
    settle,
    skip_cancelled,
)

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
    kind: TargetType  # http | rabbitmq
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
        return run_key(self.job_id, self.scheduled_at)

    @property
    def lane(self) -> Lane:
        return Lane(self.tenant_id, self.kind)


@dataclass(frozen=True)
class DeliveryOutcome:
    """The result of one delivery attempt, to be settled."""

    delivery: Delivery
    verdict: Verdict
    started_at: datetime
    finished_at: datetime
    error: str | None = None
    detail: str | None = None
    retry_after: float | None = None


@dataclass
class OutboxClaim:
    """What one relay claim leased (and what it settled instead of leasing)."""

    deliveries: list[Delivery] = field(default_factory=list)
    cancelled: int = 0  # runs of cancelled jobs, skipped instead of delivered
    lost: int = 0  # expired leases of a relay that stopped: a lost attempt each


@dataclass
class SettleResult:
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    stale: int = 0  # the lease was no longer ours: another relay took over meanwhile


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
                broker = self.store.dialect.lock(broker, Lock.share)
                if connection.execute(broker).scalar_one_or_none() is None:
                    continue  # no broker (any more): its queue rows are the built-in queue's
                ids = select(o.c.id).where(
                    o.c.tenant_id == tenant_id, o.c.target_type == TargetType.queue.value
                )
                ids = ids.limit(limit)
                ids = self.store.dialect.lock(ids, skip_locked=True)
                found = [r[0] for r in connection.execute(ids).all()]
                if found:
                    connection.execute(
                        update(o)
                        .where(o.c.id.in_(found))
                        .values(target_type=TargetType.rabbitmq.value)
                    )
                routed += len(found)
        return routed

    # -- claiming ----------------------------------------------------------------------------

    def claim(self, caps: Mapping[Lane, int], owner: str, lease_seconds: float) -> OutboxClaim:
        """Lease up to caps[lane] due rows of each lane, oldest first; returns them with
        what delivering needs. Rows of cancelled jobs are settled as skipped instead."""
        wanted = {lane: cap for lane, cap in caps.items() if cap > 0}
        if not wanted:
            return OutboxClaim()
        if lease_seconds <= 0:
            raise errors.ValidationError("must be positive", field="lease_seconds")
        # one token per claim: settling checks it, so a lease that expired and was claimed
        # again (even by this same relay) is never settled twice
        token = f"{owner}/{time.time():.6f}/{random.getrandbits(32):08x}"
        if self.store.dialect.single_writer:
            # one writer at a time: look without the write lock whether any lane has a due row
            with self.store.read() as connection:
                if not self._due_rows(connection, wanted, db_now(connection)):
                    return OutboxClaim()
        with self.store.tx() as connection:
            statements = outbox_statements(self.store.dialect)
            leased = statements.lease_outbox_rows(connection, wanted, token, lease_seconds)
            return self._leased(connection, leased, token)

    def _due_rows(
        self, connection: Connection, wanted: Mapping[Lane, int], now: datetime
    ) -> list[RowMapping]:
        return outbox_statements(self.store.dialect).due_outbox_rows(connection, wanted, now)

    def _leased(
        self, connection: Connection, leased: Sequence[OutboxLease], token: str
    ) -> OutboxClaim:
        """_lease for the rows outbox_statements' lease_outbox_rows read and leased
        already."""
        if not leased:
            return OutboxClaim()
        rows: list[dict[str, Any]] = []
        jobs: dict[str, _Job] = {}
        tenants: dict[str, _Tenant] = {}
        for r in leased:
            at = r.scheduled_at
            rows.append(
                {
                    "id": r.id,
                    "job_id": r.job_id,
                    "scheduled_at": at if at.tzinfo is UTC else at.astimezone(UTC),
                    "tenant_id": r.tenant_id,
                    "target_type": r.target_type,
                    "target": r.target,
                    "attempt": r.attempt,
                    "lease_owner": r.lease_owner,
                    "payload": r.payload,
                }
            )
            # a job's payload comes with its first row only; a gone job has no status
            if r.job_payload is not None or (r.job_status is not None and r.job_id not in jobs):
                jobs[r.job_id] = _Job(
                    r.job_status,
                    r.job_payload,
                    r.max_attempts,
                    r.retry_base_seconds,
                    r.retry_max_seconds,
                )
            if r.tenant_found and r.tenant_id not in tenants:
                tenants[r.tenant_id] = _Tenant(r.signing_secret, r.allow_list, r.broker_url)
        now = leased[0].now.astimezone(UTC)
        return self._lease(connection, rows, jobs, tenants, token, now)

    def _lease(
        self,
        connection: Connection,
        rows: Sequence[dict[str, Any]],
        jobs: Mapping[str, Any],
        tenants: Mapping[str, Any],
        token: str,
        now: datetime,
    ) -> OutboxClaim:
        """Deliveries of the rows whose job and tenant still deliver, settled lost attempts
        of the expired leases, skipped runs of stopped jobs. Every row is leased already
        (the settling of the others overwrites or deletes their lease)."""
        o = schema.outbox
        result = OutboxClaim()
        # parsed once per tenant, not once per row
        allowed = {
            tenant_id: tuple(str(a) for a in json.loads(row.allow_list))
            for tenant_id, row in tenants.items()
        }
        cancelled: list[Any] = []
        lost_rows: list[tuple[Held, AttemptResult]] = []
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
            result.deliveries.append(
                Delivery(
                    outbox_id=row["id"],
                    lease=token,
                    job_id=row["job_id"],
                    scheduled_at=row["scheduled_at"],
                    tenant_id=row["tenant_id"],
                    kind=TargetType(row["target_type"]),
                    target=row["target"],
                    attempt=row["attempt"],
                    max_attempts=job.max_attempts,
                    retry_base_seconds=job.retry_base_seconds,
                    retry_max_seconds=job.retry_max_seconds,
                    # the snapshot of an update made after the claim wins (0009)
                    stored_payload=row["payload"] if row["payload"] is not None else job.payload,
                    secret=tenant.signing_secret,
                    allow_list=allowed[row["tenant_id"]],
                    broker_url=tenant.broker_url,
                )
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

    def settle(self, outcomes: Sequence[DeliveryOutcome]) -> SettleResult:
        """Record a batch of attempt outcomes in one transaction: succeeded rows leave the
        outbox, failures are retried after a backoff (at least the endpoint's Retry-After)
        or, permanent or out of attempts, dead-lettered. Outcomes whose lease is no longer
        theirs change nothing."""
        result = SettleResult()
        if not outcomes:
            return result
        ids = [x.delivery.outbox_id for x in outcomes]
        with self.store.tx() as connection:
            # id order: two settlers (or a settler and a release) lock in one order
            now, held = outbox_statements(self.store.dialect).lock_outbox_leases(connection, ids)
            valid: dict[int, DeliveryOutcome] = {}
            for x in outcomes:
                if held.get(x.delivery.outbox_id) == (x.delivery.lease, x.delivery.attempt):
                    # one outcome per lease: a second for the same attempt changes nothing
                    valid.setdefault(x.delivery.outbox_id, x)
            result.stale = len(outcomes) - len(valid)
            if not valid:
                return result
            assert now is not None  # read with the rows
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
            mine_query = (
                select(o.c.id)
                .where(
                    id_in(connection, o.c.id, wanted),
                    func.substr(o.c.lease_owner, 1, len(prefix)) == prefix,
                )
                .order_by(o.c.id)
            )
            mine = (
                connection.execute(self.store.dialect.lock(mine_query, skip_locked=True))
                .scalars()
                .all()
            )
            if not mine:
                return 0
            outcome = connection.execute(
                update(o)
                .where(id_in(connection, o.c.id, mine))
                .values(available_at=now + timedelta(seconds=lease_seconds))
            )
            return int(outcome.rowcount)


def _worker(lease: str) -> str:
    """The relay's name from a lease token (`owner/claimed-at/random`)."""
    return lease.rsplit("/", 2)[0]


class _Job(NamedTuple):
    """What a claim needs of a job (outbox_statements.lease_outbox_rows)."""

    status: str
    payload: str | None
    max_attempts: int
    retry_base_seconds: float
    retry_max_seconds: float


class _Tenant(NamedTuple):
    """What a claim needs of a tenant (outbox_statements.lease_outbox_rows)."""

    signing_secret: str
    allow_list: str
    broker_url: str | None


def _held(row: Mapping[str, Any], job: Any) -> Held:
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
        target_type=str(delivery.kind),
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


def _attempt_of(outcome: DeliveryOutcome) -> AttemptResult:
    return AttemptResult(
        _ENDINGS[outcome.verdict],
        outcome.started_at,
        outcome.finished_at,
        _worker(outcome.delivery.lease),
        error=None if outcome.verdict is Verdict.succeeded else outcome.error,
        output_tail=outcome.detail,
        retry_after=outcome.retry_after,
    )
