"""Overlap policies at the worker's lease (issue 32 item 1), on SQLite and Postgres: skip
records the overlapping run skipped with its reason, replace stops the running run and
then starts the new one, queue waits (as before), allow runs them side by side."""

from __future__ import annotations

from datetime import UTC, datetime

from schedctl.domain.leasing import Beat
from schedctl.domain.runpolicy import SKIPPED_OVERLAP, Overlap, RunPolicy
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import Lease, QueueRepo
from tests.factories import make_tenant
from tests.integration.queue_support import attempts, messages, queue_job, run_row, trigger


def _job(store: Store, overlap: Overlap, **options: object) -> str:
    return queue_job(store, run=RunPolicy(overlap=overlap), **options)  # type: ignore[arg-type]


def _done(repo: QueueRepo, lease: Lease) -> bool:
    now = datetime.now(UTC)
    return repo.ack(lease, exit_code=0, output_tail="ok", started_at=now, finished_at=now)


def test_skip_records_the_overlapping_run_skipped_with_its_reason(store: Store) -> None:
    tenant = make_tenant(store)
    job = _job(store, Overlap.SKIP)
    first = trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    (running,) = repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    assert running.scheduled_at == first
    second, third = trigger(store, job), trigger(store, job)
    # due while the first runs (busy workers or not): skipped with the reason, never queued
    repo.move_outbox()
    assert repo.lease("q", "w2", 30, limit=10, tenant_id=tenant) == []
    for at in (second, third):
        row = run_row(store, job, at)
        assert (row["status"], row["error"]) == ("skipped", SKIPPED_OVERLAP)
    assert [m["scheduled_at"] for m in messages(store)] == [first]
    # once the first is over, the next run due starts
    assert _done(repo, running)
    fourth = trigger(store, job)
    repo.move_outbox()
    (lease,) = repo.lease("q", "w2", 30, limit=10, tenant_id=tenant)
    assert lease.scheduled_at == fourth


def test_replace_at_the_lease_of_runs_queued_together(store: Store) -> None:
    tenant = make_tenant(store)
    job = _job(store, Overlap.REPLACE)
    first, second = trigger(store, job), trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()  # nothing held yet: both queued
    (old,) = repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    assert old.scheduled_at == first
    # the next lease finds the first running: the later run replaces it
    assert repo.lease("q", "w2", 30, limit=10, tenant_id=tenant) == []
    assert run_row(store, job, first)["error"] == (
        f"replaced by the run of {format_instant(second)}"
    )
    (new,) = repo.lease("q", "w2", 30, limit=10, tenant_id=tenant)
    assert new.scheduled_at == second


def test_skip_takes_one_of_two_runs_due_together(store: Store) -> None:
    tenant = make_tenant(store)
    job = _job(store, Overlap.SKIP, max_concurrency=5)  # skip is one run at a time
    first, second = trigger(store, job), trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    (lease,) = repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    assert lease.scheduled_at == first
    assert run_row(store, job, second)["status"] == "skipped"


def test_replace_stops_the_running_run_then_starts_the_new_one(store: Store) -> None:
    tenant = make_tenant(store)
    job = _job(store, Overlap.REPLACE)
    first = trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    (old,) = repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    second = trigger(store, job)
    # it comes due (into the queue) while the first runs: the first is stopped as a cancel
    # stops it, recorded with the reason ...
    repo.move_outbox()
    row = run_row(store, job, first)
    assert row["status"] == "failed"
    assert row["error"] == f"replaced by the run of {format_instant(second)}"
    assert [a["status"] for a in attempts(store, job, first)] == ["failed"]
    # ... whose worker finds its lease gone at the next heartbeat (and kills the command)
    assert repo.beat(old, 30) is Beat.lost
    # ... and the new run is leased
    (new,) = repo.lease("q", "w2", 30, limit=10, tenant_id=tenant)
    assert new.scheduled_at == second
    assert run_row(store, job, second)["status"] == "running"
    # the stopped run is neither retried nor dead-lettered
    assert [m["scheduled_at"] for m in messages(store)] == [second]


def test_queue_waits_for_the_slot_as_before(store: Store) -> None:
    tenant = make_tenant(store)
    job = _job(store, Overlap.QUEUE)
    first, second = trigger(store, job), trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    (lease,) = repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    assert lease.scheduled_at == first
    assert repo.lease("q", "w2", 30, limit=10, tenant_id=tenant) == []
    assert run_row(store, job, second)["status"] == "dispatched"
    assert _done(repo, lease)
    (lease,) = repo.lease("q", "w2", 30, limit=10, tenant_id=tenant)
    assert lease.scheduled_at == second


def test_allow_runs_overlapping_runs_side_by_side(store: Store) -> None:
    tenant = make_tenant(store)
    job = _job(store, Overlap.ALLOW, max_concurrency=1)  # allow: max_concurrency not applied
    for _ in range(3):
        trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    assert len(repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)) == 3


def test_a_retry_of_a_skip_job_waits_instead_of_being_skipped(store: Store) -> None:
    tenant = make_tenant(store)
    job = _job(store, Overlap.SKIP, max_attempts=3)
    first = trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    (lease,) = repo.lease("q", "w1", 30, tenant_id=tenant)
    now = datetime.now(UTC)
    assert repo.fail(lease, error="exit 1", exit_code=1, output_tail="", started_at=now,
                     finished_at=now)  # fmt: skip
    second = trigger(store, job)
    repo.move_outbox()
    (running,) = repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    # whichever came first: a retry (attempt 2) is the same run and is never skipped
    if running.scheduled_at == second:
        assert run_row(store, job, first)["status"] == "failed"
        assert run_row(store, job, first)["error"] == "exit 1"
    else:
        assert run_row(store, job, second)["status"] == "skipped"
