"""Run-history housekeeping: day partitions of `runs` where the dialect partitions it
(Postgres), made ahead and dropped after the retention period; old run rows deleted
everywhere."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import delete
from sqlalchemy.exc import DBAPIError

from schedctl.storage import schema
from schedctl.storage.store import Store

log = logging.getLogger(__name__)

DEFAULT_RETENTION_DAYS = 90
DAYS_AHEAD = 7


def partition_name(day: date) -> str:
    return f"runs_{day:%Y%m%d}"


def ensure_run_partitions(
    store: Store, *, today: date | None = None, days_ahead: int = DAYS_AHEAD
) -> list[str]:
    """Create the day partitions from today to `days_ahead`; returns those created. A day
    whose rows already sit in the default partition stays there (Postgres refuses to
    create it), which costs nothing but retention precision."""
    today = today or datetime.now(UTC).date()
    created = []
    for day in store.dialect.run_partition_days(today, days_ahead):
        name = partition_name(day)
        start = datetime.combine(day, time(), UTC)
        end = start + timedelta(days=1)
        try:
            with store.tx() as connection:
                if not store.dialect.create_run_partition(connection, name, start, end):
                    continue
            created.append(name)
        except DBAPIError as exc:
            log.info("day partition %s not created: %s", name, str(exc.orig).splitlines()[0])
    return created


def drop_expired_runs(
    store: Store, *, retention_days: int = DEFAULT_RETENTION_DAYS, today: date | None = None
) -> int:
    """Drop day partitions older than the retention period (Postgres) and delete older rows
    elsewhere; returns the number of partitions dropped plus rows deleted."""
    today = today or datetime.now(UTC).date()
    cutoff = datetime.combine(today - timedelta(days=retention_days), time(), UTC)
    removed = 0
    with store.tx() as connection:
        removed += store.dialect.drop_run_partitions(connection, cutoff)
        result = connection.execute(delete(schema.runs).where(schema.runs.c.scheduled_at < cutoff))
        removed += result.rowcount or 0
        connection.execute(
            delete(schema.run_attempts).where(schema.run_attempts.c.scheduled_at < cutoff)
        )
    return removed
