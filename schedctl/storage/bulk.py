"""Bulk loading of one-time jobs straight into the jobs table, bypassing per-job API cost
(benchmarks, soak runs and test data)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from schedctl.scheduling.timeparse import format_instant
from schedctl.storage import bench as bench_rows
from schedctl.storage.jobs import new_job_id, partition_of
from schedctl.storage.store import Store


def insert_once_jobs(
    store: Store,
    tenant_id: str,
    times: Sequence[datetime],
    *,
    queue: str = "q",
    target_type: str = "queue",
    name: str = "bulk",
    grace_seconds: int = 3600,
) -> list[str]:
    """One-time jobs at `times`, active and due at their time; returns their ids. Their
    target is the built-in queue `queue`, or with `target_type` "http" the URL `queue`."""
    now = datetime.now(UTC)
    count = store.partition_count
    ids: list[str] = []
    rows: list[dict[str, Any]] = []
    for at in times:
        job_id = new_job_id()
        ids.append(job_id)
        rows.append(
            {
                "job_id": job_id,
                "tenant_id": tenant_id,
                # names are unique per tenant: the id makes each bulk job's name its own
                "name": f"{name}-{job_id}",
                "schedule": json.dumps({"kind": "once", "run_at": format_instant(at)}),
                "target_type": target_type,
                "target": queue,
                "payload": "{}",
                "max_attempts": 3,
                "retry_base_seconds": 1.0,
                "retry_max_seconds": 60.0,
                "misfire_policy": "run_once",
                "grace_seconds": grace_seconds,
                "window_seconds": 0,
                "max_concurrency": 1,
                "timeout_seconds": 0,
                "start_at": None,
                "end_at": None,
                "status": "active",
                "next_run_at": at,
                "next_fire_at": at,
                "partition": partition_of(job_id, count),
                "version": 1,
                "idempotency_key": None,
                "request_hash": name,
                "created_at": now,
                "updated_at": now,
            }
        )
    bench_rows.insert_jobs(store, rows)
    return ids
