"""Owns the jobs-table row of a one-time job as the bulk loads write it straight to the table
(bypassing the per-job API): the defaults a job made through the API would get, its name
made unique by its id, and its partition as partition_of computes it."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.jobs.jobs import partition_of


def once_job_row(
    job_id: str,
    tenant_id: str,
    at: datetime,
    *,
    target: tuple[str, str],
    name: str,
    partitions: int,
    now: datetime,
    request_hash: str,
    grace_seconds: int = 3600,
    claimed: bool = False,
) -> dict[str, Any]:
    """The job `job_id` of `tenant_id` that runs once at `at` against `target` (its type and
    address), named `name`-`job_id` (names are unique per tenant). Active and due at `at`;
    or, `claimed`, completed with no next run (its one run is claimed, which bumped the
    version)."""
    target_type, address = target
    due = None if claimed else at
    return {
        "job_id": job_id,
        "tenant_id": tenant_id,
        "name": f"{name}-{job_id}",
        "schedule": json.dumps({"kind": "once", "run_at": format_instant(at)}),
        "target_type": target_type,
        "target": address,
        "payload": "{}",
        "max_attempts": 3,
        "retry_base_seconds": 1.0,
        "retry_max_seconds": 60.0,
        "misfire_policy": "run_once",
        "grace_seconds": grace_seconds,
        "window_seconds": 0,
        "max_concurrency": 1,
        "timeout_seconds": 0,
        "overlap": "queue",
        "memory_max": None,
        "cpu_weight": None,
        "tasks_max": None,
        "start_at": None,
        "end_at": None,
        "status": "completed" if claimed else "active",
        "next_run_at": due,
        "next_fire_at": due,
        "partition": partition_of(job_id, partitions),
        "version": 2 if claimed else 1,
        "idempotency_key": None,
        "request_hash": request_hash,
        "metrics": False,
        "created_at": now,
        "updated_at": now,
    }
