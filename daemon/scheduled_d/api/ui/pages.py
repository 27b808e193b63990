"""Owns the web console's routes under /ui: sign in and out, the pages (jobs, a job, a run
and its live output, late and failing, dead letters, workers and queues, cluster) and the
actions (pause, resume, trigger, cancel; replay and purge a dead letter), each behind a
confirmation page and a POST with the CSRF token.

Every read and action goes through the tenant of the session (the same Scheduler and
repository calls as the REST API and the CLI, with the API's actor `token:ID` in the audit
log): another tenant's job, run or dead letter is 404, as one that does not exist. Query
parameters are read here, not by FastAPI, so a bad one is an error page naming it. Pages
are plain `def`s: FastAPI runs them in its thread pool, which suits the synchronous store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from schedctl.app.service import Scheduler
from schedctl.app.views import schedule_summary
from schedctl.core import errors, limits
from schedctl.domain.models import Job, JobStatus, Run, RunStatus
from schedctl.scheduling.schedules import CronSchedule, next_occurrence
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.pipeline.dead_letters import DeadLetter, DeadLetterRepo
from schedctl.storage.records import console as reads
from schedctl.storage.records import run_output
from schedctl.storage.records.alerts import get_settings
from schedctl.storage.records.status import read_database_status
from scheduled_d.api.auth import Caller, request_scheduler
from scheduled_d.api.routes.params import checked_job_id
from scheduled_d.api.ui import session

HERE = Path(__file__).parent
PAGE_SIZE = 50
RUNS_PAGE_SIZE = 25
NEXT_FIRES = 10
TIMELINE_HOURS = 24
MAX_TIMELINE_FIRES = 500
# the follow of a running run's output: how often the page asks again (console.js reads it)
FOLLOW_SECONDS = 2
MAX_FORM_BYTES = 16 * 1024
JOB_ACTIONS = ("pause", "resume", "trigger", "cancel")
LETTER_ACTIONS = ("replay", "purge")
_FINISHED = frozenset(
    {RunStatus.succeeded, RunStatus.failed, RunStatus.skipped, RunStatus.dead, RunStatus.lost}
)
_NAV = (
    ("jobs", "/ui/jobs", "Jobs"),
    ("late", "/ui/late", "Late & failing"),
    ("dead", "/ui/dead-letters", "Dead letters"),
    ("workers", "/ui/workers", "Workers & queues"),
    ("cluster", "/ui/cluster", "Cluster"),
)

templates = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    # everything a tenant wrote (names, errors, output) is escaped unless a template says
    # otherwise, and none does
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
router = APIRouter(prefix="/ui", include_in_schema=False)


# -- rendering ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Viewer:
    """The signed-in tenant, its CSRF token and the zone times are shown in."""

    caller: Caller
    csrf: str
    zone: ZoneInfo
    zone_name: str


def _render(
    request: Request, name: str, context: dict[str, Any], *, status: int = 200
) -> HTMLResponse:
    viewer: Viewer | None = context.get("viewer")
    html = templates.get_template(name).render(
        nav=_NAV,
        request_path=request.url.path,
        csrf_field=session.CSRF_FIELD,
        zones=_ZONE_CHOICES,
        fmt=_formatter(viewer.zone if viewer else ZoneInfo("UTC")),
        fmt_in=_format_in,
        instant=format_instant,
        ago=_ago,
        **context,
    )
    return session.secure_headers(HTMLResponse(html, status_code=status))  # type: ignore[return-value]


def _error_page(request: Request, exc: errors.SchedError, viewer: Viewer | None) -> Response:
    if isinstance(exc, errors.Unauthorized):
        return _to_signin(request)
    status = exc.http_status if exc.http_status < 500 or exc.http_status == 503 else 500
    message = exc.public_message if status != 500 else "internal error (see the server's log)"
    return _render(
        request,
        "error.html",
        {"viewer": viewer, "status": status, "message": message, "field": exc.field},
        status=status,
    )


def _to_signin(request: Request) -> Response:
    response = RedirectResponse("/ui/signin", status_code=303)
    return session.secure_headers(response)


def _formatter(zone: ZoneInfo) -> Callable[[datetime | None], str]:
    def fmt(value: datetime | None) -> str:
        return _format_in(value, zone)

    return fmt


def _format_in(value: datetime | None, zone: ZoneInfo | str) -> str:
    if value is None:
        return "-"
    if isinstance(zone, str):
        zone = ZoneInfo(zone)
    return value.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %Z")


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


_ZONE_CHOICES = (
    "UTC",
    "America/Los_Angeles",
    "America/New_York",
    "America/Sao_Paulo",
    "Europe/London",
    "Europe/Berlin",
    "Africa/Johannesburg",
    "Asia/Kolkata",
    "Asia/Shanghai",
    "Asia/Tokyo",
    "Australia/Sydney",
)


def _zone(name: str, field: str) -> ZoneInfo:
    if (
        len(name) > 64
        or not name.replace("/", "").replace("_", "").replace("-", "").replace("+", "").isalnum()
    ):
        raise errors.ValidationError(f"{name[:64]!r} is not an IANA time zone", field=field)
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise errors.ValidationError(f"{name!r} is not an IANA time zone", field=field) from None


def _param(request: Request, name: str, max_length: int = 200) -> str | None:
    """One query parameter; repeated or too long is an error naming it."""
    values = request.query_params.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise errors.ValidationError("give it once", field=name)
    value = values[0]
    if len(value) > max_length:
        raise errors.ValidationError(f"at most {max_length} characters", field=name)
    return value or None


async def _viewer(request: Request) -> Viewer | None:
    caller = await session.signed_in(request)
    if caller is None:
        return None
    zone_name = "UTC"
    cookie_zone = request.cookies.get(session.TZ_COOKIE)
    if cookie_zone:
        try:  # the browser's zone, written by console.js: a bad one is ignored
            _zone(cookie_zone, "tz")
            zone_name = cookie_zone
        except errors.ValidationError:
            pass
    wanted = request.query_params.get("tz")
    if wanted:
        _zone(wanted, "tz")
        zone_name = wanted
    token = request.cookies.get(session.COOKIE, "")
    return Viewer(caller, session.csrf_token(token), ZoneInfo(zone_name), zone_name)


async def _page(
    request: Request, build: Callable[[Viewer, Scheduler], Response | tuple[str, dict[str, Any]]]
) -> Response:
    """A signed-in page: the viewer, then build(viewer, scheduler) in the thread pool;
    a SchedError is an error page (naming the field), no session is the sign-in page."""
    viewer: Viewer | None = None
    try:
        viewer = await _viewer(request)
        if viewer is None:
            return _to_signin(request)
        scheduler = request_scheduler(request)
        signed = viewer
        result = await asyncio.to_thread(build, signed, scheduler)
    except errors.SchedError as exc:
        return _error_page(request, exc, viewer)
    if isinstance(result, Response):
        return session.secure_headers(result)
    name, context = result
    return _render(request, name, {"viewer": viewer, **context})


async def _form(request: Request) -> dict[str, str]:
    """A POSTed form's fields (the first of each). A body that is no form is an empty
    form: the CSRF check then refuses it (403) before anything else is read."""
    try:
        return await _parse_form(request)
    except errors.ValidationError:
        return {}


async def _parse_form(request: Request) -> dict[str, str]:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != (
        "application/x-www-form-urlencoded"
    ):
        raise errors.ValidationError("send the form as a browser does", field="body")
    raw = await request.body()
    if len(raw) > MAX_FORM_BYTES:
        raise errors.ValidationError("the form is too large", field="body")
    try:
        parsed = parse_qs(raw.decode(), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        raise errors.ValidationError("the form is not readable", field="body") from None
    return {key: values[0] for key, values in parsed.items() if values}


# -- sign in and out ---------------------------------------------------------------------


@router.get("")
@router.get("/")
async def home(request: Request) -> Response:
    return session.secure_headers(RedirectResponse("/ui/jobs", status_code=303))


@router.get("/signin")
async def signin_page(request: Request) -> Response:
    return _render(request, "signin.html", {"viewer": None, "error": None})


@router.post("/signin")
async def signin(request: Request) -> Response:
    try:
        session.check_origin(request)
        form = await _form(request)
        token = form.get("token", "").strip()
        if not token:
            raise errors.ValidationError("paste the tenant's API token (st_...)", field="token")
        await session.authenticate(request, token)
    except errors.Unauthorized:
        return _render(
            request,
            "signin.html",
            {"viewer": None, "error": "that token is not valid (or was revoked)"},
            status=401,
        )
    except errors.SchedError as exc:
        return _error_page(request, exc, None)
    response = RedirectResponse("/ui/jobs", status_code=303)
    session.set_session(response, request, token)
    return session.secure_headers(response)


@router.post("/signout")
async def signout(request: Request) -> Response:
    try:
        session.check_csrf(request, await _form(request))
    except errors.SchedError as exc:
        return _error_page(request, exc, None)
    response = RedirectResponse("/ui/signin", status_code=303)
    session.clear_session(response, request)
    return session.secure_headers(response)


# -- jobs --------------------------------------------------------------------------------


def _status_filter(text: str | None) -> JobStatus | None:
    if text is None:
        return None
    try:
        return JobStatus(text)
    except ValueError:
        allowed = ", ".join(s.value for s in JobStatus)
        raise errors.ValidationError(
            f"must be one of {allowed}, got {text[:40]!r}", field="status"
        ) from None


def _job_zone(job: Job) -> str:
    return job.schedule.timezone if isinstance(job.schedule, CronSchedule) else "UTC"


@router.get("/jobs")
async def jobs_page(request: Request) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        name = _param(request, "q")
        prefix = _param(request, "id", 40)
        status = _status_filter(_param(request, "status", 20))
        cursor = _param(request, "cursor", limits.MAX_CURSOR_LENGTH)
        page = reads.search_jobs(
            scheduler.store,
            viewer.caller.tenant.tenant_id,
            name=name,
            id_prefix=prefix,
            status=status,
            limit=PAGE_SIZE,
            cursor=cursor,
        )
        filters = {"q": name or "", "id": prefix or "", "status": status.value if status else ""}
        next_url = None
        if page.next_cursor:
            query = {k: v for k, v in filters.items() if v}
            next_url = "/ui/jobs?" + urlencode({**query, "cursor": page.next_cursor})
        rows = [
            {"job": job, "zone": _job_zone(job), "schedule": schedule_summary(job)}
            for job in page.items
        ]
        return "jobs.html", {
            "rows": rows,
            "filters": filters,
            "statuses": [s.value for s in JobStatus],
            "next_url": next_url,
            "first_url": "/ui/jobs?" + urlencode({k: v for k, v in filters.items() if v}),
            "paged": bool(cursor),
        }

    return await _page(request, build)


def _job(scheduler: Scheduler, viewer: Viewer, job_id: str) -> Job:
    return scheduler.get_job(checked_job_id(job_id), viewer.caller.tenant)


@dataclass(frozen=True)
class Fire:
    at: datetime
    local: str
    offset: str
    shifted: bool  # its UTC offset differs from the fire before it (a DST change)


def _next_fires(job: Job, now: datetime, count: int) -> list[Fire]:
    zone = ZoneInfo(_job_zone(job))
    fires: list[Fire] = []
    after = now
    previous: timedelta | None = None
    if job.status is not JobStatus.active or job.next_run_at is None:
        return fires
    at: datetime | None = job.next_run_at
    while at is not None and len(fires) < count:
        local = at.astimezone(zone)
        offset = local.utcoffset()
        fires.append(
            Fire(
                at,
                local.strftime("%Y-%m-%d %H:%M:%S %Z"),
                local.strftime("%z"),
                previous is not None and offset != previous,
            )
        )
        previous = offset
        after = at
        at = next_occurrence(job.schedule, after, end=job.end_at)
    return fires


def _fires_between(job: Job, start: datetime, end: datetime) -> list[datetime]:
    if job.status is not JobStatus.active or job.next_run_at is None:
        return []
    result: list[datetime] = []
    at: datetime | None = job.next_run_at
    while at is not None and at < end and len(result) < MAX_TIMELINE_FIRES:
        if at >= start:
            result.append(at)
        at = next_occurrence(job.schedule, at, end=job.end_at)
    return result


@dataclass(frozen=True)
class Bar:
    x: float
    width: float
    css: str
    title: str
    href: str | None


TIMELINE_WIDTH = 960.0


def _timeline(job: Job, runs: list[Run], fires: list[datetime], now: datetime) -> dict[str, Any]:
    """An SVG timeline of the past 24 hours of runs and the next 24 hours of fires: x is
    time, now in the middle."""
    start = now - timedelta(hours=TIMELINE_HOURS)
    span = 2 * TIMELINE_HOURS * 3600.0

    def x(at: datetime) -> float:
        return max(0.0, min(TIMELINE_WIDTH, (at - start).total_seconds() / span * TIMELINE_WIDTH))

    bars = []
    for run in runs:
        begin = run.started_at or run.dispatched_at or run.scheduled_at
        finish = run.finished_at or (now if run.status not in _FINISHED else begin)
        left = x(begin)
        bars.append(
            Bar(
                left,
                max(2.0, x(finish) - left),
                f"run-{run.status.value}",
                f"{format_instant(run.scheduled_at)} {run.status.value}",
                _run_url(job.job_id, run.scheduled_at),
            )
        )
    ticks = [Bar(x(at), 2.0, "fire", f"{format_instant(at)} next", None) for at in fires]
    hours = [
        # the labels at both ends kept inside the drawing
        {
            "x": min(TIMELINE_WIDTH - 14, max(14.0, x(start + timedelta(hours=h)))),
            "label": f"{h - TIMELINE_HOURS:+d}h",
        }
        for h in range(0, 2 * TIMELINE_HOURS + 1, 6)
    ]
    return {
        "width": TIMELINE_WIDTH,
        "now_x": x(now),
        "bars": bars,
        "ticks": ticks,
        "hours": hours,
    }


def _run_url(job_id: str, scheduled_at: datetime) -> str:
    return f"/ui/jobs/{job_id}/runs/{format_instant(scheduled_at)}"


@router.get("/jobs/{job_id}")
async def job_page(request: Request, job_id: str) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        cursor = _param(request, "cursor", limits.MAX_CURSOR_LENGTH)
        job = _job(scheduler, viewer, job_id)
        tenant = viewer.caller.tenant
        page = scheduler.runs(job.job_id, tenant, limit=RUNS_PAGE_SIZE, cursor=cursor)
        now = scheduler.store.now()
        past = reads.runs_between(
            scheduler.store, job.job_id, now - timedelta(hours=TIMELINE_HOURS), now
        )
        upcoming = _fires_between(job, now, now + timedelta(hours=TIMELINE_HOURS))
        own_alerts = get_settings(scheduler.store, tenant.tenant_id, job.job_id)
        default_alerts = get_settings(scheduler.store, tenant.tenant_id, "")
        next_url = None
        if page.next_cursor:
            next_url = f"/ui/jobs/{job.job_id}?" + urlencode({"cursor": page.next_cursor})
        return "job.html", {
            "job": job,
            "zone": _job_zone(job),
            "schedule": schedule_summary(job),
            "fires": _next_fires(job, now, NEXT_FIRES),
            "timeline": _timeline(job, past, upcoming, now),
            "runs": [(run, _run_url(job.job_id, run.scheduled_at)) for run in page.items],
            "next_url": next_url,
            "dependencies": scheduler.job_dependencies(job.job_id, tenant),
            "alerts": own_alerts or default_alerts,
            "alerts_own": own_alerts is not None,
            "alerts_json": reads.dumps_settings(own_alerts or default_alerts)
            if (own_alerts or default_alerts)
            else None,
            "alert_rows": reads.job_alerts(scheduler.store, tenant.tenant_id, job.job_id),
            "actions": _job_actions(job),
            "letters": DeadLetterRepo(scheduler.store)
            .list_letters(tenant_id=tenant.tenant_id, job_id=job.job_id, limit=10)
            .items,
        }

    return await _page(request, build)


def _job_actions(job: Job) -> list[str]:
    if job.status is JobStatus.active:
        return ["trigger", "pause", "cancel"]
    if job.status is JobStatus.paused:
        return ["resume", "trigger", "cancel"]
    return []


def _run(scheduler: Scheduler, viewer: Viewer, job_id: str, at: str) -> tuple[Job, Run]:
    job = _job(scheduler, viewer, job_id)
    try:
        scheduled_at = datetime.fromisoformat(at.replace("Z", "+00:00"))
    except ValueError:
        raise errors.NotFound(f"no run {at[:40]!r}", field="run") from None
    if scheduled_at.tzinfo is None:
        raise errors.NotFound(f"no run {at[:40]!r}", field="run")
    run = run_output.get_run(scheduler.store, job.job_id, scheduled_at.astimezone(UTC))
    if run is None or run.tenant_id != viewer.caller.tenant.tenant_id:
        raise errors.NotFound(f"no run {at[:40]!r}", field="run")
    return job, run


def _output_context(scheduler: Scheduler, job: Job, run: Run) -> dict[str, Any]:
    attempts = run_output.attempts(scheduler.store, job.job_id, [run.scheduled_at])
    running = run.status not in _FINISHED
    return {
        "job": job,
        "run": run,
        "attempts": attempts.get(run.scheduled_at, []),
        "running": running,
        "follow_url": f"{_run_url(job.job_id, run.scheduled_at)}/output" if running else None,
        "follow_ms": FOLLOW_SECONDS * 1000,
    }


@router.get("/jobs/{job_id}/runs/{at}")
async def run_page(request: Request, job_id: str, at: str) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        job, run = _run(scheduler, viewer, job_id, at)
        return "run.html", _output_context(scheduler, job, run)

    return await _page(request, build)


@router.get("/jobs/{job_id}/runs/{at}/output")
async def run_output_fragment(request: Request, job_id: str, at: str) -> Response:
    """The output part of a run's page, polled by console.js while the run runs."""

    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        job, run = _run(scheduler, viewer, job_id, at)
        return "run_output.html", _output_context(scheduler, job, run)

    return await _page(request, build)


# -- actions -----------------------------------------------------------------------------


def _confirm(
    viewer: Viewer, action: str, subject: str, detail: str, back: str
) -> tuple[str, dict[str, Any]]:
    return "confirm.html", {"action": action, "subject": subject, "detail": detail, "back": back}


@router.get("/jobs/{job_id}/{action}")
async def job_action_confirm(request: Request, job_id: str, action: str) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        if action not in JOB_ACTIONS:
            raise errors.NotFound(f"no page {action[:40]!r}", field="action")
        job = _job(scheduler, viewer, job_id)
        return _confirm(
            viewer, action, f"job {job.name}", _ACTION_TEXT[action], f"/ui/jobs/{job.job_id}"
        )

    return await _page(request, build)


_ACTION_TEXT = {
    "pause": "No run starts while it is paused; runs already dispatched complete.",
    "resume": "It continues from its next scheduled time after now.",
    "trigger": "One run now, in addition to its schedule.",
    "cancel": "All future runs are cancelled. This cannot be undone.",
    "replay": "The run is delivered again from its first attempt.",
    "purge": "The dead letter is deleted. This cannot be undone.",
}


async def _action(request: Request, act: Callable[[Viewer, Scheduler], str]) -> Response:
    """A POST: session, CSRF and origin first (nothing changes without them), then act()
    in the thread pool; it returns where to go next (303)."""
    viewer: Viewer | None = None
    try:
        viewer = await _viewer(request)
        if viewer is None:
            return _to_signin(request)
        session.check_csrf(request, await _form(request))
        signed = viewer
        target = await asyncio.to_thread(act, signed, request_scheduler(request))
    except errors.SchedError as exc:
        return _error_page(request, exc, viewer)
    return session.secure_headers(RedirectResponse(target, status_code=303))


@router.post("/jobs/{job_id}/{action}")
async def job_action(request: Request, job_id: str, action: str) -> Response:
    def act(viewer: Viewer, scheduler: Scheduler) -> str:
        if action not in JOB_ACTIONS:
            raise errors.NotFound(f"no action {action[:40]!r}", field="action")
        ref = checked_job_id(job_id)
        tenant, actor = viewer.caller.tenant, viewer.caller.actor
        if action == "trigger":
            run = scheduler.trigger_job(ref, tenant, actor=actor)
            return _run_url(run.job_id, run.scheduled_at)
        changed: Job = getattr(scheduler, f"{action}_job")(ref, tenant, actor=actor)
        return f"/ui/jobs/{changed.job_id}"

    return await _action(request, act)


# -- late and failing, dead letters, workers, cluster -------------------------------------


@router.get("/late")
async def late_page(request: Request) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        return "late.html", {
            "late": reads.lateness(scheduler.store, viewer.caller.tenant.tenant_id)
        }

    return await _page(request, build)


def _letter(scheduler: Scheduler, viewer: Viewer, letter_id: str) -> DeadLetter:
    return DeadLetterRepo(scheduler.store).get(
        reads.dead_letter_id(letter_id), viewer.caller.tenant.tenant_id
    )


@router.get("/dead-letters")
async def dead_letters_page(request: Request) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        cursor = _param(request, "cursor", limits.MAX_CURSOR_LENGTH)
        replayed = _param(request, "replayed", 3)
        if replayed not in (None, "yes", "no"):
            raise errors.ValidationError("must be yes or no", field="replayed")
        page = DeadLetterRepo(scheduler.store).list_letters(
            tenant_id=viewer.caller.tenant.tenant_id,
            include_replayed=replayed == "yes",
            limit=PAGE_SIZE,
            cursor=cursor,
        )
        next_url = None
        if page.next_cursor:
            query = {"cursor": page.next_cursor}
            if replayed:
                query["replayed"] = replayed
            next_url = "/ui/dead-letters?" + urlencode(query)
        return "dead_letters.html", {
            "letters": page.items,
            "next_url": next_url,
            "replayed": replayed == "yes",
        }

    return await _page(request, build)


@router.get("/dead-letters/{letter_id}")
async def dead_letter_page(request: Request, letter_id: str) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        repo = DeadLetterRepo(scheduler.store)
        letter = _letter(scheduler, viewer, letter_id)
        return "dead_letter.html", {"letter": letter, "attempts": repo.attempts(letter)}

    return await _page(request, build)


@router.get("/dead-letters/{letter_id}/{action}")
async def letter_action_confirm(request: Request, letter_id: str, action: str) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        if action not in LETTER_ACTIONS:
            raise errors.NotFound(f"no page {action[:40]!r}", field="action")
        letter = _letter(scheduler, viewer, letter_id)
        return _confirm(
            viewer,
            action,
            f"dead letter {letter.id} (job {letter.job_id}, run "
            f"{format_instant(letter.scheduled_at)})",
            _ACTION_TEXT[action],
            f"/ui/dead-letters/{letter.id}",
        )

    return await _page(request, build)


@router.post("/dead-letters/{letter_id}/{action}")
async def letter_action(request: Request, letter_id: str, action: str) -> Response:
    def act(viewer: Viewer, scheduler: Scheduler) -> str:
        if action not in LETTER_ACTIONS:
            raise errors.NotFound(f"no action {action[:40]!r}", field="action")
        repo = DeadLetterRepo(scheduler.store)
        tenant_id, actor = viewer.caller.tenant.tenant_id, viewer.caller.actor
        number = reads.dead_letter_id(letter_id)
        if action == "replay":
            repo.replay(number, tenant_id=tenant_id, actor=actor)
            return f"/ui/dead-letters/{number}"
        repo.purge(number, tenant_id=tenant_id, actor=actor)
        return "/ui/dead-letters"

    return await _action(request, act)


@router.get("/workers")
async def workers_page(request: Request) -> Response:
    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        now, queues = reads.queues(scheduler.store, viewer.caller.tenant.tenant_id)
        return "workers.html", {"at": now, "queues": queues}

    return await _page(request, build)


@router.get("/cluster")
async def cluster_page(request: Request) -> Response:
    """The cluster as a tenant may see it: aggregates only (dispatcher count, partitions
    owned, epochs, lag), never a dispatcher's name, host or pid, nor another tenant's
    queues; `schedctl status` is the operator's full view."""

    def build(viewer: Viewer, scheduler: Scheduler) -> tuple[str, dict[str, Any]]:
        store = scheduler.store
        status = read_database_status(store, store.partition_count)
        owners: dict[str, list[int]] = {}
        epochs = [p.epoch for p in status.partitions]
        for p in status.partitions:
            if p.owner is not None and p.partition < store.partition_count:
                owners.setdefault(p.owner, []).append(p.epoch)
        dispatchers = [
            {
                "label": f"dispatcher {index}",
                "partitions": len(held),
                "epoch_min": min(held),
                "epoch_max": max(held),
            }
            for index, held in enumerate(
                sorted(owners.values(), key=lambda held: -len(held)), start=1
            )
        ]
        owned = sum(len(held) for held in owners.values())
        return "cluster.html", {
            "status": status,
            "partition_count": store.partition_count,
            "owned": owned,
            "unowned": store.partition_count - owned,
            "dispatchers": dispatchers,
            "epoch_min": min(epochs) if epochs else None,
            "epoch_max": max(epochs) if epochs else None,
        }

    return await _page(request, build)


STATIC_TYPES = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript"}


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    """The console's stylesheet and script, shipped in the package (no CDN: the CSP allows
    'self' only)."""
    media = STATIC_TYPES.get(name)
    if media is None:
        raise errors.NotFound(f"no file {name[:40]!r}", field="name")
    body = (HERE / "static" / name).read_bytes()
    response = Response(body, media_type=media, headers={"Cache-Control": "max-age=300"})
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
