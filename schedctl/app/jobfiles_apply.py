"""Owns `schedctl apply`'s plan and its execution: which central jobs make the store match a
jobs.d directory as seen from one host (created, changed, unchanged, removed, by central
name), what differs field by field, and the service calls that make it so.

plan() is pure (files, host, groups, the tenant's central jobs, the database's now) and
validates every body it would send before execute() writes anything, so a bad file, or a
value only the clock refuses (an `at` already past), changes nothing and names file, line
and key. A central job counts as made by apply when its payload holds exactly the
reference and bookkeeping keys; apply never changes or removes any other job.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from schedctl.core import errors
from schedctl.domain.alerts.model import AlertConfig, parse_alerts
from schedctl.domain.config import load_config
from schedctl.domain.jobfiles import placement
from schedctl.domain.jobfiles.model import FileJob, JobFile, JobFilesError, Problem, RunOnKind
from schedctl.domain.jobfiles.tomllines import key_lines, locate
from schedctl.domain.jobpatch import parse_job_patch
from schedctl.domain.jobspec import parse_job_request
from schedctl.domain.models import Job as CentralJob
from schedctl.domain.models import JobSpec, JobStatus, Page
from schedctl.scheduling.schedules import AfterSchedule, schedule_to_dict

if TYPE_CHECKING:
    from schedctl.domain.host_scope import HostScope


class Jobs(Protocol):
    """What apply asks of the central store: the database's library API (Scheduler), or the
    REST API's client (ApiClient: `schedctl --api URL apply`, a cron host with its host
    token). A protocol, so this module stays below the clients it is used with."""

    def list_jobs(
        self,
        tenant: str,
        status: str | JobStatus | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page: ...

    def get_alerts(self, tenant: str, job_id: str | None = None) -> AlertConfig | None: ...

    def set_alerts(
        self, tenant: str, body: Mapping[str, Any] | None, job_id: str | None = None
    ) -> AlertConfig | None: ...

    def job_dependencies(self, job_id: str, tenant: str) -> dict[str, Any]: ...

    def create_job(
        self, tenant: str, body: Mapping[str, Any], *, actor: str
    ) -> tuple[CentralJob, bool]: ...

    def update_job(
        self, job_id: str, body: Mapping[str, Any], tenant: str, *, actor: str
    ) -> CentralJob: ...

    def delete_job(self, job_id: str, tenant: str, *, actor: str) -> object: ...

    def pause_job(self, job_id: str, tenant: str, *, actor: str) -> CentralJob: ...

    def resume_job(self, job_id: str, tenant: str, *, actor: str) -> CentralJob: ...


BOOT = "boot (runs on the host's worker start)"  # no longer a skip reason: kept for callers
# normalising a body needs a clock; one before any file's instant keeps `at` jobs that have
# already run comparable (the real clock checks only what is about to be sent)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# the REST field a validation error names -> the job file's key
_FILE_KEYS = {
    "run_at": "at",
    "interval": "every",
    "schedule": "cron",
    "alerts.email": "alert_email",
    "alerts.webhook": "alert_webhook",
    "alerts.no_success": "alert_no_success",
    "alerts.on": "alert_on",
    "alerts": "alert_email",
}
# fields an update cannot change: a job whose start or end moved is replaced
_FIXED = ("start", "end")
MAX_CENTRAL_PAGES = 1000  # of limits.MAX_PAGE jobs each: far beyond any tenant's quota


class Action(enum.StrEnum):
    created = "created"
    changed = "changed"
    unchanged = "unchanged"
    removed = "removed"


@dataclass(frozen=True)
class Central:
    """A central job of the tenant and its own alert settings (None: the tenant default)."""

    job: CentralJob
    alerts: AlertConfig | None = None
    after: tuple[str, ...] = ()  # the names of its upstream jobs (a dependent job)


@dataclass(frozen=True)
class Entry:
    """One central job's fate; `fields` maps each differing field to (old, new)."""

    name: str
    action: Action
    job: FileJob | None = None  # the file's job (None: a removed central job)
    current: CentralJob | None = None
    body: dict[str, Any] | None = None  # the create body
    update: dict[str, Any] = field(default_factory=dict)  # the update body (changed)
    fields: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    replace: bool = False  # delete and create again (start/end moved, or cancelled)


@dataclass(frozen=True)
class SkippedJob:
    name: str
    file: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "file": self.file, "reason": self.reason}


@dataclass(frozen=True)
class Plan:
    host: str
    directory: str
    entries: tuple[Entry, ...]
    skipped: tuple[SkippedJob, ...]

    def of(self, action: Action) -> list[Entry]:
        return [e for e in self.entries if e.action is action]

    @property
    def writes(self) -> bool:
        return any(e.action is not Action.unchanged for e in self.entries)

    def as_dict(self, *, applied: bool) -> dict[str, Any]:
        return {
            "created": [e.name for e in self.of(Action.created)],
            "changed": [
                {"name": e.name, "fields": {k: list(v) for k, v in e.fields.items()}}
                for e in self.of(Action.changed)
            ],
            "unchanged": [e.name for e in self.of(Action.unchanged)],
            "removed": [e.name for e in self.of(Action.removed)],
            "skipped": [s.as_dict() for s in self.skipped],
            "applied": applied,
        }


# -- the host --------------------------------------------------------------------------


def read_host(path: str | Path | None) -> tuple[str, tuple[str, ...]]:
    """(name, groups) of the `[host]` table of the daemon's configuration file (read and
    checked by schedctl.domain.config, as the worker reads it); the node name and no groups
    without a file or table."""
    if path is None:
        return _node_name(), ()
    host = load_config(path).host
    if host is None:
        return _node_name(), ()
    return host.name, host.groups


def _node_name() -> str:
    # the same default as the worker's [host] name: both must name the same host queue
    return os.uname().nodename


# -- the plan --------------------------------------------------------------------------


def central_body(
    job: FileJob,
    host: str,
    mail_domain: str | None = None,
    names: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The create body of a file's job applied by `host`: under its central name, to its
    queue, with the reference, the host and the digest as payload. A local mailbox of the
    alerts (cron's MAILTO=root) becomes MAILBOX@mail_domain, as the host's own mailer
    would have addressed it. `after` names the central jobs of its upstream jobs (`names`:
    a file's job name -> its central name, of the jobs this host applies): an upstream
    this host does not apply is a ValidationError naming `after`."""
    body = job.job_body(placement.queue_for(job, host), host)
    body["name"] = placement.central_name(job, host)
    if "after" in body:
        names = names or {}
        for upstream in job.after:
            if upstream not in names:
                raise errors.ValidationError(
                    f"names {upstream!r}, a job that host {host} does not apply (another "
                    "host's or group's): a job runs only after jobs its own host applies",
                    field="after",
                )
        body["after"] = [names[u] for u in job.after]
    alerts = body.get("alerts")
    if mail_domain and isinstance(alerts, dict) and alerts.get("email"):
        alerts["email"] = [a if "@" in a else f"{a}@{mail_domain}" for a in alerts["email"]]
    return body


def made_by_apply(job: CentralJob) -> bool:
    return placement.is_apply_payload(job.payload)


def plan(
    files: Sequence[JobFile],
    host: str,
    groups: Iterable[str],
    central: Iterable[Central],
    *,
    directory: str | Path,
    now: datetime,
    keep_removed: bool = False,
    mail_domain: str | None = None,
) -> Plan:
    """What applying `files` (from `directory`) on `host` does to the tenant's `central`
    jobs. Raises JobFilesError naming file, line and key when a body would be refused.
    A job this host applied from a file of `directory` that no longer defines it (a file
    removed, a job renamed or moved to another host) is removed, unless `keep_removed`:
    left, it would keep firing runs the host refuses."""
    placement.check_host(host)
    groups = tuple(groups)
    by_name = {c.job.name: c for c in central if c.job.status is not JobStatus.deleted}
    entries: list[Entry] = []
    skipped: list[SkippedJob] = []
    problems: list[Problem] = []
    wanted: set[str] = set()
    names = {
        job.name: placement.central_name(job, host)
        for file in files
        for job in file.jobs
        if not job.is_boot and placement.applies_to(job, host, groups)
    }
    for file in files:
        for index, job in enumerate(file.jobs):
            if not placement.applies_to(job, host, groups):
                reason = f"runs on every host of group {job.run_on.group}, not this one"
                skipped.append(SkippedJob(job.name, str(job.path), reason))
                continue
            name = placement.central_name(job, host)
            wanted.add(name)
            try:
                found = by_name.get(name)
                entries.append(_entry(job, host, found, now, mail_domain, names))
            except errors.ValidationError as exc:
                problems.append(_problem(job, index, exc))
    if problems:
        raise JobFilesError(problems)
    root = Path(directory).resolve()
    for name, found in sorted(by_name.items()):
        if name in wanted or not _ours(found.job, host, root):
            continue
        if not keep_removed:
            entries.append(Entry(name, Action.removed, current=found.job))
        else:
            reason = f"no longer in {directory} (kept: --keep-removed)"
            skipped.append(SkippedJob(name, str(found.job.payload["job_file"]), reason))
    return Plan(host, str(directory), tuple(_upstreams_first(entries)), tuple(skipped))


def _upstreams_first(entries: list[Entry]) -> list[Entry]:
    """The entries in an order that creates each upstream job before the jobs that run
    after it (the files are free of cycles: schedctl.domain.jobfiles.load); removals last."""
    by_name = {e.job.name: e for e in entries if e.job is not None}
    placed: set[str] = set()
    ordered: list[Entry] = []
    for _ in range(len(by_name) + 1):  # each round places at least one job
        progress = False
        for name, entry in by_name.items():
            assert entry.job is not None
            if name not in placed and all(u in placed or u not in by_name for u in entry.job.after):
                placed.add(name)
                ordered.append(entry)
                progress = True
        if not progress:
            break
    ordered.extend(e for e in by_name.values() if e.job is not None and e.job.name not in placed)
    return ordered + [e for e in entries if e.job is None]


def _ours(job: CentralJob, host: str, root: Path) -> bool:
    """Made by apply on this host from a file of this directory."""
    if not made_by_apply(job) or job.payload.get("host") != host:
        return False
    job_file = job.payload.get("job_file")
    return isinstance(job_file, str) and Path(job_file).parent.resolve() == root


def _check_alerts(job: FileJob, mail_domain: str | None) -> None:
    """What a job file may say and the central alerts cannot hold, refused by name rather
    than dropped: an alert that silently never comes is worse than an error."""
    local = [a for a in job.alerts.email if "@" not in a]
    if local and not mail_domain:
        raise errors.ValidationError(
            f"local mailbox {local[0]!r} (cron's MAILTO) needs a mail domain to be mailed "
            "from the central store: give a user@host address or --mail-domain",
            field="alerts.email",
        )
    if len(job.alerts.webhook) > 1:
        raise errors.ValidationError(
            "the central store keeps one webhook per job: give one URL", field="alerts.webhook"
        )


def _entry(
    job: FileJob,
    host: str,
    found: Central | None,
    now: datetime,
    mail_domain: str | None,
    names: Mapping[str, str],
) -> Entry:
    name = placement.central_name(job, host)
    _check_alerts(job, mail_domain)
    body = central_body(job, host, mail_domain, names)
    alerts = parse_alerts(body["alerts"]) if "alerts" in body else None
    if found is None:
        parse_job_request(body, now=now)  # the clock's say (an `at` already past), first
        return Entry(name, Action.created, job=job, body=body)
    current = found.job
    if not made_by_apply(current):
        raise errors.ValidationError(
            f"central job {name!r} exists and was not made by `schedctl apply`: rename one",
            field="name",
        )
    spec = parse_job_request(body, now=_EPOCH)
    want = _view(spec, spec.after)
    have = _view(current, found.after)
    if job.run_on.kind is RunOnKind.host_group:
        # every host of the group applies the same job: which one did last is no change
        want["payload"].pop("host", None)
        have["payload"].pop("host", None)
    want["alerts"] = alerts.to_dict() if alerts else None
    have["alerts"] = found.alerts.to_dict() if found.alerts else None
    want["status"] = _wanted_status(job, current)
    # a one-off that ran is done: neither enabled nor disabled changes anything about it
    completed = current.status is JobStatus.completed
    have["status"] = want["status"] if completed else current.status.value
    fields = _diff(have, want)
    if not fields:
        return Entry(name, Action.unchanged, job=job, current=current, body=body)
    # from a time of its own to `after` or back: the API changes neither in place
    kind_moved = "schedule" in fields and "after" in (
        fields["schedule"][0].get("kind"),
        fields["schedule"][1].get("kind"),
    )
    replace = (
        current.status is JobStatus.cancelled or kind_moved or any(k in fields for k in _FIXED)
    )
    update = {} if replace else _update_body(fields, body, parse_job_request(body, now=_EPOCH))
    if replace:
        parse_job_request(body, now=now)
    elif update:
        parse_job_patch(update, current, now=now)
    return Entry(
        name, Action.changed, job=job, current=current, body=body, update=update,
        fields=fields, replace=replace,
    )  # fmt: skip


def _wanted_status(job: FileJob, current: CentralJob) -> str:
    """`enabled = false` is the declarative off: paused. `enabled = true` (or no key) makes
    active only a job apply itself paused (its payload says `disabled`); an operator's
    pause (`job pause`) survives every apply, until the operator resumes it."""
    if not job.enabled:
        return JobStatus.paused.value
    paused_by_apply = (
        isinstance(current.payload, dict) and current.payload.get(placement.DISABLED_KEY) is True
    )
    if current.status is JobStatus.paused and not paused_by_apply:
        return JobStatus.paused.value
    return JobStatus.active.value


def _view(job: CentralJob | JobSpec, after: Iterable[str]) -> dict[str, Any]:
    """The fields apply compares, in the shape `job show -o json` prints them, and the
    names of its upstream jobs (`after`)."""
    schedule = schedule_to_dict(job.schedule)
    schedule.pop("anchor", None)  # a job file's `every` has none: it counts from its create
    return {
        "schedule": schedule,
        "after": sorted(after),
        "target": job.target.to_dict(),
        "payload": dict(job.payload) if isinstance(job.payload, dict) else job.payload,
        "retry": job.retry.to_dict(),
        "misfire_policy": job.misfire_policy.value,
        "grace": job.grace_seconds,
        "window": job.window_seconds,
        "max_concurrency": job.max_concurrency or None,
        "timeout": job.timeout_seconds or None,
        "metrics": job.metrics,
        "start": _utc(job.start_at),
        "end": _utc(job.end_at),
        **job.run.to_dict(),
    }


def _utc(instant: datetime | None) -> str | None:
    return instant.astimezone(UTC).isoformat() if instant is not None else None


def _diff(have: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    fields: dict[str, tuple[Any, Any]] = {}
    for key, new in want.items():
        old = have.get(key)
        if key == "payload" and isinstance(old, dict) and isinstance(new, dict):
            for sub in sorted(set(old) | set(new)):
                if old.get(sub) != new.get(sub):
                    fields[f"payload.{sub}"] = (old.get(sub), new.get(sub))
        elif old != new:
            fields[key] = (old, new)
    return fields


def _update_body(
    fields: Mapping[str, Any], body: Mapping[str, Any], spec: JobSpec
) -> dict[str, Any]:
    """The partial body `job update` takes for the differing central fields (status and
    alerts are set by their own calls)."""
    update: dict[str, Any] = {}
    if "schedule" in fields:
        update["schedule"] = body["schedule"]
    if "after" in fields:
        update["after"] = body["after"]
    if "target" in fields:
        update["target"] = body["target"]
    if any(k.startswith("payload") for k in fields):
        update["payload"] = body["payload"]
    if "retry" in fields:
        update["retry"] = {
            "max_attempts": spec.retry.max_attempts,
            "base_delay": spec.retry.base_delay_seconds,
            "max_delay": spec.retry.max_delay_seconds,
        }
    if "misfire_policy" in fields:
        update["misfire_policy"] = spec.misfire_policy.value
    for key in ("grace", "window", "timeout"):
        if key in fields:
            update[key] = getattr(spec, f"{key}_seconds")
    if "max_concurrency" in fields:
        update["max_concurrency"] = spec.max_concurrency or None
    if "metrics" in fields:
        update["metrics"] = spec.metrics
    update.update({k: v for k, v in spec.run.to_dict().items() if k in fields})
    return update


def _problem(job: FileJob, index: int, exc: errors.ValidationError) -> Problem:
    """A refusal of the central store, located at the file's key."""
    field_name = exc.field or "name"
    key = _FILE_KEYS.get(field_name, field_name.split(".")[0])
    message = str(exc)
    if message.startswith(f"{field_name}: "):
        message = message[len(field_name) + 2 :]
    line: int | None = job.line
    try:
        lines = key_lines(job.path.read_text(encoding="utf-8"))
        line = locate(lines, ("job", index, key)) or job.line
    except (OSError, UnicodeDecodeError):
        pass  # the table's line is still right
    return Problem(str(job.path), line, f"job.{key}", message, job.name)


# -- reading and writing the store -----------------------------------------------------


def read_central(scheduler: Jobs, tenant: str) -> list[Central]:
    """The tenant's jobs (not deleted), with the alert settings of those apply made."""
    found: list[Central] = []
    cursor: str | None = None
    for _ in range(MAX_CENTRAL_PAGES):
        page = scheduler.list_jobs(tenant, limit=1000, cursor=cursor)
        for job in page.items:
            alerts = scheduler.get_alerts(tenant, job.job_id) if made_by_apply(job) else None
            after: tuple[str, ...] = ()
            if made_by_apply(job) and isinstance(job.schedule, AfterSchedule):
                upstream = scheduler.job_dependencies(job.job_id, tenant)["upstream"]
                after = tuple(str(u["name"]) for u in upstream)
            found.append(Central(job, alerts, after))
        cursor = page.next_cursor
        if not cursor:
            return found
    raise errors.ValidationError(
        f"the tenant has more than {MAX_CENTRAL_PAGES} pages of jobs", field="tenant"
    )


def check_host_scope(plan: Plan, scope: HostScope) -> None:
    """Before anything is written over the API with a host token: each write of the plan is
    one the token may make (schedctl.domain.host_scope), else Forbidden naming the job, so a
    refusal changes nothing rather than stopping half-way."""
    for entry in plan.entries:
        try:
            if entry.action is Action.removed or entry.replace:
                assert entry.current is not None
                if not scope.owns_job(entry.current):
                    raise errors.Forbidden("is not a job of this host", field="name")
            if entry.action is Action.created or entry.replace:
                scope.check_body(entry.body)
            elif entry.action is Action.changed and entry.update:
                scope.check_body(entry.update, entry.current)
        except errors.Forbidden as exc:
            raise errors.Forbidden(
                f"job {entry.name!r}: the host token of {scope.host} may not write it: {exc}",
                field=exc.field,
            ) from None


def execute(scheduler: Jobs, tenant: str, plan: Plan, *, actor: str) -> None:
    """Make the plan so, entry by entry, through the service (validated and audited there),
    upstream jobs before the jobs that run after them. A job that runs after a replaced
    one (deleted and created again, a new id) is pointed at the new one."""
    replaced: set[str] = set()
    for entry in plan.entries:
        after = (entry.body or {}).get("after") or []
        if (
            entry.action in (Action.changed, Action.unchanged)
            and not entry.replace
            and "after" not in entry.update
            and replaced.intersection(after)
        ):
            assert entry.current is not None
            scheduler.update_job(entry.current.job_id, {"after": after}, tenant, actor=actor)
        if entry.replace:
            replaced.add(entry.name)
        if entry.action is Action.removed or entry.replace:
            assert entry.current is not None
            scheduler.delete_job(entry.current.job_id, tenant, actor=actor)
        if entry.action is Action.created or entry.replace:
            assert entry.body is not None and entry.job is not None
            job, _ = scheduler.create_job(tenant, entry.body, actor=actor)
            # a replaced job keeps an operator's pause as a changed one does
            wanted = (
                _wanted_status(entry.job, entry.current)
                if entry.current is not None and entry.current.status is JobStatus.paused
                else JobStatus.active.value
            )
            if not entry.job.enabled or wanted == JobStatus.paused.value:
                scheduler.pause_job(job.job_id, tenant, actor=actor)
        elif entry.action is Action.changed:
            _change(scheduler, tenant, entry, actor)


def _change(scheduler: Jobs, tenant: str, entry: Entry, actor: str) -> None:
    assert entry.current is not None and entry.body is not None and entry.job is not None
    job_id = entry.current.job_id
    if entry.update:
        scheduler.update_job(job_id, entry.update, tenant, actor=actor)
    if "alerts" in entry.fields:
        scheduler.set_alerts(tenant, entry.body.get("alerts"), job_id)
    if "status" in entry.fields:
        if entry.job.enabled:
            scheduler.resume_job(job_id, tenant, actor=actor)
        else:
            scheduler.pause_job(job_id, tenant, actor=actor)
