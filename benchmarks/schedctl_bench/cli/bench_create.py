"""Owns `schedctl bench create`: jobs created per second through a `scheduled-d api` process
on loopback, by single POST /v1/jobs or by POST /v1/jobs:batch (--batch), from C keep-alive
clients, or by `schedctl job import` (--import) (benchmarks/schedctl_bench/create.py does the work).
Measured and reported, never asserted."""

from __future__ import annotations

from typing import Annotated

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format
from schedctl.cli.output import emit
from schedctl.core import limits
from schedctl_bench.cli.bench_options import KeepJobsOption, count, seconds


def create(
    ctx: typer.Context,
    jobs: Annotated[int, count("--jobs", 1, 10_000_000, "Jobs to create", "-n")] = 5000,
    concurrency: Annotated[
        int, count("--concurrency", 1, 64, "Concurrent keep-alive clients", "-c")
    ] = 12,
    batch: Annotated[
        bool,
        typer.Option("--batch", help="POST /v1/jobs:batch (--batch-size jobs per request)."),
    ] = False,
    batch_size: Annotated[
        int,
        count("--batch-size", 1, limits.MAX_BATCH_JOBS, "Jobs per batch request, with --batch"),
    ] = limits.MAX_BATCH_JOBS,
    minimal: Annotated[
        bool,
        typer.Option(
            "--minimal",
            help="With --batch: ask for minimal answers (Prefer: return=minimal), as "
            "`job import` does.",
        ),
    ] = False,
    job_import: Annotated[
        bool,
        typer.Option(
            "--import",
            help="Run `schedctl --api URL job import FILE.jsonl` of --jobs lines instead.",
        ),
    ] = False,
    max_seconds: Annotated[
        float, seconds("--max-seconds", 1.0, 86_400.0, "Stop sending after this")
    ] = 120.0,
    payload_bytes: Annotated[int, count("--payload-bytes", 0, 60_000, "Payload size per job")] = 64,
    keep: KeepJobsOption = False,
    output: OutputOption = None,
) -> None:
    """Jobs created per second through `scheduled-d api` on 127.0.0.1 against the
    configured database, one POST /v1/jobs per job (or --batch), each job with its own
    idempotency key, from --concurrency keep-alive clients; with the latency of a request
    (p50/p99/max). A throwaway tenant creates one-time jobs a year ahead (nothing fires)
    and is deleted with its jobs at the end unless --keep."""
    from schedctl_bench.create import CreateBenchConfig, run

    state = cli_state(ctx)
    scheduler = state.database()  # refuses --api: the benchmark starts its own API
    config = CreateBenchConfig(
        jobs=jobs,
        concurrency=concurrency,
        batch=batch,
        batch_size=batch_size,
        minimal=minimal,
        job_import=job_import,
        max_seconds=max_seconds,
        payload_bytes=payload_bytes,
        keep=keep,
    )
    report = run(scheduler, state.database_url(), config)
    fmt = output_format(ctx, output)
    emit(report, fmt, title=f"bench create: {report['mode']} creates on loopback")
