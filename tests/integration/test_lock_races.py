"""Lock races on a real Postgres: a claim that loses one (deadlock) takes the "aborted,
try again" path and commits nothing; the worker's lease does not lock job rows, so it
never waits for (or deadlocks with) a claim; lock-race errors are recognised however they
arrive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError

from schedctl.coordination.local import LocalCoordinator
from schedctl.core import errors
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store, is_lock_race
from schedctl.storage.pipeline.claim import Claimer, ClaimResult
from tests.factories import ago, bulk_once_jobs, make_tenant

pytestmark = pytest.mark.postgres

ALL = range(1024)
WAIT_SECONDS = 60.0  # bound of every wait below; they normally end in milliseconds


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    store = Store.open(pg_url)
    yield store
    store.close()


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.02)


def _waiting_for_lock(store: Store, pid: int) -> bool:
    with store.read() as connection:
        kind = connection.execute(
            text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar_one_or_none()
    return kind == "Lock"


def _claim_waiting(store: Store) -> int | None:
    """The pid of a backend blocked in the claim's job-row lock statement, if any."""
    with store.read() as connection:
        return connection.execute(
            text(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE '%FOR NO KEY UPDATE%' AND query LIKE '%FROM jobs%'"
            )
        ).scalar()


def _lock_job(job_id: str) -> Any:
    return select(schema.jobs.c.job_id).where(schema.jobs.c.job_id == job_id).with_for_update()


def _pid(connection: Connection) -> int:
    return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_claim_that_loses_a_deadlock_is_aborted_and_commits_nothing(store: Store) -> None:
    """Deterministic deadlock with the claim as Postgres' victim.

    Job ids a < b; the claim locks partitions (FOR SHARE), then jobs a, b in id order.
    1. `gate` holds job a: the claim, holding its partition locks, waits for it.
    2. `rival` (whose deadlock_timeout is an hour, so it never runs the deadlock check
       itself) holds job b and then waits for the claim's partition row.
    3. `gate` commits: the claim takes a and waits for b, closing the cycle last, so its
       own deadlock check (after the default 1 s) finds the cycle and aborts the claim.
    The claim's 40P01 comes from the raw psycopg cursor, bypassing SQLAlchemy."""
    tenant = make_tenant(store)
    coordinator = LocalCoordinator(store, "d1")
    coordinator.start()
    epochs = dict(coordinator.owned())
    a, b = sorted(bulk_once_jobs(store, tenant, [ago(5), ago(5)]))
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    due = claimer.load_due(ALL, now, 10)
    assert {d.job_id for d in due} == {a, b}
    partition_of_a = next(d.partition for d in due if d.job_id == a)

    gate = store.engine.connect()
    rival = store.engine.connect()
    gate_tx, rival_tx = gate.begin(), rival.begin()
    results: list[ClaimResult] = []
    failures: list[BaseException] = []
    rival_done = threading.Event()
    try:
        gate.execute(
            select(schema.jobs.c.job_id).where(schema.jobs.c.job_id == a).with_for_update()
        )
        rival.execute(text("SET LOCAL deadlock_timeout = '1h'"))
        rival.execute(
            select(schema.jobs.c.job_id).where(schema.jobs.c.job_id == b).with_for_update()
        )
        rival_pid = _pid(rival)

        def claim() -> None:
            try:
                results.append(claimer.claim(due, epochs, now))
            except BaseException as exc:  # reported by the assertion below
                failures.append(exc)

        def rival_waits_for_the_partition() -> None:
            try:
                rival.execute(
                    select(schema.partitions.c.epoch)
                    .where(schema.partitions.c.partition == partition_of_a)
                    .with_for_update()
                )
            except BaseException as exc:
                failures.append(exc)
            finally:
                rival_done.set()

        claim_thread = threading.Thread(target=claim)
        claim_thread.start()
        _until(lambda: _claim_waiting(store) is not None, "the claim to wait for job a")
        rival_thread = threading.Thread(target=rival_waits_for_the_partition)
        rival_thread.start()
        _until(lambda: _waiting_for_lock(store, rival_pid), "the rival to wait for the claim")
        gate_tx.commit()  # the claim takes a, then waits for b: the cycle is closed
        claim_thread.join(WAIT_SECONDS)
        assert not claim_thread.is_alive(), "the claim never returned"
        assert not failures, failures
        assert results == [ClaimResult(aborted=True)]
        # the claim rolled back, so the rival got its partition lock and was not the victim
        assert rival_done.wait(WAIT_SECONDS)
        rival_thread.join(WAIT_SECONDS)
        assert not failures, failures
    finally:
        for tx in (gate_tx, rival_tx):
            if tx.is_active:
                tx.rollback()
        gate.close()
        rival.close()

    with store.read() as connection:
        assert connection.execute(select(schema.runs.c.job_id)).all() == []
        assert connection.execute(select(schema.outbox.c.id)).all() == []
        versions = dict(
            connection.execute(select(schema.jobs.c.job_id, schema.jobs.c.version)).all()
        )
    assert versions == {d.job_id: d.version for d in due}  # nothing advanced
    # "try again": the same batch claims both runs once the race is over
    again = claimer.claim(due, epochs, now)
    assert not again.aborted
    assert sorted(job_id for job_id, _ in again.dispatched) == [a, b]


def test_a_lease_in_progress_does_not_block_a_claim_of_the_same_job(store: Store) -> None:
    """The lease serializes slot counting with advisory locks, not job row locks: while a
    transaction holds a job's lease lock, the claim of that job's next run goes through."""
    tenant = make_tenant(store)
    coordinator = LocalCoordinator(store, "d1")
    coordinator.start()
    epochs = dict(coordinator.owned())
    (job_id,) = bulk_once_jobs(store, tenant, [ago(5)])
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    due = claimer.load_due(ALL, now, 10)
    leasing = store.engine.connect()
    tx = leasing.begin()
    try:
        # what QueueRepo._lease takes for this job (see queue.py)
        leasing.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": f"lease:{job_id}"}
        )
        result = claimer.claim(due, epochs, now)
        assert [j for j, _ in result.dispatched] == [job_id]
    finally:
        tx.rollback()
        leasing.close()


def test_lock_races_are_recognised_from_the_driver_and_through_sqlalchemy(store: Store) -> None:
    """One classifier: psycopg's own exception (raw cursor), SQLAlchemy's wrapper, and
    Store.tx turning both into LockRace (a StoreUnavailable: every retrying caller retries
    it); other errors are not lock races."""
    raw = psycopg.errors.SerializationFailure("could not serialize access")
    assert is_lock_race(raw)
    assert is_lock_race(OperationalError("SELECT 1", {}, psycopg.errors.DeadlockDetected("x")))
    assert not is_lock_race(psycopg.errors.UniqueViolation("dup"))
    assert not is_lock_race(RuntimeError("boom"))

    with pytest.raises(errors.LockRace) as through_sqlalchemy:
        with store.tx() as connection:
            connection.execute(
                text(
                    "DO $$ BEGIN RAISE EXCEPTION 'provoked' USING ERRCODE = 'deadlock_detected';"
                    " END $$"
                )
            )
    assert isinstance(through_sqlalchemy.value, errors.StoreUnavailable)
    with pytest.raises(errors.LockRace):
        with store.tx() as connection:
            driver = connection.connection.driver_connection
            assert driver is not None
            with driver.cursor() as cursor:
                cursor.execute(
                    "DO $$ BEGIN RAISE EXCEPTION 'provoked'"
                    " USING ERRCODE = 'serialization_failure'; END $$"
                )
    with pytest.raises(Exception) as other:
        with store.tx() as connection:
            connection.execute(text("SELECT 1/0"))
    assert not isinstance(other.value, errors.StoreUnavailable)
