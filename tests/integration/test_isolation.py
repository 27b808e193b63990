"""Tenant isolation at delivery on a real Postgres: tenant A has 10,000 runs due against an
endpoint that hangs for 30 s, tenant B has runs due at the same time against a healthy
endpoint; all of B's runs are delivered while A's lane is still full of its first hanging
calls (none answered yet: B never waited for A), A never has more calls in flight than its
lane allows, and its backlog waits in the outbox. B's lateness (the contract: p99 within 2 s)
is measured and printed, not asserted: this machine is shared and noisy."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from schedctl.delivery.limits import DeliveryLimits, TokenBucket
from schedctl.domain.models import Lane
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import new_job_id, partition_of
from scheduled_d.relay import Relay
from tests.factories import make_tenant, set_tenant
from tests.fakes import ManualClock
from tests.integration.queue_support import (
    hook_server,
    running_relay,
    set_allow_list,
    wait_for,
)

A_RUNS = 10_000
A_JOBS = 100
B_AT_ONCE = 100  # due at the same instant as all of A's
B_SPREAD = 400  # then one every 25 ms for 10 s, while A's endpoint still hangs
SPREAD_SECONDS = 10.0


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    store = Store.open(pg_url)
    yield store
    store.close()


def _jobs(store: Store, tenant_id: str, url: str, count: int) -> list[str]:
    now = datetime.now(UTC)
    rows: list[dict[str, Any]] = []
    for _ in range(count):
        job_id = new_job_id()
        rows.append(
            {
                "job_id": job_id,
                "tenant_id": tenant_id,
                "name": f"isolation-{job_id}",  # names are unique per tenant
                "schedule": json.dumps({"kind": "once", "run_at": now.isoformat()}),
                "target_type": "http",
                "target": url,
                "payload": json.dumps({"tenant": tenant_id}),
                "max_attempts": 3,
                "retry_base_seconds": 1.0,
                "retry_max_seconds": 5.0,
                "misfire_policy": "run_once",
                "grace_seconds": 60,
                "window_seconds": 0,
                "max_concurrency": 1,
                "timeout_seconds": 0,
                "status": "completed",  # its runs below are already claimed
                "next_run_at": None,
                "next_fire_at": None,
                "partition": partition_of(job_id, store.partition_count),
                "version": 2,
                "request_hash": "isolation",
                "created_at": now,
                "updated_at": now,
            }
        )
    with store.tx() as connection:
        connection.execute(schema.jobs.insert(), rows)
    return [r["job_id"] for r in rows]


def _claimed_runs(store: Store, tenant_id: str, url: str, runs: list[tuple[str, datetime]]) -> None:
    """Runs as the dispatcher's claim leaves them: a run row and an outbox row each, due
    (available) at the scheduled time."""
    now = datetime.now(UTC)
    with store.tx() as connection:
        for start in range(0, len(runs), 2000):
            chunk = runs[start : start + 2000]
            connection.execute(
                schema.runs.insert(),
                [
                    {
                        "job_id": job,
                        "scheduled_at": at,
                        "tenant_id": tenant_id,
                        "partition": 0,
                        "trigger": "schedule",
                        "status": "dispatched",
                        "attempt": 1,
                        "fire_at": at,
                        "dispatched_at": now,
                        "epoch": 1,
                        "job_version": 1,
                    }
                    for job, at in chunk
                ],
            )
            connection.execute(
                schema.outbox.insert(),
                [
                    {
                        "job_id": job,
                        "scheduled_at": at,
                        "tenant_id": tenant_id,
                        "target_type": "http",
                        "target": url,
                        "attempt": 1,
                        "available_at": at,
                        "created_at": now,
                    }
                    for job, at in chunk
                ],
            )


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@pytest.mark.slow
def test_a_hanging_tenant_never_delays_another(store: Store) -> None:
    a = make_tenant(store, "tenant-a")
    b = make_tenant(store, "tenant-b")
    for tenant in (a, b):
        set_allow_list(store, tenant, ["127.0.0.1"])
        # the default delivery settings: 16 in flight per lane, 1000 runs a second
        set_tenant(store, tenant, delivery_concurrency=16, dispatch_rate_per_second=1000)
    with hook_server(hang=30) as hanging, hook_server() as healthy:
        a_jobs = _jobs(store, a, hanging.url("/a"), A_JOBS)
        b_jobs = _jobs(store, b, healthy.url("/b"), 20)
        due = datetime.now(UTC) + timedelta(seconds=3)
        step = SPREAD_SECONDS / B_SPREAD
        a_runs = [
            (a_jobs[i % A_JOBS], due - timedelta(microseconds=i // A_JOBS)) for i in range(A_RUNS)
        ]
        b_runs = [(b_jobs[i % 20], due - timedelta(microseconds=i)) for i in range(B_AT_ONCE)]
        b_runs += [
            (b_jobs[i % 20], due + timedelta(seconds=step * (i + 1))) for i in range(B_SPREAD)
        ]
        _claimed_runs(store, a, hanging.url("/a"), a_runs)
        _claimed_runs(store, b, healthy.url("/b"), b_runs)
        # no call to A times out while the test runs (a timed-out call would still hang at
        # the server, and its count would no longer be the relay's): A's lane is full of
        # hanging calls for the whole test; they end when the server lets them go
        relay = Relay(store, poll_seconds=0.2, http_timeout=45)
        started = time.monotonic()
        with running_relay(relay):
            wait_for(lambda: healthy.count() >= len(b_runs), "all of B's runs", 90)
            elapsed = time.monotonic() - started
            with store.read() as connection:
                a_leased = connection.execute(
                    select(func.count())
                    .select_from(schema.outbox)
                    .where(schema.outbox.c.tenant_id == a, schema.outbox.c.lease_owner.is_not(None))
                ).scalar_one()
            a_calls = hanging.count()
            a_held = hanging.in_flight
            a_max = hanging.max_in_flight
            # answer A's held calls (connection closed) so the relay stops at once
            hanging.release.set()
        received = healthy.requests()
    lateness = [
        r.at - datetime.fromisoformat(r.json["scheduled_at"].replace("Z", "+00:00")).timestamp()
        for r in received
    ]
    keys = {(r.json["job_id"], r.json["scheduled_at"]) for r in received}
    burst = [
        late
        for late, r in zip(lateness, received, strict=True)
        if r.json["scheduled_at"] <= format_instant(due)
    ]
    p50, p99 = statistics.median(lateness), _percentile(lateness, 0.99)
    print(
        f"\nisolation: tenant B {len(received)} runs delivered, lateness p50 {p50 * 1000:.0f} ms, "
        f"p99 {p99 * 1000:.0f} ms, max {max(lateness) * 1000:.0f} ms (the {len(burst)} due "
        f"with A's burst: max {max(burst) * 1000:.0f} ms); tenant A: {A_RUNS} due, "
        f"{a_calls} calls made, at most {a_max} in flight, {a_leased} rows leased; "
        f"{elapsed:.1f} s"
    )
    assert keys == {(job, format_instant(at)) for job, at in b_runs}
    # A's lane was full of its first calls, all still held: none of B's runs waited for one
    assert a_calls == a_held == 16
    assert a_max <= 16  # A's lane, never more
    # its slots plus one waiting batch per slot; the rest of its backlog waits unclaimed
    assert a_leased <= 2 * 16


# -- the limits themselves (no database) ------------------------------------------------------


def test_token_bucket_paces_and_bursts_one_second() -> None:
    clock = ManualClock()
    bucket = TokenBucket(10, clock=clock)
    assert bucket.take(25) == 10  # a full second's burst, no more
    assert bucket.take(1) == 0
    clock.now += 0.5
    assert bucket.take(10) == 5
    assert bucket.available() == 0


def test_lanes_are_limited_separately_and_by_the_relay() -> None:
    clock = ManualClock()
    limits = DeliveryLimits(max_in_flight=5, clock=clock)
    a, b = Lane("a", "http"), Lane("b", "http")
    limits.configure("a", rate_per_second=100, concurrency=3)
    limits.configure("b", rate_per_second=2, concurrency=3)
    # slots to fill plus one batch waiting per slot, within the tenant's tokens
    assert limits.capacity(a) == 6
    assert limits.capacity(b) == 2
    assert [limits.try_acquire(a) for _ in range(4)] == [True, True, True, False]
    assert limits.capacity(a, queued=2) == 1
    # the relay's cap: b gets two slots, then nothing, however idle its own lane is
    assert [limits.try_acquire(b) for _ in range(3)] == [True, True, False]
    assert limits.capacity(Lane("c", "http")) == 0
    limits.release(a)
    assert limits.try_acquire(b)
    assert limits.busy(a) == 2 and limits.busy(b) == 3 and limits.in_flight == 5
