"""Owns the web console benchmark behind `schedctl bench console` (cli/bench_console.py):
loads one tenant with many jobs (storage/bulk_future.py), many runs spread over past days
(a few of them failed or skipped), and some dead letters, serves the API on loopback in
this process, signs in to the console and times each page: the p50 and p99 of the server's
own time (its Server-Timing header: handler and rendering, to the response's first byte)
and of the response time on loopback (server time plus a loopback round trip and the
client's reading of the body). Measured and reported, never asserted; the target is each
page under 300 ms server time with 100,000 jobs and 1,000,000 runs.

Use a scratch database: it adds a tenant and its rows (removed at the end unless --keep).
The rows are storage/bulk_future.py's jobs and storage/bench_console.py's runs and dead
letters.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

from schedctl.app.service import Scheduler
from schedctl.core import errors
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db.cursors import encode_cursor
from schedctl.storage.db.store import Store
from schedctl_bench import measure
from schedctl_bench.storage import bench as shared_rows
from schedctl_bench.storage import bench_console as bench_rows
from schedctl_bench.storage.bench_sizes import vacuum_analyze
from schedctl_bench.storage.bulk_future import generates_rows, load_future_jobs

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
        bench_rows.load_runs(store, tenant_id, per_job, now)
        letters = bench_rows.load_dead_letters(store, tenant_id, now)
        if generates_rows(store):
            for table in ("jobs", "job_names", "runs", "dead_letters"):
                vacuum_analyze(store, table)
        loaded = time.monotonic() - began
        say("timing the pages")
        pages = _time_pages(serve, store, tenant_id, token, requests)
    finally:
        if not keep:
            say("removing the benchmark's tenant")
            shared_rows.delete_tenant(store, tenant_id)
    return {
        "jobs": jobs,
        "runs": per_job * jobs,
        "dead_letters": letters,
        "requests_per_page": requests,
        "database": shared_rows.database_settings(store),
        "load_seconds": round(loaded, 1),
        "pages": pages,
        "slowest_p99_ms": max(
            (page["p99_ms"] for page in pages if page["p99_ms"] is not None), default=None
        ),
        "slowest_server_p99_ms": max(
            (page["server_p99_ms"] for page in pages if page["server_p99_ms"] is not None),
            default=None,
        ),
    }


def _time_pages(
    serve: Serve, store: Store, tenant_id: str, token: str, requests_per_page: int
) -> list[dict[str, Any]]:
    import requests

    middle, run_at, letter = bench_rows.sample_ids(store, tenant_id)
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
            server = []
            status = 0
            for _ in range(requests_per_page):
                start = time.perf_counter()
                response = session.get(base_url + path, timeout=60)
                seconds.append(time.perf_counter() - start)
                status = response.status_code
                took = server_seconds(response.headers.get("Server-Timing", ""))
                if took is not None:
                    server.append(took)
            results.append(
                {
                    "page": name,
                    "path": _pattern(path),
                    "status": status,
                    "server_p50_ms": _ms(server, 50),
                    "server_p99_ms": _ms(server, 99),
                    "p50_ms": _ms(seconds, 50),
                    "p99_ms": _ms(seconds, 99),
                    "bytes": len(response.content),
                }
            )
    return results


def server_seconds(header: str) -> float | None:
    """The server's own time from a response's Server-Timing header (its `app;dur=`
    milliseconds, as scheduled_d.api.middleware writes it); None without one."""
    for metric in header.split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        if name != "app":
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur":
                try:
                    return float(value) / 1000
                except ValueError:
                    return None
    return None


def _ms(seconds: list[float], q: float) -> float | None:
    return measure.ms(measure.percentile(seconds, q)) if seconds else None


def _pattern(path: str) -> str:
    """A page's path with its ids as placeholders (the table's column)."""
    parts = path.split("?")[0].split("/")
    names = {3: "{job}" if parts[2] == "jobs" else "{id}", 5: "{scheduled_at}"}
    return "/".join(names.get(index, part) for index, part in enumerate(parts))
