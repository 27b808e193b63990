"""Migrations: from empty to head, from the previous revision with data, idempotent, and the
migrated schema equals the SQLAlchemy metadata the code uses."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text

from schedctl.storage.db import schema
from schedctl.storage.db.engine import make_engine
from schedctl.storage.db.migrate import current_revision, head_revision, upgrade
from tests.factories import insert_cron_job_row, insert_tenant_row

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
                # and the indexes Postgres makes on them from the parent's
                and not (d[0] == "remove_index" and d[1].table.name.startswith("runs_"))
                # an index declared for another dialect only (ddl_if), e.g. pg_trgm's
                and not (d[0] == "add_index" and not _for_dialect(d[1], connection.dialect.name))
            ]
        assert diff == []
    finally:
        engine.dispose()


def _for_dialect(index: Any, dialect: str) -> bool:
    """Whether the metadata's index of this name is made on `dialect` (autogenerate's diff
    holds a copy of it without its ddl_if)."""
    declared = {i.name: i for table in schema.metadata.tables.values() for i in table.indexes}
    condition = getattr(declared.get(index.name), "_ddl_if", None)
    return condition is None or condition.dialect in (None, dialect)


def test_upgrade_from_previous_revision_keeps_data(empty_url: str) -> None:
    upgrade(empty_url, "0001")
    engine = make_engine(empty_url)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    try:
        assert current_revision(engine) == "0001"
        with engine.begin() as connection:
            insert_tenant_row(
                connection, "t1", "acme", created_at=now, quota=10, signing_secret="s"
            )
            insert_cron_job_row(connection, "j1", "t1", queue="q", at=now)
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


@pytest.mark.postgres
def test_postgres_analyzes_jobs_every_ten_thousand_changes(empty_pg_url: str) -> None:
    """Not after a tenth of the table: the statistics must learn a new tenant's jobs soon,
    or its lookups are planned as walks through all of them (migration 0014)."""
    upgrade(empty_pg_url)
    engine = make_engine(empty_pg_url)
    try:
        with engine.connect() as connection:
            options = connection.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = 'jobs'")
            ).scalar_one()
    finally:
        engine.dispose()
    assert set(options) >= {
        "autovacuum_analyze_scale_factor=0",
        "autovacuum_analyze_threshold=10000",
    }
