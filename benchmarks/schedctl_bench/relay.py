"""Owns the relay benchmark behind `schedctl bench relay` (cli/bench_relay.py): signed HTTP
deliveries per second from one `scheduled-d relay` process to a loopback keep-alive receiver,
the p50/p99 call latency the relay recorded, and duplicates and missing runs counted by the
receiver. Measured and reported, never asserted.

The receiver (bench/receiver.py) is a child process of its own (in the relay's process,
or this one's, it would take CPU from what is measured). Everything is bounded: a fixed
number of runs, a deadline, servers on 127.0.0.1 this command starts and stops.
Use a scratch database: it adds a tenant, a job and its runs (removed at the end unless
--keep).
"""

from __future__ import annotations

import time
from typing import Any

from schedctl.storage.db.store import Store
from schedctl_bench import measure
from schedctl_bench.delivery import bench_tenant, deliver_over_http
from schedctl_bench.storage import bench as bench_rows


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def run_relay_bench(
    store: Store, *, runs: int, concurrency: int, timeout: float, keep: bool = False
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    tenant_id = bench_tenant(store, concurrency)
    try:
        job_id, relay, received = deliver_over_http(store, tenant_id, runs, deadline)
        calls = bench_rows.attempt_seconds(store, job_id)
        statuses = bench_rows.run_statuses(store, job_id)
    finally:
        if not keep:
            bench_rows.delete_tenant(store, tenant_id)
    span = (received["last"] or 0.0) - (received["first"] or 0.0)
    p50, p99 = measure.percentile(calls, 50), measure.percentile(calls, 99)
    return {
        "runs": runs,
        "tenant_delivery_concurrency": concurrency,
        "database": bench_rows.database_settings(store),
        "deliveries_per_second": round(relay["settled"] / max(relay["seconds"], 1e-6), 1),
        "received_per_second": round((received["received"] - 1) / span, 1) if span else None,
        "call_p50_ms": measure.ms(p50),
        "call_p99_ms": measure.ms(p99),
        "received": received["received"],
        "duplicates": received["duplicates"],
        "missing": runs - received["distinct"],
        "unsigned": received["unsigned"],
        "run_statuses": statuses,
        "relay_peak_rss_mb": relay["peak_rss_mb"],
        # noise-proof on a shared machine: what one core would do, start-up included
        "relay_cpu_seconds": relay["cpu_seconds"],
        "deliveries_per_relay_cpu_second": (
            round(runs / relay["cpu_seconds"], 1) if relay["cpu_seconds"] else None
        ),
        # the same from the first settled row on: the steady cost of a delivery
        "relay_delivering_cpu_seconds": _round(relay["delivering_cpu_seconds"]),
        "deliveries_per_delivering_cpu_second": (
            round(relay["settled"] / relay["delivering_cpu_seconds"], 1)
            if relay["delivering_cpu_seconds"]
            else None
        ),
        "receiver_cpu_seconds": received["cpu_seconds"],
        "note": "one scheduled-d relay process; a receiver process on loopback (keep-alive)",
    }
