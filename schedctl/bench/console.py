"""Owns the web console benchmark behind `schedctl bench console` (cli/bench_console.py):
loads one tenant with many jobs (storage/bulk_future.py), many runs spread over past days
(a few of them failed or skipped), and some dead letters, serves the API on loopback in
this process, signs in to the console and times each page: the p50 and p99 of its response
time on loopback (server time plus a loopback round trip). Measured and reported, never
asserted; the target is each page under 300 ms with 100,000 jobs and 1,000,000 runs.

Use a scratch database: it adds a tenant and its rows (removed at the end unless --keep).
On Postgres the server makes the rows itself (INSERT ... SELECT over generate_series) and
the runs go into day partitions made for them, as retention would have made them.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import insert, select, text

from schedctl import errors
from schedctl.bench import measure
from schedctl.scheduling.timeparse import format_instant
from schedctl.service import Scheduler
from schedctl.storage import bench as bench_rows
from schedctl.storage import schema
from schedctl.storage.bench_sizes import vacuum_analyze
from schedctl.storage.bulk_future import load_future_jobs
from schedctl.storage.cursors import encode_cursor
from schedctl.storage.retention import partition_name
from schedctl.storage.store import Store

DEAD_LETTERS = 1000
SQLITE_CHUNK = 20_000

# every Nth run of a job failed, every Mth was skipped (a reason to show)
FAILED_EVERY = 50
SKIPPED_EVERY = 97

_PG_RUNS = """
INSERT INTO runs (job_id, scheduled_at, tenant_id, partition, trigger, status, attempt,
                  fire_at, dispatched_at, started_at, finished_at, exit_code, error,
                  output_tail)
SELECT j.job_id, r.at, j.tenant_id, j.partition, 'schedule',
       CASE WHEN r.n % {failed} = 0 THEN 'failed'
            WHEN r.n % {skipped} = 0 THEN 'skipped' ELSE 'succeeded' END,
       1, r.at, r.at + interval '1 second', r.at + interval '2 seconds',
       r.at + interval '12 seconds',
       CASE WHEN r.n % {failed} = 0 THEN 1 ELSE 0 END,
       CASE WHEN r.n % {skipped} = 0 THEN 'missed by more than its grace period'
            WHEN r.n % {failed} = 0 THEN 'exit code 1' END,
       'bench output line'
FROM (SELECT job_id, tenant_id, partition FROM jobs
      WHERE tenant_id = :tenant_id AND job_id >= :low AND job_id < :high) AS j
CROSS JOIN LATERAL (
    -- n: the run's number shifted per job, so that failures fall on every day
    SELECT i + ('x' || substr(j.job_id, 17, 8))::bit(32)::bigint % 9973 AS n,
           date_trunc('second', CAST(:now AS timestamptz) - interval '1 minute'
           - (i - 1) * CAST(:spacing AS interval)
           - (('x' || substr(j.job_id, 25, 8))::bit(32)::bigint % 3600) * interval '1 second')
           AS at
    FROM generate_series(1, :per_job) AS i
) AS r
"""


# starts `scheduled-d api` on the same database and yields its base URL (the CLI's
# _api_process: the API in its own process, as in production)
Serve = Callable[[], AbstractContextManager[str]]


def run_console_bench(
    store: Store,
    serve: Serve,
    *,
    jobs: int,
    runs: int,
    requests: int,
    keep: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    say = progress or (lambda _message: None)
    scheduler = Scheduler(store)
    tenant, token = scheduler.create_tenant(f"bench-console-{uuid.uuid4().hex[:8]}", "bench")
    tenant_id = tenant.tenant_id
    try:
        began = time.monotonic()
        now = store.now()
        say(f"loading {jobs:,} jobs")
        load_future_jobs(
            store,
            tenant_id,
            jobs,
            first_at=now + timedelta(hours=1),
            spacing=timedelta(seconds=1),
            name="console",
            queue="console",
        )
        per_job = max(1, runs // max(jobs, 1))
        say(f"loading {per_job * jobs:,} runs ({per_job} per job)")
        _load_runs(store, tenant_id, per_job, now)
        letters = _load_dead_letters(store, tenant_id, now)
        if store.dialect.generates_rows:
            for table in ("jobs", "runs", "dead_letters"):
                vacuum_analyze(store, table)
        loaded = time.monotonic() - began
        say("timing the pages")
        pages = _time_pages(serve, store, tenant_id, token, requests)
    finally:
        if not keep:
            say("removing the benchmark's tenant")
            bench_rows.delete_tenant(store, tenant_id)
    return {
        "jobs": jobs,
        "runs": per_job * jobs,
        "dead_letters": letters,
        "requests_per_page": requests,
        "database": bench_rows.database_settings(store),
        "load_seconds": round(loaded, 1),
        "pages": pages,
        "slowest_p99_ms": max(
            (page["p99_ms"] for page in pages if page["p99_ms"] is not None), default=None
        ),
    }


def _job_ranges(store: Store, tenant_id: str, parts: int = 20) -> list[tuple[str, str]]:
    """Id ranges splitting the tenant's jobs into about `parts` chunks (one INSERT each)."""
    j = schema.jobs
    with store.read() as connection:
        ids = list(
            connection.execute(
                select(j.c.job_id).where(j.c.tenant_id == tenant_id).order_by(j.c.job_id)
            ).scalars()
        )
    if not ids:
        return []
    step = max(1, len(ids) // parts)
    bounds = [*ids[::step], ids[-1] + "g"]
    return list(itertools.pairwise(bounds))


def _load_runs(store: Store, tenant_id: str, per_job: int, now: datetime) -> None:
    spacing = timedelta(days=1) if per_job <= 30 else timedelta(hours=1)
    if store.dialect.generates_rows:
        oldest = now - per_job * spacing - timedelta(days=1)
        day = oldest.date()
        while day <= now.date():
            start = datetime(day.year, day.month, day.day, tzinfo=UTC)
            with store.tx() as connection:
                store.dialect.create_run_partition(
                    connection, partition_name(day), start, start + timedelta(days=1)
                )
            day += timedelta(days=1)
        statement = text(_PG_RUNS.format(failed=FAILED_EVERY, skipped=SKIPPED_EVERY))
        for low, high in _job_ranges(store, tenant_id):
            with store.tx() as connection:
                connection.execute(
                    statement,
                    {
                        "tenant_id": tenant_id,
                        "low": low,
                        "high": high,
                        "now": now,
                        "spacing": f"{spacing.total_seconds()} seconds",
                        "per_job": per_job,
                    },
                )
        return
    j = schema.jobs
    with store.read() as connection:
        rows = connection.execute(
            select(j.c.job_id, j.c.partition).where(j.c.tenant_id == tenant_id)
        ).all()
    batch: list[dict[str, Any]] = []
    for job_id, partition in rows:
        for i in range(1, per_job + 1):
            offset = timedelta(minutes=1, seconds=int(job_id[24:32], 16) % 3600)
            at = (now - offset - (i - 1) * spacing).replace(microsecond=0)  # as in _PG_RUNS
            n = i + int(job_id[16:24], 16) % 9973  # as in _PG_RUNS
            failed, skipped = n % FAILED_EVERY == 0, n % SKIPPED_EVERY == 0
            batch.append(
                {
                    "job_id": job_id,
                    "scheduled_at": at,
                    "tenant_id": tenant_id,
                    "partition": partition,
                    "trigger": "schedule",
                    "status": "failed" if failed else "skipped" if skipped else "succeeded",
                    "attempt": 1,
                    "fire_at": at,
                    "dispatched_at": at + timedelta(seconds=1),
                    "started_at": at + timedelta(seconds=2),
                    "finished_at": at + timedelta(seconds=12),
                    "exit_code": 1 if failed else 0,
                    "error": "missed by more than its grace period" if skipped else None,
                    "output_tail": "bench output line",
                }
            )
            if len(batch) >= SQLITE_CHUNK:
                with store.tx() as connection:
                    connection.execute(insert(schema.runs), batch)
                batch = []
    if batch:
        with store.tx() as connection:
            connection.execute(insert(schema.runs), batch)


def _load_dead_letters(store: Store, tenant_id: str, now: datetime) -> int:
    j = schema.jobs
    with store.read() as connection:
        job_ids = list(
            connection.execute(
                select(j.c.job_id).where(j.c.tenant_id == tenant_id).limit(DEAD_LETTERS)
            ).scalars()
        )
    rows = [
        {
            "job_id": job_id,
            "scheduled_at": (now - timedelta(minutes=index + 1)).replace(microsecond=0),
            "tenant_id": tenant_id,
            "target_type": "queue",
            "target": "console",
            "attempts": 3,
            "last_error": "bench: retries exhausted",
            "created_at": now,
        }
        for index, job_id in enumerate(job_ids)
    ]
    if rows:
        with store.tx() as connection:
            connection.execute(insert(schema.dead_letters), rows)
    return len(rows)


def _time_pages(
    serve: Serve, store: Store, tenant_id: str, token: str, requests_per_page: int
) -> list[dict[str, Any]]:
    import requests

    j, r, d = schema.jobs, schema.runs, schema.dead_letters
    with store.read() as connection:
        ids = list(
            connection.execute(
                select(j.c.job_id).where(j.c.tenant_id == tenant_id).order_by(j.c.job_id)
            ).scalars()
        )
        middle = ids[len(ids) // 2]
        run_at = connection.execute(
            select(r.c.scheduled_at)
            .where(r.c.job_id == middle)
            .order_by(r.c.scheduled_at.desc())
            .limit(1)
        ).scalar()
        letter = connection.execute(
            select(d.c.id).where(d.c.tenant_id == tenant_id).order_by(d.c.id.desc()).limit(1)
        ).scalar()
    pages = [
        ("jobs", "/ui/jobs"),
        ("jobs, a middle page", "/ui/jobs?cursor=" + encode_cursor(middle)),
        ("jobs by name", f"/ui/jobs?q={middle[-10:]}"),
        ("jobs by name, no match", "/ui/jobs?q=no-such-name"),
        ("jobs by id prefix", f"/ui/jobs?id={middle[:14]}"),
        ("jobs by status, none", "/ui/jobs?status=paused"),
        ("job", f"/ui/jobs/{middle}"),
        ("job, older runs", f"/ui/jobs/{middle}?cursor=" + encode_cursor(run_at.isoformat()))
        if run_at is not None
        else ("job, again", f"/ui/jobs/{middle}"),
        ("run", f"/ui/jobs/{middle}/runs/{format_instant(run_at)}")
        if run_at is not None
        else ("job, once more", f"/ui/jobs/{middle}"),
        ("late and failing", "/ui/late"),
        ("dead letters", "/ui/dead-letters"),
        ("dead letter", f"/ui/dead-letters/{letter}"),
        ("workers and queues", "/ui/workers"),
        ("cluster", "/ui/cluster"),
    ]
    results = []
    with serve() as base_url, requests.Session() as session:
        signed = session.post(
            base_url + "/ui/signin",
            data={"token": token},
            timeout=30,
            allow_redirects=False,
        )
        if signed.status_code != 303:
            raise errors.SchedError(f"the console's sign-in failed: HTTP {signed.status_code}")
        for name, path in pages:
            session.get(base_url + path, timeout=60)  # warm: plans, caches
            seconds = []
            status = 0
            for _ in range(requests_per_page):
                start = time.perf_counter()
                response = session.get(base_url + path, timeout=60)
                seconds.append(time.perf_counter() - start)
                status = response.status_code
            results.append(
                {
                    "page": name,
                    "path": _pattern(path),
                    "status": status,
                    "p50_ms": measure.ms(measure.percentile(seconds, 50)),
                    "p99_ms": measure.ms(measure.percentile(seconds, 99)),
                    "bytes": len(response.content),
                }
            )
    return results


def _pattern(path: str) -> str:
    """A page's path with its ids as placeholders (the table's column)."""
    parts = path.split("?")[0].split("/")
    names = {3: "{job}" if parts[2] == "jobs" else "{id}", 5: "{scheduled_at}"}
    return "/".join(names.get(index, part) for index, part in enumerate(parts))
