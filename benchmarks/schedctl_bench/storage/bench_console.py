"""Owns the rows of the web console benchmark (schedctl_bench/console.py): a tenant's runs
spread over past days (a few failed or skipped, so that the late page has something to
show), its dead letters, and the ids the timed pages name. On Postgres the server makes the
runs (INSERT ... SELECT over the tenant's jobs and generate_series) into day partitions
made for them, as retention would have made them; elsewhere Python makes them."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select, text

from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.records.retention import partition_name
from schedctl.storage.records.run_partitions import PostgresRunPartitions
from schedctl_bench.storage.bulk_future import generates_rows

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


def load_runs(store: Store, tenant_id: str, per_job: int, now: datetime) -> None:
    spacing = timedelta(days=1) if per_job <= 30 else timedelta(hours=1)
    if generates_rows(store):
        oldest = now - per_job * spacing - timedelta(days=1)
        day = oldest.date()
        while day <= now.date():
            start = datetime(day.year, day.month, day.day, tzinfo=UTC)
            with store.tx() as connection:
                PostgresRunPartitions().create(
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


def load_dead_letters(store: Store, tenant_id: str, now: datetime) -> int:
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


def sample_ids(store: Store, tenant_id: str) -> tuple[str, datetime | None, int | None]:
    """The pages' subjects: the job in the middle of the tenant's id order, its newest
    run's time, and the tenant's newest dead letter."""
    j, r, d = schema.jobs, schema.runs, schema.dead_letters
    with store.read() as connection:
        count = connection.execute(
            select(func.count()).select_from(j).where(j.c.tenant_id == tenant_id)
        ).scalar_one()
        middle = connection.execute(
            select(j.c.job_id)
            .where(j.c.tenant_id == tenant_id)
            .order_by(j.c.job_id)
            .offset(count // 2)
            .limit(1)
        ).scalar_one()
        run_at = connection.execute(
            select(r.c.scheduled_at)
            .where(r.c.job_id == middle)
            .order_by(r.c.scheduled_at.desc())
            .limit(1)
        ).scalar()
        letter = connection.execute(
            select(d.c.id).where(d.c.tenant_id == tenant_id).order_by(d.c.id.desc()).limit(1)
        ).scalar()
    return str(middle), run_at, letter
