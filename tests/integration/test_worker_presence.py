"""Worker presence and unserved queues, on SQLite and a real Postgres: workers announce
themselves when they lease and heartbeat (direct workers through their backend, API
workers through the lease and heartbeat routes), a process writes at most every few
seconds, a worker stops being live after its window, `schedctl status` flags a queue with
ready runs and no live worker, and the oldest ready run's age is exported as a metric."""

from __future__ import annotations

import json
import sys
import threading
from datetime import timedelta

import pytest
import requests
from prometheus_client import generate_latest
from sqlalchemy import select, update
from typer.testing import CliRunner

from schedctl.app.cluster_status import gather_status
from schedctl.app.service import Scheduler
from schedctl.cli.app import app as cli
from schedctl.domain.config import Config
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline import workers
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.pipeline.workers import LIVE_SECONDS, Presence, WorkerRepo
from scheduled_d.api.server import ApiServer
from scheduled_d.metrics import export_queue_depths
from scheduled_d.worker import DirectBackend, Worker
from tests.factories import make_tenant
from tests.integration.queue_support import queue_job, trigger


@pytest.fixture
def unthrottled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every presence call writes (the throttle is tested on its own)."""
    monkeypatch.setattr(workers, "PRESENCE", Presence(interval=0.0))


def ready_run(store: Store, tenant: str, queue: str = "backups") -> str:
    job = queue_job(store, queue=queue, tenant=tenant, max_attempts=1)
    trigger(store, job)
    assert QueueRepo(store).move_outbox() == 1
    return job


def age_ready_messages(store: Store, seconds: float) -> None:
    m = schema.queue_messages
    with store.tx() as connection:
        now = store.now()
        connection.execute(update(m).values(available_at=now - timedelta(seconds=seconds)))


def expire(store: Store, worker: str) -> None:
    w = schema.workers
    with store.tx() as connection:
        past = store.now() - timedelta(seconds=1)
        connection.execute(update(w).where(w.c.worker == worker).values(live_until=past))


def test_seen_workers_are_live_until_their_window_ends(store: Store) -> None:
    repo = WorkerRepo(store)
    repo.seen("t1", "backups", "host-a:1:x")
    repo.seen("t1", "backups", "host-a:1:x")  # an update, not a second row
    repo.seen("t1", "backups", "host-b:2:y", lease_seconds=120)
    repo.seen("t2", "backups", "host-c:3:z")
    assert repo.live() == {
        ("t1", "backups"): ("host-a:1:x", "host-b:2:y"),
        ("t2", "backups"): ("host-c:3:z",),
    }
    rows = {r.worker: r for r in repo.all()}
    assert len(rows) == 3
    a, b = rows["host-a:1:x"], rows["host-b:2:y"]
    assert (a.live_until - a.last_seen).total_seconds() == pytest.approx(LIVE_SECONDS)
    assert (b.live_until - b.last_seen).total_seconds() == pytest.approx(120)
    expire(store, "host-a:1:x")
    assert repo.live()[("t1", "backups")] == ("host-b:2:y",)


def test_workers_gone_for_a_day_are_forgotten_when_a_new_one_shows_up(store: Store) -> None:
    repo = WorkerRepo(store)
    repo.seen("t1", "q", "old")
    repo.seen("t1", "q", "recent")
    w = schema.workers
    with store.tx() as connection:
        connection.execute(
            update(w).where(w.c.worker == "old").values(live_until=store.now() - timedelta(days=2))
        )
    repo.seen("t1", "q", "new")
    assert sorted(r.worker for r in repo.all()) == ["new", "recent"]


def test_a_tenant_polling_many_queue_names_is_bounded(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a tenant's token may poll any queue name, and each new name is a row: past the
    # bound no new row is written for that tenant; other tenants and known rows go on
    monkeypatch.setattr(workers, "MAX_ROWS_PER_TENANT", 5)
    repo = WorkerRepo(store)
    for i in range(8):
        repo.seen("t1", f"made-up-{i}", "api:tok")
    mine = [r for r in repo.all() if r.tenant_id == "t1"]
    assert sorted(r.queue for r in mine) == [f"made-up-{i}" for i in range(5)]
    repo.seen("t1", "made-up-0", "api:tok")  # a known row is still renewed
    repo.seen("t2", "backups", "host-c:3:z")
    assert ("t2", "backups") in repo.live()
    # rows gone for a day are forgotten across the tenant's queues, which frees room
    w = schema.workers
    with store.tx() as connection:
        connection.execute(
            update(w)
            .where(w.c.tenant_id == "t1", w.c.queue != "made-up-0")
            .values(live_until=store.now() - timedelta(days=2))
        )
    repo.seen("t1", "backups", "host-a:1:x")
    assert sorted(r.queue for r in repo.all() if r.tenant_id == "t1") == ["backups", "made-up-0"]


def test_presence_writes_at_most_once_per_interval_and_never_raises(store: Store) -> None:
    now = [100.0]
    presence = Presence(interval=5.0, clock=lambda: now[0])
    assert presence.seen(store, "t1", "q", "w") is True
    assert presence.seen(store, "t1", "q", "w") is False  # throttled
    assert presence.seen(store, "t1", "q", "other") is True  # another worker
    now[0] += 5.0
    assert presence.seen(store, "t1", "q", "w") is True
    assert len(WorkerRepo(store).all()) == 2
    # a failure (no table) is logged, not raised: the lease it rides on must go through
    with store.tx() as connection:
        connection.exec_driver_sql("DROP TABLE workers")
    now[0] += 5.0
    assert presence.seen(store, "t1", "q", "w") is False


def test_a_direct_worker_is_seen_when_it_polls_and_when_it_heartbeats(
    store: Store, unthrottled: None
) -> None:
    tenant = make_tenant(store, "acme")
    worker = Worker(store, "backups", [sys.executable, "-c", "pass"], tenant="acme")
    worker.run(threading.Event(), idle_exit=True)  # one poll of an empty queue
    assert WorkerRepo(store).live() == {(tenant, "backups"): (worker.owner,)}
    # busy: no polls, but each heartbeat renews it
    ready_run(store, tenant)
    backend = DirectBackend(store, "acme")
    (lease,) = backend.lease("backups", "busy-worker", 30.0, 1)
    expire(store, "busy-worker")
    assert "busy-worker" not in WorkerRepo(store).live()[(tenant, "backups")]
    backend.beat(lease, 30.0)
    assert "busy-worker" in WorkerRepo(store).live()[(tenant, "backups")]


def test_an_api_worker_is_seen_by_its_token_when_it_leases_and_heartbeats(
    db_url: str, unthrottled: None
) -> None:
    sched = Scheduler.open(db_url)
    tenant, token = sched.create_tenant("acme", "test")
    token_id = token.split("_")[1]
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        headers = {"Authorization": f"Bearer {token}"}
        empty = requests.post(
            f"{server.url}/v1/queues/backups/leases", json={}, headers=headers, timeout=30
        )
        assert empty.status_code == 200 and empty.json()["items"] == []
        name = f"api:{token_id}"
        live = WorkerRepo(sched.store).live()
        assert live == {(tenant.tenant_id, "backups"): (name,)}
        ready_run(sched.store, tenant.tenant_id)
        leased = requests.post(
            f"{server.url}/v1/queues/backups/leases", json={}, headers=headers, timeout=30
        ).json()["items"]
        expire(sched.store, name)
        assert WorkerRepo(sched.store).live() == {}
        beat = requests.post(
            f"{server.url}/v1/leases/{leased[0]['lease_id']}/heartbeat",
            json={},
            headers=headers,
            timeout=30,
        )
        assert beat.status_code == 200
        assert WorkerRepo(sched.store).live() == {(tenant.tenant_id, "backups"): (name,)}
    finally:
        server.stop()
        sched.close()


def test_status_flags_ready_runs_with_no_live_worker(store: Store) -> None:
    acme, globex = make_tenant(store, "acme"), make_tenant(store, "globex")
    ready_run(store, acme)
    ready_run(store, globex)
    age_ready_messages(store, 120)
    WorkerRepo(store).seen(globex, "backups", "globex-worker")
    status = gather_status(store, Config(database_url=str(store.engine.url)))
    queues = {q["tenant"]: q for q in status.to_dict()["queues"]}
    assert queues["acme"]["unserved"] is True and queues["acme"]["live_workers"] == []
    assert queues["globex"]["unserved"] is False
    assert queues["globex"]["live_workers"] == ["globex-worker"]
    for q in queues.values():
        assert 110 <= q["oldest_ready_age_seconds"] < 3600
    (warning,) = [n for n in status.notes if "no live worker" in n]
    assert "'backups' of tenant acme" in warning


def test_status_command_shows_the_warning(db_url: str, store: Store) -> None:
    acme = make_tenant(store, "acme")
    ready_run(store, acme)
    runner = CliRunner()
    table = runner.invoke(cli, ["--db", db_url, "status"])
    assert table.exit_code == 0, table.output
    assert "none!" in table.stdout and "oldest ready" in table.stdout
    assert "warning: queue 'backups' of tenant acme has 1 ready run(s)" in table.stdout
    data = json.loads(runner.invoke(cli, ["--db", db_url, "status", "-o", "json"]).stdout)
    assert data["queues"][0]["unserved"] is True
    WorkerRepo(store).seen(acme, "backups", "w1")
    data = json.loads(runner.invoke(cli, ["--db", db_url, "status", "-o", "json"]).stdout)
    assert data["queues"][0]["unserved"] is False
    assert data["queues"][0]["live_workers"] == ["w1"]
    assert not [n for n in data["notes"] if "no live worker" in n]


def test_oldest_ready_age_metric(store: Store) -> None:
    ready_run(store, make_tenant(store, "acme"))
    age_ready_messages(store, 300)
    export_queue_depths(QueueRepo(store).stats)
    try:
        scraped = generate_latest().decode()
    finally:
        export_queue_depths(None)
    (line,) = [
        line
        for line in scraped.splitlines()
        if line.startswith('scheduled_queue_oldest_ready_age_seconds{queue="backups"')
    ]
    assert 'tenant="acme"' in line
    assert 290 <= float(line.rsplit(" ", 1)[1]) < 3600


def test_the_workers_table_is_migrated(store: Store) -> None:
    with store.read() as connection:
        assert connection.execute(select(schema.workers)).all() == []
