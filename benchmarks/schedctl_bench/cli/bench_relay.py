"""`schedctl bench relay`: the command of the relay benchmark (schedctl_bench.relay), signed
HTTP deliveries per second from one relay process to a loopback keep-alive receiver;
registered on the `bench` group in plugin.py. The benchmark is imported when the command runs
(`schedctl --help` must not load sqlalchemy)."""

from __future__ import annotations

from typing import Annotated

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format
from schedctl.cli.output import emit
from schedctl_bench.cli.bench_options import LaneWidthOption, count, keep_option, seconds


def relay(
    ctx: typer.Context,
    runs: Annotated[int, count("--runs", 1, 1_000_000, "Runs to deliver")] = 20_000,
    concurrency: LaneWidthOption = 64,
    timeout: Annotated[float, seconds("--timeout", 1.0, 3600.0, "Give up after this")] = 600.0,
    keep: Annotated[bool, keep_option("tenant, job and runs")] = False,
    output: OutputOption = None,
) -> None:
    """Signed HTTP deliveries per second from one `scheduled-d relay` to a loopback
    keep-alive receiver, p50/p99 call latency, duplicates and missing runs. Use a scratch
    database: it adds a tenant, a job and its runs (removed after unless --keep)."""
    from schedctl_bench.relay import run_relay_bench

    result = run_relay_bench(
        cli_state(ctx).store(), runs=runs, concurrency=concurrency, timeout=timeout, keep=keep
    )
    emit(result, output_format(ctx, output), title="relay")
