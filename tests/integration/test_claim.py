"""The claim transaction: exactly-once under racing claimers, fencing, and cancel/reschedule
races, on SQLite and on a real Postgres."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from schedctl.coordination.local import LocalCoordinator
from schedctl.core import errors
from schedctl.domain.models import Target, TargetType
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import CronSchedule, IntervalSchedule
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.claim import Claimer, ClaimResult, DueJob
from schedctl.storage.pipeline.partitions import PartitionRepo
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl_bench.storage.bench import move_jobs_due
from tests.factories import (
    ago,
    ahead,
    bulk_once_jobs,
    create_job,
    every,
    make_tenant,
    move_next_run,
    once_at,
    set_tenant,
    spec,
)

ALL = range(1024)


def own_all(store: Store, owner: str = "d1") -> dict[int, int]:
    coordinator = LocalCoordinator(store, owner)
    coordinator.start()
    return dict(coordinator.owned())


def run_keys(store: Store) -> list[tuple[str, datetime]]:
    with store.read() as connection:
        return [
            (r[0], r[1])
            for r in connection.execute(select(schema.runs.c.job_id, schema.runs.c.scheduled_at))
        ]


def delivery_keys(store: Store) -> list[tuple[str, datetime]]:
    """Each dispatched run's delivery: an outbox row, or the queue message the claim wrote
    for a built-in queue target (one list: a run in both tables shows twice)."""
    with store.read() as connection:
        return [
            (r[0], r[1])
            for table in (schema.outbox, schema.queue_messages)
            for r in connection.execute(select(table.c.job_id, table.c.scheduled_at))
        ]


def assert_exactly_once(store: Store) -> None:
    runs = Counter(run_keys(store))
    deliveries = Counter(delivery_keys(store))
    assert all(n == 1 for n in runs.values()), "a run row twice"
    assert all(n == 1 for n in deliveries.values()), "a run delivered twice"
    assert set(deliveries) <= set(runs)


def test_claim_dispatches_due_one_time_and_recurring_jobs(store: Store) -> None:
    tenant = make_tenant(store)
    epochs = own_all(store)
    once = create_job(store, tenant, once_at(ago(1)))
    later = create_job(store, tenant, once_at(ahead(3600)))
    anchor = ago(10).replace(microsecond=0)
    recurring = create_job(store, tenant, every(60, anchor))
    # an interval job's first run is after creation: make it due by moving its time back
    move_next_run(store, recurring, anchor)
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    due = claimer.load_due(ALL, now)
    assert {d.job_id for d in due} == {once, recurring}
    result = claimer.claim(due, epochs, now)
    assert sorted(j for j, _ in result.dispatched) == sorted([once, recurring])
    jobs = JobRepo(store)
    assert jobs.get(once).status.value == "completed"
    assert jobs.get(later).status.value == "active"
    assert jobs.get(recurring).next_run_at == anchor + timedelta(seconds=60)
    assert len(delivery_keys(store)) == 2
    assert_exactly_once(store)


def _delivery_tables(store: Store) -> dict[str, str]:
    """job_id -> the table its run's delivery is in ("outbox" or "queue_messages")."""
    with store.read() as connection:
        return {
            job_id: table.name
            for table in (schema.outbox, schema.queue_messages)
            for (job_id,) in connection.execute(select(table.c.job_id))
        }


def test_the_claim_writes_built_in_queue_runs_as_ready_messages_and_the_rest_to_the_outbox(
    store: Store,
) -> None:
    """A built-in queue is in the same database: the claim's transaction queues the run
    itself. HTTP runs, a broker tenant's queue runs and every-host runs (whose host must be
    live when they are delivered) still go through the outbox and a relay."""
    plain = make_tenant(store)
    broker = make_tenant(store, "brokered")
    set_tenant(store, broker, broker_url="amqp://guest:secret@127.0.0.1:1/")
    epochs = own_all(store)
    queued = create_job(store, plain, once_at(ago(1), queue="backups"))
    http = create_job(
        store,
        plain,
        dataclasses.replace(
            once_at(ago(1)), target=Target(TargetType.http, url="https://hooks.example.com/x")
        ),
    )
    every_host = create_job(store, plain, once_at(ago(1), queue="every:web1"))
    brokered = create_job(store, broker, once_at(ago(1), queue="backups"))
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    result = claimer.claim(claimer.load_due(ALL, now), epochs, now)
    assert len(result.dispatched) == 4
    # the in-process relay is woken for these two (HTTP, every-host); the brokered run
    # wakes it because its tenant has a broker (Relay.routes_brokers)
    assert result.relayed == 2
    assert _delivery_tables(store) == {
        queued: "queue_messages",
        http: "outbox",
        every_host: "outbox",
        brokered: "outbox",
    }
    assert_exactly_once(store)
    # ready at once, for the tenant's worker of that queue, as its first attempt
    leases = QueueRepo(store).lease("backups", "w1", 30, 10, tenant_id=plain)
    assert [(x.job_id, x.attempt) for x in leases] == [(queued, 1)]
    assert QueueRepo(store).lease("backups", "w1", 30, 10, tenant_id=broker) == []


def test_a_cancel_after_the_claim_stops_the_queued_run_at_the_lease(store: Store) -> None:
    """The outbox skipped a cancelled job's run when it moved it; a run the claim queued
    itself is skipped where workers take it, and never starts."""
    tenant = make_tenant(store)
    epochs = own_all(store)
    job_id = create_job(store, tenant, once_at(ago(1)))
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    assert len(claimer.claim(claimer.load_due(ALL, now), epochs, now).dispatched) == 1
    JobRepo(store).cancel(job_id, actor="test")
    assert QueueRepo(store).lease("q", "w1", 30, 10, tenant_id=tenant) == []
    with store.read() as connection:
        status = connection.execute(select(schema.runs.c.status)).scalar_one()
        left = connection.execute(select(func.count()).select_from(schema.queue_messages))
        assert left.scalar_one() == 0
    assert status == "skipped"


def test_two_claimers_racing_from_the_same_stale_read_enqueue_each_run_once(store: Store) -> None:
    tenant = make_tenant(store)
    epochs = own_all(store)
    bulk_once_jobs(store, tenant, [ago(5)] * 300)
    anchor = ago(30).replace(microsecond=0)
    for _ in range(20):
        job_id = create_job(store, tenant, every(1, anchor, misfire=MisfirePolicy.run_all))
        move_next_run(store, job_id, anchor)
    a, b = Claimer(store, "d1"), Claimer(store, "d2")
    for _round in range(5):
        now = datetime.now(UTC)
        due_a = a.load_due(ALL, now, 1000)
        due_b = b.load_due(ALL, now, 1000)  # the same snapshot, as two dispatchers racing
        assert due_a == due_b
        barrier = threading.Barrier(2)
        results: dict[str, ClaimResult] = {}

        def claim(
            name: str,
            claimer: Claimer,
            due: list[DueJob],
            barrier: threading.Barrier = barrier,
            results: dict[str, ClaimResult] = results,
            now: datetime = now,
        ) -> None:
            barrier.wait(10)
            results[name] = claimer.claim(due, epochs, now)

        threads = [
            threading.Thread(target=claim, args=("a", a, due_a)),
            threading.Thread(target=claim, args=("b", b, due_b)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        won_a, won_b = set(results["a"].dispatched), set(results["b"].dispatched)
        assert not won_a & won_b, "both claimers dispatched the same run"
        if not (results["a"].aborted or results["b"].aborted):
            # every due job went to exactly one of them; a deadlock-aborted batch committed
            # nothing and its jobs are claimed in a later round
            assert len(won_a | won_b) == len(due_a)
        assert_exactly_once(store)
    # a batch a deadlock aborted is claimed now; then every one-time job ran exactly once
    now = datetime.now(UTC)
    a.claim(a.load_due(ALL, now, 1000), epochs, now)
    runs = run_keys(store)
    assert len(runs) == len(set(runs))
    with store.read() as connection:
        once_runs = connection.execute(
            select(func.count())
            .select_from(schema.runs)
            .join(schema.jobs, schema.jobs.c.job_id == schema.runs.c.job_id)
            .where(schema.jobs.c.name.like("bulk-%"))
        ).scalar_one()
    assert once_runs == 300


def test_sequential_stale_claim_commits_nothing(store: Store) -> None:
    tenant = make_tenant(store)
    epochs = own_all(store)
    bulk_once_jobs(store, tenant, [ago(5)] * 50)
    a, b = Claimer(store, "d1"), Claimer(store, "d2")
    now = datetime.now(UTC)
    stale = b.load_due(ALL, now)
    first = a.claim(a.load_due(ALL, now), epochs, now)
    second = b.claim(stale, epochs, now)
    assert len(first.dispatched) == 50
    assert second.dispatched == [] and second.stale == 50
    assert len(run_keys(store)) == 50 and len(delivery_keys(store)) == 50


def test_a_job_listed_twice_in_one_batch_is_claimed_once(store: Store) -> None:
    """The memory may hold a job twice (a notification and a reload); one batch with both
    advances it once and makes one run and one delivery."""
    tenant = make_tenant(store)
    epochs = own_all(store)
    bulk_once_jobs(store, tenant, [ago(5)] * 3)
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    due = claimer.load_due(ALL, now)
    result = claimer.claim([*due, due[0]], epochs, now)
    assert len(result.dispatched) == 3 and result.stale == 1
    assert len(run_keys(store)) == 3 and len(delivery_keys(store)) == 3
    assert_exactly_once(store)


def test_cancel_committed_before_a_stale_claim_produces_no_run(store: Store) -> None:
    tenant = make_tenant(store)
    epochs = own_all(store)
    job_id = create_job(store, tenant, once_at(ago(1)))
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    snapshot = claimer.load_due(ALL, now)
    JobRepo(store).cancel(job_id, actor="test")
    result = claimer.claim(snapshot, epochs, now)
    assert result.dispatched == [] and result.stale == 1
    assert run_keys(store) == [] and delivery_keys(store) == []


def test_reschedule_racing_a_claim_never_runs_the_old_version(store: Store) -> None:
    tenant = make_tenant(store)
    epochs = own_all(store)
    old_time = ago(1)
    job_id = create_job(store, tenant, once_at(old_time))
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    snapshot = claimer.load_due(ALL, now)
    new_time = ahead(3600)
    from schedctl.scheduling.schedules import OnceSchedule

    job = JobRepo(store).reschedule(job_id, OnceSchedule(run_at=new_time), actor="test")
    result = claimer.claim(snapshot, epochs, now)
    assert result.dispatched == []
    assert run_keys(store) == []
    assert job.next_run_at == new_time
    # the new version is claimed at its new time and only then
    assert claimer.load_due(ALL, datetime.now(UTC)) == []
    later = claimer.load_due(ALL, new_time + timedelta(seconds=1))
    assert [d.job_id for d in later] == [job_id] and later[0].next_run_at == new_time


@pytest.mark.postgres
def test_cancel_racing_claims_on_postgres(pg_url: str) -> None:
    """Cancels and claims interleave for real; afterwards every run of a cancelled job was
    claimed at a version older than the cancel."""
    store = Store.open(pg_url)
    try:
        tenant = make_tenant(store)
        epochs = own_all(store)
        ids = bulk_once_jobs(store, tenant, [ago(5)] * 400)
        claimer = Claimer(store, "d1")
        now = datetime.now(UTC)
        snapshot = claimer.load_due(ALL, now, 1000)
        barrier = threading.Barrier(2)
        cancelled: list[str] = []

        def cancel_half() -> None:
            barrier.wait(10)
            for job_id in ids[::2]:
                try:
                    JobRepo(store).cancel(job_id, actor="test")
                    cancelled.append(job_id)
                except errors.Conflict:  # the claim won: the job is completed already
                    pass

        def claim_in_batches() -> None:
            barrier.wait(10)
            for start in range(0, len(snapshot), 20):
                claimer.claim(snapshot[start : start + 20], epochs, now)

        threads = [threading.Thread(target=cancel_half), threading.Thread(target=claim_in_batches)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        runs = dict(run_keys(store))
        for job_id in cancelled:
            job = JobRepo(store).get(job_id)
            assert job.status.value == "cancelled"
            if job_id in runs:
                # the claim committed first: the cancel then saw the completed job version
                with store.read() as connection:
                    run_version = connection.execute(
                        select(schema.runs.c.job_version).where(schema.runs.c.job_id == job_id)
                    ).scalar_one()
                assert run_version < job.version
        assert_exactly_once(store)
    finally:
        store.close()


def test_misfire_skip_records_missed_runs_and_waits_for_the_next(store: Store) -> None:
    tenant = make_tenant(store)
    epochs = own_all(store)
    job_id = create_job(
        store, tenant, spec(CronSchedule.parse("* * * * *", "UTC"), misfire=MisfirePolicy.skip)
    )
    missed_from = (datetime.now(UTC) - timedelta(minutes=10)).replace(second=0, microsecond=0)
    move_next_run(store, job_id, missed_from)
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    result = claimer.claim(claimer.load_due(ALL, now), epochs, now)
    assert result.dispatched == []
    assert result.skipped >= 8
    with store.read() as connection:
        statuses = Counter(r[0] for r in connection.execute(select(schema.runs.c.status)))
    assert set(statuses) == {"skipped"}
    job = JobRepo(store).get(job_id)
    assert job.next_run_at is not None and job.next_run_at > now - timedelta(seconds=60)


def test_misfire_run_once_dispatches_one_catch_up_run(store: Store) -> None:
    tenant = make_tenant(store)
    epochs = own_all(store)
    job_id = create_job(
        store, tenant, spec(IntervalSchedule(every_seconds=60, anchor=ago(3600)), grace=5)
    )
    missed_from = ago(600)
    job = JobRepo(store).get(job_id)
    assert job.next_run_at is not None
    start = job.next_run_at - timedelta(seconds=600)
    move_next_run(store, job_id, start)
    del missed_from
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    result = claimer.claim(claimer.load_due(ALL, now), epochs, now)
    assert len(result.dispatched) == 1
    assert result.skipped >= 8
    after = JobRepo(store).get(job_id)
    assert after.next_run_at is not None and after.next_run_at > now


def test_large_batches_claim_every_run_once(store: Store) -> None:
    tenant = make_tenant(store)
    epochs = own_all(store)
    bulk_once_jobs(store, tenant, [ago(1)] * 5000)
    claimer = Claimer(store, "d1")
    total = 0
    for _ in range(20):
        now = datetime.now(UTC)
        due = claimer.load_due(ALL, now, 2000)
        if not due:
            break
        total += len(claimer.claim(due, epochs, now).dispatched)
    assert total == 5000
    assert len(delivery_keys(store)) == 5000
    assert_exactly_once(store)


@pytest.mark.postgres
def test_a_claimer_paused_inside_its_transaction_does_not_block_the_new_owner(
    pg_url: str,
) -> None:
    """A claim holds FOR SHARE on its partition rows; if its process stops mid-transaction
    the server ends the idle session, so the new owner's epoch write goes through and the
    paused claim commits nothing."""
    store = Store.open(pg_url)
    other = Store.open(pg_url)
    try:
        epochs = own_all(store, "old-owner")
        paused = store.engine.connect()
        transaction = paused.begin()
        paused.execute(
            select(schema.partitions.c.epoch)
            .where(schema.partitions.c.partition.in_([0, 1]))
            .with_for_update(read=True)
        )
        done = threading.Event()
        acquired: set[int] = set()

        def take_over() -> None:
            acquired.update(PartitionRepo(other).acquire([0, 1], epochs[0] + 1, "new-owner"))
            done.set()

        thread = threading.Thread(target=take_over)
        thread.start()
        assert done.wait(60), "the new owner stayed blocked behind the paused transaction"
        assert acquired == {0, 1}
        with pytest.raises(DBAPIError):  # the server closed the idle session
            transaction.commit()
        paused.close()
        thread.join(10)
    finally:
        store.close()
        other.close()


def test_jobs_the_bench_moves_due_are_claimed_as_one_time_jobs_and_complete(store: Store) -> None:
    # the burst bench loads one-time jobs a year ahead and moves them due: their claim
    # must complete them, not advance them to the year-ahead time they were loaded with
    tenant = make_tenant(store)
    epochs = own_all(store)
    far = bulk_once_jobs(store, tenant, [ahead(365 * 86400)] * 3)
    recurring = create_job(store, tenant, every(60, ago(10).replace(microsecond=0)))
    due_at = ago(1)
    move_jobs_due(store, tenant, due_at)
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    due = claimer.load_due(ALL, now)
    assert {d.job_id for d in due} == {*far, recurring}
    claimer.claim(due, epochs, now)
    jobs = JobRepo(store)
    assert [jobs.get(job_id).status.value for job_id in far] == ["completed"] * 3
    advanced = jobs.get(recurring)  # its schedule is left as it was: advanced, still active
    assert advanced.status.value == "active"
    assert advanced.next_run_at is not None and advanced.next_run_at > now
    assert_exactly_once(store)
