"""Run-history retention: day partitions made ahead on Postgres, expired history removed."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import func, select, text

from schedctl.storage import schema
from schedctl.storage.retention import drop_expired_runs, ensure_run_partitions, partition_name
from schedctl.storage.store import Store


def insert_run(store: Store, job_id: str, at: datetime) -> None:
    with store.tx() as connection:
        connection.execute(
            schema.runs.insert().values(
                job_id=job_id,
                scheduled_at=at,
                tenant_id="t",
                partition=0,
                trigger="schedule",
                status="succeeded",
                attempt=1,
            )
        )


def count_runs(store: Store) -> int:
    with store.read() as connection:
        return int(connection.execute(select(func.count()).select_from(schema.runs)).scalar_one())


@pytest.mark.postgres
def test_day_partitions_are_made_ahead_and_dropped_after_retention(pg_url: str) -> None:
    store = Store.open(pg_url)
    try:
        today = datetime.now(UTC).date()
        old_day = today - timedelta(days=100)
        created = ensure_run_partitions(store, today=old_day, days_ahead=1)
        assert partition_name(old_day) in created
        created_now = ensure_run_partitions(store)
        assert partition_name(today) in created_now
        assert ensure_run_partitions(store) == []  # idempotent
        insert_run(store, "old", datetime.combine(old_day, datetime.min.time(), UTC))
        insert_run(store, "new", datetime.now(UTC))
        with store.read() as connection:
            where = connection.execute(
                text("SELECT tableoid::regclass::text FROM runs WHERE job_id = 'new'")
            ).scalar_one()
        assert where == partition_name(today)
        removed = drop_expired_runs(store, retention_days=90)
        assert removed >= 1
        assert count_runs(store) == 1
        with store.read() as connection:
            gone = connection.execute(
                text("SELECT to_regclass(:n) IS NULL"), {"n": partition_name(old_day)}
            ).scalar_one()
        assert gone
    finally:
        store.close()


def test_expired_runs_are_deleted_on_sqlite(sqlite_url: str) -> None:
    store = Store.open(sqlite_url)
    try:
        assert ensure_run_partitions(store) == []
        insert_run(store, "old", datetime.now(UTC) - timedelta(days=120))
        insert_run(store, "new", datetime.now(UTC))
        assert drop_expired_runs(store, retention_days=90, today=date.today()) == 1
        assert count_runs(store) == 1
    finally:
        store.close()
