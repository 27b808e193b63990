"""The built-in queue on SQLite and a real Postgres: outbox relay exactly once, leases,
ack/fail with backoff and dead letters, lease expiry, per-job max concurrency."""

from __future__ import annotations

import contextlib
import random
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.queue import (
    CANCELLED_ERROR,
    CANCELLED_RUNNING_ERROR,
    LOST_ERROR,
    Beat,
    Lease,
    QueueRepo,
)
from tests.factories import ago, bulk_once_jobs, make_tenant
from tests.integration.queue_support import (
    add_dispatched_run,
    attempts,
    dead_letters,
    messages,
    outbox_count,
    queue_job,
    queued_run,
    run_row,
    trigger,
    wait_for,
)


def done(repo: QueueRepo, lease: Lease, code: int = 0, tail: str = "ok") -> bool:
    now = datetime.now(UTC)
    return repo.ack(lease, exit_code=code, output_tail=tail, started_at=now, finished_at=now)


def failed(repo: QueueRepo, lease: Lease, error: str = "exit code 3") -> bool:
    now = datetime.now(UTC)
    return repo.fail(
        lease, error=error, exit_code=3, output_tail="boom", started_at=now, finished_at=now
    )


# -- outbox -> queue ----------------------------------------------------------------------


def test_move_outbox_moves_each_run_once(store: Store) -> None:
    make_tenant(store)
    a = queue_job(store, queue="q1")
    b = queue_job(store, queue="q2")
    runs = [(a, trigger(store, a)), (a, trigger(store, a)), (b, trigger(store, b))]
    repo = QueueRepo(store)
    assert repo.move_outbox() == 3
    assert repo.move_outbox() == 0
    assert outbox_count(store) == 0
    moved = messages(store)
    assert sorted((m["job_id"], m["scheduled_at"]) for m in moved) == sorted(runs)
    assert Counter(m["queue"] for m in moved) == {"q1": 2, "q2": 1}
    assert {m["attempt"] for m in moved} == {1}
    assert all(m["leased_until"] is None and m["lease_owner"] is None for m in moved)
    # the runs stay dispatched until a worker takes them
    assert {run_row(store, j, at)["status"] for j, at in runs} == {"dispatched"}


def test_replayed_outbox_row_never_duplicates_a_message(store: Store) -> None:
    make_tenant(store)
    job = queue_job(store)
    at = trigger(store, job)
    repo = QueueRepo(store)
    assert repo.move_outbox() == 1
    # as if a relay crashed after the insert and its outbox row came back
    tenant = run_row(store, job, at)["tenant_id"]
    with store.tx() as connection:
        connection.execute(
            schema.outbox.insert().values(
                job_id=job,
                scheduled_at=at,
                tenant_id=tenant,
                target_type="queue",
                target="q",
                attempt=1,
                available_at=ago(1),
                created_at=ago(1),
            )
        )
    repo.move_outbox()
    assert outbox_count(store) == 0
    assert len(messages(store)) == 1


def test_move_outbox_leaves_other_targets_and_future_rows(store: Store) -> None:
    tenant = make_tenant(store)
    job = queue_job(store)
    with store.tx() as connection:
        for target_type, available in [
            ("http", ago(1)),
            ("queue", datetime.now(UTC) + timedelta(hours=1)),
        ]:
            connection.execute(
                schema.outbox.insert().values(
                    job_id=job,
                    scheduled_at=ago(100) if target_type == "http" else ago(200),
                    tenant_id=tenant,
                    target_type=target_type,
                    target="https://example.com/hook" if target_type == "http" else "q",
                    attempt=1,
                    available_at=available,
                    created_at=ago(1),
                )
            )
    assert QueueRepo(store).move_outbox() == 0
    assert outbox_count(store) == 2
    assert messages(store) == []


def test_move_outbox_skips_runs_of_cancelled_jobs(store: Store) -> None:
    make_tenant(store)
    job = queue_job(store)
    at = trigger(store, job)
    JobRepo(store).cancel(job, actor="test")
    assert QueueRepo(store).move_outbox() == 0
    assert outbox_count(store) == 0
    assert messages(store) == []
    run = run_row(store, job, at)
    assert run["status"] == "skipped"
    assert run["error"] == CANCELLED_ERROR
    assert run["finished_at"] is not None


def test_one_move_queues_live_runs_with_their_stored_payload_and_skips_cancelled_ones(
    store: Store,
) -> None:
    """The move is set-based (INSERT ... SELECT): the row's stored payload goes with it,
    and the cancelled job's run in the same batch is skipped, not queued."""
    make_tenant(store)
    live, stopped = queue_job(store), queue_job(store)
    at = trigger(store, live)
    gone_at = trigger(store, stopped)
    with store.tx() as connection:
        connection.execute(
            schema.outbox.update()
            .where(schema.outbox.c.job_id == live)
            .values(payload='{"as": "claimed"}')
        )
    JobRepo(store).cancel(stopped, actor="test")
    assert QueueRepo(store).move_outbox(limit=10) == 1
    assert outbox_count(store) == 0
    [moved] = messages(store)
    assert (moved["job_id"], moved["scheduled_at"]) == (live, at)
    assert moved["payload"] == '{"as": "claimed"}'
    assert moved["available_at"] == moved["created_at"] is not None
    assert run_row(store, stopped, gone_at)["status"] == "skipped"


def test_move_outbox_leaves_rows_of_excluded_tenants(store: Store) -> None:
    """Queue rows of tenants with a RabbitMQ broker are the RabbitMQ relay's, not the
    built-in queue's."""
    make_tenant(store)
    job = queue_job(store)
    trigger(store, job)
    tenant = run_row(store, job, trigger(store, job))["tenant_id"]
    repo = QueueRepo(store)
    assert repo.move_outbox(exclude_tenants=[tenant]) == 0
    assert outbox_count(store) == 2
    assert repo.move_outbox(exclude_tenants=["someone-else"]) == 2


def test_heartbeat_sees_a_cancelled_job(store: Store) -> None:
    tenant = make_tenant(store)
    job, _ = queued_run(store)
    repo = QueueRepo(store)
    (lease,) = repo.lease("q", "w1", 30, tenant_id=tenant)
    assert repo.beat(lease, 30) is Beat.extended
    JobRepo(store).cancel(job, actor="test")
    assert repo.beat(lease, 30) is Beat.cancelled
    assert repo.heartbeat(lease, 30) is True  # still ours until the worker settles it
    now = datetime.now(UTC)
    assert repo.stop_cancelled(
        lease, exit_code=None, output_tail="bye", started_at=now, finished_at=now
    )
    assert repo.beat(lease, 30) is Beat.lost
    assert messages(store) == [] and dead_letters(store) == []
    run = run_row(store, job, lease.scheduled_at)
    assert (run["status"], run["error"]) == ("failed", CANCELLED_RUNNING_ERROR)


def test_concurrent_relays_on_postgres_move_each_row_once(pg_store: Store) -> None:
    store = pg_store
    tenant = make_tenant(store)
    times = [ago(60) + timedelta(milliseconds=i) for i in range(400)]
    job_ids = bulk_once_jobs(store, tenant, times)
    with store.tx() as connection:
        for job_id, at in zip(job_ids, times, strict=True):
            add_dispatched_run(connection, job_id, at, tenant, trigger="schedule")
    repo = QueueRepo(store)
    barrier = threading.Barrier(4)
    moved: list[int] = []
    lock = threading.Lock()

    def relay() -> None:
        barrier.wait(30)
        while True:
            n = repo.move_outbox(limit=25)
            with lock:
                moved.append(n)
            if n == 0 and outbox_count(store) == 0:
                return

    threads = [threading.Thread(target=relay) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # every row was moved by exactly one relay: the counts add up with no conflicts hidden
    assert sum(moved) == 400
    keys = Counter((m["job_id"], m["scheduled_at"]) for m in messages(store))
    assert len(keys) == 400
    assert set(keys.values()) == {1}


# -- lease / ack / fail -------------------------------------------------------------------


def test_lease_and_ack(store: Store) -> None:
    tenant = make_tenant(store)
    job, at = queued_run(store, payload={"hello": "world"}, timeout=30, max_attempts=4)
    repo = QueueRepo(store)
    assert repo.lease("other-queue", "w1", 30, tenant_id=tenant) == []
    (lease,) = repo.lease("q", "w1", 30, limit=5, tenant_id=tenant)
    assert (lease.job_id, lease.scheduled_at, lease.attempt) == (job, at, 1)
    assert lease.payload == {"hello": "world"}
    assert (lease.max_attempts, lease.timeout_seconds, lease.owner) == (4, 30, "w1")
    assert lease.idempotency_key == f"{job}:{format_instant(at)}"
    assert lease.idempotency_key.endswith("Z")
    assert "world" not in repr(lease)
    run = run_row(store, job, at)
    assert run["status"] == "running" and run["started_at"] is not None
    assert repo.lease("q", "w2", 30, tenant_id=tenant) == []  # leased: invisible to others
    assert repo.heartbeat(lease, 30)
    assert done(repo, lease, tail="all good")
    # a second ack (a retry after a lost commit answer) finds the first one's outcome
    # recorded, says so, and changes nothing
    assert done(repo, lease), "a repeated ack is answered recorded"
    run = run_row(store, job, at)
    assert (run["status"], run["exit_code"], run["output_tail"]) == ("succeeded", 0, "all good")
    assert run["finished_at"] is not None
    assert messages(store) == []
    (attempt,) = attempts(store, job, at)
    assert (attempt["status"], attempt["attempt"], attempt["worker"]) == ("succeeded", 1, "w1")
    assert not repo.heartbeat(lease, 30)


def test_failures_retry_then_dead_letter(store: Store) -> None:
    tenant = make_tenant(store)
    job, at = queued_run(store, max_attempts=3)
    repo = QueueRepo(store)
    for attempt in (1, 2, 3):
        (lease,) = repo.lease("q", "w1", 30, tenant_id=tenant)
        assert lease.attempt == attempt
        run = run_row(store, job, at)
        assert (run["status"], run["attempt"]) == ("running", attempt)
        assert failed(repo, lease, error=f"exit code {attempt}")
        if attempt < 3:
            run = run_row(store, job, at)
            assert (run["status"], run["error"], run["exit_code"]) == (
                "failed",
                f"exit code {attempt}",
                3,
            )
            (message,) = messages(store)
            assert message["attempt"] == attempt + 1 and message["leased_until"] is None
    assert messages(store) == []
    run = run_row(store, job, at)
    assert (run["status"], run["attempt"], run["error"]) == ("dead", 3, "exit code 3")
    (letter,) = dead_letters(store)
    assert (letter["job_id"], letter["scheduled_at"]) == (job, at)
    assert (letter["target_type"], letter["target"], letter["attempts"]) == ("queue", "q", 3)
    assert letter["last_error"] == "exit code 3"
    history = attempts(store, job, at)
    assert [(a["attempt"], a["status"]) for a in history] == [
        (1, "failed"),
        (2, "failed"),
        (3, "failed"),
    ]
    assert repo.lease("q", "w1", 30, tenant_id=tenant) == []


def test_failure_backs_off_with_jitter_within_the_policy(store: Store) -> None:
    tenant = make_tenant(store)
    job = queue_job(store, max_attempts=5, base=100.0, cap=1000.0)
    trigger(store, job)
    repo = QueueRepo(store, rng=random.Random(1))
    repo.move_outbox()
    (lease,) = repo.lease("q", "w1", 30, tenant_id=tenant)
    before = store.now()
    assert failed(repo, lease)
    after = store.now()
    (message,) = messages(store)
    # attempt 1 failed: uniform(0, min(1000, 100 * 2 ** 0)) seconds after the failure,
    # drawn from the same seeded generator
    delay = timedelta(seconds=random.Random(1).uniform(0, 100))
    assert before + delay <= message["available_at"] <= after + delay
    assert repo.lease("q", "w1", 30, tenant_id=tenant) == []  # not before its time


def test_fail_or_ack_of_a_lost_lease_changes_nothing(store: Store) -> None:
    tenant = make_tenant(store)
    job, at = queued_run(store)
    repo = QueueRepo(store)
    (lease,) = repo.lease("q", "w1", 30, tenant_id=tenant)
    forged = Lease(**{**lease.__dict__, "owner": "w2"})
    assert not failed(repo, forged)
    assert not done(repo, forged)
    assert not repo.heartbeat(forged, 30)
    assert attempts(store, job, at) == []
    assert run_row(store, job, at)["status"] == "running"


# -- lease expiry --------------------------------------------------------------------------


def expire(repo: QueueRepo, count: int = 1) -> None:
    settled = [0]

    def reaped() -> bool:
        settled[0] += repo.expire_leases()
        return settled[0] >= count

    wait_for(reaped, "the lease to expire")


def test_expired_lease_marks_the_run_lost_and_redelivers(store: Store) -> None:
    tenant = make_tenant(store)
    job, at = queued_run(store, max_attempts=3)
    repo = QueueRepo(store)
    (lease,) = repo.lease("q", "dead-worker", 0.2, tenant_id=tenant)
    expire(repo)
    run = run_row(store, job, at)
    assert (run["status"], run["error"]) == ("lost", LOST_ERROR)
    (lost,) = attempts(store, job, at)
    assert (lost["status"], lost["attempt"], lost["worker"]) == ("lost", 1, "dead-worker")
    # the former holder can neither extend nor settle it any more
    assert not repo.heartbeat(lease, 30)
    assert not done(repo, lease)
    (again,) = repo.lease("q", "w2", 30, tenant_id=tenant)
    assert again.attempt == 2
    assert done(repo, again)
    assert run_row(store, job, at)["status"] == "succeeded"
    assert [a["status"] for a in attempts(store, job, at)] == ["lost", "succeeded"]


def test_expired_lease_of_the_last_attempt_is_dead_lettered(store: Store) -> None:
    tenant = make_tenant(store)
    job, at = queued_run(store, max_attempts=1)
    repo = QueueRepo(store)
    repo.lease("q", "dead-worker", 0.2, tenant_id=tenant)
    expire(repo)
    assert run_row(store, job, at)["status"] == "dead"
    (letter,) = dead_letters(store)
    assert (letter["attempts"], letter["last_error"]) == (1, LOST_ERROR)
    assert messages(store) == []


def test_heartbeat_keeps_a_lease_from_expiring(store: Store) -> None:
    tenant = make_tenant(store)
    queued_run(store)
    repo = QueueRepo(store)
    (lease,) = repo.lease("q", "w1", 0.2, tenant_id=tenant)
    assert repo.heartbeat(lease, 3600)
    (message,) = messages(store)
    assert message["leased_until"] > store.now() + timedelta(seconds=3000)
    assert repo.expire_leases() == 0


# -- max concurrency ---------------------------------------------------------------------


def test_max_concurrency_one_holds_back_the_second_run(store: Store) -> None:
    tenant = make_tenant(store)
    job = queue_job(store, max_concurrency=1)
    other = queue_job(store, max_concurrency=1)
    first, second = trigger(store, job), trigger(store, job)
    third = trigger(store, other)
    repo = QueueRepo(store)
    repo.move_outbox()
    leases = repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    # one of each job: the second run of `job` waits although the limit allows ten
    assert sorted((le.job_id, le.scheduled_at) for le in leases) == sorted(
        [(job, first), (other, third)]
    )
    assert repo.lease("q", "w2", 30, limit=10, tenant_id=tenant) == []
    assert done(repo, next(le for le in leases if le.job_id == job))
    (next_lease,) = repo.lease("q", "w2", 30, limit=10, tenant_id=tenant)
    assert (next_lease.job_id, next_lease.scheduled_at) == (job, second)


def test_max_concurrency_above_one(store: Store) -> None:
    tenant = make_tenant(store)
    job = queue_job(store, max_concurrency=2)
    for _ in range(4):
        trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    assert len(repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)) == 2
    assert repo.lease("q", "w1", 30, limit=10, tenant_id=tenant) == []


def test_max_concurrency_zero_means_no_limit(store: Store) -> None:
    tenant = make_tenant(store)
    job = queue_job(store, max_concurrency=0)  # null in the API: overlapping runs allowed
    for _ in range(3):
        trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    assert len(repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)) == 3


def test_unlimited_and_limited_jobs_in_one_lease(store: Store) -> None:
    # the slot count is taken for the limited job only: its limit still holds beside an
    # unlimited job's runs
    tenant = make_tenant(store)
    free = queue_job(store, max_concurrency=0)
    one = queue_job(store, max_concurrency=1)
    for _ in range(3):
        trigger(store, free)
        trigger(store, one)
    repo = QueueRepo(store)
    repo.move_outbox()
    leases = repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    assert sorted(le.job_id for le in leases) == sorted([free] * 3 + [one])
    assert repo.lease("q", "w2", 30, limit=10, tenant_id=tenant) == []


def test_a_job_at_its_limit_does_not_hide_the_runs_behind_it(store: Store) -> None:
    # many runs of one max_concurrency=1 job ahead of others in the queue: one lease takes
    # one of them and (the query leaving out a job at its limit) the next takes the others
    tenant = make_tenant(store)
    busy = queue_job(store, max_concurrency=1)
    for _ in range(12):
        trigger(store, busy)
    others = [queue_job(store, max_concurrency=1) for _ in range(3)]
    for job in others:
        trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    taken = repo.lease("q", "w1", 30, limit=2, tenant_id=tenant)
    taken += repo.lease("q", "w1", 30, limit=10, tenant_id=tenant)
    assert sorted(le.job_id for le in taken) == sorted([busy, *others])


def test_an_expired_unreaped_lease_still_holds_its_slot(store: Store) -> None:
    tenant = make_tenant(store)
    job = queue_job(store, max_concurrency=1)
    trigger(store, job)
    trigger(store, job)
    repo = QueueRepo(store)
    repo.move_outbox()
    assert len(repo.lease("q", "w1", 0.05, tenant_id=tenant)) == 1
    wait_for(lambda: messages(store)[0]["leased_until"] < store.now(), "the lease to run out")
    # its command may still be running until the reaper settles it: no overlap meanwhile
    assert repo.lease("q", "w2", 30, tenant_id=tenant) == []
    expire(repo)
    (taken,) = repo.lease("q", "w2", 30, limit=10, tenant_id=tenant)
    assert taken.job_id == job


def test_racing_workers_on_postgres_never_exceed_max_concurrency(pg_store: Store) -> None:
    store = pg_store
    tenant = make_tenant(store)
    repo = QueueRepo(store)
    for _round in range(10):
        job = queue_job(store, max_concurrency=1)
        for _ in range(12):
            trigger(store, job)
        repo.move_outbox()
        barrier = threading.Barrier(6)
        taken: list[Lease] = []
        lock = threading.Lock()

        def take(
            name: str,
            barrier: threading.Barrier = barrier,
            taken: list[Lease] = taken,
            lock: threading.Lock = lock,
        ) -> None:
            barrier.wait(30)
            got = repo.lease("q", name, 30, limit=1, tenant_id=tenant)
            with lock:
                taken.extend(got)

        threads = [threading.Thread(target=take, args=(f"w{i}",)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(taken) == 1, f"{len(taken)} runs of one max_concurrency=1 job leased at once"
        # clear the queue for the next round
        for lease in taken:
            done(repo, lease)
        with store.tx() as connection:
            connection.execute(schema.queue_messages.delete())


# -- depths ----------------------------------------------------------------------------------


def test_depths_and_stats(store: Store) -> None:
    tenant = make_tenant(store)
    a = queue_job(store, queue="q1", max_concurrency=5)
    slow = queue_job(store, queue="q1", base=1000.0, cap=1000.0)
    b = queue_job(store, queue="q2")
    for _ in range(3):
        trigger(store, a)
    trigger(store, slow)
    trigger(store, b)
    repo = QueueRepo(store)
    repo.move_outbox()
    leases = repo.lease("q1", "w1", 30, limit=10, tenant_id=tenant)
    assert len(leases) == 4
    failed(repo, next(le for le in leases if le.job_id == slow))  # delayed by the backoff
    stats = {(s.tenant_id, s.queue): s.depth for s in repo.stats()}
    assert (stats[tenant, "q1"].ready, stats[tenant, "q1"].delayed) == (0, 1)
    assert stats[tenant, "q1"].leased == 3
    assert (stats[tenant, "q2"].ready, stats[tenant, "q2"].delayed) == (1, 0)
    assert stats[tenant, "q2"].leased == 0
    name = repo.stats()[0].tenant
    assert repo.depths() == {(name, "q1"): 4, (name, "q2"): 1}


def test_on_sqlite_reads_and_idle_pollers_do_not_wait_for_the_writer(sqlite_url: str) -> None:
    # SQLite has one writer at a time: a read, and a relay or reaper poll that finds
    # nothing to do, run beside a long write transaction instead of queueing for its lock
    store = Store.open(sqlite_url)
    try:
        make_tenant(store)
        writing, release = threading.Event(), threading.Event()

        def hold_the_write_lock() -> None:
            with store.tx() as connection:
                connection.execute(schema.settings.update().values(value="held"))
                writing.set()
                release.wait(60)
                raise RuntimeError("rolled back")  # nothing of it stays

        holder = threading.Thread(target=lambda: _swallow(hold_the_write_lock), daemon=True)
        holder.start()
        assert writing.wait(30)
        done_reading = threading.Event()
        results: list[object] = []

        def poll() -> None:
            repo = QueueRepo(store)
            results.extend([repo.move_outbox(), repo.expire_leases(), store.now()])
            with store.read() as connection:
                results.append(connection.execute(schema.tenants.select()).all())
            done_reading.set()

        threading.Thread(target=poll, daemon=True).start()
        # before the writer lets go: with the write lock taken first these would wait
        # for it (up to the 30 s busy timeout)
        assert done_reading.wait(20), "the reads waited for the writer"
        release.set()
        holder.join(30)
        assert results[:2] == [0, 0] and len(results[3]) == 1  # type: ignore[arg-type]
    finally:
        store.close()


def _swallow(action: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):
        action()


def test_the_candidate_statement_admits_what_lease_slots_acts_on(store: Store) -> None:
    # The statement pre-filters (it has a LIMIT: a job at its limit must not fill it) and
    # lease_slots decides under the slot lock; the two must agree on every combination of
    # overlap, attempt, max_concurrency and runs already held, or a run the lease would
    # take (or skip, or replace) is never fetched, or a fetched one is never acted on
    from schedctl.domain.runpolicy import Overlap
    from schedctl.storage.pipeline.admission import lease_slots
    from schedctl.storage.pipeline.lease_statements import lease_statements

    tenant = make_tenant(store)
    m, j = schema.queue_messages, schema.jobs
    cases: dict[str, tuple[Overlap, int, int, int]] = {}  # job -> overlap, attempt, limit, held
    for overlap in Overlap:
        for attempt in (1, 2):
            for limit in (0, 1, 2):
                for held in (0, 1, 2):
                    job = queue_job(store, tenant=tenant, max_concurrency=limit)
                    for _ in range(held + 1):
                        trigger(store, job)
                    cases[job] = (overlap, attempt, limit, held)
    QueueRepo(store).move_outbox()
    future = datetime.now(UTC) + timedelta(hours=1)
    with store.tx() as connection:
        for job, (overlap, attempt, _, held) in cases.items():
            connection.execute(j.update().where(j.c.job_id == job).values(overlap=overlap.value))
            ids = connection.execute(
                select(m.c.id).where(m.c.job_id == job).order_by(m.c.id)
            ).scalars().all()  # fmt: skip
            connection.execute(m.update().where(m.c.id.in_(ids[:held])).values(leased_until=future))
            connection.execute(m.update().where(m.c.id == ids[-1]).values(attempt=attempt))
    with store.tx() as connection:
        _, found = lease_statements(store.dialect).lease_candidates(connection, tenant, "q", 999)
    fetched = {c.job_id: c for c in found}
    assert len(fetched) == len(found)  # a job's one ready message at most
    template = found[0]
    for job, (overlap, attempt, limit, held) in cases.items():
        candidate = template._replace(
            job_id=job, overlap=overlap.value, attempt=attempt, max_concurrency=limit
        )
        slots = lease_slots(candidate)
        skips_or_replaces = overlap in (Overlap.SKIP, Overlap.REPLACE) and attempt == 1
        acted_on = slots == 0 or held < slots or skips_or_replaces
        assert (job in fetched) == acted_on, (overlap, attempt, limit, held)
        if job in fetched:
            assert fetched[job] == candidate._replace(
                id=fetched[job].id, scheduled_at=fetched[job].scheduled_at,
                payload=fetched[job].payload,
            )  # fmt: skip
