"""Owns the worker benchmark behind `schedctl bench worker` (cli/bench_dispatch.py): how many
commands a second ONE `scheduled-d worker` process starts while it drains a backlog of
already-queued `/bin/true` runs (one one-time job each), against the spawn ceiling measured
in the same run (schedctl_bench.pipeline.spawn_ceiling, before and after the drain, so
that a change in the machine's load shows). Measured and reported, never asserted.

Everything is bounded: a fixed number of runs, a deadline, one worker process this command
starts and stops. Use a scratch database: it adds a tenant, its jobs and their runs
(removed at the end unless --keep).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from schedctl.core import errors
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl_bench import measure
from schedctl_bench.consumers import Consumers
from schedctl_bench.delivery import bench_tenant
from schedctl_bench.pipeline import spawn_ceiling
from schedctl_bench.storage import bench as bench_rows
from schedctl_bench.storage import bench_sizes

POLL_SECONDS = 0.1
STOP_SECONDS = 60.0
RELAY_BATCH = 2000


def run_worker_bench(
    store: Store,
    *,
    runs: int,
    concurrency: int,
    spawn_seconds: float,
    timeout: float,
    keep: bool = False,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    tenant_id = bench_tenant(store, concurrency)
    tenant = bench_rows.tenant_name(store, tenant_id)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    url = store.engine.url.render_as_string(hide_password=False)
    consumers = Consumers(url, queue, workers=1, relays=0, concurrency=concurrency, tenant=tenant)
    try:
        bench_sizes.clear_dead_rows(store)
        _queue_runs(store, tenant_id, queue, runs)
        # the ceiling is measured on either side of the drain, never during it
        before = spawn_ceiling(spawn_seconds)
        consumers.start()
        worker = consumers.processes[0]
        assert worker.popen is not None
        pid = worker.popen.pid
        cpu_before = measure.cpu_seconds(pid) or 0.0
        succeeded = 0
        while (succeeded := bench_rows.count_runs(store, tenant_id, status="succeeded")) < runs:
            if consumers.dead():
                raise errors.SchedError(f"the worker exited (see {worker.log_path})")
            if time.monotonic() > deadline:
                break
            cpu = measure.cpu_seconds(pid)
            cpu_before = cpu if succeeded == 0 and cpu is not None else cpu_before
            time.sleep(POLL_SECONDS)
        cpu_after = measure.cpu_seconds(pid)
        peak = measure.peak_rss_bytes(pid)
        exits = consumers.stop()
        after = spawn_ceiling(spawn_seconds)
        stages = bench_rows.run_stages(store, tenant_id)
        duplicates = bench_rows.extra_executions(store, tenant_id)
        trouble = sum(len(v) for v in consumers.trouble().values())
    finally:
        consumers.kill()
        if not keep:
            bench_rows.delete_tenant(store, tenant_id)
    starts = sorted(s.timestamp() for _, _, _, s, f in stages if s is not None and f is not None)
    finishes = sorted(f.timestamp() for _, _, _, s, f in stages if s is not None and f is not None)
    start_rate = _rate(starts)
    ceiling = (before.per_second + after.per_second) / 2
    spawn_cpu = [x.cpu_ms_per_start for x in (before, after) if x.cpu_ms_per_start is not None]
    cpu_used = (cpu_after - cpu_before) if cpu_after is not None else None
    load = os.getloadavg()
    return {
        "runs": runs,
        "worker_concurrency": concurrency,
        "database": bench_rows.database_settings(store),
        "complete": succeeded >= runs,
        "succeeded": succeeded,
        "started_per_second": start_rate,
        "finished_per_second": _rate(finishes),
        "drain_seconds": round(finishes[-1] - starts[0], 3) if starts else None,
        "spawn_ceiling_per_second": round(ceiling, 1),
        "spawn_ceiling_before_after": [round(before.per_second, 1), round(after.per_second, 1)],
        # the machine's CPU for one start of /bin/true (the child's included): with the
        # worker's own CPU per run, what a start costs the cores in all
        "spawn_cpu_ms_per_start": (
            round(sum(spawn_cpu) / len(spawn_cpu), 3) if spawn_cpu else None
        ),
        "starts_to_ceiling": round(start_rate / ceiling, 3) if start_rate and ceiling else None,
        # noise-proof on a shared machine: the worker's own CPU per run while it drained
        "worker_cpu_ms_per_run": (
            round(cpu_used * 1000 / succeeded, 3) if cpu_used is not None and succeeded else None
        ),
        "duplicates": duplicates,
        "worker_peak_rss_mb": round(peak / 2**20, 1) if peak is not None else None,
        "worker_exit_code": exits.get("worker-0"),
        "log_trouble": trouble,
        "load_average": [round(x, 2) for x in load],
        "note": "one scheduled-d worker process running /bin/true; "
        f"spawn ceiling: {spawn_seconds:g} s of /bin/true from 16 threads, before and after",
    }


def _queue_runs(store: Store, tenant_id: str, queue: str, runs: int) -> None:
    """`runs` one-time jobs' runs, claimed and moved into the built-in queue `queue` (as a
    relay does): the backlog the worker drains."""
    bench_rows.insert_claimed_once_jobs(
        store, tenant_id, ("queue", queue), runs, now=datetime.now(UTC)
    )
    repo = QueueRepo(store)
    moved = 0
    while moved < runs:
        step = repo.move_outbox(RELAY_BATCH)
        if step == 0:
            raise errors.SchedError(f"only {moved} of {runs} runs reached the queue")
        moved += step


def _rate(times: list[float]) -> float | None:
    """Events per second between the first and the last."""
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return round((len(times) - 1) / span, 1) if span > 0 else None
