"""Owns the fast bulk load of many one-time jobs (millions) for the scale benchmark, one
transaction per chunk so that memory stays flat: on Postgres the server makes the rows
itself (INSERT ... SELECT over generate_series: no row crosses the wire, none is built in
Python), with ids as new_job_id makes them (milliseconds, then random hex) and partitions
as partition_of computes them (the first 4 bytes of the id's SHA-256, mod P); on SQLite
Python makes the same rows for the chunked INSERT of storage/bench.py."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text

from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.quotas import forget_quota_use
from schedctl.storage.pipeline.once_rows import once_job_row
from schedctl_bench.storage import bench as bench_rows

CHUNK_ROWS = 250_000  # rows per INSERT ... SELECT transaction
PARALLEL_SESSIONS = 2
SQLITE_CHUNK_ROWS = 20_000

COLUMNS = [c.name for c in schema.jobs.columns]
# The columns the server's generated rows give values for, in the dialect's statement's
# order; a column added later takes its server default there.
GENERATED_COLUMNS = [
    "job_id", "tenant_id", "name", "schedule", "target_type", "target", "payload",
    "max_attempts", "retry_base_seconds", "retry_max_seconds", "misfire_policy",
    "grace_seconds", "window_seconds", "max_concurrency", "timeout_seconds", "start_at",
    "end_at", "status", "next_run_at", "next_fire_at", "partition", "version",
    "idempotency_key", "request_hash", "created_at", "updated_at",
]  # fmt: skip


def generates_rows(store: Store) -> bool:
    """Whether the server makes benchmark rows itself (Postgres: a database server, not
    the embedded file)."""
    return not store.dialect.embedded


# The scale benchmark's one-time job rows, as _rows makes them in Python, made by Postgres;
# the times are whole seconds, so that run_at is what format_instant writes for them (no
# fraction).
_GENERATE_ONCE_JOBS = """
INSERT INTO jobs ({columns})
SELECT g.job_id, :tenant_id, :name || '-' || g.job_id,
       '{{"kind": "once", "run_at": "' || to_char(g.at AT TIME ZONE 'UTC',
           'YYYY-MM-DD"T"HH24:MI:SS') || 'Z"}}',
       'queue', :queue, '{{}}', 3, 1.0, 60.0, 'run_once', 3600, 0, 1, 0, NULL, NULL,
       'active', g.at, g.at,
       (('x' || substr(encode(sha256(convert_to(g.job_id, 'UTF8')), 'hex'), 1, 8))::bit(32)
           ::bigint % :partitions)::int,
       1, NULL, :name, now(), now()
FROM (
    SELECT lpad(to_hex(:millis), 12, '0')
               || substr(replace(gen_random_uuid()::text, '-', ''), 1, 20) AS job_id,
           date_trunc('second', CAST(:first_at AS timestamptz) + i * CAST(:spacing AS interval))
               AS at
    FROM generate_series(0, :size - 1) AS i
) AS g
"""


def _rows(
    tenant_id: str,
    count: int,
    first_at: datetime,
    spacing: timedelta,
    partitions: int,
    name: str,
    queue: str,
) -> Iterator[dict[str, Any]]:
    """`count` active one-time jobs of the tenant's queue, the i-th due at
    first_at + i * spacing; ids as new_job_id makes them (milliseconds, then random)."""
    now = datetime.now(UTC)
    millis = int(time.time() * 1000)
    for i in range(count):
        yield once_job_row(
            f"{millis:012x}{os.urandom(10).hex()}",
            tenant_id,
            first_at + i * spacing,
            target=("queue", queue),
            name=name,
            partitions=partitions,
            now=now,
            request_hash=name,
        )


def load_future_jobs(
    store: Store,
    tenant_id: str,
    count: int,
    *,
    first_at: datetime,
    spacing: timedelta,
    name: str = "scale",
    queue: str = "scale",
    progress: Callable[[int], None] | None = None,
) -> float:
    """Load `count` one-time jobs due from `first_at` on, `spacing` apart; the seconds it
    took. `progress` is told the rows loaded so far after each chunk."""
    began = time.monotonic()
    if generates_rows(store):
        starts = list(range(0, count, CHUNK_ROWS))
        loaded = [0]
        lock = threading.Lock()

        def chunk(start: int) -> None:
            size = min(CHUNK_ROWS, count - start)
            _generate(store, tenant_id, size, first_at + start * spacing, spacing, name, queue)
            with lock:
                loaded[0] += size
                if progress is not None:
                    progress(loaded[0])

        # the server does the work: a few sessions at once keep its cores busy
        with ThreadPoolExecutor(PARALLEL_SESSIONS) as pool:
            list(pool.map(chunk, starts))
        with store.tx() as connection:
            forget_quota_use(connection, tenant_id)  # written without a create
        return time.monotonic() - began
    rows = _rows(tenant_id, count, first_at, spacing, store.partition_count, name, queue)
    done = 0
    while done < count:
        size = min(SQLITE_CHUNK_ROWS, count - done)
        part = [next(rows) for _ in range(size)]
        bench_rows.insert_jobs(store, part)
        done += size
        if progress is not None:
            progress(done)
    return time.monotonic() - began


def _generate(
    store: Store,
    tenant_id: str,
    size: int,
    first_at: datetime,
    spacing: timedelta,
    name: str,
    queue: str,
) -> None:
    """`size` rows made by the server in one transaction (_GENERATE_ONCE_JOBS)."""
    names = ", ".join(f'"{c}"' for c in GENERATED_COLUMNS)
    with store.tx() as connection:
        connection.execute(
            text(_GENERATE_ONCE_JOBS.format(columns=names)),
            {
                "tenant_id": tenant_id,
                "name": name,
                "queue": queue,
                "partitions": store.partition_count,
                "millis": int(time.time() * 1000),
                "first_at": first_at,
                "spacing": f"{spacing.total_seconds()} seconds",
                "size": size,
            },
        )
