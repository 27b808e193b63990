"""Owns the web console's tenant-scoped reads (scheduled_d.api.ui): the job search, a job's
runs in a time range (its timeline), its recent alerts, the tenant's lateness and failing
jobs, and its queues and live workers.

Every read takes the tenant id and filters by it: the console never shows another tenant's
rows. Each is bounded (a page, a time range with a row cap) and walks an index: the job
search ix_jobs_tenant (tenant_id, job_id) in keyset order, or ix_job_names_name_trgm for a
name (Postgres, 0023: on job_names, kept by triggers on jobs), a job's runs pk_runs (job_id,
scheduled_at), the tenant's lateness ix_jobs_tenant_status, its failing jobs
ix_runs_tenant_failed (0021), its queues ix_queue_messages_ready and its workers pk_workers.
The lateness percentiles read the runs table's newest day partitions only (Postgres prunes
by scheduled_at), capped at MAX_RECENT_RUNS rows, and on Postgres the database takes them
(reading and converting 5,000 rows' times was most of the late page's time).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, extract, func, literal_column, select

from schedctl.core import errors, limits
from schedctl.domain.alerts.model import loads as load_alerts
from schedctl.domain.models import JobStatus, Page, Run, RunStatus
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.cursors import check_page_limit, decode_cursor, encode_cursor
from schedctl.storage.db.rows import job_from_row, run_from_row
from schedctl.storage.db.store import Store

log = logging.getLogger(__name__)

# the rows one page may read to draw a timeline or to measure lateness: a bound on the
# work per page view whatever the tenant's size
MAX_TIMELINE_RUNS = 500
MAX_RECENT_RUNS = 5_000
MAX_FAILING = 100
MAX_NO_SUCCESS_JOBS = 200
MAX_ALERTS_SHOWN = 20
MAX_QUERY_LENGTH = 200
LATE_SLACK = timedelta(hours=1)
_HEX = frozenset("0123456789abcdef")
_FAILED = (RunStatus.failed.value, RunStatus.dead.value, RunStatus.lost.value)
# constants of the code (never input), written into the statement
_FAILED_LITERAL = schema.runs.c.status.in_([literal_column(f"'{value}'") for value in _FAILED])


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def search_jobs(
    store: Store,
    tenant_id: str,
    *,
    name: str | None = None,
    id_prefix: str | None = None,
    status: JobStatus | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> Page:
    """The tenant's jobs in id (creation) order, filtered by a name substring (case
    insensitive), an id prefix (hex) and a status; deleted jobs only when asked for by
    status. The cursor is the last id shown (keyset: no page shifts or repeats)."""
    limit = check_page_limit(limit)
    j = schema.jobs
    query = select(j).where(j.c.tenant_id == tenant_id).order_by(j.c.job_id).limit(limit + 1)
    if name:
        if len(name) > MAX_QUERY_LENGTH or any(ord(c) < 32 for c in name):
            raise errors.ValidationError(
                f"must be at most {MAX_QUERY_LENGTH} printable characters", field="q"
            )
        # job_names, not jobs.name: the trigram index lives there (0023)
        n = schema.job_names
        query = query.join(n, n.c.job_id == j.c.job_id).where(
            n.c.tenant_id == tenant_id,
            n.c.name.ilike(f"%{_like_escape(name)}%", escape="\\"),
        )
    if id_prefix:
        prefix = id_prefix.lower()
        if len(prefix) > 40 or not set(prefix) <= _HEX:
            raise errors.ValidationError(
                f"must be hexadecimal digits (a job id's start), got {id_prefix[:40]!r}",
                field="id",
            )
        # a range of the index, not LIKE: ids are lowercase hex, "g" sorts after "f"
        query = query.where(j.c.job_id >= prefix, j.c.job_id < prefix + "g")
    if status is not None:
        query = query.where(j.c.status == status.value)
    else:
        query = query.where(j.c.status != JobStatus.deleted.value)
    if cursor:
        (after,) = decode_cursor(cursor, 1)
        if len(after) > 40 or not set(after) <= _HEX:
            raise errors.ValidationError("not a cursor this server issued", field="cursor")
        query = query.where(j.c.job_id > after)
    with store.read() as connection:
        rows = connection.execute(query).mappings().all()
    items = tuple(job_from_row(r) for r in rows[:limit])
    next_cursor = encode_cursor(items[-1].job_id) if len(rows) > limit else None
    return Page(items, next_cursor)


def runs_between(store: Store, job_id: str, start: datetime, end: datetime) -> list[Run]:
    """A job's runs scheduled in [start, end), oldest first, at most MAX_TIMELINE_RUNS (the
    newest of them). The caller has checked the job is the tenant's."""
    r = schema.runs
    query = (
        select(r)
        .where(r.c.job_id == job_id, r.c.scheduled_at >= start, r.c.scheduled_at < end)
        .order_by(r.c.scheduled_at.desc())
        .limit(MAX_TIMELINE_RUNS)
    )
    with store.read() as connection:
        rows = connection.execute(query).mappings().all()
    return [run_from_row(row) for row in reversed(rows)]


def job_alerts(store: Store, tenant_id: str, job_id: str) -> list[dict[str, Any]]:
    """The job's newest alerts (kind, channel, status, when; never their body)."""
    a = schema.alerts
    query = (
        select(
            a.c.id,
            a.c.kind,
            a.c.channel,
            a.c.status,
            a.c.scheduled_at,
            a.c.created_at,
            a.c.delivered_at,
            a.c.last_error,
        )
        .where(a.c.tenant_id == tenant_id, a.c.job_id == job_id)
        .order_by(a.c.id.desc())
        .limit(MAX_ALERTS_SHOWN)
    )
    with store.read() as connection:
        return [dict(row._mapping) for row in connection.execute(query)]


@dataclass(frozen=True)
class FailingJob:
    job_id: str
    name: str
    failures: int
    last_failure_at: datetime
    last_status: str


@dataclass(frozen=True)
class SilentJob:
    """A job whose alerts ask for a success every `window` and that has none in it."""

    job_id: str
    name: str
    window: timedelta
    last_success_at: datetime | None


@dataclass(frozen=True)
class Lateness:
    at: datetime  # the database's now
    oldest_due_at: datetime | None  # the tenant's oldest due, unclaimed run
    seconds: float  # now - oldest_due_at; 0 when nothing is due
    due: int  # the tenant's active jobs due and not claimed
    p99_seconds: float | None  # of the runs dispatched in the last `window`
    p50_seconds: float | None
    measured: int  # runs the percentiles are of
    window: timedelta
    failing: tuple[FailingJob, ...]
    silent: tuple[SilentJob, ...]


def lateness(store: Store, tenant_id: str, *, window: timedelta = timedelta(hours=1)) -> Lateness:
    """Lateness now (the tenant's oldest due, unclaimed run), its p50/p99 over the runs
    dispatched in the last `window` (dispatch time minus due time; of a sample of at most
    MAX_RECENT_RUNS of them, in the order the database reads them), the jobs with failed,
    lost or dead runs in the last 24 hours, and the jobs with no success in their
    no_success alert window."""
    j, r = schema.jobs, schema.runs
    with store.read() as connection:
        now = db_now(connection)
        oldest, due = connection.execute(
            select(func.min(j.c.next_fire_at), func.count()).where(
                j.c.tenant_id == tenant_id,
                j.c.status == JobStatus.active.value,
                j.c.next_fire_at <= now,
            )
        ).one()
        p50, p99, measured = _recent_lateness(connection, tenant_id, now, window)
        failed_runs = connection.execute(
            select(r.c.job_id, func.count(), func.max(r.c.scheduled_at))
            .where(
                r.c.tenant_id == tenant_id,
                r.c.scheduled_at >= now - timedelta(days=1),
                # the statuses as literals, as in ix_runs_tenant_failed's predicate: a
                # generic plan (a statement psycopg prepared) cannot prove bound values
                # imply it, and would read the day's partitions again
                _FAILED_LITERAL,
            )
            .group_by(r.c.job_id)
            .order_by(func.max(r.c.scheduled_at).desc())
            .limit(MAX_FAILING)
        ).all()
        # names for the page's jobs only (a join named every failed run's job)
        names = dict(
            connection.execute(
                select(j.c.job_id, j.c.name).where(
                    j.c.job_id.in_([row[0] for row in failed_runs]), j.c.tenant_id == tenant_id
                )
            ).all()
        )
        failing_rows = [
            (job_id, names.get(job_id, job_id), count, last_at)
            for job_id, count, last_at in failed_runs
        ]
        # each failing job's latest run of the day, in one read of the same day partitions
        # (a query per job probed every day partition's index, once per failing job)
        latest: dict[str, tuple[datetime, str]] = {}
        if failing_rows:
            for job_id, at, run_status in connection.execute(
                select(r.c.job_id, r.c.scheduled_at, r.c.status).where(
                    r.c.job_id.in_([row[0] for row in failing_rows]),
                    r.c.scheduled_at >= now - timedelta(days=1),
                )
            ):
                if job_id not in latest or at > latest[job_id][0]:
                    latest[job_id] = (at, str(run_status))
        failing = [
            FailingJob(job_id, name, int(count), last_at, latest.get(job_id, (last_at, "?"))[1])
            for job_id, name, count, last_at in failing_rows
        ]
        silent = _silent_jobs(connection, tenant_id, now)
    return Lateness(
        at=now,
        oldest_due_at=oldest,
        seconds=max(0.0, (now - oldest).total_seconds()) if oldest is not None else 0.0,
        due=int(due or 0),
        p99_seconds=p99,
        p50_seconds=p50,
        measured=measured,
        window=window,
        failing=tuple(failing),
        silent=tuple(silent),
    )


def _recent_lateness(
    connection: Any, tenant_id: str, now: datetime, window: timedelta
) -> tuple[float | None, float | None, int]:
    """The p50 and p99 lateness (dispatch time minus due time, at least 0) of a sample of
    at most MAX_RECENT_RUNS of the tenant's runs dispatched in the last `window`, and the
    sample's size. On Postgres the database takes the percentiles (percentile_disc: the
    nearest rank, as _nearest_rank): reading the 5,000 rows' three times and converting
    them was most of the late page's time."""
    r = schema.runs
    recent = (
        r.c.tenant_id == tenant_id,
        # a run is dispatched after it is due: a bound on scheduled_at lets Postgres read
        # the newest day partition(s) only (runs later than an hour more are left out of
        # the percentiles; "late now" still shows them)
        r.c.scheduled_at >= now - window - LATE_SLACK,
        r.c.dispatched_at >= now - window,
    )
    if connection.dialect.name == "postgresql":
        late = extract(
            "epoch", r.c.dispatched_at - func.coalesce(r.c.fire_at, r.c.scheduled_at)
        ).label("late")
        rows = select(late).where(*recent).limit(MAX_RECENT_RUNS).subquery()
        p50, p99, count = connection.execute(
            select(
                func.percentile_disc(0.5).within_group(rows.c.late),
                func.percentile_disc(0.99).within_group(rows.c.late),
                func.count(),
            )
        ).one()
        return (
            None if p50 is None else max(0.0, float(p50)),
            None if p99 is None else max(0.0, float(p99)),
            int(count),
        )
    lates = sorted(
        max(0.0, (dispatched - (fire or scheduled)).total_seconds())
        for scheduled, fire, dispatched in connection.execute(
            select(r.c.scheduled_at, r.c.fire_at, r.c.dispatched_at)
            .where(*recent)
            .limit(MAX_RECENT_RUNS)
        )
        if dispatched is not None
    )
    return _nearest_rank(lates, 50), _nearest_rank(lates, 99), len(lates)


def _nearest_rank(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    index = max(0, -(-len(ordered) * q // 100) - 1)
    return ordered[int(index)]


def _silent_jobs(connection: Any, tenant_id: str, now: datetime) -> list[SilentJob]:
    """Jobs with their own no_success alert setting and no success within it (a tenant
    default's window is not expanded over every job here: the alert lane checks those)."""
    s, j, r = schema.alert_settings, schema.jobs, schema.runs
    rows = connection.execute(
        select(s.c.job_id, s.c.config, j.c.name)
        .select_from(s.join(j, j.c.job_id == s.c.job_id))
        .where(
            s.c.tenant_id == tenant_id,
            j.c.tenant_id == tenant_id,
            j.c.status == JobStatus.active.value,
        )
        .order_by(s.c.job_id)
        .limit(MAX_NO_SUCCESS_JOBS)
    ).all()
    silent = []
    for job_id, config_text, name in rows:
        try:
            config = load_alerts(config_text)
        except (ValueError, errors.SchedError):  # unreadable settings: no window to check
            continue
        if config.no_success is None:
            continue
        last = connection.execute(
            select(func.max(r.c.scheduled_at)).where(
                r.c.job_id == job_id, r.c.status == RunStatus.succeeded.value
            )
        ).scalar()
        if last is None or now - last > config.no_success:
            silent.append(SilentJob(job_id, name, config.no_success, last))
    return silent


@dataclass(frozen=True)
class QueueView:
    queue: str
    ready: int
    delayed: int
    leased: int
    oldest_ready_seconds: float
    workers: tuple[str, ...]

    @property
    def unserved(self) -> bool:
        """Ready runs and no live worker: they wait until someone starts one."""
        return self.ready > 0 and not self.workers


def queues(store: Store, tenant_id: str) -> tuple[datetime, list[QueueView]]:
    """The tenant's queues (those with messages or live workers), by name: ready, delayed
    and leased counts, the oldest ready message's age, and the live workers."""
    m, w = schema.queue_messages, schema.workers
    with store.read() as connection:
        now = db_now(connection)
        unleased = m.c.leased_until.is_(None)
        ready = and_(unleased, m.c.available_at <= now)
        rows = connection.execute(
            select(
                m.c.queue,
                func.count().filter(ready),
                func.count().filter(and_(unleased, m.c.available_at > now)),
                func.count().filter(m.c.leased_until.is_not(None)),
                func.min(m.c.available_at).filter(ready),
            )
            .where(m.c.tenant_id == tenant_id)
            .group_by(m.c.queue)
        ).all()
        live = connection.execute(
            select(w.c.queue, w.c.worker)
            .where(w.c.tenant_id == tenant_id, w.c.live_until > now)
            .order_by(w.c.queue, w.c.worker)
        ).all()
    workers: dict[str, list[str]] = {}
    for queue, worker in live:
        workers.setdefault(str(queue), []).append(str(worker))
    views = {
        str(queue): QueueView(
            queue=str(queue),
            ready=int(r or 0),
            delayed=int(d or 0),
            leased=int(le or 0),
            oldest_ready_seconds=max(0.0, (now - oldest).total_seconds()) if oldest else 0.0,
            workers=tuple(workers.get(str(queue), ())),
        )
        for queue, r, d, le, oldest in rows
    }
    for queue, names in workers.items():
        views.setdefault(queue, QueueView(queue, 0, 0, 0, 0.0, tuple(names)))
    return now, [views[name] for name in sorted(views)]


def dead_letter_id(text: str) -> int:
    """A dead letter's id from a path: NotFound (not a 422) for anything that is not one,
    as for an id that does not exist."""
    try:
        return limits.cursor_id(text)
    except errors.SchedError:
        raise errors.NotFound(f"no dead letter {text[:40]!r}", field="id") from None


def dumps_settings(config: Any) -> str:
    """Alert settings as shown on a job's page."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)
