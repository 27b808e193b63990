"""Owns the delivery benchmark behind `schedctl bench delivery` (cli/bench_dispatch.py):
how many claimed runs a relay delivers per second to a
loopback HTTP endpoint (signed POSTs through the SSRF guard, one tenant lane) and into the
built-in queue, on the configured database. Measured and reported, never asserted.

Everything is bounded: a fixed number of runs, a deadline, an HTTP server on 127.0.0.1
(a child process) that this command starts and stops. Use a scratch database: it adds a
tenant, jobs and their runs (the queue messages it makes are removed at the end).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from schedctl.core import errors
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import new_job_id, partition_of
from schedctl.storage.tenants.tenants import TenantRepo
from schedctl_bench import children, measure
from schedctl_bench.receiver import Receiver
from schedctl_bench.storage import bench as bench_rows
from schedctl_bench.storage import bench_sizes


def bench_tenant(store: Store, concurrency: int) -> str:
    tenant, _token = TenantRepo(store).create(f"bench-{uuid.uuid4().hex[:8]}", actor="bench")
    bench_rows.set_tenant_columns(
        store,
        tenant.tenant_id,
        {
            # no pacing: this measures delivery, not the rate limit
            "dispatch_rate_per_second": 10_000_000,
            "delivery_concurrency": concurrency,
            "allow_list": json.dumps(["127.0.0.1/32"]),
        },
    )
    return tenant.tenant_id


def claimed_runs(store: Store, tenant_id: str, target_type: str, target: str, count: int) -> str:
    """One job and `count` runs of it as a claim leaves them (run + outbox rows, due now),
    in delivery tables cleared of former runs' dead rows first."""
    bench_sizes.clear_dead_rows(store)
    now = datetime.now(UTC)
    job_id = new_job_id()
    # read before the write transaction: on SQLite a second connection would wait for it
    partition = partition_of(job_id, store.partition_count)
    job = {
        "job_id": job_id,
        "tenant_id": tenant_id,
        "name": f"bench-delivery-{job_id}",  # names are unique per tenant
        "schedule": json.dumps({"kind": "once", "run_at": format_instant(now)}),
        "target_type": target_type,
        "target": target,
        "payload": json.dumps({"bench": True}),
        "max_attempts": 3,
        "retry_base_seconds": 1.0,
        "retry_max_seconds": 10.0,
        "misfire_policy": "run_once",
        "grace_seconds": 60,
        "window_seconds": 0,
        "max_concurrency": 0,
        "timeout_seconds": 0,
        "status": "completed",
        "partition": partition,
        "version": 2,
        "request_hash": "bench",
        "metrics": False,
        "created_at": now,
        "updated_at": now,
    }
    times = [now - timedelta(microseconds=i) for i in range(count)]
    bench_rows.insert_claimed(
        store, job_id, tenant_id, (target_type, target), times, now=now, job=job
    )
    return job_id


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 1024 / 1024, 1)


def relay_until_settled(store: Store, job_id: str, runs: int, deadline: float) -> dict[str, Any]:
    """Run one real `scheduled-d relay` process until the job's `runs` outbox rows are all
    settled; the rate is timed from the first settled row (start-up is not delivery) to the
    last. Raises past the deadline."""
    url = store.engine.url.render_as_string(hide_password=False)
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "scheduled-d"), "relay"],
        env={**os.environ, "SCHEDULED_DATABASE_URL": url, "SCHEDULED_LOG_LEVEL": "WARNING"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    launched = time.monotonic()
    try:
        started = counted = None
        cpu_at_start: float | None = None
        while bench_rows.outbox_holds(store, job_id):
            if process.poll() is not None:
                raise errors.SchedError(f"the relay exited with code {process.returncode}")
            if time.monotonic() > deadline:
                left = bench_rows.outbox_left(store, job_id)
                raise errors.SchedError(
                    f"the benchmark did not finish in time ({left} runs left in the outbox)"
                )
            if started is None and bench_rows.any_attempt(store, job_id):
                started = time.monotonic()
                cpu_at_start = measure.cpu_seconds(process.pid)
                counted = bench_rows.outbox_left(store, job_id)  # once: it reads every row
            time.sleep(0.02)
        finished = time.monotonic()
        cpu = measure.cpu_seconds(process.pid)
        if started is None or counted is None:  # all settled before the first look
            started, counted = launched, runs
        return {
            "seconds": finished - started,
            "settled": counted,
            "rate": counted / max(finished - started, 1e-6),
            "pid": process.pid,
            "peak_rss_mb": _mb(measure.peak_rss_bytes(process.pid)),
            "cpu_seconds": cpu,
            # the CPU of delivering alone: from the first settled row on (start-up, imports
            # and the first claim excluded)
            "delivering_cpu_seconds": (
                None if cpu is None or cpu_at_start is None else cpu - cpu_at_start
            ),
        }
    finally:
        children.stop(process, 60)


def deliver_over_http(
    store: Store, tenant_id: str, runs: int, deadline: float
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """`runs` claimed HTTP runs of a new job delivered by one relay process to the loopback
    receiver: the job, the relay's figures (relay_until_settled) and the receiver's counts
    and CPU seconds.
    The receiver runs in its own process: in this one it would compete with the relay for
    the interpreter lock, and the figure would measure the lock, not the relay."""
    receiver = Receiver()
    try:
        job_id = claimed_runs(store, tenant_id, "http", receiver.url, runs)
        relay = relay_until_settled(store, job_id, runs, deadline)
        # the receiver shares the machine's cores with the relay: its CPU says how much of
        # the wall clock it took
        received = {**receiver.count(), "cpu_seconds": measure.cpu_seconds(receiver.process.pid)}
        return job_id, relay, received
    finally:
        receiver.close()


def run_delivery_bench(
    store: Store,
    *,
    runs: int,
    concurrency: int,
    timeout: float,
    rabbitmq_url: str | None = None,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    tenant_id = bench_tenant(store, concurrency)
    _, http, received = deliver_over_http(store, tenant_id, runs, deadline)
    span = (received["last"] or 0.0) - (received["first"] or 0.0)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    queue_job = claimed_runs(store, tenant_id, "queue", queue, runs)
    try:
        queue_rate = relay_until_settled(store, queue_job, runs, deadline)["rate"]
    finally:
        bench_rows.delete_queue_messages(store, queue)
    result: dict[str, Any] = {
        "runs": runs,
        "tenant_delivery_concurrency": concurrency,
        "database": bench_rows.database_settings(store),
        "http_deliveries_per_second": round(http["rate"], 1),
        "http_received": received["received"],
        "http_received_per_second": round((received["received"] - 1) / span, 1) if span else None,
        "queue_deliveries_per_second": round(queue_rate, 1),
        "note": "one scheduled-d relay process; http = signed POST + SSRF check + outcome",
    }
    if rabbitmq_url is not None:
        rate = _rabbitmq(store, tenant_id, rabbitmq_url, runs, deadline)
        result["rabbitmq_publishes_per_second"] = round(rate, 1)
    return result


def _rabbitmq(store: Store, tenant_id: str, url: str, runs: int, deadline: float) -> float:
    """Persistent publishes with confirms to the broker at `url`, into a queue deleted after."""
    import pika  # type: ignore[import-untyped]

    from schedctl.storage.tenants.tenant_delivery import TenantDeliveryRepo

    TenantDeliveryRepo(store).set_broker(tenant_id, url, actor="bench")
    queue = f"schedctl-bench-{uuid.uuid4().hex[:8]}"
    job = claimed_runs(store, tenant_id, "queue", queue, runs)
    try:
        rate: float = relay_until_settled(store, job, runs, deadline)["rate"]
        return rate
    finally:
        TenantDeliveryRepo(store).set_broker(tenant_id, None, actor="bench")
        try:
            connection = pika.BlockingConnection(pika.URLParameters(url))
            connection.channel().queue_delete(queue=queue)
            connection.close()
        except pika.exceptions.AMQPError:
            pass  # the queue stays; its name says where it came from
