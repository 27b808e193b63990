"""Owns the database's part of `schedctl status`: partitions with their owners and epochs,
lag, outbox and dead-letter depths, read in one transaction at one database now; and the
liveness probe (`check_reachable`) of the API's /healthz.

Lag is the age of the oldest due and unclaimed run: min(next_fire_at) of active jobs that
is at or before the database's now. On Postgres it is read per partition from the due
index (one index probe each), never by scanning the jobs table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, func, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from schedctl.core import errors
from schedctl.storage.backend.dialect import dialect_of
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.engine import first_line
from schedctl.storage.db.store import Store
from schedctl.storage.records.status_statements import status_statements


@dataclass(frozen=True)
class PartitionStatus:
    partition: int
    owner: str | None
    epoch: int
    updated_at: datetime | None


@dataclass(frozen=True)
class LagStatus:
    oldest_due_at: datetime | None  # the oldest due, unclaimed run's fire time
    seconds: float  # now - oldest_due_at; 0 when nothing is due
    due: int  # active jobs due now and not claimed yet


@dataclass(frozen=True)
class OutboxStatus:
    depth: int  # rows still to deliver
    ready: int  # of those, deliverable now (including leases of relays that went away)
    delivering: int  # held by a relay under a lease that has not run out
    waiting: int  # waiting for a retry backoff to pass
    oldest_ready_at: datetime | None
    age_seconds: float  # now - oldest_ready_at; 0 when nothing is ready


def _partitions(connection: Connection) -> list[PartitionStatus]:
    t = schema.partitions
    rows = connection.execute(
        select(t.c.partition, t.c.owner, t.c.epoch, t.c.updated_at).order_by(t.c.partition)
    ).all()
    return [
        PartitionStatus(int(p), owner, int(epoch), updated) for p, owner, epoch, updated in rows
    ]


def _lag(connection: Connection, now: datetime, partition_count: int) -> LagStatus:
    statements = status_statements(dialect_of(connection))
    oldest, due = statements.due_lag(connection, now, partition_count)
    if oldest is None:
        return LagStatus(None, 0.0, due)
    return LagStatus(oldest, max(0.0, (now - oldest).total_seconds()), due)


def _outbox(connection: Connection, now: datetime) -> OutboxStatus:
    o = schema.outbox
    # available_at is the due time, or the end of the lease while a relay delivers the row
    ready_now = o.c.available_at <= now
    leased = and_(o.c.available_at > now, o.c.lease_owner.is_not(None))
    depth, ready, delivering, oldest = connection.execute(
        select(
            func.count(),
            func.count().filter(ready_now),
            func.count().filter(leased),
            func.min(o.c.available_at).filter(ready_now),
        )
    ).one()
    depth, ready, delivering = int(depth), int(ready or 0), int(delivering or 0)
    age = max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0
    return OutboxStatus(depth, ready, delivering, depth - ready - delivering, oldest, age)


def _dead_letters(connection: Connection) -> tuple[int, int]:
    d = schema.dead_letters
    pending, total = connection.execute(
        select(func.count().filter(d.c.replayed_at.is_(None)), func.count())
    ).one()
    return int(pending or 0), int(total)


@dataclass(frozen=True)
class DatabaseStatus:
    at: datetime  # the database's clock
    partitions: list[PartitionStatus]
    lag: LagStatus
    outbox: OutboxStatus
    dead_letters: int  # not replayed
    dead_letters_total: int


def read_database_status(store: Store, partition_count: int) -> DatabaseStatus:
    """One consistent read of the cluster's tables, at the database's now."""
    with store.read() as connection:
        now = db_now(connection)
        partitions = _partitions(connection)
        lag = _lag(connection, now, partition_count)
        outbox = _outbox(connection, now)
        dead_pending, dead_total = _dead_letters(connection)
    return DatabaseStatus(now, partitions, lag, outbox, dead_pending, dead_total)


def check_reachable(store: Store) -> None:
    """Raise StoreUnavailable unless one trivial statement runs: also for what Store.read
    does not wrap (a pool timeout, ...). The message names no host and no driver detail
    beyond its first line."""
    try:
        with store.read() as connection:
            connection.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        raise errors.StoreUnavailable(f"database error: {first_line(exc)}") from exc
