"""Owns recording a boot run: the run of an @reboot job (a central job with a `boot`
schedule, made by `schedctl apply`) that its host's worker ran at the machine's boot,
written once it ended as a run and its one attempt, so that `schedctl runs JOB` and
`schedctl logs` show it like any run.

The times are the database's: the run finished now and started `seconds` before (the
host's clock is not trusted). A failed boot run is `failed` with its error: nothing
retries it, and it is no dead letter (the next boot runs the job again).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from schedctl.core import errors
from schedctl.domain.models import Job, Run, RunStatus, RunTrigger
from schedctl.scheduling.schedules import BootSchedule
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.rows import run_from_row, run_query
from schedctl.storage.db.store import Store
from schedctl.storage.jobs import job_lookup
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.records.audit import audit

MAX_OUTPUT_CHARS = 64 * 1024  # of the output's tail kept (the host sends its own tail)
MAX_ERROR_CHARS = 2000
MAX_BOOT_SECONDS = 366 * 86400.0
WORKER_CHARS = 200


def record(
    store: Store,
    tenant_id: str,
    name: str,
    *,
    seconds: float,
    exit_code: int | None,
    error: str | None,
    output: str | None,
    worker: str,
    actor: str,
    allowed: Callable[[Job], bool] | None = None,
) -> Run:
    """Record the ended boot run of the tenant's job `name`. NotFound naming `job` for an
    unknown job or one `allowed` refuses (a host token's: not its own); ValidationError
    for a job that is no @reboot job or bad values, naming the field."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise errors.ValidationError("must be a number of seconds", field="seconds")
    if not 0 <= seconds <= MAX_BOOT_SECONDS:
        raise errors.ValidationError(
            f"must be 0 to {MAX_BOOT_SECONDS:.0f} seconds, got {seconds}", field="seconds"
        )
    if exit_code is not None and (
        isinstance(exit_code, bool) or not isinstance(exit_code, int) or abs(exit_code) > 255
    ):
        raise errors.ValidationError("must be an exit code (-255..255) or null", field="exit_code")
    for value, field in ((error, "error"), (output, "output")):
        if value is not None and not isinstance(value, str):
            raise errors.ValidationError("must be a string or null", field=field)
    succeeded = exit_code == 0 and error is None
    output = output[-MAX_OUTPUT_CHARS:] if output else None
    error = error[:MAX_ERROR_CHARS] if error else None
    if not succeeded and error is None:
        error = f"exit code {exit_code}" if exit_code is not None else "failed"
    with store.tx() as connection:
        job_id = job_lookup.name_taken_by(connection, tenant_id, name)
        job = JobRepo(store)._get(connection, job_id, tenant_id) if job_id else None
        if job is None or (allowed is not None and not allowed(job)):
            raise errors.NotFound(f"no job named {name!r}", field="job")
        if not isinstance(job.schedule, BootSchedule):
            raise errors.ValidationError(
                f"job {name!r} is not an @reboot job: only those have boot runs", field="job"
            )
        now = db_now(connection)
        started = now - timedelta(seconds=seconds)
        status = (RunStatus.succeeded if succeeded else RunStatus.failed).value
        outcome = {
            "started_at": started,
            "finished_at": now,
            "exit_code": exit_code,
            "error": error,
            "output_tail": output,
        }
        connection.execute(
            schema.runs.insert().values(
                job_id=job.job_id,
                scheduled_at=started,
                tenant_id=job.tenant_id,
                partition=job.partition,
                trigger=RunTrigger.boot.value,
                status=status,
                attempt=1,
                fire_at=started,
                dispatched_at=started,
                job_version=job.version,
                **outcome,
            )
        )
        connection.execute(
            schema.run_attempts.insert().values(
                job_id=job.job_id,
                scheduled_at=started,
                attempt=1,
                status=status,
                worker=worker[:WORKER_CHARS],
                **outcome,
            )
        )
        audit(
            connection,
            at=now,
            tenant_id=job.tenant_id,
            actor=actor,
            action="job.boot_run",
            job_id=job.job_id,
            detail={"status": status, "exit_code": exit_code},
        )
        row = connection.execute(run_query(job.job_id, started)).mappings().one()
    return run_from_row(row)
