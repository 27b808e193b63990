"""Bulk loading of one-time jobs straight into the jobs table, bypassing per-job API cost
(benchmarks, soak runs and test data)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import new_job_id
from schedctl.storage.pipeline.once_rows import once_job_row
from schedctl_bench.storage import bench as bench_rows


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
    rows = [
        once_job_row(
            new_job_id(),
            tenant_id,
            at,
            target=(target_type, queue),
            name=name,
            partitions=store.partition_count,
            now=now,
            request_hash=name,
            grace_seconds=grace_seconds,
        )
        for at in times
    ]
    bench_rows.insert_jobs(store, rows)
    return [row["job_id"] for row in rows]
