"""Rolling upgrades: the schema compatibility rule (a daemon accepts its own revision and a
newer one declared compatible with it, refuses the others with the command to run), `db
downgrade` (previous revision, --to, refusals) and back up on SQLite and Postgres, and the
online upgrade's lock timeout with retries."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import inspect, select, text
from typer.testing import CliRunner

from schedctl.cli.app import app
from schedctl.core import errors
from schedctl.storage.db import migrate, schema
from schedctl.storage.db.engine import make_engine
from schedctl.storage.db.migrate import (
    FLOOR_SETTING,
    current_revision,
    downgrade_steps,
    head_revision,
    revisions,
    schema_check,
    upgrade_steps,
)
from schedctl.storage.db.store import Store
from tests.factories import insert_cron_job_row, insert_tenant_row

runner = CliRunner()
NEXT = "9001"  # a synthetic next release's revision, unknown to this release


# 0020 (the run policy) adds columns to jobs: its ALTER waits behind any reader of jobs
ALTERS_JOBS = "0020"


def previous() -> str:
    found = revisions()[head_revision()]
    assert found is not None
    return found


def fake_next_release(url: str, *, floor: str) -> None:
    """What a next release's additive migration leaves: a new table, a nullable column on a
    hot table, and its revision with its recorded floor (as its `db upgrade` writes it)."""
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE next_release_notes (id INTEGER PRIMARY KEY)"))
            connection.execute(text("ALTER TABLE jobs ADD COLUMN next_release_note TEXT"))
            connection.execute(text(f"UPDATE alembic_version SET version_num = '{NEXT}'"))
            connection.execute(
                text("UPDATE settings SET value = :v WHERE key = :k"),
                {"v": floor, "k": FLOOR_SETTING},
            )
    finally:
        engine.dispose()


def db_status(url: str) -> tuple[int, dict[str, object]]:
    result = runner.invoke(app, ["--db", url, "--output", "json", "db", "status"])
    return result.exit_code, json.loads(result.stdout)


def test_every_migration_declares_its_floor_within_its_lineage() -> None:
    floors = migrate.floors()
    assert set(floors) == set(revisions())
    for revision, floor in floors.items():
        assert floor in migrate.lineage(revision), (revision, floor)


def test_a_fresh_database_records_the_heads_floor(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        check = schema_check(engine)
    finally:
        engine.dispose()
    assert (check.state, check.current, check.floor) == (
        "current",
        head_revision(),
        migrate.floors()[head_revision()],
    )
    assert db_status(db_url) == (
        0,
        {
            "database": db_status(db_url)[1]["database"],
            "current": head_revision(),
            "head": head_revision(),
            "compatible_with": migrate.floors()[head_revision()],
            "compatibility": "current",
            "up_to_date": True,
        },
    )


def test_a_newer_compatible_revision_is_accepted(db_url: str) -> None:
    fake_next_release(db_url, floor=head_revision())
    store = Store.open(db_url)  # the daemons' check
    try:
        assert store.partition_count > 0
    finally:
        store.close()
    code, status = db_status(db_url)
    assert code == 0
    assert (status["current"], status["compatibility"]) == (NEXT, "compatible")
    # the CLI's commands work against it too
    result = runner.invoke(app, ["--db", db_url, "tenant", "create", "acme"])
    assert result.exit_code == 0, result.output
    # and this release's `db upgrade` (an old host's, say) leaves the newer schema alone
    result = runner.invoke(app, ["--db", db_url, "db", "upgrade"])
    assert result.exit_code == 0 and f"already at revision {NEXT}" in result.output
    code, status = db_status(db_url)
    assert (code, status["current"]) == (0, NEXT)


def test_a_newer_revision_whose_floor_is_past_head_is_refused(db_url: str) -> None:
    fake_next_release(db_url, floor=NEXT)
    with pytest.raises(errors.SchemaOutdated) as caught:
        Store.open(db_url)
    message = str(caught.value)
    assert NEXT in message and "install the release" in message
    code, status = db_status(db_url)
    assert (code, status["compatibility"]) == (2, "too_new")
    result = runner.invoke(app, ["--db", db_url, "tenant", "list"])
    assert result.exit_code == 2 and "install the release" in result.output
    # this release's `db upgrade` does not touch a schema it does not know
    result = runner.invoke(app, ["--db", db_url, "db", "upgrade"])
    assert result.exit_code == 2
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == NEXT
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["dispatcher", "relay"])
def test_a_daemon_refuses_a_newer_revision_whose_floor_is_past_head(
    db_url: str, mode: str, tmp_path: Path
) -> None:
    """The real `scheduled-d` process: exit 2 before it does anything, the message naming
    the release to install; the database is left as it was."""
    fake_next_release(db_url, floor=NEXT)
    config = tmp_path / "scheduled.toml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "scheduled-d"), mode],
        env={**env, "SCHEDULED_DATABASE_URL": db_url, "SCHEDULED_CONFIG": str(config)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"schema revision {NEXT}" in done.stderr and "install the release" in done.stderr
    assert "Traceback" not in done.stderr
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == NEXT
    finally:
        engine.dispose()


def test_a_newer_revision_without_a_recorded_floor_is_refused(db_url: str) -> None:
    fake_next_release(db_url, floor=head_revision())
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("DELETE FROM settings WHERE key = :k"), {"k": FLOOR_SETTING})
        assert schema_check(engine).state == "too_new"
    finally:
        engine.dispose()


def test_an_older_revision_is_refused_with_db_upgrade(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        downgrade_steps(engine)
        assert current_revision(engine) == previous()
    finally:
        engine.dispose()
    with pytest.raises(errors.SchemaOutdated, match="run `schedctl db upgrade`"):
        Store.open(db_url)
    assert db_status(db_url)[0] == 2


def test_downgrade_to_previous_and_back_up_keeps_data(db_url: str) -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            insert_tenant_row(
                connection, "t1", "acme", created_at=now, quota=10, signing_secret="s"
            )
            insert_cron_job_row(connection, "j1", "t1", queue="q", at=now)
        result = runner.invoke(app, ["--db", db_url, "--output", "json", "db", "downgrade"])
        assert result.exit_code == 0, result.output
        body = json.loads(result.stdout)
        assert (body["before"], body["after"]) == (head_revision(), previous())
        assert schema_check(engine).floor == migrate.floors()[previous()]
        result = runner.invoke(app, ["--db", db_url, "--output", "json", "db", "upgrade"])
        assert result.exit_code == 0, result.output
        body = json.loads(result.stdout)
        assert (body["before"], body["after"]) == (previous(), head_revision())
        assert [s["to"] for s in body["steps"]] == [head_revision()]
        with engine.connect() as connection:
            assert connection.execute(select(schema.jobs.c.name)).scalars().all() == ["nightly"]
    finally:
        engine.dispose()


def test_every_downgrade_works_down_to_the_first_revision_and_back(db_url: str) -> None:
    first = migrate.lineage(head_revision())[0]
    engine = make_engine(db_url)
    try:
        steps = downgrade_steps(engine, first)
        assert [s.target for s in steps] == list(reversed(migrate.lineage(head_revision())[:-1]))
        assert current_revision(engine) == first
        assert set(inspect(engine).get_table_names()) - {"alembic_version"} >= {"jobs", "runs"}
        assert "queue_messages" not in inspect(engine).get_table_names()
        upgrade_steps(engine)
        assert current_revision(engine) == head_revision()
        assert set(schema.metadata.tables) <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_downgrade_refusals_change_nothing(db_url: str) -> None:
    first = migrate.lineage(head_revision())[0]
    for argv, code, words in [
        (["db", "downgrade", "--to", "nope"], 2, "to: unknown schema revision"),
        (["db", "downgrade", "--to", NEXT], 2, "unknown schema revision"),
    ]:
        result = runner.invoke(app, ["--db", db_url, *argv])
        assert result.exit_code == code and words in result.output, result.output
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == head_revision()
        downgrade_steps(engine, first)
        result = runner.invoke(app, ["--db", db_url, "db", "downgrade"])
        assert result.exit_code == 4 and "first schema revision" in result.output
        # --to a revision after the current one is an upgrade, not a downgrade
        result = runner.invoke(app, ["--db", db_url, "db", "downgrade", "--to", head_revision()])
        assert result.exit_code == 2 and "db upgrade" in result.output
        assert current_revision(engine) == first
    finally:
        engine.dispose()


def test_downgrade_of_an_empty_database_is_refused(empty_sqlite_url: str) -> None:
    result = runner.invoke(app, ["--db", empty_sqlite_url, "db", "downgrade"])
    assert result.exit_code == 4 and "nothing to downgrade" in result.output


@pytest.mark.postgres
def test_a_migration_that_cannot_take_its_lock_gives_up_and_retries(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A long transaction holding a lock on `jobs` makes a migration that alters jobs (ALTERS_JOBS)
    time out after LOCK_TIMEOUT_MS, roll back and try again; once the holder ends it runs."""
    caplog.set_level(logging.WARNING, logger="schedctl.storage.db.migrate")
    before = revisions()[ALTERS_JOBS]
    assert before is not None
    engine = make_engine(pg_url)
    holder = make_engine(pg_url)
    done: list[object] = []
    try:
        downgrade_steps(engine, to=before)
        with holder.connect() as blocking:
            blocking.execute(text("SELECT count(*) FROM jobs"))  # ACCESS SHARE until the end
            thread = threading.Thread(
                target=lambda: done.append(upgrade_steps(engine, ALTERS_JOBS))
            )
            thread.start()
            for _ in range(600):  # bounded: 60 s
                if any("could not take its lock" in r.getMessage() for r in caplog.records):
                    break
                time.sleep(0.1)
            assert current_revision(engine) == before  # nothing applied while it waits
            blocking.rollback()
        thread.join(timeout=120)
        assert not thread.is_alive()
        assert current_revision(engine) == ALTERS_JOBS
        (steps,) = done
        assert isinstance(steps, list) and steps[-1].attempts >= 2
        with engine.connect() as connection:
            # the pooled session did not keep the migration's lock timeout
            assert connection.execute(text("SHOW lock_timeout")).scalar() == "0"
    finally:
        holder.dispose()
        engine.dispose()


@pytest.mark.postgres
def test_a_lock_never_granted_fails_the_step_and_applies_nothing(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate, "MIGRATION_ATTEMPTS", 2)
    before = revisions()[ALTERS_JOBS]
    assert before is not None
    engine = make_engine(pg_url)
    holder = make_engine(pg_url)
    try:
        downgrade_steps(engine, to=before)
        with holder.connect() as blocking:
            blocking.execute(text("SELECT count(*) FROM jobs"))
            with pytest.raises(errors.StoreUnavailable, match="could not take its lock"):
                upgrade_steps(engine, ALTERS_JOBS)
            blocking.rollback()
        assert current_revision(engine) == before
    finally:
        holder.dispose()
        engine.dispose()
