"""Owns the public JSON shape of jobs, runs and tenants, shared by the CLI and the REST API.

Every value is JSON-safe: instants are RFC 3339 UTC with `Z`, enums are their values.
Secrets (token hashes, signing secrets) are never part of a view.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from schedctl.models import Job, Run, Tenant
from schedctl.scheduling.schedules import schedule_to_dict
from schedctl.scheduling.timeparse import format_instant


def _instant(value: datetime | None) -> str | None:
    return format_instant(value) if value is not None else None


def job_to_dict(job: Job) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "tenant_id": job.tenant_id,
        "name": job.name,
        "status": job.status.value,
        "schedule": schedule_to_dict(job.schedule),
        "target": job.target.to_dict(),
        "payload": job.payload,
        "retry": job.retry.to_dict(),
        "misfire_policy": job.misfire_policy.value,
        "grace_seconds": job.grace_seconds,
        "window_seconds": job.window_seconds,
        # the model keeps 0 for "no limit" (the column is NOT NULL); the API says null
        "max_concurrency": job.max_concurrency or None,
        "timeout_seconds": job.timeout_seconds or None,
        "start_at": _instant(job.start_at),
        "end_at": _instant(job.end_at),
        "next_run_at": _instant(job.next_run_at),
        "next_fire_at": _instant(job.next_fire_at),
        "partition": job.partition,
        "version": job.version,
        "idempotency_key": job.idempotency_key,
        "created_at": format_instant(job.created_at),
        "updated_at": format_instant(job.updated_at),
    }


def run_to_dict(run: Run) -> dict[str, Any]:
    scheduled_at = format_instant(run.scheduled_at)
    return {
        "job_id": run.job_id,
        "scheduled_at": scheduled_at,
        # what every target receives as its idempotency key
        "idempotency_key": f"{run.job_id}:{scheduled_at}",
        "tenant_id": run.tenant_id,
        "trigger": run.trigger.value,
        "status": run.status.value,
        "attempt": run.attempt,
        "fire_at": _instant(run.fire_at),
        "dispatched_at": _instant(run.dispatched_at),
        "started_at": _instant(run.started_at),
        "finished_at": _instant(run.finished_at),
        "exit_code": run.exit_code,
        "error": run.error,
        "output_tail": run.output_tail,
        "epoch": run.epoch,
    }


def tenant_to_dict(tenant: Tenant) -> dict[str, Any]:
    return {
        "tenant_id": tenant.tenant_id,
        "name": tenant.name,
        "max_jobs": tenant.max_jobs,
        "create_rate_per_minute": tenant.create_rate_per_minute,
        "dispatch_rate_per_second": tenant.dispatch_rate_per_second,
        "allow_list": list(tenant.allow_list),
        "created_at": format_instant(tenant.created_at),
    }


def schedule_summary(job: Job) -> str:
    """One short line for tables: "cron 0 8 * * MON (Asia/Kolkata)", "every 30s", "once at ..."."""
    data = schedule_to_dict(job.schedule)
    if data["kind"] == "cron":
        return f"cron {data['cron']} ({data['timezone']})"
    if data["kind"] == "interval":
        seconds = data["every_seconds"]
        assert isinstance(seconds, int)
        return f"every {_short_duration(seconds)}"
    return f"once at {data['run_at']}"


def _short_duration(seconds: int) -> str:
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts) or "0s"
