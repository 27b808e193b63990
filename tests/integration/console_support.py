"""Owns the web console tests' data: a tenant with a job, its runs (one finished with output,
one running, one skipped with a reason) and a dead letter, written straight into the tables
so each page has something to show."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import insert

from schedctl.app.service import Scheduler
from schedctl.domain.models import Tenant
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db import schema


@dataclass(frozen=True)
class Seeded:
    tenant: Tenant
    token: str
    job_id: str
    run_at: datetime  # a finished run with output
    running_at: datetime  # a running run
    letter_id: int

    @property
    def run_path(self) -> str:
        return f"/ui/jobs/{self.job_id}/runs/{format_instant(self.run_at)}"

    @property
    def running_path(self) -> str:
        return f"/ui/jobs/{self.job_id}/runs/{format_instant(self.running_at)}"


def _run_row(
    job_id: str, tenant_id: str, at: datetime, status: str, **extra: Any
) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "scheduled_at": at,
        "tenant_id": tenant_id,
        "partition": 0,
        "trigger": "schedule",
        "status": status,
        "attempt": 1,
        "fire_at": at,
        "dispatched_at": at + timedelta(seconds=1),
        "started_at": at + timedelta(seconds=2),
        "finished_at": None,
        "exit_code": None,
        "error": None,
        "output_tail": None,
        **extra,
    }


def seed(sched: Scheduler, tenant_name: str, job_name: str = "nightly-report") -> Seeded:
    tenant, token = sched.create_tenant(tenant_name, "test")
    job, _ = sched.create_job(
        tenant,
        {
            "name": job_name,
            "schedule": {"cron": "30 1 * * *", "timezone": "Europe/Berlin"},
            "target": {"type": "queue", "name": "reports"},
        },
        actor="test",
    )
    now = datetime.now(UTC).replace(microsecond=0)
    run_at = now - timedelta(hours=3)
    running_at = now - timedelta(minutes=5)
    skipped_at = now - timedelta(hours=6)
    letter_at = now - timedelta(hours=9)
    with sched.store.tx() as connection:
        connection.execute(
            insert(schema.runs),
            [
                _run_row(
                    job.job_id,
                    tenant.tenant_id,
                    run_at,
                    "succeeded",
                    finished_at=run_at + timedelta(seconds=30),
                    exit_code=0,
                    output_tail=f"report of {tenant_name} done",
                ),
                _run_row(job.job_id, tenant.tenant_id, running_at, "running"),
                _run_row(
                    job.job_id,
                    tenant.tenant_id,
                    skipped_at,
                    "skipped",
                    error="missed by more than its grace period",
                    started_at=None,
                    dispatched_at=None,
                ),
                _run_row(
                    job.job_id,
                    tenant.tenant_id,
                    letter_at,
                    "dead",
                    finished_at=letter_at + timedelta(seconds=5),
                    error="worker said no",
                ),
            ],
        )
        connection.execute(
            insert(schema.run_attempts),
            [
                {
                    "job_id": job.job_id,
                    "scheduled_at": run_at,
                    "attempt": 1,
                    "status": "succeeded",
                    "started_at": run_at,
                    "finished_at": run_at + timedelta(seconds=30),
                    "exit_code": 0,
                    "output_tail": f"report of {tenant_name} done",
                },
                {
                    "job_id": job.job_id,
                    "scheduled_at": running_at,
                    "attempt": 1,
                    "status": "running",
                    "started_at": running_at,
                    "finished_at": None,
                    "exit_code": None,
                    "output_tail": "step 1 of 3",
                },
            ],
        )
        letter_id = connection.execute(
            insert(schema.dead_letters)
            .values(
                job_id=job.job_id,
                scheduled_at=letter_at,
                tenant_id=tenant.tenant_id,
                target_type="queue",
                target="reports",
                attempts=3,
                last_error="worker said no",
                created_at=letter_at + timedelta(seconds=5),
            )
            .returning(schema.dead_letters.c.id)
        ).scalar_one()
    return Seeded(tenant, token, job.job_id, run_at, running_at, int(letter_id))


def finish_running(sched: Scheduler, seeded: Seeded, output: str) -> None:
    """The running run ends with `output` (what the live follow must come to show)."""
    from sqlalchemy import update

    r, a = schema.runs, schema.run_attempts
    with sched.store.tx() as connection:
        connection.execute(
            update(r)
            .where(r.c.job_id == seeded.job_id, r.c.scheduled_at == seeded.running_at)
            .values(status="succeeded", finished_at=datetime.now(UTC), exit_code=0)
        )
        connection.execute(
            update(a)
            .where(a.c.job_id == seeded.job_id, a.c.scheduled_at == seeded.running_at)
            .values(status="succeeded", finished_at=datetime.now(UTC), output_tail=output)
        )
