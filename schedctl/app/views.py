"""Owns the public JSON shape of jobs, runs, tenants, tokens and audit entries, shared by the
CLI and the REST API, and its inverse for jobs and runs (the API client reads them back).

Every value is JSON-safe: instants are RFC 3339 UTC with `Z`, enums are their values.
Secrets (token hashes, signing secrets) are never part of a view.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from schedctl.core import errors
from schedctl.domain.models import (
    Job,
    JobStatus,
    RetryPolicy,
    Run,
    RunStatus,
    RunTrigger,
    Target,
    TargetType,
    Tenant,
    run_key,
)
from schedctl.domain.runpolicy import run_policy_from
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import schedule_from_dict, schedule_to_dict
from schedctl.scheduling.timeparse import format_instant

if TYPE_CHECKING:
    from schedctl.storage.records.audit import AuditEntry
    from schedctl.storage.tenants.tenants import TokenInfo


def _instant(value: datetime | None) -> str | None:
    return format_instant(value) if value is not None else None


def job_to_dict(job: Job) -> dict[str, Any]:
    # equal instants format alike: a job's fire time is mostly its run time, and a new
    # job's updated_at its created_at (a 1,000-job batch response formats 4,000 times)
    next_run_at = _instant(job.next_run_at)
    created_at = format_instant(job.created_at)
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
        **job.run.to_dict(),
        "start_at": _instant(job.start_at),
        "end_at": _instant(job.end_at),
        "next_run_at": next_run_at,
        "next_fire_at": (
            next_run_at if job.next_fire_at == job.next_run_at else _instant(job.next_fire_at)
        ),
        "partition": job.partition,
        "version": job.version,
        "idempotency_key": job.idempotency_key,
        "metrics": job.metrics,
        "created_at": created_at,
        "updated_at": (
            created_at if job.updated_at == job.created_at else format_instant(job.updated_at)
        ),
    }


def run_to_dict(run: Run) -> dict[str, Any]:
    scheduled_at = format_instant(run.scheduled_at)
    return {
        "job_id": run.job_id,
        "scheduled_at": scheduled_at,
        # what every target receives as its idempotency key
        "idempotency_key": run_key(run.job_id, run.scheduled_at),
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


def token_to_dict(token: TokenInfo) -> dict[str, Any]:
    return {
        "token_id": token.token_id,
        "tenant_id": token.tenant_id,
        "created_at": format_instant(token.created_at),
        "revoked_at": _instant(token.revoked_at),
        "active": token.revoked_at is None,
        "host": token.host.host if token.host is not None else None,
        "groups": list(token.host.groups) if token.host is not None else [],
    }


def audit_to_dict(entry: AuditEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "at": format_instant(entry.at),
        "tenant_id": entry.tenant_id,
        "tenant": entry.tenant,
        "actor": entry.actor,
        "action": entry.action,
        "job_id": entry.job_id,
        "detail": entry.detail,
    }


# -- the inverse: JSON views back to models (the API client) ---------------------------


def job_from_dict(data: Mapping[str, Any]) -> Job:
    """The Job a job_to_dict view describes; a malformed view is a SchedError (the server
    sent something this client does not understand), never a KeyError."""
    try:
        target_data = data["target"]
        kind = TargetType(target_data["type"])
        target = (
            Target(kind, name=target_data["name"])
            if kind is TargetType.queue
            else Target(kind, url=target_data["url"])
        )
        retry = data["retry"]
        return Job(
            schedule=schedule_from_dict(data["schedule"]),
            target=target,
            payload=data["payload"],
            retry=RetryPolicy(
                max_attempts=int(retry["max_attempts"]),
                base_delay_seconds=float(retry["base_delay_seconds"]),
                max_delay_seconds=float(retry["max_delay_seconds"]),
            ),
            misfire_policy=MisfirePolicy(data["misfire_policy"]),
            status=JobStatus(data["status"]),
            # null (no limit) in the view, 0 in the model
            max_concurrency=int(data["max_concurrency"] or 0),
            timeout_seconds=int(data["timeout_seconds"] or 0),
            # a server from before 0020 does not send it
            metrics=bool(data.get("metrics", False)),
            run=run_policy_from(data),
            **_read(data, _as_sent, ("job_id", "tenant_id", "name", "idempotency_key")),
            **_read(data, int, ("grace_seconds", "window_seconds", "partition", "version")),
            **_read(data, _parse, ("start_at", "end_at", "next_run_at", "next_fire_at")),
            **_read(data, _required, ("created_at", "updated_at")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.SchedError(f"the server sent a job this client cannot read: {exc!r}") from exc


# the fields of a run's view that a Run keeps as they are
_RUN_AS_SENT = ("job_id", "tenant_id", "exit_code", "error", "output_tail", "epoch")


def run_from_dict(data: Mapping[str, Any]) -> Run:
    try:
        return Run(
            scheduled_at=_required(data["scheduled_at"]),
            trigger=RunTrigger(data["trigger"]),
            status=RunStatus(data["status"]),
            attempt=int(data["attempt"]),
            **_read(data, _as_sent, _RUN_AS_SENT),
            **_read(data, _parse, ("fire_at", "dispatched_at", "started_at", "finished_at")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.SchedError(f"the server sent a run this client cannot read: {exc!r}") from exc


def _read(
    data: Mapping[str, Any], convert: Callable[[Any], Any], names: tuple[str, ...]
) -> dict[str, Any]:
    """The fields `names` of a JSON view, each read by `convert`, under the same names."""
    return {name: convert(data[name]) for name in names}


def _as_sent(value: Any) -> Any:
    return value


def _parse(value: Any) -> datetime | None:
    return None if value is None else _required(value)


def _required(value: Any) -> datetime:
    if not isinstance(value, str):
        raise TypeError(f"expected an instant, got {value!r}")
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise ValueError(f"instant without an offset: {value!r}")
    return parsed


def schedule_summary(job: Job) -> str:
    """One short line for tables: "cron 0 8 * * MON (Asia/Kolkata)", "every 30s", "once at ..."."""
    data = schedule_to_dict(job.schedule)
    if data["kind"] == "cron":
        return f"cron {data['cron']} ({data['timezone']})"
    if data["kind"] == "interval":
        seconds = data["every_seconds"]
        assert isinstance(seconds, int)
        return f"every {_short_duration(seconds)}"
    if data["kind"] == "after":
        return "after upstream jobs"
    if data["kind"] == "boot":
        return "@reboot (once per boot of its host)"
    return f"once at {data['run_at']}"


def _short_duration(seconds: int) -> str:
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts) or "0s"
