"""`schedctl bench burst`, `bench steady`, `bench spawn`, `bench worker`, `bench failover` and
`bench delivery`: the commands of the whole-path benchmarks against real dispatcher, relay and
worker processes (schedctl_bench.pipeline), of the failover benchmark
(schedctl_bench.dispatch) and of the delivery benchmark (schedctl_bench.delivery);
registered on the `bench` group in plugin.py.
The benchmarks themselves are imported when a command runs: they load sqlalchemy, requests
and pika, which `schedctl --help` must not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format
from schedctl.cli.output import OutputFormat, emit
from schedctl_bench.cli.bench_options import (
    BatchOption,
    ConcurrencyOption,
    DispatchersOption,
    EmbeddedOption,
    LaneWidthOption,
    RelaysOption,
    SpawnOption,
    TargetOption,
    TimeoutOption,
    WorkersOption,
    ZooKeeperOption,
    count,
    keep_option,
    seconds,
)

if TYPE_CHECKING:
    from schedctl_bench.pipeline import Plan


def _url(ctx: typer.Context) -> str:
    return cli_state(ctx).store().engine.url.render_as_string(hide_password=False)


STAGES = ("claimed", "delivered", "started", "finished")  # as schedctl_bench.pipeline.STAGES
PLAN_KNOBS = (
    "embedded",
    "relays",
    "workers",
    "worker_concurrency",
    "timeout",
    "spawn_seconds",
    "api_workers",
)


def _plan(ctx: typer.Context, options: dict[str, Any]) -> Plan:
    """The processes of a run, from a command's options (its locals())."""
    from schedctl_bench.dispatch import Dispatchers
    from schedctl_bench.pipeline import Plan

    group = Dispatchers(
        _url(ctx), options["dispatchers"], options["zookeeper"], options["batch_size"]
    )
    knobs = {k: options[k] for k in PLAN_KNOBS if k in options}
    return Plan(target=options["target"], dispatchers=group, **knobs)


def _emit(ctx: typer.Context, result: dict[str, Any], output: OutputFormat | None) -> None:
    """JSON as measured; for humans, a table of the stages and then the rest."""
    fmt = output_format(ctx, output)
    if fmt is not OutputFormat.table:
        emit(result, fmt)
        return
    stages = [
        {
            "stage": stage,
            **result[f"{stage}_after_due_seconds"],
            "per_second": result[f"{stage}_per_second"],
        }
        for stage in STAGES
    ]
    emit(stages, fmt, title=f"{result['benchmark']}: seconds after the due instant")
    per_stage = {
        f"{stage}_{what}" for stage in STAGES for what in ("after_due_seconds", "per_second")
    }
    rest = {k: v for k, v in result.items() if k not in per_stage}
    rest["peak_rss_mb"] = {k: round(v / 2**20, 1) for k, v in rest.pop("peak_rss_bytes").items()}
    emit(rest, fmt, title=result["benchmark"])


def burst(
    ctx: typer.Context,
    jobs: Annotated[int, count("--jobs", 1, 1_000_000, "Runs due at once")] = 100_000,
    lead: Annotated[
        float, seconds("--lead", 1.0, 86_400.0, "From the load's end to the due instant")
    ] = 10.0,
    target: TargetOption = "queue",
    dispatchers: DispatchersOption = 1,
    zookeeper: ZooKeeperOption = None,
    batch_size: BatchOption = 10_000,
    relays: RelaysOption = 1,
    workers: WorkersOption = 1,
    worker_concurrency: ConcurrencyOption = 16,
    spawn_seconds: SpawnOption = 0.0,
    embedded: EmbeddedOption = False,
    timeout: TimeoutOption = 300.0,
    output: OutputOption = None,
) -> None:
    """Runs all due at one instant, through real dispatcher, relay and worker processes:
    for each stage (claimed, delivered, started, finished) how long after the instant the
    last run got there, lateness p50/p99/max, duplicates, missing and peak RSS. Use a
    scratch database: it adds a tenant with its jobs, deleted at the end."""
    from schedctl_bench import pipeline

    plan = _plan(ctx, locals())
    result = pipeline.burst(cli_state(ctx).store(), plan, jobs=jobs, lead_seconds=lead)
    _emit(ctx, result, output)


def steady(
    ctx: typer.Context,
    rate: Annotated[int, count("--rate", 1, 100_000, "Runs due a second")] = 500,
    duration: Annotated[float, seconds("--duration", 1.0, 3600.0, "Seconds of load")] = 30.0,
    target: TargetOption = "queue",
    dispatchers: DispatchersOption = 1,
    zookeeper: ZooKeeperOption = None,
    batch_size: BatchOption = 1000,
    relays: RelaysOption = 1,
    workers: WorkersOption = 2,
    api_workers: Annotated[
        int,
        count(
            "--api-workers",
            0,
            64,
            "Tenant workers over the REST API (`scheduled-d worker --api`, the bench tenant's "
            "token, no database setting) running /bin/true beside the --workers, with a "
            "`scheduled-d api` on a free loopback port",
        ),
    ] = 0,
    worker_concurrency: ConcurrencyOption = 16,
    spawn_seconds: SpawnOption = 0.0,
    embedded: EmbeddedOption = False,
    timeout: TimeoutOption = 120.0,
    output: OutputOption = None,
) -> None:
    """A steady stream of due runs through real dispatcher, relay and worker processes: the
    lateness of each stage (claimed, delivered, started, finished), duplicates, missing and
    peak RSS. --timeout counts after the last run's instant. Use a scratch database: it adds
    a tenant with its jobs, deleted at the end."""
    from schedctl_bench import pipeline

    plan = _plan(ctx, locals())
    result = pipeline.steady(cli_state(ctx).store(), plan, rate=rate, duration=duration)
    _emit(ctx, result, output)


def spawn(
    ctx: typer.Context,
    duration: Annotated[float, seconds("--duration", 1.0, 600.0, "Seconds to measure")] = 5.0,
    threads: Annotated[int, count("--threads", 1, 256, "Threads starting /bin/true")] = 16,
    output: OutputOption = None,
) -> None:
    """The spawn ceiling: how many times a second Python starts /bin/true from --threads
    threads on this machine (the most one worker process could start), and the CPU of one
    start, the child's included."""
    from schedctl_bench.pipeline import spawn_ceiling

    spawns = spawn_ceiling(duration, threads)
    result = {
        "threads": threads,
        "duration_seconds": duration,
        "starts_per_second": round(spawns.per_second, 1),
        # the child's CPU included: what each start costs the machine's cores
        "cpu_ms_per_start": spawns.cpu_ms_per_start,
    }
    emit(result, output_format(ctx, output), title="spawn ceiling")


def worker(
    ctx: typer.Context,
    runs: Annotated[
        int, count("--runs", 1, 1_000_000, "Runs queued before the worker starts")
    ] = 5000,
    worker_concurrency: ConcurrencyOption = 16,
    spawn_seconds: Annotated[
        float,
        seconds("--spawn-seconds", 1.0, 600.0, "Spawn ceiling measured this long before and after"),
    ] = 5.0,
    timeout: TimeoutOption = 300.0,
    keep: Annotated[bool, keep_option("tenant, jobs and runs")] = False,
    output: OutputOption = None,
) -> None:
    """One `scheduled-d worker` process draining --runs already-queued /bin/true runs (one
    one-time job each): commands started a second, against the spawn ceiling measured in
    the same run, and the worker's CPU per run. Use a scratch database: it adds a tenant,
    its jobs and their runs (removed after unless --keep)."""
    from schedctl_bench.worker import run_worker_bench

    result = run_worker_bench(
        cli_state(ctx).store(),
        runs=runs,
        concurrency=worker_concurrency,
        spawn_seconds=spawn_seconds,
        timeout=timeout,
        keep=keep,
    )
    emit(result, output_format(ctx, output), title="worker")


def failover(
    ctx: typer.Context,
    zookeeper: Annotated[str, typer.Option("--zookeeper", help="ZooKeeper hosts.")],
    session_timeout: Annotated[
        float, seconds("--session-timeout", 1.0, 120.0, "The dispatchers' ZooKeeper session")
    ] = 10.0,
    timeout: TimeoutOption = 120.0,
    output: OutputOption = None,
) -> None:
    """Recovery time: three dispatchers, then kill -9, SIGSTOP and SIGTERM of one each;
    the seconds until its partitions are owned again. Use a scratch database."""
    store = cli_state(ctx).store()
    from schedctl_bench import dispatch

    result = dispatch.failover(
        store,
        url=_url(ctx),
        zookeeper=zookeeper,
        session_timeout=session_timeout,
        timeout=timeout,
    )
    emit(result, output_format(ctx, output), title="failover")


def delivery(
    ctx: typer.Context,
    runs: Annotated[int, count("--runs", 1, 200_000, "Runs per target kind")] = 5000,
    concurrency: LaneWidthOption = 16,
    timeout: TimeoutOption = 300.0,
    rabbitmq: Annotated[
        str | None,
        typer.Option(
            "--rabbitmq",
            help="Also publish to this broker (amqp://...; a scratch queue, deleted after).",
        ),
    ] = None,
    output: OutputOption = None,
) -> None:
    """Deliveries per second from the outbox to a loopback HTTP endpoint and into the
    built-in queue (and RabbitMQ with --rabbitmq). Use a scratch database: it adds a
    tenant, jobs and runs."""
    from schedctl_bench.delivery import run_delivery_bench

    result = run_delivery_bench(
        cli_state(ctx).store(),
        runs=runs,
        concurrency=concurrency,
        timeout=timeout,
        rabbitmq_url=rabbitmq,
    )
    emit(result, output_format(ctx, output), title="delivery")
