"""Owns `schedctl bench create`: jobs created per second through a `scheduled-d api` process
on loopback, by single POST /v1/jobs or by POST /v1/jobs:batch (--batch), from C keep-alive
clients (schedctl/bench/create.py does the work). Measured and reported, never asserted."""

from __future__ import annotations

from typing import Annotated

import typer

from schedctl import limits
from schedctl.cli.common import OutputOption, cli_state, int_parser, number_parser, output_format
from schedctl.cli.output import emit


def create(
    ctx: typer.Context,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs", "-n", parser=int_parser("jobs", 1, 10_000_000), help="Jobs to create."
        ),
    ] = 5000,
    concurrency: Annotated[
        int,
        typer.Option(
            "--concurrency",
            "-c",
            parser=int_parser("concurrency", 1, 64),
            help="Concurrent keep-alive clients (1-64).",
        ),
    ] = 12,
    batch: Annotated[
        bool,
        typer.Option("--batch", help="POST /v1/jobs:batch (--batch-size jobs per request)."),
    ] = False,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            parser=int_parser("batch_size", 1, limits.MAX_BATCH_JOBS),
            help=f"Jobs per batch request, with --batch (1-{limits.MAX_BATCH_JOBS}).",
        ),
    ] = limits.MAX_BATCH_JOBS,
    max_seconds: Annotated[
        float,
        typer.Option(
            "--max-seconds",
            parser=number_parser("max_seconds", 1.0, 86_400.0),
            help="Stop sending after this long (1-86400).",
        ),
    ] = 120.0,
    payload_bytes: Annotated[
        int,
        typer.Option(
            "--payload-bytes",
            parser=int_parser("payload_bytes", 0, 60_000),
            help="Payload size per job (0-60000).",
        ),
    ] = 64,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the benchmark tenant and its jobs afterwards.")
    ] = False,
    output: OutputOption = None,
) -> None:
    """Jobs created per second through `scheduled-d api` on 127.0.0.1 against the
    configured database, one POST /v1/jobs per job (or --batch), each job with its own
    idempotency key, from --concurrency keep-alive clients; with the latency of a request
    (p50/p99/max). A throwaway tenant creates one-time jobs a year ahead (nothing fires)
    and is deleted with its jobs at the end unless --keep."""
    from schedctl.bench.create import CreateBenchConfig, run

    state = cli_state(ctx)
    scheduler = state.database()  # refuses --api: the benchmark starts its own API
    config = CreateBenchConfig(
        jobs=jobs,
        concurrency=concurrency,
        batch=batch,
        batch_size=batch_size,
        max_seconds=max_seconds,
        payload_bytes=payload_bytes,
        keep=keep,
    )
    report = run(scheduler, state.database_url(), config)
    fmt = output_format(ctx, output)
    emit(report, fmt, title=f"bench create: {report['mode']} creates on loopback")
