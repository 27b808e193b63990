"""Built-in queues belong to tenants, on SQLite and a real Postgres: a queue is (tenant,
name) for leases, workers, dead letters and depths; a worker names its tenant unless only
one exists; migration 0005 indexes messages by tenant and takes each one's tenant from its
job."""

from __future__ import annotations

import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from sqlalchemy import inspect
from typer.testing import CliRunner

from schedctl.core import errors
from schedctl.domain.config import load_config
from schedctl.storage.db import schema
from schedctl.storage.db.engine import make_engine
from schedctl.storage.db.migrate import head_revision, upgrade
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.pipeline.workers import worker_tenant
from scheduled_d.__main__ import app
from scheduled_d.metrics import export_queue_depths
from scheduled_d.worker import Worker
from tests.factories import (
    insert_cron_job_row,
    insert_queue_message_row,
    insert_tenant_row,
    make_tenant,
)
from tests.integration.queue_support import (
    dead_letters,
    messages,
    queue_job,
    run_row,
    trigger,
)


def two_tenants_one_queue(store: Store) -> tuple[tuple[str, str, datetime], ...]:
    """Tenants acme and globex, each with a job on a queue named `backups` and one run
    relayed into it: (tenant, job, scheduled_at) each."""
    runs = []
    for name in ("acme", "globex"):
        tenant = make_tenant(store, name)
        job = queue_job(store, queue="backups", tenant=tenant, max_attempts=1)
        runs.append((tenant, job, trigger(store, job)))
    assert QueueRepo(store).move_outbox() == 2
    return tuple(runs)


def test_a_lease_sees_only_its_tenants_queue(store: Store) -> None:
    (a, a_job, _), (b, b_job, _) = two_tenants_one_queue(store)
    repo = QueueRepo(store)
    (lease,) = repo.lease("backups", "w-a", 30, limit=10, tenant_id=a)
    assert (lease.tenant_id, lease.job_id) == (a, a_job)
    assert repo.lease("backups", "w-a", 30, limit=10, tenant_id=a) == []
    (other,) = repo.lease("backups", "w-b", 30, limit=10, tenant_id=b)
    assert (other.tenant_id, other.job_id) == (b, b_job)
    assert repo.lease("backups", "w", 30, tenant_id="no-such-tenant") == []


def test_each_tenants_worker_runs_only_its_own_runs(store: Store, tmp_path: Path) -> None:
    """The bug this fixes: tenant B's run on queue `backups` was executed by tenant A's
    worker (with A's command)."""
    (a, a_job, a_at), (b, b_job, b_at) = two_tenants_one_queue(store)
    log = tmp_path / "ran.log"
    record = [
        sys.executable,
        "-c",
        "import os, sys; open(sys.argv[1], 'a').write(sys.argv[2] + ' ' + "
        "os.environ['SCHED_JOB_ID'] + '\\n')",
        str(log),
    ]
    options = {"lease_seconds": 5.0, "heartbeat_seconds": 1.0, "poll_seconds": 0.05}

    worker_a = Worker(store, "backups", [*record, "acme"], tenant="acme", **options)
    assert worker_a.tenant_id == a
    # idle_exit: returns once nothing of its queue is ready and nothing runs
    assert worker_a.run(threading.Event(), idle_exit=True) == 1
    assert log.read_text().splitlines() == [f"acme {a_job}"]
    assert run_row(store, a_job, a_at)["status"] == "succeeded"
    assert run_row(store, b_job, b_at)["status"] == "dispatched"
    (waiting,) = messages(store)
    assert (waiting["tenant_id"], waiting["job_id"]) == (b, b_job)

    worker_b = Worker(store, "backups", [*record, "globex"], tenant=b, **options)
    assert worker_b.run(threading.Event(), idle_exit=True) == 1
    assert log.read_text().splitlines() == [f"acme {a_job}", f"globex {b_job}"]
    assert run_row(store, b_job, b_at)["status"] == "succeeded"
    assert messages(store) == [] and dead_letters(store) == []


def test_a_worker_names_its_tenant_unless_only_one_exists(store: Store) -> None:
    with pytest.raises(errors.ConfigError) as none:
        worker_tenant(store, None)
    assert none.value.field == "tenant"
    only = make_tenant(store, "acme")
    assert worker_tenant(store, None) == only
    assert worker_tenant(store, "acme") == worker_tenant(store, only) == only
    make_tenant(store, "globex")
    with pytest.raises(errors.ConfigError) as several:
        worker_tenant(store, None)
    assert several.value.field == "tenant" and "--tenant" in str(several.value)
    assert several.value.exit_code == 2
    with pytest.raises(errors.ConfigError) as unknown:
        worker_tenant(store, "initech")
    assert unknown.value.field == "tenant" and "initech" in str(unknown.value)
    assert worker_tenant(store, "globex") == "tenant-globex"


def test_the_worker_command_refuses_to_guess_the_tenant(db_url: str) -> None:
    store = Store.open(db_url)
    try:
        make_tenant(store, "acme")
        make_tenant(store, "globex")
    finally:
        store.close()
    runner = CliRunner()
    result = runner.invoke(app, ["worker", "--db", db_url, "--queue", "backups", "--", "true"])
    assert result.exit_code == 2, result.output
    assert "tenant" in result.output and "--tenant" in result.output


def test_depths_are_per_tenant_and_queue(store: Store) -> None:
    two_tenants_one_queue(store)
    stats = QueueRepo(store).stats()
    assert [(s.tenant, s.queue, s.depth.ready) for s in stats] == [
        ("acme", "backups", 1),
        ("globex", "backups", 1),
    ]
    assert QueueRepo(store).depths() == {("acme", "backups"): 1, ("globex", "backups"): 1}


def test_queue_depth_metrics_are_per_tenant(store: Store) -> None:
    two_tenants_one_queue(store)
    export_queue_depths(QueueRepo(store).stats)
    try:
        scraped = generate_latest().decode()
    finally:
        export_queue_depths(None)
    for tenant in ("acme", "globex"):
        line = f'scheduled_queue_messages{{queue="backups",state="ready",tenant="{tenant}"}} 1.0'
        assert line in scraped


def test_worker_tables_take_a_tenant(tmp_path: Path) -> None:
    path = tmp_path / "scheduled.toml"
    path.write_text(
        '[[worker]]\ntenant = "acme"\nqueue = "backups"\ncommand = ["/bin/true"]\n'
        '[[worker]]\nqueue = "reports"\ncommand = ["/bin/true"]\n'
    )
    first, second = load_config(path, environ={}).workers
    assert (first.tenant, first.queue) == ("acme", "backups")
    assert (second.tenant, second.queue) == (None, "reports")
    path.write_text('[[worker]]\ntenant = 7\nqueue = "q"\ncommand = ["/bin/true"]\n')
    with pytest.raises(errors.ConfigError) as bad:
        load_config(path, environ={})
    assert bad.value.field == "worker.tenant"


def test_migration_0005_indexes_messages_by_tenant(empty_sqlite_url: str) -> None:
    upgrade(empty_sqlite_url, "0004")
    engine = make_engine(empty_sqlite_url)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    try:
        with engine.begin() as connection:
            for tenant in ("t1", "t2"):
                insert_tenant_row(
                    connection, tenant, tenant, created_at=now, quota=10, signing_secret="s"
                )
            insert_cron_job_row(connection, "j2", "t2", queue="backups", at=now)
            # a message whose tenant disagrees with its job's: the job's tenant wins
            insert_queue_message_row(connection, "j2", "t1", queue="backups", at=now)
    finally:
        engine.dispose()
    assert upgrade(empty_sqlite_url) == ("0004", head_revision())
    engine = make_engine(empty_sqlite_url)
    try:
        indexes = {
            i["name"]: i["column_names"] for i in inspect(engine).get_indexes("queue_messages")
        }
        assert indexes["ix_queue_messages_ready"] == ["tenant_id", "queue", "available_at"]
        with engine.connect() as connection:
            (message,) = connection.execute(schema.queue_messages.select()).mappings().all()
        assert (message["job_id"], message["tenant_id"]) == ("j2", "t2")
    finally:
        engine.dispose()
