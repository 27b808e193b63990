"""Metrics people can read (issue 34, item 5): `metrics = true` on a job, bounded per tenant
by metrics_max_jobs_per_tenant; the per-job run counts and durations settle records,
labelled with the tenant's and the job's names; the last-success gauge that keeps its value
while the database is unreachable, and scheduled_store_up that says so."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import event, func, select, update
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app as cli
from schedctl.core import errors
from schedctl.domain.alerts.metrics import export_last_success
from schedctl.domain.alerts.model import parse_alerts
from schedctl.storage.db import schema
from schedctl.storage.db.migrate import upgrade
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.records import alerts as alerts_repo
from schedctl.storage.records import run_metrics
from scheduled_d.metrics import export_queue_depths, export_store
from tests.factories import ahead, create_job, make_tenant, once_at
from tests.integration.queue_support import settle_lease, trigger
from tests.services.ports import free_port
from tests.services.postgres import PostgresServer

BOUND = 2


def body(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "schedule": {"every": "1h"},
        "target": {"type": "queue", "name": "q"},
        **extra,
    }


@pytest.fixture
def sched(store: Store) -> Iterator[Scheduler]:
    yield Scheduler(store, metrics_max_jobs=BOUND)


def job_rows(store: Store) -> list[tuple[str, bool, int]]:
    j = schema.jobs
    with store.read() as connection:
        rows = connection.execute(select(j.c.name, j.c.metrics, j.c.version).order_by(j.c.name))
        return [(str(n), bool(m), int(v)) for n, m, v in rows]


def test_metrics_is_a_job_field_and_anything_but_a_boolean_is_refused(
    sched: Scheduler,
) -> None:
    tenant, _ = sched.create_tenant("acme", actor="test")
    job, _ = sched.create_job(tenant.tenant_id, body("watched", metrics=True), actor="test")
    plain, _ = sched.create_job(tenant.tenant_id, body("plain"), actor="test")
    assert (job.metrics, plain.metrics) == (True, False)
    assert sched.get_job(job.job_id).metrics is True
    before = job_rows(sched.store)
    for bad in ("yes", 1, None, []):
        with pytest.raises(errors.ValidationError) as refused:
            sched.create_job(tenant.tenant_id, body("bad", metrics=bad), actor="test")
        assert refused.value.field == "metrics"
        with pytest.raises(errors.ValidationError) as refused:
            sched.update_job(plain.job_id, {"metrics": bad}, actor="test")
        assert refused.value.field == "metrics"
    assert job_rows(sched.store) == before


def test_the_per_tenant_bound_refuses_one_more_and_changes_nothing(sched: Scheduler) -> None:
    acme, _ = sched.create_tenant("acme", actor="test")
    globex, _ = sched.create_tenant("globex", actor="test")
    first, _ = sched.create_job(acme.tenant_id, body("a1", metrics=True), actor="test")
    plain, _ = sched.create_job(acme.tenant_id, body("plain"), actor="test")
    # a batch: the first takes the last place, the second is refused
    outcomes = sched.create_many(
        acme.tenant_id, [body("a2", metrics=True), body("a3", metrics=True)], actor="test"
    )
    assert outcomes[0].created and outcomes[1].error is not None
    assert outcomes[1].error.field == "metrics"
    assert "metrics_max_jobs_per_tenant = 2" in outcomes[1].error.message
    before = job_rows(sched.store)
    with pytest.raises(errors.ValidationError) as refused:
        sched.create_job(acme.tenant_id, body("a4", metrics=True), actor="test")
    assert refused.value.field == "metrics"
    with pytest.raises(errors.ValidationError) as refused:
        sched.update_job(plain.job_id, {"metrics": True}, actor="test")
    assert refused.value.field == "metrics"
    assert job_rows(sched.store) == before
    # another tenant has its own places; a job without metrics is never counted
    sched.create_job(globex.tenant_id, body("g1", metrics=True), actor="test")
    sched.create_job(acme.tenant_id, body("a5"), actor="test")
    # a place given back is free again
    sched.update_job(first.job_id, {"metrics": False}, actor="test")
    assert sched.update_job(plain.job_id, {"metrics": True}, actor="test").metrics is True


def sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_settled_runs_of_a_job_with_metrics_are_counted_and_timed_by_name(store: Store) -> None:
    tenant = make_tenant(store, "acme")
    watched = create_job(
        store,
        tenant,
        dataclasses.replace(
            once_at(ahead(86_400), name="nightly-backup", max_attempts=1), metrics=True
        ),
    )
    other = create_job(store, tenant, once_at(ahead(86_400), name="unwatched", max_attempts=1))
    labels = {"tenant": "acme", "job": "nightly-backup"}
    ok_before = sample("scheduled_job_runs_total", {**labels, "outcome": "succeeded"})
    # one attempt each: a failure is the run's last (dead), none waits to be retried
    failed_before = sample("scheduled_job_runs_total", {**labels, "outcome": "dead"})
    timed_before = sample("scheduled_job_run_duration_seconds_count", labels)
    failures_before = sample("scheduled_run_failures_total", {"tenant": "acme"})
    repo = QueueRepo(store)
    for job, ok in ((watched, False), (watched, True), (other, False)):
        trigger(store, job)
        repo.move_outbox()
        (lease,) = repo.lease("q", "w1", 30, tenant_id=tenant)
        settle_lease(repo, lease, ok=ok)
    assert sample("scheduled_job_runs_total", {**labels, "outcome": "succeeded"}) == ok_before + 1
    assert sample("scheduled_job_runs_total", {**labels, "outcome": "dead"}) == failed_before + 1
    assert sample("scheduled_job_run_duration_seconds_count", labels) == timed_before + 2
    # the job that did not ask has no series; failures count under the tenant's name
    assert (
        REGISTRY.get_sample_value(
            "scheduled_job_runs_total", {"tenant": "acme", "job": "unwatched", "outcome": "dead"}
        )
        is None
    )
    assert sample("scheduled_run_failures_total", {"tenant": "acme"}) == failures_before + 2
    assert REGISTRY.get_sample_value("scheduled_run_failures_total", {"tenant": tenant}) is None


@pytest.fixture
def own_pg() -> Iterator[PostgresServer]:
    """A Postgres of this test's own: the test stops it."""
    server = PostgresServer(port=free_port())
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


def test_the_last_success_stays_while_the_store_is_unreachable_and_store_up_says_so(
    own_pg: PostgresServer,
) -> None:
    own_pg.create_database("sched")
    url = own_pg.url("sched")
    upgrade(url)
    store = Store.open(url)
    try:
        tenant = make_tenant(store, "acme")
        job = create_job(store, tenant, once_at(ahead(86_400), name="nightly-backup"))
        alerts_repo.set_settings(
            store, tenant, job, parse_alerts({"email": ["a@example.com"], "no_success": "PT1H"})
        )
        at = trigger(store, job)
        finished = datetime(2026, 6, 1, 12, tzinfo=UTC)
        with store.tx() as connection:
            connection.execute(
                update(schema.runs)
                .where(schema.runs.c.job_id == job, schema.runs.c.scheduled_at == at)
                .values(status="succeeded", finished_at=finished)
            )
        export_last_success(partial(alerts_repo.last_successes, store))
        export_store(store)
        last = "scheduled_job_last_success_timestamp_seconds"
        labels = {"tenant": "acme", "job": "nightly-backup"}
        try:
            assert REGISTRY.get_sample_value(last, labels) == finished.timestamp()
            assert REGISTRY.get_sample_value("scheduled_store_up", {}) == 1.0
            assert REGISTRY.get_sample_value("scheduled_partitions", {}) == float(
                store.partition_count
            )
            own_pg.stop()
            export_store(store)  # no cached read: the next scrape asks the database
            assert REGISTRY.get_sample_value("scheduled_store_up", {}) == 0.0
            assert REGISTRY.get_sample_value(last, labels) == finished.timestamp()
            assert REGISTRY.get_sample_value("scheduled_partitions", {}) is None
            own_pg.start()
            export_store(store)
            assert REGISTRY.get_sample_value("scheduled_store_up", {}) == 1.0
        finally:
            export_last_success(None)
            export_queue_depths(None)
    finally:
        store.close()


def test_the_cluster_gauges_count_unowned_partitions_and_live_workers(store: Store) -> None:
    tenant = make_tenant(store, "acme")
    job = create_job(store, tenant, once_at(ahead(86_400), name="j"))
    trigger(store, job)
    QueueRepo(store).move_outbox()
    p = schema.partitions
    with store.tx() as connection:
        connection.execute(update(p).values(owner=None))
        # one owned partition (the row written as a dispatcher's claim of it would)
        connection.execute(p.delete().where(p.c.partition == 0))
        connection.execute(
            p.insert().values(partition=0, owner="d1", epoch=1, updated_at=datetime.now(UTC))
        )
        rows = connection.execute(select(func.count()).select_from(p)).scalar_one()
    assert rows >= 1
    export_store(store)
    try:
        unowned = REGISTRY.get_sample_value("scheduled_partitions_unowned", {})
        assert unowned == float(store.partition_count - 1)
        queue = {"tenant": "acme", "queue": "q"}
        assert REGISTRY.get_sample_value("scheduled_queue_live_workers", queue) == 0.0
        ready = {**queue, "state": "ready"}
        assert REGISTRY.get_sample_value("scheduled_queue_messages", ready) == 1.0
        assert REGISTRY.get_sample_value("scheduled_dead_letters_pending", {}) == 0.0
    finally:
        export_queue_depths(None)


def test_the_cli_sets_metrics_and_the_configured_bound_refuses(
    db_url: str, store: Store, tmp_path: Path
) -> None:
    make_tenant(store, "acme")
    runner = CliRunner()
    base = ["--db", db_url]
    create = ["job", "create", "--tenant", "acme", "--every", "1h", "--queue", "q"]
    made = runner.invoke(cli, [*base, *create, "--name", "w", "--metrics", "-o", "json"])
    assert made.exit_code == 0, made.output
    job = json.loads(made.stdout)
    assert job["metrics"] is True
    off = runner.invoke(cli, [*base, "job", "update", job["job_id"], "--no-metrics", "-o", "json"])
    assert off.exit_code == 0, off.output
    assert json.loads(off.stdout)["metrics"] is False
    # the operator allows none: refused, naming the field, and nothing is written
    config = tmp_path / "scheduled.toml"
    config.write_text("metrics_max_jobs_per_tenant = 0\n")
    before = job_rows(store)
    refused = runner.invoke(
        cli, [*base, "--config", str(config), *create, "--name", "x", "--metrics"]
    )
    assert refused.exit_code == 2, refused.output
    assert "metrics" in refused.output and "Traceback" not in refused.output
    assert job_rows(store) == before
    # a bad bound is a configuration error naming its key
    config.write_text("metrics_max_jobs_per_tenant = -1\n")
    bad = runner.invoke(cli, [*base, "--config", str(config), *create, "--name", "y"])
    assert bad.exit_code != 0 and "metrics_max_jobs_per_tenant" in bad.output
    assert job_rows(store) == before


def test_settle_reuses_a_jobs_labels_and_reads_them_again_once_they_are_old(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_metrics.names sends no statement for jobs it looked up less than NAMES_TTL ago
    (the relay settles batch after batch of the same jobs); an older entry is read again,
    so a rename reaches the series."""
    tenant = make_tenant(store, "acme")
    watched = create_job(
        store, tenant, dataclasses.replace(once_at(ahead(86_400), name="nightly"), metrics=True)
    )
    quiet = create_job(store, tenant, once_at(ahead(86_400), name="quiet"))
    sent: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "FROM jobs JOIN tenants" in statement:
            sent.append(statement)

    def labels(named: frozenset[str] = frozenset()) -> dict[str, tuple[str, str]]:
        with store.read() as connection:
            found = run_metrics.names(connection, {watched, quiet}, named=named)
        return {job_id: (n.tenant, n.job) for job_id, n in found.items()}

    monkeypatch.setattr(run_metrics, "NAMES_TTL", 3600.0)
    event.listen(store.engine, "before_cursor_execute", count)
    try:
        assert labels() == {watched: ("acme", "nightly")}
        assert len(sent) == 1
        # from the cache: the job without metrics is named only when asked for
        assert labels() == {watched: ("acme", "nightly")}
        assert labels(frozenset({quiet})) == {
            watched: ("acme", "nightly"),
            quiet: ("acme", "quiet"),
        }
        assert len(sent) == 1
        with store.tx() as connection:
            connection.execute(
                update(schema.jobs).where(schema.jobs.c.job_id == watched).values(name="weekly")
            )
        monkeypatch.setattr(run_metrics, "NAMES_TTL", 0.0)
        assert labels() == {watched: ("acme", "weekly")}
        assert len(sent) == 2
    finally:
        event.remove(store.engine, "before_cursor_execute", count)
