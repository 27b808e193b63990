"""Migrations: from empty to head, from the previous revision with data, idempotent, and the
migrated schema equals the SQLAlchemy metadata the code uses."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text

from schedctl.storage import schema
from schedctl.storage.engine import make_engine
from schedctl.storage.migrate import current_revision, head_revision, upgrade

EMPTY = ["empty_sqlite_url", pytest.param("empty_pg_url", marks=pytest.mark.postgres)]


@pytest.fixture(params=EMPTY)
def empty_url(request: pytest.FixtureRequest) -> str:
    url = request.getfixturevalue(request.param)
    assert isinstance(url, str)
    return url


def test_upgrade_from_empty_builds_every_table(empty_url: str) -> None:
    before, after = upgrade(empty_url)
    assert before is None
    assert after == head_revision()
    engine = make_engine(empty_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert set(schema.metadata.tables) <= tables
    finally:
        engine.dispose()


def test_upgrade_twice_changes_nothing(empty_url: str) -> None:
    upgrade(empty_url)
    before, after = upgrade(empty_url)
    assert before == after == head_revision()


def test_migrated_schema_matches_the_metadata(empty_url: str) -> None:
    upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection)
            diff = [
                d
                for d in compare_metadata(context, schema.metadata)
                # Postgres day partitions of runs are created at run time, not declared
                if not (d[0] == "remove_table" and d[1].name.startswith("runs_"))
            ]
        assert diff == []
    finally:
        engine.dispose()


def test_upgrade_from_previous_revision_keeps_data(empty_url: str) -> None:
    upgrade(empty_url, "0001")
    engine = make_engine(empty_url)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    try:
        assert current_revision(engine) == "0001"
        with engine.begin() as connection:
            connection.execute(
                schema.tenants.insert().values(
                    tenant_id="t1",
                    name="acme",
                    signing_secret="s",
                    max_jobs=10,
                    create_rate_per_minute=10,
                    dispatch_rate_per_second=10,
                    allow_list="[]",
                    created_at=now,
                )
            )
            connection.execute(
                schema.jobs.insert().values(
                    job_id="j1",
                    tenant_id="t1",
                    name="nightly",
                    schedule=json.dumps({"kind": "cron", "cron": "0 2 * * *", "timezone": "UTC"}),
                    target_type="queue",
                    target="q",
                    payload="{}",
                    max_attempts=3,
                    retry_base_seconds=1.0,
                    retry_max_seconds=60.0,
                    misfire_policy="run_once",
                    grace_seconds=60,
                    window_seconds=0,
                    max_concurrency=1,
                    timeout_seconds=0,
                    status="active",
                    next_run_at=now,
                    next_fire_at=now,
                    partition=7,
                    version=1,
                    request_hash="h",
                    created_at=now,
                    updated_at=now,
                )
            )
    finally:
        engine.dispose()
    before, after = upgrade(empty_url)
    assert (before, after) == ("0001", head_revision())
    engine = make_engine(empty_url)
    try:
        with engine.connect() as connection:
            row = connection.execute(select(schema.jobs).where(schema.jobs.c.job_id == "j1")).one()
            assert row.name == "nightly" and row.next_run_at == now
            # the tables the second revision adds are there and usable
            assert connection.execute(text("SELECT count(*) FROM queue_messages")).scalar() == 0
    finally:
        engine.dispose()
