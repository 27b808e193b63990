"""The two Postgres roles: `schedctl db grant` gives the runtime role exactly DML on the
scheduler's tables (no DDL), `schedctl db maintain` makes and drops day partitions as the
owner and refuses the runtime role, and the daemons' maintenance does no DDL as the
runtime role (a day without its partition fills the default one) and warns when the
owner's partitions run short."""

from __future__ import annotations

import json
import logging
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.records import console
from schedctl.storage.records.retention import maintain_runs, partition_name
from schedctl.storage.records.run_partitions import PostgresRunPartitions
from scheduled_d.maintenance import maintain_once
from tests.integration.api_support import Api, serving
from tests.pg_roles import RUNTIME_ROLE
from tests.services.postgres import PostgresServer

pytestmark = pytest.mark.postgres

runner = CliRunner()


def invoke(db: str, *args: str) -> Any:
    result = runner.invoke(app, ["--db", db, *args])
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{result.output}")
    return result


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def privileges(pg_url: str, role: str) -> set[tuple[str, str]]:
    """(table, privilege) the role holds on the database's tables."""
    with closing(Store.open(pg_url)) as store, store.read() as connection:
        rows = connection.execute(
            text(
                "SELECT table_name, privilege_type FROM information_schema.table_privileges"
                " WHERE grantee = :role"
            ),
            {"role": role},
        ).all()
    return {(str(r[0]), str(r[1])) for r in rows}


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


# -- db grant ----------------------------------------------------------------------------


def test_db_grant_prints_exactly_dml_on_the_tables(pg_url: str) -> None:
    result = invoke(pg_url, "db", "grant", RUNTIME_ROLE)
    assert result.exit_code == 0, result.output
    statements = [line for line in result.stdout.splitlines() if line]
    assert all(line.endswith(";") for line in statements)
    assert any(
        s.startswith("GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE ") and '"jobs"' in s
        for s in statements
    )
    assert any(s.startswith("GRANT USAGE ON SEQUENCE ") for s in statements)
    assert 'GRANT SELECT ON TABLE "alembic_version" TO "schedctl_runtime";' in statements
    assert any("ALTER DEFAULT PRIVILEGES" in s and "ON TABLES" in s for s in statements)
    text_ = result.stdout.upper()
    for right in ("TRUNCATE", "REFERENCES", "TRIGGER", "CREATE", "ALL PRIVILEGES"):
        assert f"GRANT {right}" not in text_ and f", {right}" not in text_
    as_json = json.loads(invoke(pg_url, "db", "grant", RUNTIME_ROLE, "-o", "json").stdout)
    assert [f"{s};" for s in as_json["statements"]] == statements
    assert as_json["applied"] is False


def test_db_grant_apply_makes_the_grants_exact_and_is_idempotent(pg_url: str) -> None:
    granted = privileges(pg_url, RUNTIME_ROLE)  # the template's, by the same code
    assert ("jobs", "INSERT") in granted and ("alembic_version", "SELECT") in granted
    assert ("alembic_version", "INSERT") not in granted
    with closing(Store.open(pg_url)) as store, store.tx() as connection:
        connection.exec_driver_sql(f"GRANT TRUNCATE, TRIGGER ON runs, jobs TO {RUNTIME_ROLE}")
    assert ("runs", "TRUNCATE") in privileges(pg_url, RUNTIME_ROLE)
    for _ in range(2):
        result = invoke(pg_url, "db", "grant", RUNTIME_ROLE, "--apply")
        assert result.exit_code == 0, result.output
        assert privileges(pg_url, RUNTIME_ROLE) == granted


def test_a_table_a_later_migration_creates_is_the_runtime_roles_without_a_new_grant(
    pg_url: str, pg_runtime_url: str
) -> None:
    with closing(Store.open(pg_url)) as store, store.tx() as connection:
        # as a migration would, run by the owner
        connection.exec_driver_sql("CREATE TABLE later_table (id bigserial PRIMARY KEY, v text)")
    with psycopg.connect(libpq(pg_runtime_url), autocommit=True) as connection:
        connection.execute("INSERT INTO later_table (v) VALUES ('x')")
        assert connection.execute("SELECT v FROM later_table").fetchall() == [("x",)]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute("TRUNCATE later_table")


def test_db_grant_notes_a_role_that_may_create_tables_in_the_schema(
    pg_server: PostgresServer, pg_url: str
) -> None:
    pg_server.ensure_role("schedctl_creator")
    with closing(Store.open(pg_url)) as store, store.tx() as connection:
        connection.exec_driver_sql("GRANT CREATE ON SCHEMA public TO schedctl_creator")
    result = invoke(pg_url, "db", "grant", "schedctl_creator")
    assert result.exit_code == 0, result.output
    assert "may create tables in schema 'public'" in result.stderr
    assert "REVOKE CREATE ON SCHEMA" in result.stderr
    assert "note:" not in result.stdout  # stdout stays statements only (| psql)


def test_db_grant_of_a_missing_role_names_it_and_changes_nothing(pg_url: str) -> None:
    before = privileges(pg_url, "nobody_here")
    result = invoke(pg_url, "db", "grant", "nobody_here", "--apply")
    assert result.exit_code == 3, result.output
    assert "role: no role 'nobody_here'" in result.output
    assert privileges(pg_url, "nobody_here") == before == set()


@pytest.mark.parametrize("role", ["x; DROP TABLE jobs", "", "1abc", "a" * 64, "ro\nle"])
def test_db_grant_refuses_a_bad_role_name(pg_url: str, role: str) -> None:
    result = invoke(pg_url, "db", "grant", role)
    assert result.exit_code == 2, result.output
    assert "role: a role name is" in result.output


def test_db_grant_refuses_the_owner_and_its_members(pg_server: PostgresServer, pg_url: str) -> None:
    pg_server.ensure_role("schedctl_member")
    pg_server.admin("GRANT postgres TO schedctl_member")
    result = invoke(pg_url, "db", "grant", "schedctl_member", "--apply")
    assert result.exit_code == 2, result.output
    assert "role: 'schedctl_member' is (or is a member of) 'postgres'" in result.output
    assert privileges(pg_url, "schedctl_member") == set()
    itself = invoke(pg_url, "db", "grant", "postgres")  # the tests' owner is a superuser
    assert itself.exit_code == 2 and "role: 'postgres' is a superuser" in itself.output


def test_db_grant_refuses_a_superuser(pg_server: PostgresServer, pg_url: str) -> None:
    pg_server.ensure_role("schedctl_super")
    pg_server.admin("ALTER ROLE schedctl_super SUPERUSER")
    result = invoke(pg_url, "db", "grant", "schedctl_super", "--apply")
    assert result.exit_code == 2, result.output
    assert "role: 'schedctl_super' is a superuser" in result.output
    assert privileges(pg_url, "schedctl_super") == set()


def test_db_grant_as_the_runtime_role_fails_clearly_and_grants_nothing(
    pg_server: PostgresServer, pg_url: str, pg_runtime_url: str
) -> None:
    pg_server.ensure_role("schedctl_other")
    result = invoke(pg_runtime_url, "db", "grant", "schedctl_other", "--apply")
    assert result.exit_code == 2, result.output
    assert "database_url: 'schedctl_runtime' does not own the scheduler's tables" in result.output
    assert privileges(pg_url, "schedctl_other") == set()


def test_db_grant_on_sqlite_says_roles_do_not_apply(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    result = invoke(f"sqlite:///{path}", "db", "grant", RUNTIME_ROLE)
    assert result.exit_code == 2, result.output
    assert "database_url: database roles do not apply" in result.output
    assert not path.exists()


def test_the_operator_setup_with_an_owner_that_is_no_superuser(
    pg_server: PostgresServer, empty_pg_url: str
) -> None:
    """As docs/operations.md says: an owner role owns the database and migrates it, grants the
    runtime role and runs `db maintain`; the runtime role works and may not change the
    schema."""
    name = empty_pg_url.rsplit("/", 1)[1]
    pg_server.ensure_role("schedctl_owner")
    pg_server.ensure_role("schedctl_rt")
    pg_server.admin(f'ALTER DATABASE "{name}" OWNER TO schedctl_owner')
    owner = pg_server.url(name, user="schedctl_owner")
    runtime = pg_server.url(name, user="schedctl_rt")
    assert invoke(owner, "db", "upgrade").exit_code == 0
    granted = invoke(owner, "db", "grant", "schedctl_rt", "--apply")
    assert granted.exit_code == 0, granted.output
    assert 'ALTER DEFAULT PRIVILEGES FOR ROLE "schedctl_owner"' in granted.stdout
    maintained = invoke(owner, "db", "maintain", "-o", "json")
    assert maintained.exit_code == 0, maintained.output
    assert json.loads(maintained.stdout)["days_ahead"] == 7
    with closing(Scheduler.open(runtime)) as sched:
        sched.create_tenant("acme", "test")
    with psycopg.connect(libpq(runtime), autocommit=True) as connection:
        assert connection.execute("SELECT count(*) FROM tenants").fetchone() == (1,)
        for statement in ("CREATE TABLE intruder (id int)", "TRUNCATE runs", "DROP TABLE jobs"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                connection.execute(statement)
    refused = invoke(runtime, "db", "maintain")
    assert refused.exit_code == 2, refused.output


# -- the runtime role ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "statement",
    [
        "CREATE TABLE intruder (id int)",
        "DROP TABLE runs",
        "DROP TABLE runs_default",
        "ALTER TABLE jobs ADD COLUMN intruder int",
        "TRUNCATE runs",
        "CREATE INDEX intruder ON jobs (name)",
        "CREATE TABLE runs_20990101 PARTITION OF runs"
        " FOR VALUES FROM ('2099-01-01') TO ('2099-01-02')",
        "INSERT INTO alembic_version VALUES ('9999')",
        "DELETE FROM alembic_version",
    ],
)
def test_the_runtime_role_cannot_change_the_schema(pg_runtime_url: str, statement: str) -> None:
    with psycopg.connect(libpq(pg_runtime_url), autocommit=True) as connection:
        assert connection.execute("SELECT current_user").fetchone() == (RUNTIME_ROLE,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute(statement)
        # while it reads and writes the tables
        connection.execute("SELECT count(*) FROM jobs")
        connection.execute("DELETE FROM runs WHERE job_id = 'none'")


def test_service_and_api_work_as_the_runtime_role(pg_runtime_url: str) -> None:
    with Scheduler.open(pg_runtime_url) as sched, serving(sched) as server:
        _, token = sched.create_tenant("acme", "test")
        api = Api(server.url, token)
        job_id = api.new_job()["job_id"]
        for method, path, expected in [
            ("GET", f"/v1/jobs/{job_id}", 200),
            ("POST", f"/v1/jobs/{job_id}/trigger", 202),
            ("GET", f"/v1/jobs/{job_id}/runs", 200),
            ("POST", f"/v1/jobs/{job_id}/pause", 200),
            ("GET", "/v1/jobs", 200),
            ("DELETE", f"/v1/jobs/{job_id}", 204),
        ]:
            answer = api.request(method, path)
            assert answer.status_code == expected, (method, path, answer.text)


def test_the_runtime_roles_grants_cover_job_names_which_triggers_write(
    pg_url: str, pg_runtime_url: str
) -> None:
    """job_names (0023) is written by triggers on jobs as the role that writes the job: a
    create, a rename and a removal by the runtime role keep the console's search right."""
    dml = {("job_names", right) for right in ("SELECT", "INSERT", "UPDATE", "DELETE")}
    assert dml <= privileges(pg_url, RUNTIME_ROLE)
    body = {
        "name": "nightly-backup",
        "schedule": {"every": "1h"},
        "target": {"type": "queue", "name": "q"},
    }
    with Scheduler.open(pg_runtime_url) as sched:
        tenant, _ = sched.create_tenant("acme", "test")
        job, _ = sched.create_job(tenant.tenant_id, body, actor="test")
        sched.update_job(job.job_id, {"name": "weekly-archive"}, actor="test")
        page = console.search_jobs(sched.store, tenant.tenant_id, name="archive")
        assert [found.name for found in page.items] == ["weekly-archive"]
        with sched.store.tx() as connection:
            connection.execute(schema.jobs.delete().where(schema.jobs.c.job_id == job.job_id))
            left = connection.execute(text("SELECT count(*) FROM job_names")).scalar_one()
        assert left == 0


# -- partitions: the owner's, never the daemons' -----------------------------------------------


def test_runtime_maintenance_does_no_ddl_and_warns_when_partitions_run_short(
    pg_url: str, pg_runtime_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    today = datetime.now(UTC).date()
    with closing(Store.open(pg_runtime_url)) as store:
        # today's partition is missing: a run of today goes to the default one, no DDL
        insert_run(store, "today", datetime.now(UTC))
        insert_run(store, "old", datetime.now(UTC) - timedelta(days=120))
        with caplog.at_level(logging.WARNING, logger="scheduled_d.maintenance"):
            maintain_once(store, retention_days=90)
        done = maintain_runs(store, retention_days=90)
        with store.read() as connection:
            where = connection.execute(
                text("SELECT job_id, tableoid::regclass::text FROM runs")
            ).all()
    assert done.created == [] and done.owned is False and done.days_ahead == 0
    assert [(r[0], r[1]) for r in where] == [("today", "runs_default")]  # the old one deleted
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("schedctl db maintain" in m and "0 day(s) ahead" in m for m in warned), warned
    with closing(Store.open(pg_url)) as owner, owner.read() as connection:
        made = connection.execute(
            text("SELECT to_regclass(:n) IS NOT NULL"), {"n": partition_name(today)}
        ).scalar_one()
    assert not made


def test_a_today_left_in_the_default_partition_is_no_alarm_when_days_ahead_are_ready(
    pg_url: str, pg_runtime_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    today = datetime.now(UTC).date()
    with closing(Store.open(pg_runtime_url)) as store:
        insert_run(store, "today", datetime.now(UTC))  # before the owner's timer ran
    result = invoke(pg_url, "db", "maintain", "--days-ahead", "2", "-o", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    # today's partition cannot be made (its rows are in the default one); the days after can
    assert partition_name(today) not in report["created"]
    assert report["days_ahead"] == 2
    with closing(Store.open(pg_runtime_url)) as store:
        with caplog.at_level(logging.WARNING, logger="scheduled_d.maintenance"):
            maintain_once(store, retention_days=90)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_db_maintain_as_the_owner_makes_and_drops_partitions(
    pg_url: str, pg_runtime_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    old_day = datetime.now(UTC).date() - timedelta(days=100)
    with closing(Store.open(pg_url)) as store, store.tx() as connection:
        PostgresRunPartitions().create(
            connection,
            partition_name(old_day),
            datetime.combine(old_day, datetime.min.time(), UTC),
            datetime.combine(old_day + timedelta(days=1), datetime.min.time(), UTC),
        )
    result = invoke(pg_url, "db", "maintain", "--days-ahead", "3", "-o", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["created"]) == 5  # yesterday, today and 3 ahead
    assert report["removed"] == 1 and report["days_ahead"] == 3
    again = json.loads(invoke(pg_url, "db", "maintain", "--days-ahead", "3", "-o", "json").stdout)
    assert again["created"] == [] and again["removed"] == 0
    # the runtime role's maintenance now finds enough days ahead: no warning
    with closing(Store.open(pg_runtime_url)) as store:
        with caplog.at_level(logging.WARNING, logger="scheduled_d.maintenance"):
            maintain_once(store, retention_days=90)
        insert_run(store, "today", datetime.now(UTC))
        with store.read() as connection:
            where = connection.execute(text("SELECT tableoid::regclass::text FROM runs")).all()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert where[0][0] == partition_name(datetime.now(UTC).date())


def test_db_maintain_refuses_the_runtime_role_and_changes_nothing(
    pg_runtime_url: str,
) -> None:
    with closing(Store.open(pg_runtime_url)) as store:
        insert_run(store, "old", datetime.now(UTC) - timedelta(days=120))
    result = invoke(pg_runtime_url, "db", "maintain")
    assert result.exit_code == 2, result.output
    assert "database_url: this database role does not own the runs table" in result.output
    with closing(Store.open(pg_runtime_url)) as store, store.read() as connection:
        assert connection.execute(text("SELECT count(*) FROM runs")).scalar_one() == 1


@pytest.mark.parametrize("option", [["--days-ahead", "0"], ["--retention-days", "0"]])
def test_db_maintain_refuses_bad_numbers(pg_url: str, option: list[str]) -> None:
    result = invoke(pg_url, "db", "maintain", *option)
    assert result.exit_code == 2, result.output
    assert option[0] in result.output


def test_db_maintain_on_sqlite_deletes_expired_rows(sqlite_url: str) -> None:
    with closing(Store.open(sqlite_url)) as store:
        insert_run(store, "old", datetime.now(UTC) - timedelta(days=120))
        with store.tx() as connection:  # older than audit_retention_days (365)
            connection.execute(
                schema.audit_log.insert().values(
                    at=datetime.now(UTC) - timedelta(days=400), actor="op", action="job.create"
                )
            )
    result = invoke(sqlite_url, "db", "maintain", "-o", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "created": [],
        "removed": 1,
        "pruned": {"dead_letters": 0, "alerts": 0, "audit_log": 1},
        "days_ahead": None,
        "retention_days": 90,
    }
