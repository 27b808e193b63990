"""Owns `schedctl job`: create (also --after), list, show (with the dependency tree), update,
delete, cancel, pause, resume, trigger, reschedule.

The flags are turned into the REST API's job body and validated by the same parser
(schedctl.domain.jobspec), so the CLI and the API accept and refuse exactly the same jobs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text
from rich.tree import Tree

from schedctl.app.views import job_to_dict, run_to_dict, schedule_summary
from schedctl.cli.common import (
    OutputOption,
    TenantOption,
    actor,
    cli_state,
    cursor_option,
    emit_page,
    int_parser,
    limit_option,
    output_format,
    require_one,
    say,
)
from schedctl.cli.output import OutputFormat, emit, emit_tree
from schedctl.core import errors, limits
from schedctl.domain.models import Job

app = typer.Typer(help="Jobs: create, inspect and change scheduled jobs.", no_args_is_help=True)

JobArgument = Annotated[
    str,
    typer.Argument(help="The job: its id, its name, or an unambiguous id prefix (6+ hex digits)."),
]
AtOption = Annotated[
    str | None, typer.Option("--at", help="Run once at this time (ISO 8601 with an offset).")
]
InOption = Annotated[
    str | None, typer.Option("--in", help="Run once after this delay (30s, 10m, 1h30m, PT10M).")
]
CronOption = Annotated[
    str | None, typer.Option("--cron", help="Run on a 5-field cron expression (or @daily ...).")
]
TzOption = Annotated[
    str | None, typer.Option("--tz", help="IANA time zone of --cron (default UTC).")
]
EveryOption = Annotated[
    str | None, typer.Option("--every", help="Run every interval (30s, 5m, PT1H).")
]
AnchorOption = Annotated[
    str | None,
    typer.Option("--anchor", help="With --every: the instant the intervals count from (ISO)."),
]

WindowOption = Annotated[
    str | None, typer.Option("--window", help="Spread each run within this window.")
]
TimeoutOption = Annotated[
    str | None, typer.Option("--timeout", help="Kill a run after this long (worker).")
]
MetricsOption = Annotated[
    bool | None,
    typer.Option(
        "--metrics/--no-metrics",
        help="Export this job's run counts and durations on /metrics "
        "(at most metrics_max_jobs_per_tenant such jobs per tenant).",
    ),
]
OverlapOption = Annotated[
    str | None,
    typer.Option(
        "--overlap",
        help="A run due while one runs: queue (default: wait), allow, skip, replace.",
    ),
]
MemoryMaxOption = Annotated[
    str | None,
    typer.Option("--memory-max", help="Each run's memory limit (512M, 2G; none: no limit)."),
]
CpuWeightOption = Annotated[
    str | None, typer.Option("--cpu-weight", help="Each run's cgroup cpu.weight (1-10000).")
]
TasksMaxOption = Annotated[
    str | None,
    typer.Option("--tasks-max", help="Each run's limit of processes and threads (none: off)."),
]
IfVersionOption = Annotated[
    int | None,
    typer.Option(
        "--if-version",
        help="Refuse (exit 4) unless the job is still at this version.",
        parser=int_parser("version", 1, 2**62),
    ),
]


def max_attempts_option(help_text: str) -> Any:
    return typer.Option(
        "--max-attempts",
        help=help_text,
        parser=int_parser("retry.max_attempts", 1, limits.MAX_ATTEMPTS),
    )


def max_concurrency_option(help_text: str) -> Any:
    return typer.Option(
        "--max-concurrency",
        help=help_text,
        parser=int_parser("max_concurrency", 0, limits.MAX_CONCURRENCY),
    )


JOB_COLUMNS = ("job_id", "name", "status", "schedule", "target", "next_run_at")


def schedule_body(
    at: str | None,
    in_: str | None,
    cron: str | None,
    tz: str | None,
    every: str | None,
    anchor: str | None,
) -> dict[str, Any]:
    """The REST "schedule" object for exactly one of --at, --in, --cron, --every."""
    kind = require_one(
        {"--at": at, "--in": in_, "--cron": cron, "--every": every}, field="schedule"
    )
    if tz is not None and kind != "--cron":
        raise errors.ValidationError("--tz applies only with --cron", field="timezone")
    if anchor is not None and kind != "--every":
        raise errors.ValidationError("--anchor applies only with --every", field="anchor")
    if kind == "--at":
        return {"run_at": at}
    if kind == "--in":
        return {"delay": in_}
    if kind == "--cron":
        return {"cron": cron, "timezone": tz or "UTC"}
    body: dict[str, Any] = {"every": every}
    if anchor is not None:
        body["anchor"] = anchor
    return body


def after_body(
    after: str | None, at: str | None, in_: str | None, cron: str | None, every: str | None
) -> dict[str, Any] | None:
    """The REST "after" of --after JOB[,JOB...], or None without it."""
    if after is None:
        return None
    if any(v is not None for v in (at, in_, cron, every)):
        raise errors.ValidationError(
            "a dependent job has no schedule of its own: give --after or a schedule, not both",
            field="after",
        )
    return {"after": [part.strip() for part in after.split(",")]}


def target_body(queue: str | None, url: str | None) -> dict[str, Any]:
    """The REST "target" object for exactly one of --queue, --url."""
    kind = require_one({"--queue": queue, "--url": url}, field="target")
    return {"type": "queue", "name": queue} if kind == "--queue" else {"type": "http", "url": url}


def settings_body(
    retry: dict[str, Any], max_concurrency: int | None, optional: dict[str, Any]
) -> dict[str, Any]:
    """The body's settings, only those given: the defaults (or, for an update, the job's
    values) stay the parser's, and the same command line always gives the same idempotency
    hash. --max-concurrency 0 means no limit."""
    body: dict[str, Any] = {}
    if any(v is not None for v in retry.values()):
        body["retry"] = {k: v for k, v in retry.items() if v is not None}
    if max_concurrency is not None:
        body["max_concurrency"] = max_concurrency if max_concurrency != 0 else None
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def run_body(
    overlap: str | None, memory_max: str | None, cpu_weight: str | None, tasks_max: str | None
) -> dict[str, Any]:
    """The run policy's keys given on the command line ("none" clears a limit); the
    values are checked by the same parser as the API's (schedctl/domain/runpolicy.py)."""
    body: dict[str, Any] = {} if overlap is None else {"overlap": overlap}
    for key, text in (("memory_max", memory_max), ("cpu_weight", cpu_weight),
                      ("tasks_max", tasks_max)):  # fmt: skip
        if text is not None:
            value = text.strip()
            body[key] = (
                None if value.lower() == "none" else int(value) if value.isdigit() else value
            )
    return body


def read_payload(payload: str | None, payload_file: Path | None) -> Any:
    if payload is not None and payload_file is not None:
        raise errors.ValidationError("give --payload or --payload-file, not both", field="payload")
    if payload_file is not None:
        try:
            text = sys.stdin.read() if str(payload_file) == "-" else payload_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise errors.ValidationError(
                f"cannot read {payload_file}: {getattr(exc, 'strerror', None) or exc}",
                field="payload",
            ) from exc
        source = str(payload_file)
    elif payload is not None:
        text, source = payload, "--payload"
    else:
        return None
    try:
        value = limits.parse_json(text, "payload")
    except errors.ValidationError as exc:
        raise errors.ValidationError(
            f"{source} {exc.message.split(': ', 1)[-1]}", field="payload"
        ) from None
    # checked here too, not only by the server: with --api, a 5,000-digit integer could not
    # even be sent
    limits.check_json_value(value, "payload")
    return value


def _row(job: Job) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "name": job.name,
        "status": job.status.value,
        "schedule": schedule_summary(job),
        "target": f"{job.target.type.value}:{job.target.address}",
        "next_run_at": job_to_dict(job)["next_run_at"],
    }


def _show(ctx: typer.Context, job: Job, output: OutputFormat | None, *, title: str) -> None:
    emit(job_to_dict(job), output_format(ctx, output), title=title)


@app.command()
def create(
    ctx: typer.Context,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", "-t", help="Tenant name or id (with --api: the token's)."),
    ] = None,
    at: AtOption = None,
    in_: InOption = None,
    cron: CronOption = None,
    tz: TzOption = None,
    every: EveryOption = None,
    anchor: AnchorOption = None,
    queue: Annotated[
        str | None, typer.Option("--queue", help="Target: put each run on this queue.")
    ] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="Target: POST each run to this http(s) URL.")
    ] = None,
    payload: Annotated[str | None, typer.Option("--payload", help="Payload (JSON).")] = None,
    payload_file: Annotated[
        Path | None, typer.Option("--payload-file", help="Payload from a JSON file ('-': stdin).")
    ] = None,
    max_attempts: Annotated[
        int | None,
        max_attempts_option(f"Delivery attempts per run (default 3, 1-{limits.MAX_ATTEMPTS})."),
    ] = None,
    misfire: Annotated[
        str | None,
        typer.Option(
            "--misfire",
            help="run_once (default), skip or run_all: runs missed by more than --grace.",
        ),
    ] = None,
    grace: Annotated[
        str | None, typer.Option("--grace", help="How late a run may start (default 60s).")
    ] = None,
    window: WindowOption = None,
    max_concurrency: Annotated[
        int | None,
        max_concurrency_option(
            f"Overlapping runs allowed (default 1, at most {limits.MAX_CONCURRENCY}; 0: no limit)."
        ),
    ] = None,
    timeout: TimeoutOption = None,
    metrics: MetricsOption = None,
    start: Annotated[str | None, typer.Option("--start", help="No runs before (ISO).")] = None,
    end: Annotated[str | None, typer.Option("--end", help="No runs after (ISO).")] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option(
            "--idempotency-key", help="Same key + same job: the existing job is returned."
        ),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="A name for listings.")] = None,
    overlap: OverlapOption = None,
    memory_max: MemoryMaxOption = None,
    cpu_weight: CpuWeightOption = None,
    tasks_max: TasksMaxOption = None,
    output: OutputOption = None,
    after: Annotated[
        str | None,
        typer.Option(
            "--after",
            help="JOB[,JOB...]: run when all these jobs' runs succeeded (no schedule of its own).",
        ),
    ] = None,
) -> None:
    """Create a job: one schedule (--at, --in, --cron, --every) or --after, and one target
    (--queue, --url)."""
    body: dict[str, Any] = after_body(after, at, in_, cron, every) or {
        "schedule": schedule_body(at, in_, cron, tz, every, anchor)
    }
    body["target"] = target_body(queue, url)
    value = read_payload(payload, payload_file)
    if value is not None:
        body["payload"] = value
    optional = {
        "misfire_policy": misfire,
        "grace": grace,
        "window": window,
        "timeout": timeout,
        "start": start,
        "end": end,
        "idempotency_key": idempotency_key,
        "name": name,
    }
    body.update(settings_body({"max_attempts": max_attempts}, max_concurrency, optional))
    if metrics is not None:
        body["metrics"] = metrics
    body.update(run_body(overlap, memory_max, cpu_weight, tasks_max))
    scheduler = cli_state(ctx).scheduler()
    from schedctl.clients.client import ApiClient

    if isinstance(scheduler, ApiClient):
        job, created = scheduler.create_job(tenant, body, actor=actor())
    elif tenant is None:
        raise errors.ValidationError("a tenant is required (--tenant)", field="tenant")
    else:
        job, created = scheduler.create_job(tenant, body, actor=actor())
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit({**job_to_dict(job), "created": created}, fmt)
        return
    title = "job created" if created else "job already exists (same idempotency key and body)"
    emit(job_to_dict(job), fmt, title=title)


@app.command("list")
def list_(
    ctx: typer.Context,
    tenant: TenantOption = None,
    status: Annotated[
        str | None,
        typer.Option("--status", help="active, paused, cancelled, completed or deleted."),
    ] = None,
    limit: Annotated[int, limit_option("Jobs")] = 50,
    cursor: Annotated[str | None, cursor_option()] = None,
    output: OutputOption = None,
) -> None:
    """Jobs in creation order, one page at a time."""
    page = cli_state(ctx).scheduler().list_jobs(tenant, status, limit=limit, cursor=cursor)

    def rows(jobs: list[Job]) -> list[dict[str, Any]]:
        # the shortest unique id prefix (8+ characters): it fits, and commands accept it
        short = cli_state(ctx).scheduler().short_job_ids(tenant, [j.job_id for j in jobs])
        return [{**_row(j), "job_id": short.get(j.job_id, j.job_id)} for j in jobs]

    emit_page(
        output_format(ctx, output),
        page,
        job_to_dict,
        columns=JOB_COLUMNS,
        empty="no jobs",
        table_rows=rows,
    )


@app.command()
def show(
    ctx: typer.Context,
    job_id: JobArgument,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """One job, in full, with its upstream and downstream jobs (`after`) as a tree."""
    scheduler = cli_state(ctx).scheduler()
    job = scheduler.get_job(job_id, tenant)
    graph = scheduler.job_dependencies(job.job_id, tenant)
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit({**job_to_dict(job), **graph}, fmt)
        return
    emit(job_to_dict(job), fmt, title=f"job {job.job_id}")
    if graph["upstream"] or graph["downstream"]:
        emit_tree(dependency_tree(job, graph))


@app.command()
def why(
    ctx: typer.Context,
    job_id: JobArgument,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """Why the job did (not) run: its schedule and next fires, its last runs with the reason
    each was skipped or failed, how late it is, the live workers of its queue, and its pause
    and alert state."""
    from schedctl.app.why import render

    data = cli_state(ctx).scheduler().job_why(job_id, tenant)
    if output_format(ctx, output) is OutputFormat.json:
        emit(data, OutputFormat.json)
        return
    sys.stdout.write(render(data))
    sys.stdout.flush()


def _lifecycle_command(name: str, help_text: str, done: str) -> None:
    """Register `job NAME`: a change of state (cancel, pause, resume) shown as the changed job."""

    def command(
        ctx: typer.Context,
        job_id: JobArgument,
        tenant: TenantOption = None,
        output: OutputOption = None,
    ) -> None:
        change = getattr(cli_state(ctx).scheduler(), f"{name}_job")
        job: Job = change(job_id, tenant, actor=actor())
        _show(ctx, job, output, title=f"job {job.job_id} {done}")

    app.command(name, help=help_text)(command)


_lifecycle_command(
    "cancel", "Cancel all future runs (a run already dispatched still completes).", "cancelled"
)
_lifecycle_command("pause", "Stop scheduling runs until resumed.", "paused")
_lifecycle_command("resume", "Continue from the next scheduled time after now.", "resumed")


@app.command()
def trigger(
    ctx: typer.Context,
    job_id: JobArgument,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """Run the job now, once, in addition to its schedule."""
    run = cli_state(ctx).scheduler().trigger_job(job_id, tenant, actor=actor())
    emit(run_to_dict(run), output_format(ctx, output), title=f"manual run of job {job_id}")


@app.command()
def reschedule(
    ctx: typer.Context,
    job_id: JobArgument,
    at: AtOption = None,
    in_: InOption = None,
    cron: CronOption = None,
    tz: TzOption = None,
    every: EveryOption = None,
    anchor: AnchorOption = None,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """Replace the schedule (--at, --in, --cron, --every); the next run is recomputed at once."""
    body = schedule_body(at, in_, cron, tz, every, anchor)
    job = cli_state(ctx).scheduler().reschedule_job(job_id, body, tenant, actor=actor())
    _show(ctx, job, output, title=f"job {job.job_id} rescheduled")


def dependency_tree(job: Job, graph: dict[str, list[Any]]) -> Tree:
    """The job, its upstream jobs (runs after) and its downstream jobs (run after it)."""
    root = Tree(Text(f"{job.name} ({job.job_id})", style="bold"))

    def add(parent: Tree, nodes: list[Any]) -> None:
        for node in nodes:
            label = f"{node['name'] or '?'} ({node['job_id']}) {node['status'] or 'gone'}"
            add(parent.add(Text(label)), node["children"])

    if graph["upstream"]:
        add(root.add(Text("after (upstream)")), graph["upstream"])
    if graph["downstream"]:
        add(root.add(Text("before (downstream)")), graph["downstream"])
    return root


@app.command()
def update(
    ctx: typer.Context,
    job_id: JobArgument,
    at: AtOption = None,
    in_: InOption = None,
    cron: CronOption = None,
    tz: Annotated[
        str | None,
        typer.Option("--tz", help="IANA time zone of --cron; alone: the job's cron, new zone."),
    ] = None,
    every: EveryOption = None,
    anchor: AnchorOption = None,
    queue: Annotated[str | None, typer.Option("--queue", help="New target: this queue.")] = None,
    url: Annotated[str | None, typer.Option("--url", help="New target: this URL.")] = None,
    payload: Annotated[str | None, typer.Option("--payload", help="New payload (JSON).")] = None,
    payload_file: Annotated[
        Path | None, typer.Option("--payload-file", help="New payload from a file ('-': stdin).")
    ] = None,
    max_attempts: Annotated[
        int | None, max_attempts_option(f"Delivery attempts per run (1-{limits.MAX_ATTEMPTS}).")
    ] = None,
    base_delay: Annotated[
        str | None, typer.Option("--base-delay", help="First retry delay (doubles each time).")
    ] = None,
    max_delay: Annotated[
        str | None, typer.Option("--max-delay", help="Longest retry delay.")
    ] = None,
    misfire: Annotated[
        str | None, typer.Option("--misfire", help="run_once, skip or run_all.")
    ] = None,
    grace: Annotated[str | None, typer.Option("--grace", help="How late a run may start.")] = None,
    window: WindowOption = None,
    max_concurrency: Annotated[
        int | None,
        max_concurrency_option(
            f"Overlapping runs allowed (at most {limits.MAX_CONCURRENCY}; 0: no limit)."
        ),
    ] = None,
    timeout: TimeoutOption = None,
    metrics: MetricsOption = None,
    name: Annotated[str | None, typer.Option("--name", help="A new name.")] = None,
    overlap: OverlapOption = None,
    memory_max: MemoryMaxOption = None,
    cpu_weight: CpuWeightOption = None,
    tasks_max: TasksMaxOption = None,
    after: Annotated[
        str | None,
        typer.Option(
            "--after",
            help="New upstream jobs JOB[,JOB...] (ids or names): a dependent job, no schedule.",
        ),
    ] = None,
    if_version: IfVersionOption = None,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """Change what the options name; the rest keeps its value. A new schedule recomputes
    the next run; a new target or payload applies to runs not yet claimed."""
    body: dict[str, Any] = after_body(after, at, in_, cron, every) or {}
    if any(v is not None for v in (at, in_, cron, every)):
        body["schedule"] = schedule_body(at, in_, cron, tz, every, anchor)
    elif anchor is not None:
        raise errors.ValidationError("--anchor applies only with --every", field="anchor")
    elif tz is not None:
        body["schedule"] = {"timezone": tz}
    if queue is not None or url is not None:
        body["target"] = target_body(queue, url)
    if payload is not None or payload_file is not None:
        # given, the payload is set even to JSON null
        body["payload"] = read_payload(payload, payload_file)
    retry = {"max_attempts": max_attempts, "base_delay": base_delay, "max_delay": max_delay}
    optional = {
        "misfire_policy": misfire,
        "grace": grace,
        "window": window,
        "timeout": timeout,
        "name": name,
    }
    body.update(settings_body(retry, max_concurrency, optional))
    if metrics is not None:
        body["metrics"] = metrics
    body.update(run_body(overlap, memory_max, cpu_weight, tasks_max))
    job = (
        cli_state(ctx)
        .scheduler()
        .update_job(job_id, body, tenant, if_version=if_version, actor=actor())
    )
    _show(ctx, job, output, title=f"job {job.job_id} updated")


@app.command()
def delete(
    ctx: typer.Context,
    job_id: JobArgument,
    if_version: IfVersionOption = None,
    tenant: TenantOption = None,
) -> None:
    """Stop the job (as cancel) and remove it from lists and lookups; `schedctl runs JOB`
    still shows its run history until retention removes it."""
    cli_state(ctx).scheduler().delete_job(job_id, tenant, if_version=if_version, actor=actor())
    say(f"job {job_id} deleted")
