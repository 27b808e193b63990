"""Owns job update validation: a partial REST-shaped body (PATCH /v1/jobs/{id}, `schedctl job
update`) -> the validated new values of the fields it names.

Each field goes through the same jobspec parser as a create, so an update accepts and
refuses exactly what a create would; nothing here touches the database. What is not named
keeps its current value; a "retry" object is merged into the current policy, and a
"schedule" object without a kind (only "timezone") keeps the current cron expression.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from schedctl.core import errors
from schedctl.core.limits import DEFAULT_MAX_PAYLOAD_BYTES
from schedctl.domain.jobspec import (
    TOP_LEVEL_KEYS,
    _check_payload,
    _parse_max_concurrency,
    _parse_misfire,
    _parse_name,
    _parse_retry,
    _reject_unknown,
    _seconds,
    parse_after,
    parse_metrics,
    parse_schedule,
    parse_target,
)
from schedctl.domain.models import Job, RetryPolicy, Target
from schedctl.domain.runpolicy import RUN_KEYS, RunPolicy, parse_run_policy
from schedctl.scheduling.cron import CronSchedule
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import AfterSchedule, BootSchedule, Schedule

# part of a job's identity or bounds: changing them would be another job
FIXED_KEYS = frozenset({"idempotency_key", "start", "end"})
# a create's keys but the fixed ones and the alerts (they have their own route)
UPDATABLE_KEYS = TOP_LEVEL_KEYS - FIXED_KEYS - {"alerts"}
_KINDS = ("run_at", "delay", "cron", "every")


@dataclass(frozen=True)
class JobPatch:
    """The validated new values; None is "unchanged" (payload: see has_payload)."""

    fields: tuple[str, ...]  # the body's keys, sorted: what the audit log records
    name: str | None = None
    schedule: Schedule | None = None
    target: Target | None = None
    has_payload: bool = False
    payload: Any = None
    retry: RetryPolicy | None = None
    misfire_policy: MisfirePolicy | None = None
    grace_seconds: int | None = None
    window_seconds: int | None = None
    max_concurrency: int | None = None
    timeout_seconds: int | None = None
    metrics: bool | None = None
    # new upstream jobs (ids or names, resolved and cycle-checked in the update's transaction)
    after: tuple[str, ...] | None = None
    run: RunPolicy | None = None  # overlap and resource limits (runpolicy.py)


def parse_job_patch(
    body: Any,
    job: Job,
    *,
    now: datetime,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> JobPatch:
    """Validate a partial job body against the current job at `now` (the database clock)."""
    if not isinstance(body, Mapping):
        raise errors.ValidationError("the update must be a JSON object", field="body")
    fixed = sorted(str(k) for k in body if k in FIXED_KEYS)
    if fixed:
        raise errors.ValidationError(
            "cannot be changed by an update (create another job)", field=fixed[0]
        )
    _reject_unknown(body, UPDATABLE_KEYS, prefix="")
    if not body:
        raise errors.ValidationError(
            f"names nothing to change (one of {', '.join(sorted(UPDATABLE_KEYS))})",
            field="body",
        )
    values: dict[str, Any] = {"fields": tuple(sorted(str(k) for k in body))}
    if "name" in body:
        if body["name"] is None:
            raise errors.ValidationError("must be a non-empty string, got null", field="name")
        values["name"] = _parse_name(body["name"], schedule_kind="", target=job.target)
    if "after" in body:
        if "schedule" in body:
            raise errors.ValidationError(
                "a dependent job has no schedule of its own: give schedule or after, not both",
                field="after",
            )
        values["after"] = parse_after(body["after"])
    if "schedule" in body:
        if isinstance(job.schedule, AfterSchedule):
            # its runs come from its upstream jobs; a time of its own would run it twice
            raise errors.ValidationError(
                f"job {job.job_id} runs after its upstream jobs and has no schedule of its own "
                "(change its after instead)",
                field="schedule",
            )
        values["schedule"] = parse_schedule(_schedule_body(body["schedule"], job), now)
        if isinstance(values["schedule"], BootSchedule):
            raise errors.ValidationError(
                "a job becomes an @reboot job only when created so (schedctl apply)",
                field="boot",
            )
    if "target" in body:
        values["target"] = parse_target(body["target"])
    if "payload" in body:
        _check_payload(body["payload"], max_payload_bytes)
        values["has_payload"] = True
        values["payload"] = body["payload"]
    if "retry" in body:
        values["retry"] = _parse_retry(_retry_body(body["retry"], job.retry))
    if "misfire_policy" in body:
        if body["misfire_policy"] is None:
            raise errors.ValidationError("must not be null", field="misfire_policy")
        values["misfire_policy"] = _parse_misfire(body["misfire_policy"])
    for key, current in (
        ("grace", job.grace_seconds),
        ("window", job.window_seconds),
        ("timeout", job.timeout_seconds),
    ):
        if key in body:
            values[f"{key}_seconds"] = _seconds(body, key, default=current, allow_zero=True)
    if "max_concurrency" in body:
        values["max_concurrency"] = _parse_max_concurrency(body)
    if "metrics" in body:
        values["metrics"] = parse_metrics(body["metrics"])
    if body.keys() & (RUN_KEYS | {"target"}):
        # checked against the target it will have (an http target keeps only `queue`)
        target = values.get("target", job.target)
        values["run"] = parse_run_policy(body, target_type=target.type.value, current=job.run)
    return JobPatch(**values)


def _schedule_body(obj: Any, job: Job) -> Any:
    """A schedule with only a new "timezone" keeps the job's cron expression."""
    if isinstance(obj, Mapping) and not any(k in obj for k in _KINDS) and "timezone" in obj:
        if not isinstance(job.schedule, CronSchedule):
            raise errors.ValidationError(
                "timezone applies only to cron schedules (give a new cron, too)",
                field="timezone",
            )
        return {**obj, "cron": job.schedule.expr}
    return obj


def _retry_body(obj: Any, current: RetryPolicy) -> Any:
    """The given retry keys over the current policy: --max-attempts alone keeps the delays."""
    if not isinstance(obj, Mapping):
        return obj
    return {
        "max_attempts": current.max_attempts,
        "base_delay": current.base_delay_seconds,
        "max_delay": current.max_delay_seconds,
        **obj,
    }
