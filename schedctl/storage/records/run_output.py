"""Owns reading a run's output for `schedctl logs`: one run by its scheduled time, and the
recorded attempts (run_attempts rows: status, times, exit code, error, output) of a few runs
of one job. The caller has resolved the job within its tenant (Scheduler.resolve_job)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import select

from schedctl.domain.models import AttemptLog, Run
from schedctl.storage.db import schema
from schedctl.storage.db.rows import run_from_row, run_query
from schedctl.storage.db.store import Store

# runs whose attempts are read in one query (`logs --follow` looks at a page of recent runs)
MAX_RUNS_PER_READ = 1000


def get_run(store: Store, job_id: str, scheduled_at: datetime) -> Run | None:
    with store.read() as connection:
        row = connection.execute(run_query(job_id, scheduled_at)).mappings().first()
    return None if row is None else run_from_row(row)


def attempts(
    store: Store, job_id: str, scheduled_ats: Iterable[datetime]
) -> dict[datetime, list[AttemptLog]]:
    """The recorded attempts of each run of `job_id` at `scheduled_ats`, oldest first."""
    wanted = list(scheduled_ats)[:MAX_RUNS_PER_READ]
    result: dict[datetime, list[AttemptLog]] = {at: [] for at in wanted}
    if not wanted:
        return result
    a = schema.run_attempts
    with store.read() as connection:
        rows = (
            connection.execute(
                select(a)
                .where(a.c.job_id == job_id, a.c.scheduled_at.in_(wanted))
                .order_by(a.c.scheduled_at, a.c.attempt, a.c.id)
            )
            .mappings()
            .all()
        )
    for row in rows:
        result.setdefault(row["scheduled_at"], []).append(
            AttemptLog(
                attempt=row["attempt"],
                status=row["status"],
                started_at=row["started_at"],
                finished_at=row["finished_at"],
                exit_code=row["exit_code"],
                error=row["error"],
                output=row["output_tail"],
            )
        )
    return result
