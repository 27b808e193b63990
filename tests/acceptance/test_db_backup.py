"""`schedctl db backup FILE` and `db restore FILE` on both backends: a restore into a fresh
database holds the jobs and runs of the backup; bad input is a clear error naming the
field, and nothing changes."""

from __future__ import annotations

import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from schedctl.cli.app import app
from schedctl.storage.db import schema
from schedctl.storage.db.backup import libpq_target
from schedctl.storage.db.store import Store
from tests.factories import create_job, every, make_tenant

runner = CliRunner()


def invoke(db: str, *args: str) -> Any:
    result = runner.invoke(app, ["--db", db, *args])
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{result.output}")
    return result


def contents(url: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The job ids and (job id, run status) of the database at `url`."""
    store = Store.open(url)
    try:
        with store.read() as connection:
            jobs = sorted(connection.execute(select(schema.jobs.c.job_id)).scalars())
            runs = sorted(
                (str(row[0]), str(row[1]))
                for row in connection.execute(select(schema.runs.c.job_id, schema.runs.c.status))
            )
        return jobs, runs
    finally:
        store.close()


def populate(url: str) -> None:
    store = Store.open(url)
    try:
        tenant = make_tenant(store)
        job_id = create_job(store, tenant, every(60, datetime.now(UTC)))
        with store.tx() as connection:
            for minutes in (1, 2, 3):
                connection.execute(
                    schema.runs.insert().values(
                        job_id=job_id,
                        scheduled_at=datetime.now(UTC) - timedelta(minutes=minutes),
                        tenant_id=tenant,
                        partition=0,
                        trigger="schedule",
                        status="succeeded",
                        attempt=1,
                    )
                )
    finally:
        store.close()


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def source_and_fresh(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """A migrated database to back up, and a fresh one (no file; no schema) to restore into."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url"), f"sqlite:///{tmp_path / 'restored.db'}"
    return request.getfixturevalue("pg_url"), request.getfixturevalue("empty_pg_url")


def test_a_restore_into_a_fresh_database_holds_the_jobs_and_runs(
    source_and_fresh: tuple[str, str], tmp_path: Path
) -> None:
    source, fresh = source_and_fresh
    populate(source)
    expected = contents(source)
    assert len(expected[0]) == 1 and len(expected[1]) == 3
    file = tmp_path / "scheduler.backup"
    made = invoke(source, "db", "backup", str(file))
    assert made.exit_code == 0, made.output
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    restored = invoke(fresh, "db", "restore", str(file))
    assert restored.exit_code == 0, restored.output
    assert contents(fresh) == expected
    if fresh.startswith("sqlite"):
        path = Path(fresh.removeprefix("sqlite:///"))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    else:
        assert "db grant" in restored.stdout  # the grants are the operator's to re-run
    # the restored database is at this version's schema: commands work on it at once
    assert invoke(fresh, "db", "status").exit_code == 0


def test_a_restore_over_a_scheduler_needs_force(
    source_and_fresh: tuple[str, str], tmp_path: Path
) -> None:
    source, _fresh = source_and_fresh
    file = tmp_path / "empty.backup"
    assert invoke(source, "db", "backup", str(file)).exit_code == 0
    populate(source)
    before = contents(source)
    refused = invoke(source, "db", "restore", str(file))
    assert refused.exit_code == 4, refused.output
    assert "--force" in refused.stderr
    assert contents(source) == before  # nothing changed
    forced = invoke(source, "db", "restore", "--force", str(file))
    assert forced.exit_code == 0, forced.output
    assert contents(source) == ([], [])


def test_a_restore_is_refused_while_a_dispatcher_holds_the_database(
    source_and_fresh: tuple[str, str], tmp_path: Path
) -> None:
    source, _fresh = source_and_fresh
    file = tmp_path / "scheduler.backup"
    assert invoke(source, "db", "backup", str(file)).exit_code == 0
    populate(source)
    store = Store.open(source)
    try:
        with store.tx() as connection:
            connection.execute(schema.partitions.delete().where(schema.partitions.c.partition == 0))
            connection.execute(
                schema.partitions.insert().values(
                    partition=0, epoch=1, owner="sched-a-1234", updated_at=datetime.now(UTC)
                )
            )
    finally:
        store.close()
    before = contents(source)
    refused = invoke(source, "db", "restore", str(file))
    assert refused.exit_code == 4, refused.output
    assert "stop the daemons" in refused.stderr and "sched-a-1234" in refused.stderr
    assert contents(source) == before  # nothing changed
    # a claim left by a killed dispatcher is forced over
    forced = invoke(source, "db", "restore", "--force", str(file))
    assert forced.exit_code == 0, forced.output
    assert contents(source) == ([], [])


def test_bad_backup_and_restore_input_names_the_field_and_changes_nothing(
    db_url: str, tmp_path: Path
) -> None:
    populate(db_url)
    before = contents(db_url)
    missing = invoke(db_url, "db", "restore", str(tmp_path / "nope.backup"))
    assert missing.exit_code == 2 and "FILE" in missing.stderr
    assert "does not exist" in missing.stderr
    directory = invoke(db_url, "db", "restore", str(tmp_path))
    assert directory.exit_code == 2 and "FILE" in directory.stderr
    assert "not a file" in directory.stderr
    garbage = tmp_path / "garbage.backup"
    garbage.write_text("not a backup\n")
    foreign = invoke(db_url, "db", "restore", "--force", str(garbage))
    assert foreign.exit_code == 2 and "FILE" in foreign.stderr
    assert "not a" in foreign.stderr
    assert contents(db_url) == before
    # an existing backup file is replaced only with --force
    existing = tmp_path / "kept.backup"
    existing.write_text("keep me\n")
    refused = invoke(db_url, "db", "backup", str(existing))
    assert refused.exit_code == 4 and "FILE" in refused.stderr and "--force" in refused.stderr
    assert existing.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    replaced = invoke(db_url, "db", "backup", "--force", str(existing))
    assert replaced.exit_code == 0, replaced.output
    assert existing.read_bytes()[:5] in (b"SQLit", b"PGDMP")


def test_a_sqlite_file_that_is_no_scheduler_is_refused(sqlite_url: str, tmp_path: Path) -> None:
    import contextlib
    import sqlite3

    other = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(other)) as connection:
        connection.execute("CREATE TABLE t (x)")
        connection.commit()
    populate(sqlite_url)
    before = contents(sqlite_url)
    refused = invoke(sqlite_url, "db", "restore", "--force", str(other))
    assert refused.exit_code == 2 and "not a scheduler database" in refused.stderr
    assert contents(sqlite_url) == before


def test_the_postgres_password_never_reaches_the_command_line() -> None:
    conninfo, env = libpq_target(
        "postgresql://owner:s3cr%20t@db.internal:5433/sched?sslmode=verify-full"
        "&sslrootcert=/etc/scheduled/db ca.crt"
    )
    assert "s3cr" not in conninfo
    assert env == {"PGPASSWORD": "s3cr t"}
    assert conninfo == (
        "host=db.internal port=5433 user=owner dbname=sched sslmode=verify-full "
        "sslrootcert='/etc/scheduled/db ca.crt'"
    )
    _conninfo, env = libpq_target("postgresql://owner@db.internal/sched?password=q")
    assert env == {"PGPASSWORD": "q"} and "q" not in _conninfo.split("=")[-1]


@pytest.mark.postgres
def test_a_postgres_restore_that_fails_half_way_changes_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    """The drop of the old tables and the restore are one transaction: an error in the
    middle (here a name the backup's index needs, taken in the target) leaves the
    database as it was."""
    from sqlalchemy import text

    file = tmp_path / "scheduler.backup"
    assert invoke(pg_url, "db", "backup", str(file)).exit_code == 0
    populate(pg_url)
    store = Store.open(pg_url)
    try:
        with store.tx() as connection:
            connection.execute(text("DROP INDEX ix_audit_log_tenant"))
            connection.execute(text("CREATE SEQUENCE ix_audit_log_tenant"))
    finally:
        store.close()
    before = contents(pg_url)
    failed = invoke(pg_url, "db", "restore", "--force", str(file))
    assert failed.exit_code == 7, failed.output
    assert "ix_audit_log_tenant" in failed.stderr
    assert contents(pg_url) == before
