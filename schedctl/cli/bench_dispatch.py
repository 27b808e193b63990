"""`schedctl bench burst`, `bench steady`, `bench failover` and `bench delivery`: the commands
of the dispatch benchmarks against real dispatcher processes (schedctl.bench.dispatch) and of
the delivery benchmark (schedctl.bench.delivery); registered on the `bench` group in app.py.
The benchmarks themselves are imported when a command runs: they load sqlalchemy, requests
and pika, which `schedctl --help` must not."""

from __future__ import annotations

from typing import Annotated

import typer

from schedctl.cli.common import (
    OutputOption,
    cli_state,
    int_parser,
    number_parser,
    output_format,
)
from schedctl.cli.output import emit

DispatchersOption = Annotated[
    int,
    typer.Option(
        "--dispatchers",
        parser=int_parser("dispatchers", 1, 16),
        help="Dispatcher processes (>1 needs --zookeeper).",
    ),
]
ZooKeeperOption = Annotated[
    str | None, typer.Option("--zookeeper", help="ZooKeeper hosts for several dispatchers.")
]
BatchOption = Annotated[
    int,
    typer.Option(
        "--batch-size",
        parser=int_parser("batch_size", 1, 100_000),
        help="Runs per claim (1-100000).",
    ),
]


def _url(ctx: typer.Context) -> str:
    return cli_state(ctx).store().engine.url.render_as_string(hide_password=False)


def burst(
    ctx: typer.Context,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs", parser=int_parser("jobs", 1, 1_000_000), help="Runs due at once (1-1000000)."
        ),
    ] = 100_000,
    lead: Annotated[
        float,
        typer.Option(
            "--lead",
            parser=number_parser("lead", 1.0, 86_400.0),
            help="Seconds from dispatcher start to the due instant (1-86400).",
        ),
    ] = 10.0,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            parser=number_parser("timeout", 1.0, 86_400.0),
            help="Give up after this (1-86400).",
        ),
    ] = 300.0,
    dispatchers: DispatchersOption = 1,
    zookeeper: ZooKeeperOption = None,
    batch_size: BatchOption = 10_000,
    output: OutputOption = None,
) -> None:
    """Runs all due at one instant: how soon after it the last one is claimed. Use a
    scratch database: it adds a tenant and its jobs."""
    from schedctl.bench import dispatch

    result = dispatch.burst(
        cli_state(ctx).store(),
        jobs=jobs,
        lead_seconds=lead,
        timeout=timeout,
        dispatchers=dispatch.Dispatchers(_url(ctx), dispatchers, zookeeper, batch_size),
    )
    emit(result, output_format(ctx, output), title="burst")


def steady(
    ctx: typer.Context,
    rate: Annotated[
        int,
        typer.Option(
            "--rate", parser=int_parser("rate", 1, 100_000), help="Runs due a second (1-100000)."
        ),
    ] = 500,
    duration: Annotated[
        float,
        typer.Option(
            "--duration",
            parser=number_parser("duration", 1.0, 3600.0),
            help="Seconds of load (1-3600).",
        ),
    ] = 30.0,
    dispatchers: DispatchersOption = 1,
    zookeeper: ZooKeeperOption = None,
    batch_size: BatchOption = 1000,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=0,
            max=64,
            help="`scheduled-d worker` processes running /bin/true (plus a relay) that "
            "consume the queue during the run; 0: claims only.",
        ),
    ] = 2,
    api_workers: Annotated[
        int,
        typer.Option(
            "--api-workers",
            min=0,
            max=64,
            help="Tenant workers over the REST API (`scheduled-d worker --api`, the bench "
            "tenant's token, no database setting) running /bin/true beside the --workers, "
            "with a `scheduled-d api` on a free loopback port; 0: none.",
        ),
    ] = 0,
    worker_concurrency: Annotated[
        int, typer.Option("--worker-concurrency", min=1, max=256, help="Commands per worker.")
    ] = 16,
    output: OutputOption = None,
) -> None:
    """A steady stream of due runs: the dispatch lateness distribution, with workers (direct,
    and over the API with --api-workers) executing the runs meanwhile. Use a scratch
    database: it adds a tenant and its jobs."""
    from schedctl.bench import dispatch

    result = dispatch.steady(
        cli_state(ctx).store(),
        rate=rate,
        duration=duration,
        dispatchers=dispatch.Dispatchers(_url(ctx), dispatchers, zookeeper, batch_size),
        workers=workers,
        worker_concurrency=worker_concurrency,
        api_workers=api_workers,
    )
    emit(result, output_format(ctx, output), title="steady")


def failover(
    ctx: typer.Context,
    zookeeper: Annotated[str, typer.Option("--zookeeper", help="ZooKeeper hosts.")],
    session_timeout: Annotated[
        float,
        typer.Option(
            "--session-timeout",
            parser=number_parser("session_timeout", 1.0, 120.0),
            help="Seconds (1-120).",
        ),
    ] = 10.0,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            parser=number_parser("timeout", 1.0, 86_400.0),
            help="Give up after this (1-86400).",
        ),
    ] = 120.0,
    output: OutputOption = None,
) -> None:
    """Recovery time: three dispatchers, then kill -9, SIGSTOP and SIGTERM of one each;
    the seconds until its partitions are owned again. Use a scratch database."""
    store = cli_state(ctx).store()
    from schedctl.bench import dispatch

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
    runs: Annotated[
        int,
        typer.Option(
            "--runs", parser=int_parser("runs", 1, 200_000), help="Runs per target kind (1-200000)."
        ),
    ] = 5000,
    concurrency: Annotated[
        int,
        typer.Option(
            "--concurrency",
            parser=int_parser("concurrency", 1, 256),
            help="The tenant's HTTP lane width (1-256).",
        ),
    ] = 16,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            parser=number_parser("timeout", 1.0, 3600.0),
            help="Give up after this (1-3600).",
        ),
    ] = 300.0,
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
    from schedctl.bench.delivery import run_delivery_bench

    result = run_delivery_bench(
        cli_state(ctx).store(),
        runs=runs,
        concurrency=concurrency,
        timeout=timeout,
        rabbitmq_url=rabbitmq,
    )
    emit(result, output_format(ctx, output), title="delivery")
