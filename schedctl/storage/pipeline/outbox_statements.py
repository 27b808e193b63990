"""Owns the relay's outbox reads and locks (storage/pipeline/outbox.py), Postgres's and
SQLite's side by side: each lane's due rows, the one-statement lease of Postgres (rows as
OutboxLease) and the settle's lock of the leased rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, Protocol

from sqlalchemy import select, text, update
from sqlalchemy.engine import Connection, RowMapping

from schedctl.domain.models import Lane
from schedctl.storage.backend.dialect import Dialect, dialect_of
from schedctl.storage.backend.dialect_postgres import pg_rows
from schedctl.storage.db import schema


class OutboxLease(NamedTuple):
    """A due outbox row the lease statement leased (its lease owner as it was before), its
    job (None when the job is gone; the job's payload only on the first row of each job,
    so a big payload crosses the wire once per claim), its tenant (`tenant_found` false
    when the tenant is gone) and the database's now."""

    id: int
    job_id: str
    scheduled_at: datetime
    tenant_id: str
    target_type: str
    target: str
    attempt: int
    lease_owner: str | None
    payload: str | None
    # the job's columns: NULL (None) when the job is gone
    job_status: Any
    job_payload: str | None
    max_attempts: Any
    retry_base_seconds: Any
    retry_max_seconds: Any
    tenant_found: bool
    signing_secret: Any  # NULL when the tenant is gone
    allow_list: Any
    broker_url: str | None
    now: datetime


class OutboxStatements(Protocol):
    """The relay's outbox statements on one backend, inside the caller's transaction."""

    def due_outbox_rows(
        self, connection: Connection, wanted: Mapping[Lane, int], now: datetime
    ) -> list[RowMapping]:
        """Up to wanted[lane] due outbox rows of each lane, oldest first, locked; rows
        another relay holds are skipped."""
        ...

    def lease_outbox_rows(
        self,
        connection: Connection,
        wanted: Mapping[Lane, int],
        token: str,
        lease_seconds: float,
    ) -> list[OutboxLease]:
        """due_outbox_rows, the lease of every row it finds (lease_owner `token`,
        available_at the database's now plus `lease_seconds`) and the reads of their jobs
        and tenants, as one statement (one round trip) where the backend has round trips."""
        ...

    def lock_outbox_leases(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime | None, dict[int, tuple[str | None, int]]]:
        """Lock the outbox rows `ids` (in id order, waiting for them) and read the
        database's now (in the same statement where it can): (now, {id: (lease_owner,
        attempt)}), for settling (now None on Postgres when no row is left)."""
        ...


class _Postgres:
    def due_outbox_rows(
        self, connection: Connection, wanted: Mapping[Lane, int], now: datetime
    ) -> list[RowMapping]:
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
                    "kinds": [str(lane.kind) for lane, _ in lanes],
                    "caps": [cap for _, cap in lanes],
                    "now": now,
                },
            )
            .mappings()
            .all()
        )

    def lease_outbox_rows(
        self,
        connection: Connection,
        wanted: Mapping[Lane, int],
        token: str,
        lease_seconds: float,
    ) -> list[OutboxLease]:
        lanes = sorted(wanted.items(), key=lambda item: (item[0].tenant_id, item[0].kind))
        # Planned at each execution, never prepared (as lease_candidates): a relay started
        # before a burst ran it on an empty outbox, and the generic plan Postgres then kept
        # was a seq scan and a sort of the whole outbox per claim until an analyze happened
        # to replace it, which made a burst over HTTP several times slower (figures in
        # docs/performance.md)
        rows = pg_rows(
            connection,
            _LEASE_OUTBOX,
            {
                "tenants": [lane.tenant_id for lane, _ in lanes],
                "kinds": [str(lane.kind) for lane, _ in lanes],
                "caps": [cap for _, cap in lanes],
                "token": token,
                "lease_seconds": float(lease_seconds),
            },
            prepare=False,
        )
        return [OutboxLease._make(r) for r in rows]

    def lock_outbox_leases(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime | None, dict[int, tuple[str | None, int]]]:
        rows = pg_rows(connection, _LOCK_OUTBOX_LEASES, {"ids": list(ids)})
        now = rows[0][3].astimezone(UTC) if rows else None
        return now, {r[0]: (r[1], r[2]) for r in rows}


class _Sqlite:
    def due_outbox_rows(
        self, connection: Connection, wanted: Mapping[Lane, int], now: datetime
    ) -> list[RowMapping]:
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
                        o.c.target_type == str(lane.kind),
                        o.c.available_at <= now,
                    )
                    .order_by(o.c.available_at)
                    .limit(cap)
                )
                .mappings()
                .all()
            )
        return rows

    def lease_outbox_rows(
        self,
        connection: Connection,
        wanted: Mapping[Lane, int],
        token: str,
        lease_seconds: float,
    ) -> list[OutboxLease]:
        # the same reads and lease as Postgres's one statement, step by step: transactions
        # are serialized and local, so the steps cost no round trips
        o, j, t = schema.outbox, schema.jobs, schema.tenants
        now = dialect_of(connection).now(connection)
        rows = self.due_outbox_rows(connection, wanted, now)
        if not rows:
            return []
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
            )
        }
        tenants = {
            r.tenant_id: r
            for r in connection.execute(
                select(t.c.tenant_id, t.c.signing_secret, t.c.allow_list, t.c.broker_url).where(
                    t.c.tenant_id.in_({r["tenant_id"] for r in rows})
                )
            )
        }
        connection.execute(
            update(o)
            .where(o.c.id.in_([r["id"] for r in rows]))
            .values(available_at=now + timedelta(seconds=lease_seconds), lease_owner=token)
        )
        leased: list[OutboxLease] = []
        paid: set[str] = set()  # jobs whose payload came already
        for r in rows:
            job, tenant = jobs.get(r["job_id"]), tenants.get(r["tenant_id"])
            first = job is not None and r["job_id"] not in paid
            paid.add(r["job_id"])
            leased.append(
                OutboxLease(
                    id=r["id"],
                    job_id=r["job_id"],
                    scheduled_at=r["scheduled_at"],
                    tenant_id=r["tenant_id"],
                    target_type=r["target_type"],
                    target=r["target"],
                    attempt=r["attempt"],
                    lease_owner=r["lease_owner"],
                    payload=r["payload"],
                    job_status=job.status if job is not None else None,
                    job_payload=job.payload if first and job is not None else None,
                    max_attempts=job.max_attempts if job is not None else None,
                    retry_base_seconds=job.retry_base_seconds if job is not None else None,
                    retry_max_seconds=job.retry_max_seconds if job is not None else None,
                    tenant_found=tenant is not None,
                    signing_secret=tenant.signing_secret if tenant is not None else None,
                    allow_list=tenant.allow_list if tenant is not None else None,
                    broker_url=tenant.broker_url if tenant is not None else None,
                    now=now,
                )
            )
        return leased

    def lock_outbox_leases(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime | None, dict[int, tuple[str | None, int]]]:
        # no row locks (the transaction holds the database), and this machine's clock
        o = schema.outbox
        now = dialect_of(connection).now(connection)
        query = select(o.c.id, o.c.lease_owner, o.c.attempt).where(o.c.id.in_(list(ids)))
        return now, {r.id: (r.lease_owner, r.attempt) for r in connection.execute(query)}


_STATEMENTS: dict[str, OutboxStatements] = {"postgresql": _Postgres(), "sqlite": _Sqlite()}


def outbox_statements(dialect: Dialect) -> OutboxStatements:
    """The outbox statements of the dialect's backend."""
    return _STATEMENTS[dialect.name]


# The relay's claim (lease_outbox_rows) in one round trip instead of six (clock, lane read,
# jobs, tenants, lease): the clock is read once, before any row is locked, as the separate
# read was; the lane read is due_outbox_rows'; every row it locks is leased (rows of a
# stopped job or an expired lease are settled in the same transaction right after, which
# overwrites or deletes the lease) by primary key, `= ANY(ARRAY(...))` (an UPDATE ... FROM
# the CTE was planned as a hash join over a seq scan of the whole outbox: 24 ms a claim at
# 100,000 rows); the job and the tenant are one primary-key lookup per row (a LATERAL with
# LIMIT 1 is never flattened into a join, which the planner once made a hash join over the
# whole jobs table).
_LEASE_OUTBOX = """
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now),
picked AS MATERIALIZED (
    SELECT o.id, o.job_id, o.scheduled_at, o.tenant_id, o.target_type, o.target,
           o.attempt, o.lease_owner, o.payload
      FROM unnest(CAST(%(tenants)b AS text[]), CAST(%(kinds)b AS text[]),
                  CAST(%(caps)b AS integer[])) AS l(tenant_id, kind, cap)
     CROSS JOIN LATERAL (
            SELECT id, job_id, scheduled_at, tenant_id, target_type, target,
                   attempt, lease_owner, payload
              FROM outbox
             WHERE outbox.tenant_id = l.tenant_id
               AND outbox.target_type = l.kind
               AND outbox.available_at <= (SELECT now FROM clock)
             ORDER BY outbox.available_at
             LIMIT l.cap
               FOR UPDATE SKIP LOCKED) AS o
),
leased AS (
    UPDATE outbox
       SET available_at = (SELECT now FROM clock)
               + CAST(%(lease_seconds)b AS float8) * interval '1 second',
           lease_owner = CAST(%(token)b AS text)
     WHERE outbox.id = ANY(ARRAY(SELECT id FROM picked))
)
SELECT p.id, p.job_id, p.scheduled_at, p.tenant_id, p.target_type, p.target, p.attempt,
       p.lease_owner, p.payload, j.status,
       CASE WHEN row_number() OVER (PARTITION BY p.job_id ORDER BY p.id) = 1
            THEN j.payload END,
       j.max_attempts, j.retry_base_seconds, j.retry_max_seconds,
       t.tenant_id IS NOT NULL, t.signing_secret, t.allow_list, t.broker_url,
       (SELECT now FROM clock)
  FROM picked AS p
  LEFT JOIN LATERAL (
        SELECT status, payload, max_attempts, retry_base_seconds, retry_max_seconds
          FROM jobs WHERE jobs.job_id = p.job_id LIMIT 1) AS j ON true
  LEFT JOIN LATERAL (
        SELECT tenant_id, signing_secret, allow_list, broker_url
          FROM tenants WHERE tenants.tenant_id = p.tenant_id LIMIT 1) AS t ON true
"""


# Settling's row locks and the database's now in one round trip (the clock was a statement
# of its own): the initplan reads the clock once, when the first row comes out -- before
# any lock is waited for, as the separate read was
_LOCK_OUTBOX_LEASES = """
SELECT id, lease_owner, attempt, (SELECT clock_timestamp())
  FROM outbox
 WHERE id = ANY(CAST(%(ids)b AS bigint[]))
 ORDER BY id
 FOR UPDATE
"""
