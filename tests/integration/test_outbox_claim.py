"""The relay's outbox claim and settle on SQLite and a real Postgres: on Postgres one statement
reads the database's clock, locks the due rows, leases them and reads their jobs and tenants;
rows of several jobs, own payload snapshots, a cancelled job's run and an expired lease in
one claim each come out as before (a delivery with its job's payload, a skipped run, a lost
attempt). Settling reads the clock in its locking statement: a retry is due by the
database's clock, and a settle whose rows another transaction holds waits for them; the
runs' update reuses the attempts' arrays."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import select, text, update

from schedctl.domain.models import Lane, TargetType, Verdict
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.outbox import Delivery, DeliveryOutcome, OutboxRepo
from schedctl.storage.pipeline.outbox_statements import outbox_statements
from schedctl.storage.pipeline.settle import CANCELLED_ERROR, LOST_ERROR
from tests.factories import make_tenant
from tests.integration.queue_support import (
    allow_loopback_tenant,
    attempts,
    http_job,
    outbox_rows,
    run_row,
    set_allow_list,
    trigger,
    wait_for,
)


@pytest.fixture
def store(store: Store) -> Store:
    allow_loopback_tenant(store)
    return store


def stored_payload(store: Store, job_id: str) -> str:
    with store.read() as connection:
        value = connection.execute(
            select(schema.jobs.c.payload).where(schema.jobs.c.job_id == job_id)
        ).scalar_one()
    assert isinstance(value, str)
    return value


def test_a_postgres_claim_is_one_statement_leasing_by_the_database_clock(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = pg_store
    tenant = make_tenant(store, "claimer")
    set_allow_list(store, tenant, ["127.0.0.1"])
    jobs = [http_job(store, "http://127.0.0.1:9/hook", tenant=tenant) for _ in range(2)]
    for job in jobs:
        trigger(store, job)
        trigger(store, job)
    with store.read() as connection:
        before = db_now(connection)
    statements: list[str] = []
    execute = psycopg.Cursor.execute

    def counted(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        statements.append(str(query))
        return execute(cursor, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counted)
    claimed = OutboxRepo(store).claim({Lane(tenant, TargetType.http): 10}, "relay-one", 30.0)
    monkeypatch.undo()
    with store.read() as connection:
        after = db_now(connection)
    # clock, lane read, jobs, tenants and lease were five statements, each a round trip
    assert len(statements) == 1, statements
    assert len(claimed.deliveries) == 4 and claimed.lost == claimed.cancelled == 0
    (token,) = {d.lease for d in claimed.deliveries}
    assert token.startswith("relay-one/")
    rows = {r["id"]: r for r in outbox_rows(store)}
    for delivery in claimed.deliveries:
        row = rows[delivery.outbox_id]
        assert row["lease_owner"] == token
        # the lease runs from the database's now, read inside the claim
        lease = timedelta(seconds=30)
        assert before + lease <= row["available_at"] <= after + lease
        assert delivery.scheduled_at.utcoffset() == timedelta(0)
        assert delivery.stored_payload == stored_payload(store, delivery.job_id)
    # nothing left that is due: a second claim leases nothing
    again = OutboxRepo(store).claim({Lane(tenant, TargetType.http): 10}, "relay-two", 30.0)
    assert again.deliveries == []


def test_one_claim_of_payloads_a_cancelled_run_and_an_expired_lease(store: Store) -> None:
    tenant = make_tenant(store, "mixed")
    set_allow_list(store, tenant, ["127.0.0.1"])
    lane = Lane(tenant, TargetType.http)
    repo = OutboxRepo(store)
    # an expired lease of a relay that stopped
    lost_job = http_job(store, "http://127.0.0.1:9/lost", tenant=tenant, max_attempts=3)
    lost_at = trigger(store, lost_job)
    assert len(repo.claim({lane: 10}, "relay-gone", lease_seconds=0.05).deliveries) == 1
    wait_for(
        lambda: all(r["available_at"] < store.now() for r in outbox_rows(store)),
        "the lease to run out",
    )
    big = {"blob": "x" * 5000}
    first = http_job(store, "http://127.0.0.1:9/a", tenant=tenant, payload=big)
    second = http_job(store, "http://127.0.0.1:9/b", tenant=tenant, payload={"n": 2})
    cancelled = http_job(store, "http://127.0.0.1:9/c", tenant=tenant)
    runs = [trigger(store, first), trigger(store, second), trigger(store, first)]
    cancelled_at = trigger(store, cancelled)
    JobRepo(store).cancel(cancelled, actor="test")
    # an own payload snapshot on one run of `second` (an update made after its claim)
    snapshot_at = trigger(store, second)
    with store.tx() as connection:
        connection.execute(
            update(schema.outbox)
            .where(schema.outbox.c.job_id == second, schema.outbox.c.scheduled_at == snapshot_at)
            .values(payload="snapshot")
        )
    claimed = repo.claim({lane: 10}, "relay-next", lease_seconds=60)
    assert (claimed.lost, claimed.cancelled) == (1, 1)
    got = {(d.job_id, d.scheduled_at): d for d in claimed.deliveries}
    assert set(got) == {
        (first, runs[0]),
        (second, runs[1]),
        (first, runs[2]),
        (second, snapshot_at),
    }
    assert got[(first, runs[0])].stored_payload == stored_payload(store, first)
    assert got[(first, runs[2])].stored_payload == stored_payload(store, first)
    assert got[(second, runs[1])].stored_payload == stored_payload(store, second)
    assert got[(second, snapshot_at)].stored_payload == "snapshot"
    assert {d.allow_list for d in claimed.deliveries} == {("127.0.0.1",)}
    assert {d.attempt for d in claimed.deliveries} == {1}
    # the lost attempt is recorded and the row waits for its retry, leased by no one
    history = attempts(store, lost_job, lost_at)
    assert [(a["status"], a["error"], a["worker"]) for a in history] == [
        ("lost", LOST_ERROR, "relay-gone")
    ]
    rows = {(r["job_id"], r["scheduled_at"]): r for r in outbox_rows(store)}
    assert (rows[(lost_job, lost_at)]["attempt"], rows[(lost_job, lost_at)]["lease_owner"]) == (
        2,
        None,
    )
    # the cancelled job's run is skipped and gone from the outbox
    assert (cancelled, cancelled_at) not in rows
    skipped = run_row(store, cancelled, cancelled_at)
    assert (skipped["status"], skipped["error"]) == ("skipped", CANCELLED_ERROR)
    tokens = {rows[key]["lease_owner"] for key in got}
    assert tokens == {claimed.deliveries[0].lease}


def outcome(
    delivery: Delivery, verdict: Verdict, retry_after: float | None = None
) -> DeliveryOutcome:
    now = datetime.now(UTC)
    error = None if verdict is Verdict.succeeded else "HTTP 503"
    return DeliveryOutcome(delivery, verdict, now, now, error=error, retry_after=retry_after)


def test_a_settle_reads_the_database_clock_in_its_locking_statement(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = make_tenant(store, "settler")
    set_allow_list(store, tenant, ["127.0.0.1"])
    job = http_job(store, "http://127.0.0.1:9/hook", tenant=tenant, max_attempts=3)
    for _ in range(3):
        trigger(store, job)
    repo = OutboxRepo(store)
    claimed = repo.claim({Lane(tenant, TargetType.http): 10}, "relay-s", 30.0).deliveries
    assert len(claimed) == 3
    statements: list[str] = []
    parameters: list[Any] = []
    with store.read() as connection:
        before = db_now(connection)
    if store.is_postgres:
        execute = psycopg.Cursor.execute

        def counted(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append(str(query))
            parameters.append(args[0] if args else kwargs.get("params"))
            return execute(cursor, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", counted)
    # the endpoint asked for 100 s: more than this job's backoff, so the delay is exactly it
    result = repo.settle(
        [
            outcome(claimed[0], Verdict.succeeded),
            outcome(claimed[1], Verdict.retry, retry_after=100.0),
            outcome(claimed[2], Verdict.succeeded),
        ]
    )
    monkeypatch.undo()
    with store.read() as connection:
        after = db_now(connection)
    assert (result.succeeded, result.retried, result.stale) == (2, 1, 0)
    (row,) = outbox_rows(store)
    assert (row["id"], row["attempt"], row["lease_owner"]) == (claimed[1].outbox_id, 2, None)
    wait = timedelta(seconds=100)
    assert before + wait <= row["available_at"] <= after + wait
    if store.is_postgres:
        # the clock was a statement (a round trip) of its own before the locking one
        assert not any(s.strip() == "SELECT clock_timestamp()" for s in statements), statements
        assert "FOR UPDATE" in statements[0] and "clock_timestamp()" in statements[0]
        # a run per attempt: the runs' update takes the attempts' arrays, and only the runs'
        # statuses are an array of their own (besides the span of their instants)
        (record,) = [p for q, p in zip(statements, parameters, strict=True) if "run_attempts" in q]
        arrays = {name for name, value in record.items() if isinstance(value, list)}
        assert {name for name in arrays if name.startswith("r_")} == {"r_status"}
        assert {"r_first_at", "r_last_at"} <= set(record)
        assert run_row(store, job, claimed[0].scheduled_at)["status"] == "succeeded"
        assert run_row(store, job, claimed[1].scheduled_at)["status"] == "failed"
    # settling the same outcomes again changes nothing: the leases are no longer theirs
    again = repo.settle([outcome(d, Verdict.succeeded) for d in claimed])
    assert (again.succeeded, again.stale) == (0, 3)


def test_a_settle_waits_for_rows_another_transaction_holds(pg_store: Store) -> None:
    store = pg_store
    tenant = make_tenant(store, "waiter")
    set_allow_list(store, tenant, ["127.0.0.1"])
    job = http_job(store, "http://127.0.0.1:9/hook", tenant=tenant)
    at = trigger(store, job)
    repo = OutboxRepo(store)
    (delivery,) = repo.claim({Lane(tenant, TargetType.http): 10}, "relay-w", 30.0).deliveries
    results: list[Any] = []
    with store.tx() as holder:
        holder.execute(
            select(schema.outbox.c.id)
            .where(schema.outbox.c.id == delivery.outbox_id)
            .with_for_update()
        )
        settler = threading.Thread(
            target=lambda: results.append(repo.settle([outcome(delivery, Verdict.succeeded)]))
        )
        settler.start()

        def waiting() -> bool:
            with store.read() as connection:
                return bool(
                    connection.execute(
                        text("SELECT count(*) FROM pg_locks WHERE NOT granted")
                    ).scalar_one()
                )

        wait_for(waiting, "the settle to wait for the row lock")
        assert results == []
    settler.join(60)
    (result,) = results
    assert (result.succeeded, result.stale) == (1, 0)
    assert outbox_rows(store) == []
    assert run_row(store, job, at)["status"] == "succeeded"


def test_the_claim_statement_reads_and_leases_by_index_at_100000_rows(pg_store: Store) -> None:
    """The plan of the one-statement claim over a big outbox: the lease is an index scan by
    primary key, never a seq scan of the whole outbox (an UPDATE ... FROM the picked rows
    was planned as a hash join over all of them)."""
    from schedctl.storage.pipeline.outbox_statements import _LEASE_OUTBOX

    url = pg_store.engine.url.set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False)) as connection:
        with connection.transaction(force_rollback=True):
            connection.execute(
                "INSERT INTO outbox (job_id, scheduled_at, tenant_id, target_type, target,"
                " attempt, available_at, created_at)"
                " SELECT 'job-' || i, now(), 'tenant-big', 'http', 'http://127.0.0.1:9/', 1,"
                " now() - interval '1 second', now() FROM generate_series(1, 100000) AS i"
            )
            connection.execute("ANALYZE outbox")
            plan = "\n".join(
                row[0]
                for row in connection.execute(
                    "EXPLAIN " + _LEASE_OUTBOX,
                    {
                        "tenants": ["tenant-big"],
                        "kinds": ["http"],
                        "caps": [128],
                        "token": "relay/1/2",
                        "lease_seconds": 9.0,
                    },
                )
            )
    assert "Seq Scan on outbox" not in plan, plan
    assert "outbox_pkey" in plan, plan


def test_the_claim_is_planned_at_every_execution_never_kept_from_an_empty_outbox(
    pg_store: Store,
) -> None:
    """psycopg prepares a statement run five times, and Postgres may then keep one generic
    plan. A relay started before a burst made it while the outbox was empty: a seq scan and
    a sort of the whole outbox for every claim, until an analyze happened to invalidate
    it, and an HTTP burst took several times as long. Fails when the claim statement is
    prepared on its connection."""
    store = pg_store
    tenant = make_tenant(store, "quiet")
    lane = Lane(tenant, TargetType.http)
    statements = outbox_statements(store.dialect)
    with store.tx() as connection:
        for _ in range(8):
            statements.lease_outbox_rows(connection, {lane: 64}, "relay/1/1", 9.0)
        prepared = connection.execute(
            text("SELECT statement FROM pg_prepared_statements"),
        ).scalars()
        assert [s for s in prepared if "picked AS MATERIALIZED" in s] == []
