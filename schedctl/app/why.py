"""Owns `schedctl job why JOB` (and GET /v1/jobs/{id}/why): one report answering "why did my
job not run": its schedule and next fire times, its last runs with the reason each was
skipped or failed, how late it is now, the live workers of its queue, and its pause and
alert state, with the conclusions an operator would draw from them as sentences.

Built from what the scheduler already records (the job row, the run history, worker
presence, the alert settings); the caller has resolved the job within its tenant."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from schedctl.app.views import schedule_summary
from schedctl.core import limits
from schedctl.domain.alerts.model import AlertConfig
from schedctl.domain.models import Job, JobStatus, Run, RunStatus, TargetType
from schedctl.scheduling.schedules import next_occurrence
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.pipeline.workers import WorkerSeen

NEXT_FIRES = 5  # next fire times shown
LAST_RUNS = 10  # recent runs shown
_FAILED = (RunStatus.failed, RunStatus.dead, RunStatus.lost)


def next_fires(job: Job, count: int = NEXT_FIRES) -> list[datetime]:
    """The job's next `count` nominal times from its next run (none unless active)."""
    if job.status is not JobStatus.active or job.next_run_at is None:
        return []
    found = [job.next_run_at]
    for _ in range(count - 1):
        following = next_occurrence(job.schedule, found[-1], end=job.end_at)
        if following is None:
            break
        found.append(following)
    return found


def report(
    job: Job,
    *,
    runs: list[Run],
    workers: list[WorkerSeen] | None,
    alerts: AlertConfig | None,
    alerts_from: str,
    now: datetime,
) -> dict[str, Any]:
    """The why-report of `job` as JSON-ready data; `workers` is None for a job with no
    queue (an HTTP or RabbitMQ target); `alerts_from`: "job", "tenant" or "none"."""
    lateness = 0.0
    if job.status is JobStatus.active and job.next_fire_at is not None:
        lateness = max(0.0, (now - job.next_fire_at).total_seconds())
    target = job.target.to_dict()
    shown_runs = [_run(run) for run in runs[:LAST_RUNS]]
    result: dict[str, Any] = {
        "job_id": job.job_id,
        "name": job.name,
        "tenant_id": job.tenant_id,
        "status": job.status.value,
        "paused": job.status is JobStatus.paused,
        "schedule": schedule_summary(job),
        "misfire_policy": job.misfire_policy.value,
        "grace_seconds": job.grace_seconds,
        "window_seconds": job.window_seconds,
        "target": target,
        "timezone": getattr(job.schedule, "timezone", None),
        "next_fires": [format_instant(at) for at in next_fires(job)],
        "late_seconds": round(lateness, 3),
        "last_runs": shown_runs,
        "workers": None if workers is None else [w.worker for w in workers],
        "alerts": None if alerts is None else {**alerts.to_dict(), "from": alerts_from},
        "now": format_instant(now),
    }
    result["explanation"] = _explain(job, result, runs, workers, alerts, lateness)
    return result


def _run(run: Run) -> dict[str, Any]:
    return {
        "scheduled_at": format_instant(run.scheduled_at),
        "trigger": run.trigger.value,
        "status": run.status.value,
        "attempt": run.attempt,
        "finished_at": None if run.finished_at is None else format_instant(run.finished_at),
        "exit_code": run.exit_code,
        # a skipped run's reason, a failed one's error
        "reason": run.error,
    }


def _explain(
    job: Job,
    result: dict[str, Any],
    runs: list[Run],
    workers: list[WorkerSeen] | None,
    alerts: AlertConfig | None,
    lateness: float,
) -> list[str]:
    """The conclusions, most telling first."""
    said: list[str] = []
    if job.status is JobStatus.paused:
        said.append("paused: no run is scheduled until `schedctl job resume`")
    elif job.status is not JobStatus.active:
        said.append(f"{job.status.value}: it runs no more")
    elif not result["next_fires"]:
        said.append("no next fire time: its schedule has no occurrence left")
    else:
        said.append(f"next run at {result['next_fires'][0]}")
    if lateness >= 1:
        said.append(
            f"late by {lateness:.0f} s: its run is due and no dispatcher has claimed it "
            "(is a scheduled-d dispatcher running?)"
        )
    if runs:
        last = runs[0]
        when = format_instant(last.scheduled_at)
        if last.status is RunStatus.skipped:
            said.append(f"last run {when} was skipped: {last.error or 'no reason recorded'}")
        elif last.status in _FAILED:
            said.append(f"last run {when} {last.status.value}: {last.error or 'no error'}")
        else:
            said.append(f"last run {when}: {last.status.value}")
    else:
        said.append("no run recorded yet")
    if workers is not None and not workers:
        said.append(
            f"no live worker serves queue {job.target.address!r}: its runs wait "
            "(or, for an every-host queue, are skipped) until one starts"
        )
    if alerts is None or not alerts.channels:
        said.append("no alerts are set: a failure is only in the run history")
    return said


def _local(at: str, zone: str | None) -> str:
    """A next fire time in UTC, and in the schedule's zone when it has another."""
    if not zone or zone == "UTC":
        return at
    local = datetime.fromisoformat(at.replace("Z", "+00:00")).astimezone(ZoneInfo(zone))
    return f"{at} ({local.strftime('%Y-%m-%d %H:%M:%S %Z')} {zone})"


def has_queue(job: Job) -> bool:
    return job.target.type is TargetType.queue


def render(data: dict[str, Any]) -> str:
    """The report as text (control characters in recorded reasons made harmless)."""

    def clean(value: Any) -> str:
        return limits.CONTROL_CHARS.sub("\ufffd", str(value))

    lines = [
        f"job {clean(data['name'])} ({data['job_id']})",
        f"  status:    {data['status']}",
        f"  schedule:  {clean(data['schedule'])}; misfire policy {data['misfire_policy']}, "
        f"grace {data['grace_seconds']} s, window {data['window_seconds']} s",
        f"  late:      {data['late_seconds']:.0f} s",
    ]
    fires = [_local(at, data.get("timezone")) for at in data["next_fires"]]
    lines[3:3] = [f"  next:      {fires[0] if fires else 'none'}"] + [
        f"             {fire}" for fire in fires[1:]
    ]
    if data["workers"] is not None:
        shown = ", ".join(clean(w) for w in data["workers"]) or "none live"
        lines.append(f"  workers:   {shown} (queue {clean(data['target'].get('name', ''))})")
    alerts = data["alerts"]
    if alerts is None:
        lines.append("  alerts:    none")
    else:
        where = [k for k in ("webhook", "email", "command") if alerts.get(k)]
        lines.append(
            f"  alerts:    on {', '.join(alerts['on']) or 'nothing'} by "
            f"{', '.join(where) or 'no channel'} ({alerts['from']} settings)"
        )
    lines.append("  last runs:")
    if not data["last_runs"]:
        lines.append("    none")
    for run in data["last_runs"]:
        reason = f": {clean(run['reason'])}" if run["reason"] else ""
        lines.append(f"    {run['scheduled_at']}  {run['status']}{reason}")
    lines.append("why:")
    lines.extend(f"  - {clean(line)}" for line in data["explanation"])
    return "\n".join(lines) + "\n"
