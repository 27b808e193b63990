"""Job dependencies (`after`) through real settling, on SQLite and a real Postgres: a chain
A -> B -> C over the built-in queue's ack and the outbox's HTTP settle, fan-in (once, only
after every upstream), a dead letter skipping the dependents down the chain, cycles
refused, settling twice creating one run, and the upstream's success and the dependent
run committing together or not at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from schedctl.app.service import Scheduler
from schedctl.coordination.local import LocalCoordinator
from schedctl.core import errors
from schedctl.domain.models import JobStatus, Lane, RunStatus, RunTrigger, TargetType, Verdict
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import AfterSchedule, CronSchedule
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline import dependencies
from schedctl.storage.pipeline.claim import Claimer
from schedctl.storage.pipeline.outbox import DeliveryOutcome, OutboxRepo
from schedctl.storage.pipeline.queue import QueueRepo
from tests.factories import create_job, make_tenant, move_next_run, spec
from tests.integration.queue_support import (
    add_dispatched_run,
    allow_loopback_tenant,
    existing_tenant,
    http_job,
    queue_job,
    run_row,
    settle_lease,
    trigger,
)


@pytest.fixture
def store(store: Store) -> Store:
    allow_loopback_tenant(store)
    return store


def after(store: Store, job: str, *ups: str) -> None:
    with store.tx() as connection:
        dependencies.add(connection, job, "tenant-acme", list(ups))


def runs_of(store: Store, job: str) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = connection.execute(select(schema.runs).where(schema.runs.c.job_id == job))
        return [dict(r) for r in rows.mappings().all()]


def outbox_of(store: Store, job: str) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = connection.execute(select(schema.outbox).where(schema.outbox.c.job_id == job))
        return [dict(r) for r in rows.mappings().all()]


def run_queue(store: Store, *, ok: bool = True) -> list[str]:
    """Move the queue's outbox rows in, lease every message once and ack (or fail) it;
    returns the job ids run."""
    repo = QueueRepo(store)
    repo.move_outbox()
    leases = repo.lease("q", "worker", 60, limit=50, tenant_id=existing_tenant(store))
    for lease in leases:
        settle_lease(repo, lease, ok=ok)
    return [lease.job_id for lease in leases]


def settle_http(store: Store, verdict: Verdict = Verdict.succeeded) -> list[str]:
    repo = OutboxRepo(store)
    claimed = repo.claim(
        {Lane(existing_tenant(store), TargetType.http): 50}, "relay", lease_seconds=60
    )
    now = store.now()
    repo.settle([DeliveryOutcome(d, verdict, now, now) for d in claimed.deliveries])
    return [d.job_id for d in claimed.deliveries]


def _reaped_and_run_again(store: Store, a: str, b: str, at: datetime) -> None:
    """The leased run of `a` at `at` is reaped, runs again and succeeds, and its dependent
    `b` gets its one run."""
    with store.tx() as connection:
        connection.execute(
            schema.queue_messages.update().values(leased_until=datetime(2000, 1, 1, tzinfo=UTC))
        )
    assert QueueRepo(store).expire_leases() == 1
    assert run_queue(store) == [a]
    assert run_row(store, a, at)["status"] == RunStatus.succeeded.value
    assert len(runs_of(store, b)) == 1


def test_chain_queue_then_http(store: Store) -> None:
    a, b = queue_job(store), queue_job(store, max_concurrency=0)
    c = http_job(store, "https://127.0.0.1:9/hook")
    after(store, b, a)
    after(store, c, b)
    at = trigger(store, a)
    assert runs_of(store, b) == [] and runs_of(store, c) == []
    assert run_queue(store) == [a]
    (run_b,) = runs_of(store, b)
    assert run_b["scheduled_at"] == at
    assert run_b["status"] == RunStatus.dispatched.value
    assert run_b["trigger"] == RunTrigger.upstream.value
    assert len(outbox_of(store, b)) == 1
    assert runs_of(store, c) == []
    assert run_queue(store) == [b]
    (run_c,) = runs_of(store, c)
    assert run_c["scheduled_at"] == at and run_c["status"] == RunStatus.dispatched.value
    (row,) = outbox_of(store, c)
    assert row["target_type"] == TargetType.http.value
    # the HTTP success settles through the outbox and is recorded, with nothing further
    assert settle_http(store) == [c]
    assert run_row(store, c, at)["status"] == RunStatus.succeeded.value


def test_http_success_creates_the_dependent_run(store: Store) -> None:
    a = http_job(store, "https://127.0.0.1:9/hook")
    b = queue_job(store)
    after(store, b, a)
    at = trigger(store, a)
    assert settle_http(store) == [a]
    (run_b,) = runs_of(store, b)
    assert run_b["scheduled_at"] == at and run_b["status"] == RunStatus.dispatched.value
    assert run_queue(store) == [b]
    assert run_row(store, b, at)["status"] == RunStatus.succeeded.value


def fan_in(store: Store) -> tuple[str, str, str, datetime]:
    """c after a and b, and a run of a and one of b at the same scheduled_at, both moved
    into the queue: (a, b, c, scheduled_at)."""
    a, b, c = queue_job(store, max_concurrency=0), queue_job(store), queue_job(store)
    after(store, c, a, b)
    at = trigger(store, a)
    tenant = existing_tenant(store)
    # b's run at the same scheduled_at (a manual run of b keyed at a's time)
    with store.tx() as connection:
        add_dispatched_run(connection, b, at, tenant)
    QueueRepo(store).move_outbox()
    return a, b, c, at


def test_fan_in_runs_once_after_both(store: Store) -> None:
    a, b, c, at = fan_in(store)
    repo = QueueRepo(store)
    leases = {
        lease.job_id: lease
        for lease in repo.lease("q", "w", 60, limit=10, tenant_id=existing_tenant(store))
    }
    assert set(leases) == {a, b}
    t = leases[a].leased_until
    assert repo.ack(leases[a], exit_code=0, output_tail="", started_at=t, finished_at=t)
    assert runs_of(store, c) == []  # only one of two upstreams succeeded
    assert repo.ack(leases[b], exit_code=0, output_tail="", started_at=t, finished_at=t)
    (run_c,) = runs_of(store, c)
    assert run_c["scheduled_at"] == at
    assert len(outbox_of(store, c)) == 1


def test_dead_letter_skips_the_chain(store: Store) -> None:
    a = queue_job(store, max_attempts=1)
    b, c = queue_job(store), queue_job(store)
    after(store, b, a)
    after(store, c, b)
    at = trigger(store, a)
    assert run_queue(store, ok=False) == [a]
    assert run_row(store, a, at)["status"] == RunStatus.dead.value
    run_b, run_c = run_row(store, b, at), run_row(store, c, at)
    assert run_b["status"] == RunStatus.skipped.value
    assert a in run_b["error"] and "dead-lettered" in run_b["error"]
    assert run_c["status"] == RunStatus.skipped.value
    assert b in run_c["error"] and "skipped" in run_c["error"]
    assert outbox_of(store, b) == [] and outbox_of(store, c) == []


def test_cycles_and_foreign_upstreams_refused(store: Store) -> None:
    a, b, c = queue_job(store), queue_job(store), queue_job(store)
    after(store, b, a)
    after(store, c, b)
    for job, ups in ((a, [c]), (a, [a]), (a, [b])):
        with pytest.raises(errors.ValidationError) as caught:
            after(store, job, *ups)
        assert caught.value.field == "after"
    other = make_tenant(store, name="other")
    foreign = queue_job(store, tenant=other)
    for ups in ([foreign], ["no-such-job"]):
        with pytest.raises(errors.NotFound) as missing:
            after(store, c, *ups)
        assert missing.value.field == "after"
    with store.read() as connection:
        assert dependencies.upstreams(connection, a) == []
        assert dependencies.upstreams(connection, c) == [b]
        assert dependencies.downstreams(connection, a) == [b]


def test_settling_twice_creates_one_run(store: Store) -> None:
    a, b = queue_job(store), queue_job(store)
    after(store, b, a)
    at = trigger(store, a)
    assert run_queue(store) == [a]
    with store.tx() as connection:
        # as if a second settle of the same success ran (a replay after a crash)
        dependencies.on_settled(connection, succeeded=[(a, at)], ended=(), now=store.now())
    assert len(runs_of(store, b)) == 1
    assert len(outbox_of(store, b)) == 1


def test_upstream_success_and_dependent_run_commit_together(store: Store) -> None:
    a, b = queue_job(store), queue_job(store)
    after(store, b, a)
    at = trigger(store, a)
    # a real fault in the dependent insert: the database refuses b's run
    with store.tx() as connection:
        if store.is_postgres:
            connection.execute(
                text(
                    "CREATE FUNCTION refuse_run() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'refused'; END $$"
                )
            )
            connection.execute(
                text(
                    "CREATE TRIGGER refuse BEFORE INSERT ON runs FOR EACH ROW "
                    f"WHEN (NEW.job_id = '{b}') EXECUTE FUNCTION refuse_run()"
                )
            )
        else:
            connection.execute(
                text(
                    f"CREATE TRIGGER refuse BEFORE INSERT ON runs WHEN NEW.job_id = '{b}' "
                    "BEGIN SELECT RAISE(ABORT, 'refused'); END"
                )
            )
    with pytest.raises(Exception, match="refused"):
        run_queue(store)
    # neither the upstream's success nor the dependent run was recorded
    assert run_row(store, a, at)["status"] == RunStatus.running.value
    assert runs_of(store, b) == []
    with store.tx() as connection:
        connection.execute(text("DROP TRIGGER refuse" + (" ON runs" if store.is_postgres else "")))
    # the message is still leased: once the lease is reaped it runs again and succeeds
    _reaped_and_run_again(store, a, b, at)


def test_concurrent_fan_in_creates_one_run(store: Store) -> None:
    """Two upstreams settled at once from two threads: exactly one run of the dependent."""
    _a, _b, c, _at = fan_in(store)
    repo = QueueRepo(store)
    leases = repo.lease("q", "w", 60, limit=10, tenant_id=existing_tenant(store))
    assert len(leases) == 2
    barrier = threading.Barrier(2, timeout=60)
    results: list[bool] = []

    def ack(index: int) -> None:
        barrier.wait()
        t = leases[index].leased_until
        results.append(
            repo.ack(leases[index], exit_code=0, output_tail="", started_at=t, finished_at=t)
        )

    threads = [threading.Thread(target=ack, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == [True, True]
    assert len(runs_of(store, c)) == 1
    assert len(outbox_of(store, c)) == 1


def test_library_create_with_after(store: Store) -> None:
    scheduler = Scheduler(store)
    tenant = "tenant-acme"
    target = {"type": "queue", "name": "q"}
    a = queue_job(store)
    job, created = scheduler.create_job(tenant, {"after": [a], "target": target}, actor="t")
    assert created and isinstance(job.schedule, AfterSchedule) and job.next_run_at is None
    assert scheduler.job_dependencies(job.job_id, tenant)["upstream"][0]["job_id"] == a
    # paused and resumed, a dependent job is active again (not completed: it has no time)
    with pytest.raises(errors.ValidationError) as refused:
        scheduler.reschedule_job(job.job_id, {"delay": "PT1M"}, tenant, actor="t")
    assert refused.value.field == "schedule"
    scheduler.pause_job(job.job_id, tenant, actor="t")
    assert scheduler.resume_job(job.job_id, tenant, actor="t").status is JobStatus.active
    at = trigger(store, a)
    assert run_queue(store) == [a]
    assert run_row(store, job.job_id, at)["status"] == RunStatus.dispatched.value
    before = len(scheduler.list_jobs(tenant).items)
    bad: list[tuple[dict[str, Any], type[errors.SchedError]]] = [
        ({"after": [a], "schedule": {"delay": "PT1M"}, "target": target}, errors.ValidationError),
        ({"after": ["missing"], "target": target}, errors.NotFound),
        ({"after": [], "target": target}, errors.ValidationError),
        ({"after": "x", "target": target}, errors.ValidationError),
    ]
    other = make_tenant(store, name="other")
    bad.append(({"after": [queue_job(store, tenant=other)], "target": target}, errors.NotFound))
    for body, error in bad:
        with pytest.raises(error) as caught:
            scheduler.create_job(tenant, body, actor="t")
        assert caught.value.field == "after"
    assert len(scheduler.list_jobs(tenant).items) == before


def test_update_check_refuses_cycles(store: Store) -> None:
    a, b, c = queue_job(store), queue_job(store), queue_job(store)
    after(store, b, a)
    after(store, c, b)
    with pytest.raises(errors.ValidationError) as caught:
        dependencies.check_after(store, a, "tenant-acme", [c])
    assert caught.value.field == "after"
    assert dependencies.check_after(store, c, "tenant-acme", [a, b]) == sorted([a, b])
    with store.tx() as connection:
        dependencies.replace(connection, c, "tenant-acme", [a])
        assert dependencies.upstreams(connection, c) == [a]


def test_misfire_skipped_upstream_runs_skip_the_dependent(store: Store) -> None:
    tenant = "tenant-acme"
    coordinator = LocalCoordinator(store, "d1")
    coordinator.start()
    epochs = dict(coordinator.owned())
    a = create_job(
        store, tenant, spec(CronSchedule.parse("* * * * *", "UTC"), misfire=MisfirePolicy.skip)
    )
    b = queue_job(store)
    after(store, b, a)
    missed_from = (datetime.now(UTC) - timedelta(minutes=5)).replace(second=0, microsecond=0)
    move_next_run(store, a, missed_from)
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    result = claimer.claim(claimer.load_due(range(1024), now), epochs, now)
    assert result.skipped >= 3
    skipped_a = {r["scheduled_at"] for r in runs_of(store, a)}
    runs_b = runs_of(store, b)
    assert {r["scheduled_at"] for r in runs_b} == skipped_a
    assert all(r["status"] == RunStatus.skipped.value for r in runs_b)
    assert all(a in r["error"] for r in runs_b)
    assert outbox_of(store, b) == []


KILLED_ACK = """
import sys
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.db.store import Store

store = Store.open(sys.argv[1])
repo = QueueRepo(store)
(lease,) = repo.lease("q", "doomed", 600, tenant_id="tenant-acme")
at = lease.leased_until
repo.ack(lease, exit_code=0, output_tail="", started_at=at, finished_at=at)
print("acked", flush=True)
"""


@pytest.mark.postgres
def test_kill_9_while_settling_records_neither(pg_url: str) -> None:
    """A worker killed with -9 inside the settling transaction, after the upstream's
    success was written and while the dependent run waits to be: after recovery both
    exist or neither, never one without the other."""
    store = Store.open(pg_url)
    try:
        make_tenant(store)
        a, b = queue_job(store), queue_job(store)
        after(store, b, a)
        at = trigger(store, a)
        QueueRepo(store).move_outbox()
        # hold the dependent job's row: the settling transaction stops right there
        with store.engine.connect() as holder:
            holder.execute(text("SELECT job_id FROM jobs WHERE job_id = :b FOR UPDATE"), {"b": b})
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
            worker = subprocess.Popen(
                [sys.executable, "-c", KILLED_ACK, pg_url],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            try:
                blocked = False
                for _ in range(600):  # bounded: the worker reaches the lock quickly
                    with store.read() as connection:
                        waiting = connection.execute(
                            text(
                                "SELECT count(*) FROM pg_stat_activity"
                                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                            )
                        ).scalar_one()
                    if waiting:
                        blocked = True
                        break
                    if worker.poll() is not None:
                        break
                    time.sleep(0.1)
                assert blocked, worker.communicate()
                # the upstream's run row is already written (uncommitted) by the ack
                os.kill(worker.pid, signal.SIGKILL)
            finally:
                if worker.poll() is None:
                    worker.kill()
                worker.communicate(timeout=60)  # reaps it and closes its pipes
            holder.rollback()
        # neither the upstream's success nor the dependent run
        assert run_row(store, a, at)["status"] == RunStatus.running.value
        assert runs_of(store, b) == []
        # recovery: the lease is reaped, the run goes again and both commit together
        _reaped_and_run_again(store, a, b, at)
    finally:
        store.close()


def test_update_sets_after_and_refuses_a_cycle_naming_it(store: Store) -> None:
    scheduler = Scheduler(store)
    tenant = "tenant-acme"
    a, b = queue_job(store), queue_job(store)
    job = scheduler.update_job(b, {"after": [a]}, tenant, actor="t")
    assert isinstance(job.schedule, AfterSchedule) and job.next_run_at is None
    assert job.status is JobStatus.active
    assert scheduler.job_dependencies(b, tenant)["upstream"][0]["job_id"] == a
    before = scheduler.get_job(a, tenant)
    refused: list[tuple[dict[str, Any], type[errors.SchedError], str]] = [
        ({"after": [b]}, errors.ValidationError, "after"),  # a -> b -> a
        ({"after": [a]}, errors.ValidationError, "after"),  # a after itself
        ({"after": ["missing"]}, errors.NotFound, "after"),
        ({"after": [b], "schedule": {"delay": "PT1M"}}, errors.ValidationError, "after"),
    ]
    for body, error, field in refused:
        with pytest.raises(error) as caught:
            scheduler.update_job(a, body, tenant, actor="t")
        assert caught.value.field == field
    # nothing written: same version, same schedule, no upstreams
    assert scheduler.get_job(a, tenant) == before
    assert scheduler.job_dependencies(a, tenant)["upstream"] == []
    # a dependent job's runs come from its upstreams: no schedule of its own by update either
    with pytest.raises(errors.ValidationError) as caught:
        scheduler.update_job(b, {"schedule": {"delay": "PT1M"}}, tenant, actor="t")
    assert caught.value.field == "schedule"
    # new upstreams replace the old ones, and the new one's success creates the run
    c = queue_job(store)
    scheduler.update_job(b, {"after": [c]}, tenant, actor="t")
    assert [n["job_id"] for n in scheduler.job_dependencies(b, tenant)["upstream"]] == [c]
    at = trigger(store, c)
    assert run_queue(store) == [c]
    assert run_row(store, b, at)["status"] == RunStatus.dispatched.value


def test_a_deleted_upstream_behaves_like_a_cancelled_one(store: Store) -> None:
    scheduler = Scheduler(store)
    tenant = "tenant-acme"
    a, b = queue_job(store), queue_job(store)
    after(store, b, a)
    at = trigger(store, a)
    QueueRepo(store).move_outbox()  # a's run waits in the queue when a is deleted
    name = scheduler.get_job(a, tenant).name
    scheduler.delete_job(a, tenant, actor="t")
    assert run_queue(store) == []  # not run: skipped as for a cancelled job
    assert run_row(store, a, at)["status"] == RunStatus.skipped.value
    skipped = run_row(store, b, at)
    assert skipped["status"] == RunStatus.skipped.value and a in skipped["error"]
    # and a deleted job is no upstream, by id or by name
    target = {"type": "queue", "name": "q"}
    for ref in (a, name):
        with pytest.raises(errors.NotFound) as caught:
            scheduler.create_job(tenant, {"after": [ref], "target": target}, actor="t")
        assert caught.value.field == "after"
