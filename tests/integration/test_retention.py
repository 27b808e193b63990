"""Run-history retention: day partitions made ahead on Postgres, expired history removed."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import func, select, text

from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.records.retention import (
    drop_expired_runs,
    ensure_run_partitions,
    partition_name,
)


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


def _record_rows(store: Store, label: str, at: datetime, *, alert_status: str) -> None:
    """One dead letter, one alert and one audit entry made at `at`, named by `label`."""
    with store.tx() as connection:
        connection.execute(
            schema.dead_letters.insert().values(
                job_id=label,
                scheduled_at=at,
                tenant_id="t",
                target_type="queue",
                target="q",
                attempts=1,
                last_error="exit code 3",
                created_at=at,
            )
        )
        connection.execute(
            schema.alerts.insert().values(
                tenant_id="t",
                job_id=label,
                scheduled_at=at,
                kind="failure",
                run_attempt=1,
                channel="webhook",
                destination="https://example.com/hook",
                body="{}",
                status=alert_status,
                attempt=1,
                available_at=at,
                created_at=at,
            )
        )
        connection.execute(
            schema.audit_log.insert().values(
                at=at, tenant_id="t", actor="op", action="job.create", job_id=label
            )
        )


def _labels(store: Store) -> dict[str, set[str]]:
    with store.read() as connection:
        return {
            "dead_letters": set(connection.execute(select(schema.dead_letters.c.job_id)).scalars()),
            "alerts": set(connection.execute(select(schema.alerts.c.job_id)).scalars()),
            "audit_log": set(connection.execute(select(schema.audit_log.c.job_id)).scalars()),
        }


def test_dead_letters_alerts_and_audit_entries_are_pruned_by_their_ages(db_url: str) -> None:
    """The maintenance thread's pass with the configured ages: older rows go, recent ones
    stay; an alert still pending stays whatever its age (unfinished work, not history)."""
    from schedctl.domain.config import load_config
    from scheduled_d.maintenance import maintain_once, record_retention

    config = load_config(
        environ={
            "SCHEDULED_DATABASE_URL": db_url,
            "SCHEDULED_DEAD_LETTER_RETENTION_DAYS": "10",
            "SCHEDULED_ALERT_RETENTION_DAYS": "20",
            "SCHEDULED_AUDIT_RETENTION_DAYS": "40",
        }
    )
    store = Store.open(db_url)
    try:
        now = store.now()
        _record_rows(store, "fresh", now - timedelta(days=5), alert_status="delivered")
        _record_rows(store, "d15", now - timedelta(days=15), alert_status="failed")
        _record_rows(store, "d30", now - timedelta(days=30), alert_status="delivered")
        _record_rows(store, "d50", now - timedelta(days=50), alert_status="pending")
        maintain_once(store, retention_days=90, records=record_retention(config))
        assert _labels(store) == {
            "dead_letters": {"fresh"},
            "alerts": {"fresh", "d15", "d50"},
            "audit_log": {"fresh", "d15", "d30"},
        }
    finally:
        store.close()


def test_default_record_ages_keep_a_month_of_dead_letters_and_a_year_of_audit(
    db_url: str,
) -> None:
    from schedctl.storage.records.retention import prune_records

    store = Store.open(db_url)
    try:
        now = store.now()
        _record_rows(store, "d20", now - timedelta(days=20), alert_status="delivered")
        _record_rows(store, "d40", now - timedelta(days=40), alert_status="delivered")
        _record_rows(store, "d400", now - timedelta(days=400), alert_status="delivered")
        pruned = prune_records(store)
        assert (pruned.dead_letters, pruned.alerts, pruned.audit_log) == (2, 2, 1)
        assert _labels(store) == {
            "dead_letters": {"d20"},
            "alerts": {"d20"},
            "audit_log": {"d20", "d40"},
        }
    finally:
        store.close()


@pytest.mark.parametrize(
    "key", ["dead_letter_retention_days", "alert_retention_days", "audit_retention_days"]
)
def test_a_record_retention_age_must_be_positive(key: str) -> None:
    from schedctl.core import errors
    from schedctl.domain.config import load_config

    with pytest.raises(errors.ConfigError) as caught:
        load_config(environ={f"SCHEDULED_{key.upper()}": "0"})
    assert caught.value.field == key
