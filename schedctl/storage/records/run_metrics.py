"""Owns the per-job run series and the readable labels of the settled-run series: each
settled attempt of a job with `metrics = true` counted by outcome and timed, and the tenant
and job names the series carry instead of hex ids.

Recorded where every outcome passes: settle (storage/pipeline/settle.py), the one path of the relay
(HTTP, RabbitMQ), the built-in queue's workers and the lease reaper. So each series counts
what the process that settled those attempts saw: Prometheus sums them over the processes
(`sum by (tenant, job, outcome) (rate(...))`); a restarted process starts again at 0, which
rate() reads as a counter reset. Reading the counts back from the run history at each
scrape instead would count every run in every process (double counting once summed) and
go down when retention removes runs, which rate() reads as a reset too: a wrong spike.

Cardinality: one series per (job, outcome) and one histogram per job, only for the jobs
that asked (`metrics = true`), at most metrics_max_jobs_per_tenant of them per tenant.
A tenant or job renamed gets new series under its new name (within NAMES_TTL seconds: a
process reuses a job's labels that long); the old ones stay in a process's output until it
restarts (Prometheus marks them stale once they stop moving).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import Counter, Histogram
from sqlalchemy import select
from sqlalchemy.engine import Connection

from schedctl.storage.db import schema

JOB_RUNS = Counter(
    "scheduled_job_runs",
    "Attempts settled by this process of each job with metrics = true, by outcome: "
    "succeeded, failed or lost (retried), dead (the last attempt failed), stopped (cancel).",
    ["tenant", "job", "outcome"],
)
JOB_RUN_DURATION = Histogram(
    "scheduled_job_run_duration_seconds",
    "Start to end of each settled attempt of each job with metrics = true.",
    ["tenant", "job"],
    buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600),
)


@dataclass(frozen=True)
class Names:
    """The labels of one job's series."""

    tenant: str
    job: str
    metrics: bool  # the job asked for its own series


@dataclass(frozen=True)
class Observed:
    """One settled attempt, as the per-job series see it."""

    job_id: str
    outcome: str
    started_at: datetime | None
    finished_at: datetime | None


# a job's labels (tenant name, job name, metrics) are reused for NAMES_TTL seconds: the
# settle of a batch of runs of jobs seen in the last seconds sends no statement (a
# statement per batch is a measurable part of a relay's CPU per delivery, see
# docs/performance.md); a rename, or metrics switched on or off, shows in the series at
# most NAMES_TTL seconds later
NAMES_TTL = 5.0
_NAMES_MAX = 4_096  # cached jobs per process; the cache starts over past it
_names_lock = threading.Lock()
_names_seen: dict[str, tuple[float, Names]] = {}


def names(
    connection: Connection, job_ids: Collection[str], named: Collection[str] = ()
) -> dict[str, Names]:
    """The tenant and job names of those of `job_ids` with metrics = true, and of every job
    of `named` (failures, counted per tenant name whatever the job asked): those not looked
    up in the last NAMES_TTL seconds in one statement by the jobs' primary key, in the
    caller's transaction."""
    wanted = set(job_ids) | set(named)
    if not wanted:
        return {}
    now = time.monotonic()
    found: dict[str, Names] = {}
    with _names_lock:
        for job_id in wanted:
            cached = _names_seen.get(job_id)
            if cached is not None and now - cached[0] < NAMES_TTL:
                found[job_id] = cached[1]
    missing = wanted - found.keys()
    if missing:
        j, t = schema.jobs, schema.tenants
        rows = connection.execute(
            select(j.c.job_id, j.c.name, j.c.metrics, t.c.name)
            .join(t, t.c.tenant_id == j.c.tenant_id)
            .where(j.c.job_id.in_(sorted(missing)))
        ).all()
        looked_up = {
            str(job_id): Names(tenant=str(tenant), job=str(job), metrics=bool(metrics))
            for job_id, job, metrics, tenant in rows
        }
        with _names_lock:
            if len(_names_seen) + len(looked_up) > _NAMES_MAX:
                _names_seen.clear()
            _names_seen.update((job_id, (now, n)) for job_id, n in looked_up.items())
        found.update(looked_up)
    named_set = set(named)
    return {job_id: n for job_id, n in found.items() if n.metrics or job_id in named_set}


def record(observed: Sequence[Observed], labels: Mapping[str, Names]) -> None:
    """Count and time each attempt of a job that asked for its series."""
    for seen in observed:
        found = labels.get(seen.job_id)
        if found is None or not found.metrics:
            continue
        JOB_RUNS.labels(tenant=found.tenant, job=found.job, outcome=seen.outcome).inc()
        if seen.started_at is not None and seen.finished_at is not None:
            seconds = max(0.0, (seen.finished_at - seen.started_at).total_seconds())
            JOB_RUN_DURATION.labels(tenant=found.tenant, job=found.job).observe(seconds)
