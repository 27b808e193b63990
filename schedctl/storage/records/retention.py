"""Run-history housekeeping: day partitions of `runs` where the dialect partitions it
(Postgres), made ahead and dropped after the retention period by the role that owns the
table; old run rows deleted everywhere, by any role; dead letters, sent alerts and audit
entries older than their own retention ages deleted (plain DELETEs: the runtime role may).

The daemons run as a runtime role without DDL (`schedctl db grant`): for it, maintenance
only deletes expired rows and reports how many days ahead the owner's partitions reach
(`schedctl db maintain`, run as the owner from a timer, makes and drops them). A day
without its partition is never an error: its runs go to the default partition (made by
the first migration), so no statement of the hot path ever needs DDL."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import delete
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from schedctl.core import errors
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.records.run_partitions import (
    PostgresRunPartitions,
    RunPartitions,
    run_partitioning,
)

log = logging.getLogger(__name__)

DEFAULT_RETENTION_DAYS = 90
# the other records' ages (config keys dead_letter_retention_days, alert_retention_days,
# audit_retention_days): a dead letter is acted on within weeks or not at all, an alert is
# a sent message, the audit log is what an incident review a year later asks for
DEFAULT_DEAD_LETTER_RETENTION_DAYS = 30
DEFAULT_ALERT_RETENTION_DAYS = 30
DEFAULT_AUDIT_RETENTION_DAYS = 365
DAYS_AHEAD = 7
# fewer days ahead than this and the daemons warn: the owner's timer has stopped
MIN_DAYS_AHEAD = 2


def partition_name(day: date) -> str:
    return f"runs_{day:%Y%m%d}"


@dataclass(frozen=True)
class RecordRetention:
    """How many days dead letters, alerts and audit entries are kept."""

    dead_letter_days: int = DEFAULT_DEAD_LETTER_RETENTION_DAYS
    alert_days: int = DEFAULT_ALERT_RETENTION_DAYS
    audit_days: int = DEFAULT_AUDIT_RETENTION_DAYS


@dataclass(frozen=True)
class Pruned:
    """Rows one pass deleted, per table."""

    dead_letters: int = 0
    alerts: int = 0
    audit_log: int = 0

    @property
    def total(self) -> int:
        return self.dead_letters + self.alerts + self.audit_log


def prune_records(
    store: Store, ages: RecordRetention | None = None, *, now: datetime | None = None
) -> Pruned:
    """Delete dead letters, alerts and audit entries older than their retention ages (by
    the database's clock). An alert still pending is kept whatever its age: it is work the
    alert lane has not finished, not history."""
    ages = ages or RecordRetention()
    now = now or store.now()
    with store.tx() as connection:
        dead = connection.execute(
            delete(schema.dead_letters).where(
                schema.dead_letters.c.created_at < now - timedelta(days=ages.dead_letter_days)
            )
        ).rowcount
        alerts = connection.execute(
            delete(schema.alerts).where(
                schema.alerts.c.created_at < now - timedelta(days=ages.alert_days),
                schema.alerts.c.status != "pending",
            )
        ).rowcount
        audit = connection.execute(
            delete(schema.audit_log).where(
                schema.audit_log.c.at < now - timedelta(days=ages.audit_days)
            )
        ).rowcount
    return Pruned(dead_letters=dead or 0, alerts=alerts or 0, audit_log=audit or 0)


@dataclass(frozen=True)
class Maintenance:
    """What one maintenance pass did and found."""

    created: list[str] = field(default_factory=list)
    removed: int = 0
    pruned: Pruned = field(default_factory=Pruned)
    # the days after today that have their partition (days_covered); None where runs is
    # not partitioned
    days_ahead: int | None = None
    # whether this role may make and drop partitions (False: the runtime role; the owner's
    # `schedctl db maintain` must)
    owned: bool = True

    @property
    def running_short(self) -> bool:
        return self.days_ahead is not None and self.days_ahead < MIN_DAYS_AHEAD


def days_covered(days: frozenset[date], today: date) -> int:
    """How many consecutive days after `today` have a partition. Today itself does not
    count: once today's runs sit in the default partition (the owner's timer was late),
    today's partition can never be made, and that says nothing of the days to come."""
    count = 0
    while today + timedelta(days=count + 1) in days:
        count += 1
    return count


def _partitions(store: Store, connection: Connection) -> RunPartitions | None:
    """The day partitions of runs; None where runs is one table."""
    partitioning = run_partitioning(store.dialect)
    return None if partitioning is None else partitioning.read(connection)


def _partitioned(store: Store) -> PostgresRunPartitions:
    """The partitions' statements, where _partitions found some."""
    partitioning = run_partitioning(store.dialect)
    assert partitioning is not None
    return partitioning


def ensure_run_partitions(
    store: Store, *, today: date | None = None, days_ahead: int = DAYS_AHEAD
) -> list[str]:
    """Create the day partitions from yesterday to `days_ahead` days after today, where
    this role owns runs; returns those created. A day whose rows already sit in the
    default partition stays there (Postgres refuses to create it), which costs nothing but
    retention precision."""
    today = today or datetime.now(UTC).date()
    with store.read() as connection:
        partitions = _partitions(store, connection)
    if partitions is None or not partitions.owned:
        return []
    created = []
    for offset in range(-1, days_ahead + 1):
        day = today + timedelta(days=offset)
        if day in partitions.days:
            continue
        name = partition_name(day)
        start = datetime.combine(day, time(), UTC)
        end = start + timedelta(days=1)
        try:
            with store.tx() as connection:
                if not _partitioned(store).create(connection, name, start, end):
                    continue
            created.append(name)
        except DBAPIError as exc:
            log.info("day partition %s not created: %s", name, str(exc.orig).splitlines()[0])
    return created


def drop_expired_runs(
    store: Store, *, retention_days: int = DEFAULT_RETENTION_DAYS, today: date | None = None
) -> int:
    """Drop day partitions older than the retention period (Postgres, where this role owns
    runs) and delete older rows elsewhere; returns the number of partitions dropped plus
    rows deleted."""
    today = today or datetime.now(UTC).date()
    cutoff = datetime.combine(today - timedelta(days=retention_days), time(), UTC)
    removed = 0
    with store.tx() as connection:
        partitions = _partitions(store, connection)
        if partitions is not None and partitions.owned:
            removed += _partitioned(store).drop_before(connection, cutoff)
        result = connection.execute(delete(schema.runs).where(schema.runs.c.scheduled_at < cutoff))
        removed += result.rowcount or 0
        connection.execute(
            delete(schema.run_attempts).where(schema.run_attempts.c.scheduled_at < cutoff)
        )
    return removed


def maintain_runs(
    store: Store,
    *,
    retention_days: int = DEFAULT_RETENTION_DAYS,
    days_ahead: int = DAYS_AHEAD,
    today: date | None = None,
    require_owner: bool = False,
    records: RecordRetention | None = None,
) -> Maintenance:
    """One maintenance pass: partitions made ahead and expired ones dropped where this role
    owns runs, expired rows deleted, and how far ahead the partitions now reach.
    `require_owner`: refuse (ConfigError, nothing done) where runs is partitioned and this
    role does not own it (`schedctl db maintain` run with the runtime role's URL).
    `records`: the ages of dead letters, alerts and audit entries (default ages if None)."""
    today = today or datetime.now(UTC).date()
    if require_owner:
        with store.read() as connection:
            found = _partitions(store, connection)
        if found is not None and not found.owned:
            raise errors.ConfigError(
                "this database role does not own the runs table, so it cannot make or drop "
                "its day partitions: run it with the owner's URL (the role that runs "
                "`schedctl db upgrade`)",
                field="database_url",
            )
    created = ensure_run_partitions(store, today=today, days_ahead=days_ahead)
    removed = drop_expired_runs(store, retention_days=retention_days, today=today)
    pruned = prune_records(store, records)
    with store.read() as connection:
        partitions = _partitions(store, connection)
    if partitions is None:
        return Maintenance(created=created, removed=removed, pruned=pruned)
    return Maintenance(
        created=created,
        removed=removed,
        pruned=pruned,
        days_ahead=days_covered(partitions.days, today),
        owned=partitions.owned,
    )
