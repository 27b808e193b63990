"""Owns the alerts tables: alert settings per job and per tenant, queueing alerts in the
transaction that settles a run (deduplicated per run, kind and channel), the no-success
check, and leasing and settling alert rows for the relay's alert lane."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, func, select, update
from sqlalchemy.engine import Connection

from schedctl.core import errors
from schedctl.core.backoff import backoff_delay
from schedctl.domain.alerts import metrics
from schedctl.domain.alerts.model import (
    COMMAND,
    NO_SUCCESS,
    AlertConfig,
    alert_body,
    dumps,
    loads,
)
from schedctl.domain.models import JobStatus, RunStatus
from schedctl.storage.backend.dialect import dialect_of
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store

log = logging.getLogger("schedctl.alerts")

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
MAX_ALERT_ATTEMPTS = 12  # about an hour of backoff; then the alert is given up (failed)
RETRY_BASE_SECONDS = 5.0
RETRY_MAX_SECONDS = 600.0
NO_SUCCESS_BATCH = 1000  # jobs looked at per no-success check, bounded
TENANT_DEFAULT = ""  # alert_settings.job_id of a tenant's default
OUTPUT_LINES = 50  # of a failed attempt's output, in its alert
OUTPUT_CHARS = 8192  # at most, of those lines' end


@dataclass(frozen=True)
class Failure:
    """One failed attempt of a run, as settle saw it; dead when it was the last."""

    tenant_id: str
    job_id: str
    scheduled_at: datetime
    attempt: int
    error: str | None
    dead: bool
    target_type: str
    target: str
    # what the attempt recorded, for the alert's text (defaults: a caller that has none)
    max_attempts: int | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    exit_code: int | None = None
    output_tail: str | None = None
    worker: str | None = None


@dataclass(frozen=True)
class JobContext:
    """What an alert says about its job besides ids: names, zone and where its command is."""

    name: str | None = None
    tenant_name: str | None = None
    timezone: str | None = None
    job_file: str | None = None  # a host job's file and the host that applied it
    job_file_job: str | None = None
    applied_by: str | None = None


@dataclass(frozen=True)
class AlertRow:
    id: int
    tenant_id: str
    job_id: str
    kind: str
    channel: str
    destination: str
    body: dict[str, Any]
    attempt: int


# -- settings --------------------------------------------------------------------------


def set_settings(store: Store, tenant_id: str, job_id: str, config: AlertConfig | None) -> None:
    """Set (or with None clear) the alert settings of a job, or of the tenant's default
    when job_id is ''."""
    s = schema.alert_settings
    with store.tx() as connection:
        connection.execute(delete(s).where(s.c.tenant_id == tenant_id, s.c.job_id == job_id))
        if config is not None:
            connection.execute(
                s.insert().values(
                    tenant_id=tenant_id,
                    job_id=job_id,
                    config=dumps(config),
                    updated_at=db_now(connection),
                )
            )


def get_settings(store: Store, tenant_id: str, job_id: str) -> AlertConfig | None:
    """A job's own settings ('' for the tenant default), None when it has none."""
    s = schema.alert_settings
    with store.tx() as connection:
        text = connection.execute(
            select(s.c.config).where(s.c.tenant_id == tenant_id, s.c.job_id == job_id)
        ).scalar()
    return loads(text) if text is not None else None


def _effective(
    connection: Connection, pairs: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], AlertConfig]:
    """The settings in force for each (tenant, job): the job's own, else its tenant's."""
    pairs = set(pairs)
    tenants = {t for t, _ in pairs}
    jobs = {j for _, j in pairs} | {TENANT_DEFAULT}
    s = schema.alert_settings
    found = {
        (row.tenant_id, row.job_id): _readable(row)
        for row in connection.execute(
            select(s.c.tenant_id, s.c.job_id, s.c.config).where(
                s.c.tenant_id.in_(tenants), s.c.job_id.in_(jobs)
            )
        )
    }
    result: dict[tuple[str, str], AlertConfig] = {}
    for tenant, job in pairs:
        # a job's unreadable settings: none (never its tenant's in their place)
        config = (
            found[(tenant, job)] if (tenant, job) in found else found.get((tenant, TENANT_DEFAULT))
        )
        if config is not None:
            result[(tenant, job)] = config
    return result


def _readable(row: Any) -> AlertConfig | None:
    """A settings row's AlertConfig; None (logged) when it cannot be read: one tenant's bad
    row must not fail the settling of every run in a batch or every no-success check."""
    try:
        return loads(row.config)
    except (ValueError, errors.SchedError) as exc:  # JSONDecodeError is a ValueError
        log.error(
            "alert settings of tenant %s job %r cannot be read, ignored: %s",
            row.tenant_id,
            row.job_id,
            exc,
        )
        return None


def _contexts(connection: Connection, job_ids: set[str]) -> dict[str, JobContext]:
    """Each job's JobContext (an operator reads "backup@web1", not a job id): its name,
    its tenant's name, its schedule's zone and, for a host's job file job, where its
    command is defined (one query for the batch)."""
    if not job_ids:
        return {}
    j, t = schema.jobs, schema.tenants
    rows = connection.execute(
        select(j.c.job_id, j.c.name, j.c.schedule, j.c.payload, j.c.target_type, t.c.name)
        .join(t, t.c.tenant_id == j.c.tenant_id)
        .where(j.c.job_id.in_(sorted(job_ids)))
    ).all()
    found: dict[str, JobContext] = {}
    for job_id, name, schedule, payload, target_type, tenant_name in rows:
        zone = None
        try:
            zone = json.loads(schedule).get("timezone")
        except (ValueError, AttributeError):
            pass
        reference: dict[str, Any] = {}
        if target_type == "queue":
            reference = _job_file_reference(payload)
        found[job_id] = JobContext(
            name=name,
            tenant_name=tenant_name,
            timezone=zone if isinstance(zone, str) else None,
            job_file=_str_or_none(reference.get("job_file")),
            job_file_job=_str_or_none(reference.get("job")),
            applied_by=_str_or_none(reference.get("host")),
        )
    return found


def _job_file_reference(stored: str) -> dict[str, Any]:
    """A job file job's payload ({"job_file", "job", "host"}: a reference, never a command),
    else {}. Any other payload is the tenant's data and is not looked into (nor mailed)."""
    from schedctl.storage.jobs.payloads import decode_payload  # here: it loads cryptography

    try:
        value = decode_payload(stored)
    except Exception:  # an alert must be queued even when this process cannot decrypt
        return {}
    if isinstance(value, dict) and isinstance(value.get("job_file"), str):
        return {k: value.get(k) for k in ("job_file", "job", "host")}
    return {}


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _failure_details(f: Failure, context: JobContext) -> dict[str, Any]:
    """The attempt's facts for the alert's text: who ran it where, when and with what."""
    host = None
    if f.worker:
        host = f.worker.split(":", 1)[0]  # a worker's owner name is host:pid:random
    if context.job_file is not None:
        command = (
            f"defined on the host in {context.job_file}"
            + (f" (job {context.job_file_job})" if context.job_file_job else "")
            + (f", applied from {context.applied_by}" if context.applied_by else "")
        )
    elif f.target_type == "queue":
        command = f"the command of the workers of queue {f.target}"
    else:
        command = f"a {f.target_type} delivery (see schedctl job show)"
    return {
        "tenant_name": context.tenant_name,
        "timezone": context.timezone,
        "host": host,
        "worker": f.worker,
        "command": command,
        "exit_code": f.exit_code,
        "max_attempts": f.max_attempts,
        "started_at": None if f.started_at is None else f.started_at.isoformat(),
        "finished_at": None if f.finished_at is None else f.finished_at.isoformat(),
        "output_tail": _last_lines(f.output_tail, OUTPUT_LINES),
    }


def _last_lines(text: str | None, count: int) -> str | None:
    """The last `count` lines of `text`, and no more than OUTPUT_CHARS of their end (an
    alert row and a mail stay small whatever one line's length)."""
    if not text:
        return None
    return "\n".join(text.splitlines()[-count:])[-OUTPUT_CHARS:]


# -- queueing --------------------------------------------------------------------------


def _insert_ignore(connection: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert alert rows, skipping any whose (job, scheduled_at, kind, run_attempt,
    channel) exists."""
    if not rows:
        return
    dialect = dialect_of(connection)
    for row in rows:  # one at a time: executemany with ON CONFLICT is dialect-fussy
        connection.execute(dialect.insert(schema.alerts).values(**row).on_conflict_do_nothing())


def _rows(
    config: AlertConfig,
    *,
    kind: str,
    tenant_id: str,
    job_id: str,
    scheduled_at: datetime,
    body: dict[str, Any],
    queue: str | None,
    now: datetime,
    run_attempt: int = 0,
) -> list[dict[str, Any]]:
    rows = []
    for channel, destination in config.channels:
        if channel == COMMAND:
            if queue is None:  # only a queue job has a host (worker) to run a command on
                continue
            destination = queue
        rows.append(
            {
                "tenant_id": tenant_id,
                "job_id": job_id,
                "scheduled_at": scheduled_at,
                "kind": kind,
                "run_attempt": run_attempt,  # see queue_for_failures
                "channel": channel,
                "destination": destination,
                "body": json.dumps(body, sort_keys=True),
                "status": PENDING,
                "attempt": 0,
                "available_at": now,
                "created_at": now,
            }
        )
    return rows


def queue_for_failures(
    connection: Connection, failures: Sequence[Failure], now: datetime
) -> dict[str, JobContext]:
    """Queue the alerts of failed attempts and dead letters inside the settling transaction
    (the settle hook): a dead letter alerts when `on` has dead_letter, every failed attempt
    when it has failure. A run's final failure is one alert per channel, whatever `on`
    lists: with both, the dead letter's (marked "final", keyed by the attempt so a replay
    that dies again says so once more). Deduplicated: settling again adds nothing.
    Returns the context (names) of the jobs looked up, dead letters' always (their log
    line names them)."""
    if not failures:
        return {}
    configs = _effective(connection, ((f.tenant_id, f.job_id) for f in failures))
    contexts = _contexts(
        connection,
        {f.job_id for f in failures if f.dead or (f.tenant_id, f.job_id) in configs},
    )
    rows: list[dict[str, Any]] = []
    for f in failures:
        config = configs.get((f.tenant_id, f.job_id))
        if config is None:
            continue
        kinds = []
        both = f.dead and "dead_letter" in config.on and "failure" in config.on
        if f.dead and "dead_letter" in config.on:
            kinds.append("dead_letter")
        elif "failure" in config.on:
            kinds.append("failure")
        queue = f.target if f.target_type == "queue" else None
        context = contexts.get(f.job_id, JobContext())
        for kind in kinds:
            body = alert_body(
                kind=kind,
                tenant_id=f.tenant_id,
                job_id=f.job_id,
                scheduled_at=f.scheduled_at,
                attempt=f.attempt,
                error=f.error,
                at=now,
                job_name=context.name,
            )
            body.update(_failure_details(f, context), final=f.dead)
            if kind == "dead_letter":
                run_attempt = f.attempt if both else 0
            else:
                run_attempt = f.attempt  # a failure alert is one per attempt
            rows += _rows(
                config,
                kind=kind,
                tenant_id=f.tenant_id,
                job_id=f.job_id,
                scheduled_at=f.scheduled_at,
                body=body,
                queue=queue,
                now=now,
                run_attempt=run_attempt,
            )
    _insert_ignore(connection, rows)
    return contexts


def check_no_success(store: Store, *, limit: int = NO_SUCCESS_BATCH) -> int:
    """Queue a no_success alert for each active job with a no_success setting whose last
    success (or, never having succeeded, its creation) is older than the setting: once per
    episode, the episode being keyed by its start. Returns the alerts queued."""
    j, s, r = schema.jobs, schema.alert_settings, schema.runs
    queued = 0
    with store.tx() as connection:
        now = db_now(connection)
        settings = connection.execute(select(s.c.tenant_id, s.c.job_id, s.c.config).limit(limit))
        own: dict[str, AlertConfig] = {}
        defaults: dict[str, AlertConfig] = {}
        for row in settings:
            config = _readable(row)
            if config is None:
                continue
            if row.job_id == TENANT_DEFAULT:
                defaults[row.tenant_id] = config
            else:
                own[row.job_id] = config
        candidates = select(
            j.c.job_id, j.c.tenant_id, j.c.name, j.c.created_at, j.c.target_type, j.c.target
        )
        candidates = candidates.where(j.c.status == JobStatus.active.value)
        wanted = [jid for jid, c in own.items() if c.no_success is not None]
        tenants = [t for t, c in defaults.items() if c.no_success is not None]
        if not wanted and not tenants:
            return 0
        candidates = candidates.where(j.c.job_id.in_(wanted) | j.c.tenant_id.in_(tenants))
        for job in connection.execute(candidates.order_by(j.c.job_id).limit(limit)).all():
            found = own.get(job.job_id) or defaults.get(job.tenant_id)
            if found is None or found.no_success is None:
                continue
            last = connection.execute(
                select(func.max(r.c.finished_at)).where(
                    r.c.job_id == job.job_id, r.c.status == RunStatus.succeeded.value
                )
            ).scalar()
            start = last or job.created_at
            if now - start < found.no_success:
                continue
            body = alert_body(
                kind=NO_SUCCESS,
                tenant_id=job.tenant_id,
                job_id=job.job_id,
                scheduled_at=start,
                attempt=None,
                error=f"no successful run since {start.isoformat()}",
                at=now,
                job_name=job.name,
            )
            new = _rows(
                found,
                kind=NO_SUCCESS,
                tenant_id=job.tenant_id,
                job_id=job.job_id,
                scheduled_at=start,
                body=body,
                queue=job.target if job.target_type == "queue" else None,
                now=now,
            )
            before = _count(connection)
            _insert_ignore(connection, new)
            queued += _count(connection) - before
    return queued


def _count(connection: Connection) -> int:
    return int(connection.execute(select(func.count()).select_from(schema.alerts)).scalar() or 0)


def last_successes(store: Store) -> list[tuple[str, str, datetime]]:
    """(tenant name, job name, last success) of each active job with a no_success setting
    of its own (the metric's series: bounded by the jobs that asked for one)."""
    j, s, r, t = schema.jobs, schema.alert_settings, schema.runs, schema.tenants
    with store.tx() as connection:
        rows = connection.execute(
            select(t.c.name, j.c.name, func.max(r.c.finished_at))
            .join(t, t.c.tenant_id == j.c.tenant_id)
            .join(s, and_(s.c.job_id == j.c.job_id, s.c.tenant_id == j.c.tenant_id))
            .join(r, and_(r.c.job_id == j.c.job_id, r.c.status == RunStatus.succeeded.value))
            .where(j.c.status == JobStatus.active.value, s.c.config.like('%"no_success"%'))
            .group_by(t.c.name, j.c.job_id, j.c.name)
            .limit(NO_SUCCESS_BATCH)
        ).all()
    return [(t, jid, at) for t, jid, at in rows if at is not None]


# -- the alert lane --------------------------------------------------------------------


def claim(
    store: Store,
    channels: Sequence[str],
    owner: str,
    *,
    limit: int = 20,
    lease_seconds: float = 60.0,
    destination: str | None = None,
    tenant_id: str | None = None,
) -> list[AlertRow]:
    """Lease up to `limit` due pending alerts of `channels` (for a command: of one tenant's
    queue) to `owner` until the lease runs out; an expired lease makes them due again. An
    alert that has had all its attempts (each lease ran out: its sender stopped or died
    sending it) is given up here instead, with the reason: none is retried forever."""
    a = schema.alerts
    with store.tx() as connection:
        now = db_now(connection)
        query = select(a).where(
            a.c.status == PENDING, a.c.channel.in_(list(channels)), a.c.available_at <= now
        )
        if destination is not None:
            query = query.where(a.c.destination == destination)
        if tenant_id is not None:
            query = query.where(a.c.tenant_id == tenant_id)
        query = query.order_by(a.c.available_at, a.c.id).limit(limit)
        found = connection.execute(dialect_of(connection).lock(query, skip_locked=True)).all()
        rows = [row for row in found if row.attempt < MAX_ALERT_ATTEMPTS]
        for row in found:
            if row.attempt >= MAX_ALERT_ATTEMPTS:
                why = row.last_error or "no attempt ended (its sender stopped each time)"
                _give_up(connection, row.attempt, why, row)
        if not rows:
            return []
        connection.execute(
            update(a)
            .where(a.c.id.in_([row.id for row in rows]))
            .values(
                lease_owner=owner,
                attempt=a.c.attempt + 1,
                available_at=now + timedelta(seconds=lease_seconds),
            )
        )
    return [
        AlertRow(
            id=row.id,
            tenant_id=row.tenant_id,
            job_id=row.job_id,
            kind=row.kind,
            channel=row.channel,
            destination=row.destination,
            body=json.loads(row.body),
            attempt=row.attempt + 1,
        )
        for row in rows
    ]


def _give_up(
    connection: Connection, attempt: int, why: str, alert: Any, *where: ColumnElement[bool]
) -> None:
    """Record an alert given up (status failed) with its reason, and log it."""
    a = schema.alerts
    done = connection.execute(
        update(a)
        .where(a.c.id == alert.id, a.c.status == PENDING, *where)
        .values(status=FAILED, lease_owner=None, last_error=_stored(why))
    )
    if not done.rowcount:
        return  # no longer this sender's
    body = _body_of(alert)
    log.error(
        "alert given up after %d attempt(s): job %s of tenant %s kind=%s channel=%s: %s "
        "(job_id=%s tenant_id=%s)",
        attempt,
        named(_str_or_none(body.get("job_name")), alert.job_id),
        named(_str_or_none(body.get("tenant_name")), alert.tenant_id),
        alert.kind,
        alert.channel,
        why,
        alert.job_id,
        alert.tenant_id,
    )


def _body_of(alert: Any) -> dict[str, Any]:
    """An alert's body as a dict (an AlertRow's, or a row's stored JSON), {} if unreadable."""
    body = getattr(alert, "body", None)
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return {}
    return body if isinstance(body, dict) else {}


def _stored(error: str) -> str:
    """An error as last_error keeps it: its end, without NUL (no Postgres text holds one)."""
    return error[-2000:].replace("\0", "\ufffd")


def finish(
    store: Store, owner: str, alert: AlertRow, error: str | None, *, give_up: bool = False
) -> None:
    """Record how an attempt to send `alert` ended: delivered, retried after a backoff, or
    given up (after MAX_ALERT_ATTEMPTS, or at once with `give_up`: retrying cannot help).
    Ignored when the lease is no longer `owner`'s."""
    a = schema.alerts
    with store.tx() as connection:
        now = db_now(connection)
        where = (a.c.id == alert.id, a.c.lease_owner == owner, a.c.status == PENDING)
        if error is None:
            values: dict[str, Any] = {"status": DELIVERED, "delivered_at": now}
        elif give_up or alert.attempt >= MAX_ALERT_ATTEMPTS:
            _give_up(connection, alert.attempt, error, alert, a.c.lease_owner == owner)
            return
        else:
            delay = backoff_delay(alert.attempt, RETRY_BASE_SECONDS, RETRY_MAX_SECONDS, None)
            values = {
                "available_at": now + timedelta(seconds=delay),
                "last_error": _stored(error),
            }
        connection.execute(update(a).where(*where).values(lease_owner=None, **values))


def sent_last_hour(store: Store, tenant_ids: Iterable[str]) -> dict[str, int]:
    """Webhook and e-mail alerts delivered in the last hour, per tenant (the rate limit)."""
    tenants = set(tenant_ids)
    if not tenants:
        return {}
    a = schema.alerts
    with store.tx() as connection:
        since = db_now(connection) - timedelta(hours=1)
        rows = connection.execute(
            select(a.c.tenant_id, func.count())
            .where(
                a.c.tenant_id.in_(tenants),
                a.c.delivered_at >= since,
                a.c.status == DELIVERED,
                a.c.channel.in_(["webhook", "email"]),
            )
            .group_by(a.c.tenant_id)
        ).all()
    return {tenant: int(count) for tenant, count in rows}


def list_alerts(store: Store, tenant_id: str | None = None) -> list[dict[str, Any]]:
    """Every alert row (newest last), for the CLI and tests."""
    a = schema.alerts
    query = select(a).order_by(a.c.id)
    if tenant_id is not None:
        query = query.where(a.c.tenant_id == tenant_id)
    with store.tx() as connection:
        return [dict(row._mapping) for row in connection.execute(query)]


def count_failures(
    failures: Sequence[Failure],
    tenant_names: Mapping[str, str],
    contexts: Mapping[str, JobContext] | None = None,
) -> None:
    """Count failed attempts and dead letters per tenant (labelled with the tenant's name,
    `tenant_names` by job id; its id when the job is gone), and log each dead letter at
    WARNING (job and tenant by name with their ids, reason; never the payload)."""
    contexts = contexts or {}
    for f in failures:
        tenant = tenant_names.get(f.job_id, f.tenant_id)
        metrics.FAILURES.labels(tenant=tenant).inc()
        if f.dead:
            metrics.DEAD_LETTERS.labels(tenant=tenant).inc()
            context = contexts.get(f.job_id, JobContext())
            log.warning(
                "run dead-lettered: job %s of tenant %s, scheduled_at=%s attempts=%d "
                "reason=%s (job_id=%s tenant_id=%s)",
                named(context.name, f.job_id),
                named(context.tenant_name, f.tenant_id),
                f.scheduled_at.isoformat(),
                f.attempt,
                f.error,
                f.job_id,
                f.tenant_id,
            )


def named(name: str | None, fallback: str) -> str:
    """A name as a log line shows it (quoted: it is the tenant's text), else the id."""
    return repr(name) if name else fallback


def held_alert(store: Store, alert_id: int, owner: str, tenant_id: str) -> AlertRow | None:
    """The pending alert `alert_id` of the tenant while its lease is `owner`'s (an API
    worker settling the command alert it claimed), else None."""
    a = schema.alerts
    with store.read() as connection:
        row = connection.execute(
            select(a).where(
                a.c.id == alert_id,
                a.c.tenant_id == tenant_id,
                a.c.lease_owner == owner,
                a.c.status == PENDING,
            )
        ).first()
    if row is None:
        return None
    return AlertRow(
        id=row.id,
        tenant_id=row.tenant_id,
        job_id=row.job_id,
        kind=row.kind,
        channel=row.channel,
        destination=row.destination,
        body=json.loads(row.body),
        attempt=row.attempt,
    )
