"""Settling a batch of relay outcomes in one transaction, on SQLite and Postgres (where the
attempts and the runs are one statement each over arrays): each run gets its own status,
attempt row, retry or dead letter, and settling the same outcomes again changes nothing."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func, select

from schedctl.domain.models import Lane, TargetType, Verdict
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.outbox import DeliveryOutcome, OutboxRepo
from tests.integration.queue_support import (
    allow_loopback_tenant,
    attempts,
    dead_letters,
    http_job,
    outbox_rows,
    run_row,
    trigger,
)

VERDICTS = (Verdict.succeeded, Verdict.retry, Verdict.failed)


def test_a_batch_of_outcomes_is_settled_run_by_run(store: Store) -> None:
    tenant = allow_loopback_tenant(store)
    jobs = [
        http_job(store, "http://127.0.0.1:9/hook", tenant=tenant, max_attempts=3) for _ in range(4)
    ]
    runs = {(job, trigger(store, job)) for job in jobs for _ in range(3)}
    repo = OutboxRepo(store)
    claimed = repo.claim({Lane(tenant, TargetType.http): 100}, "relay-batch", 30.0).deliveries
    assert len(claimed) == len(runs)
    now = datetime.now(UTC)
    outcomes = [
        DeliveryOutcome(
            delivery=d,
            verdict=VERDICTS[i % 3],
            started_at=now,
            finished_at=now,
            error=None if i % 3 == 0 else f"error {i}",
            detail=f"HTTP answer {i}",
        )
        for i, d in enumerate(claimed)
    ]
    result = repo.settle(outcomes)
    expected = {v: sum(1 for o in outcomes if o.verdict is v) for v in VERDICTS}
    assert (result.succeeded, result.retried, result.dead, result.stale) == (
        expected[Verdict.succeeded],
        expected[Verdict.retry],
        expected[Verdict.failed],
        0,
    )
    want_status = {Verdict.succeeded: "succeeded", Verdict.retry: "failed", Verdict.failed: "dead"}
    for outcome in outcomes:
        d = outcome.delivery
        run = run_row(store, d.job_id, d.scheduled_at)
        assert run["status"] == want_status[outcome.verdict], (run, outcome.verdict)
        assert run["attempt"] == 1 and run["output_tail"] == outcome.detail
        (attempt,) = attempts(store, d.job_id, d.scheduled_at)
        assert attempt["worker"] == "relay-batch" and attempt["output_tail"] == outcome.detail
    left = outbox_rows(store)
    assert len(left) == expected[Verdict.retry]
    assert all(row["attempt"] == 2 and row["lease_owner"] is None for row in left)
    assert len(dead_letters(store)) == expected[Verdict.failed]
    # the same outcomes again: their leases are gone, nothing changes
    again = repo.settle(outcomes)
    assert (again.succeeded, again.retried, again.dead, again.stale) == (0, 0, 0, len(outcomes))
    with store.read() as connection:
        recorded = connection.execute(
            select(func.count()).select_from(schema.run_attempts)
        ).scalar_one()
    assert recorded == len(outcomes)
