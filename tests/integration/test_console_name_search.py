"""Owns the tests of job_names (migration 0023), the table the console's name search reads:
the triggers on jobs keep it (a create, a rename, a delete, on SQLite and Postgres), a
claim's UPDATE of a job never writes to it (the reason it exists: the trigram index is off
jobs), and 0023 copies the names of the jobs that existed before it and its downgrade puts
0021's index back."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import delete, func, inspect, select, text

from schedctl.app.service import Scheduler
from schedctl.domain.models import JobStatus
from schedctl.storage.db import schema
from schedctl.storage.db.engine import make_engine
from schedctl.storage.db.migrate import downgrade_steps, upgrade
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.claim import Claimer
from schedctl.storage.records import console
from tests.factories import ago, create_job, insert_cron_job_row, insert_tenant_row, once_at
from tests.integration.test_claim import ALL, own_all

EMPTY = ["empty_sqlite_url", pytest.param("empty_pg_url", marks=pytest.mark.postgres)]


def body(name: str) -> dict[str, Any]:
    return {"name": name, "schedule": {"every": "1h"}, "target": {"type": "queue", "name": "q"}}


def found(store: Store, tenant_id: str, query: str, **kwargs: Any) -> list[str]:
    return [job.name for job in console.search_jobs(store, tenant_id, name=query, **kwargs).items]


def names_table(store: Store) -> dict[str, tuple[str, str]]:
    n = schema.job_names
    with store.read() as connection:
        rows = connection.execute(select(n.c.job_id, n.c.tenant_id, n.c.name)).all()
    return {str(r[0]): (str(r[1]), str(r[2])) for r in rows}


def test_the_search_follows_creates_renames_and_deletes(db_url: str) -> None:
    with Scheduler.open(db_url) as sched:
        store = sched.store
        acme, _ = sched.create_tenant("acme", "test")
        other, _ = sched.create_tenant("other", "test")
        backup, _ = sched.create_job(acme.tenant_id, body("nightly-backup"), actor="test")
        sched.create_job(acme.tenant_id, body("report"), actor="test")
        sched.create_job(other.tenant_id, body("other-backup"), actor="test")
        assert found(store, acme.tenant_id, "BACKUP") == ["nightly-backup"]
        sched.update_job(backup.job_id, {"name": "weekly-archive"}, actor="test")
        assert found(store, acme.tenant_id, "backup") == []
        assert found(store, acme.tenant_id, "archive") == ["weekly-archive"]
        # a patch that leaves the name alone keeps the row as it is
        sched.update_job(backup.job_id, {"max_concurrency": 2}, actor="test")
        assert names_table(store)[backup.job_id] == (acme.tenant_id, "weekly-archive")
        sched.delete_job(backup.job_id, actor="test")
        assert found(store, acme.tenant_id, "archive") == []
        deleted = found(store, acme.tenant_id, "archive", status=JobStatus.deleted)
        assert deleted == ["weekly-archive"]
        # retention removing the row takes its name with it
        with store.tx() as connection:
            connection.execute(delete(schema.jobs).where(schema.jobs.c.job_id == backup.job_id))
        table = names_table(store)
        assert backup.job_id not in table
        with store.read() as connection:
            jobs = {
                str(job_id): (str(tenant_id), str(name))
                for job_id, tenant_id, name in connection.execute(
                    select(schema.jobs.c.job_id, schema.jobs.c.tenant_id, schema.jobs.c.name)
                )
            }
        assert table == jobs


@pytest.mark.postgres
def test_a_claim_does_not_write_the_job_names_table(pg_url: str) -> None:
    """The claim's UPDATE of the job (next fire time, status, version) leaves the job's
    job_names row version as it was: no trigger fired, no trigram index entry added."""
    store = Store.open(pg_url)
    try:
        with store.tx() as connection:
            insert_tenant_row(connection, "t1", "acme", created_at=datetime.now(UTC))
        job_id = create_job(store, "t1", once_at(ago(1)))

        def versions() -> tuple[str, str]:
            with store.read() as connection:
                job, name = connection.execute(
                    text(
                        "SELECT (SELECT xmin::text || ctid::text FROM jobs WHERE job_id = :j),"
                        " (SELECT xmin::text || ctid::text FROM job_names WHERE job_id = :j)"
                    ),
                    {"j": job_id},
                ).one()
            return str(job), str(name)

        job_before, name_before = versions()
        claimer = Claimer(store, "d1")
        now = datetime.now(UTC)
        result = claimer.claim(claimer.load_due(ALL, now), own_all(store), now)
        assert [j for j, _ in result.dispatched] == [job_id]
        job_after, name_after = versions()
        assert job_after != job_before  # the claim did update the job
        assert name_after == name_before
    finally:
        store.close()


@pytest.mark.parametrize("empty_url", EMPTY)
def test_0023_copies_existing_names_and_its_downgrade_restores_0021s_index(
    request: pytest.FixtureRequest, empty_url: str
) -> None:
    url = request.getfixturevalue(empty_url)
    upgrade(url, "0022")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            insert_tenant_row(connection, "t1", "acme", created_at=now, signing_secret="s")
            for n in range(3):
                insert_cron_job_row(connection, f"j{n}", "t1", queue="q", at=now, name=f"job-{n}")
        upgrade(url)
        with engine.connect() as connection:
            rows = connection.execute(select(schema.job_names).order_by("job_id")).all()
            assert [tuple(r) for r in rows] == [(f"j{n}", "t1", f"job-{n}") for n in range(3)]
            indexes = _indexes(connection)
        postgres = engine.dialect.name == "postgresql"
        assert ("ix_job_names_name_trgm" in indexes) is postgres
        assert "ix_jobs_name_trgm" not in indexes
        with engine.begin() as connection:  # the triggers are in place after the copy
            insert_cron_job_row(connection, "j9", "t1", queue="q", at=now, name="job-9")
            count = connection.execute(select(func.count()).select_from(schema.job_names))
            assert count.scalar_one() == 4
        downgrade_steps(engine, "0022")
        with engine.connect() as connection:
            assert not inspect(connection).has_table("job_names")
            assert ("ix_jobs_name_trgm" in _indexes(connection)) is postgres
        # a job_names no trigger keeps (a restore of an older backup leaves one) is remade
        with engine.begin() as connection:
            connection.execute(
                text("CREATE TABLE job_names (job_id TEXT, tenant_id TEXT, name TEXT)")
            )
            connection.execute(text("INSERT INTO job_names VALUES ('j0', 't1', 'stale')"))
        upgrade(url)
        with engine.connect() as connection:
            rows = connection.execute(select(schema.job_names).order_by("job_id")).all()
            assert [tuple(r) for r in rows] == [
                (job_id, "t1", f"job-{job_id[1]}") for job_id in ("j0", "j1", "j2", "j9")
            ]
    finally:
        engine.dispose()


def _indexes(connection: Any) -> set[str]:
    found_: set[str] = set()
    for table in ("jobs", "job_names"):
        if inspect(connection).has_table(table):
            found_ |= {str(i["name"]) for i in inspect(connection).get_indexes(table)}
    return found_
