"""`schedctl bench scale`: the command of the stored-work-at-scale benchmark
(schedctl_bench.scale), registered on the `bench` group in plugin.py; its table view (one
row per figure, a column per stored count and their ratio). The benchmark is imported when
the command runs (`schedctl --help` must not load sqlalchemy)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format
from schedctl.cli.output import OutputFormat, emit
from schedctl_bench.cli.bench_options import BatchOption, TimeoutOption, count, keep_option, seconds

FIGURES = (
    ("load_rows_per_second", "load rows/s"),
    ("bytes_per_job", "bytes per stored job"),
    ("bytes_per_run_row", "bytes per run-history row"),
    ("claims_per_second", "claims/s (due to last claim)"),
    ("claims_per_second_first_to_last", "claims/s (first to last claim)"),
    ("claimed_all_after_due_seconds", "last claim after due (s)"),
    ("due_read_empty_window.p50_ms", "due read, empty window p50 (ms)"),
    ("due_read_empty_window.p99_ms", "due read, empty window p99 (ms)"),
    ("due_read_burst_window.p50_ms", "due read, burst window p50 (ms)"),
    ("dispatcher_peak_rss_bytes", "dispatcher peak RSS (MB)"),
)


def _figure(level: dict[str, Any], key: str) -> Any:
    value: Any = level
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if key == "dispatcher_peak_rss_bytes" and value is not None:
        return round(value / 2**20, 1)
    return value


def _table(result: dict[str, Any]) -> list[dict[str, Any]]:
    levels = result["levels"]
    rows = []
    for key, label in FIGURES:
        row: dict[str, Any] = {"figure": label}
        values = [_figure(level, key) for level in levels]
        for level, value in zip(levels, values, strict=True):
            row[f"{level['future_jobs']:,} stored"] = value
        if len(values) == 2 and all(isinstance(v, int | float) and v for v in values):
            row["ratio"] = round(values[1] / values[0], 3)
        rows.append(row)
    return rows


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def scale(
    ctx: typer.Context,
    future_jobs: Annotated[
        int, count("--future-jobs", 1, 100_000_000, "Future jobs stored (not due)")
    ] = 10_000_000,
    compare: Annotated[
        int,
        count("--compare", 0, 100_000_000, "Measure first with this many stored (0: not)"),
    ] = 100_000,
    burst: Annotated[int, count("--burst", 1, 1_000_000, "Runs due at one instant")] = 10_000,
    batch_size: BatchOption = 5_000,
    lead: Annotated[
        float, seconds("--lead", 1.0, 600.0, "From the dispatcher's start to the burst")
    ] = 10.0,
    reads: Annotated[int, count("--reads", 1, 10_000, "Timed due reads per level")] = 20,
    timeout: TimeoutOption = 300.0,
    keep: Annotated[bool, keep_option("future jobs")] = False,
    output: OutputOption = None,
) -> None:
    """With --future-jobs one-time jobs stored (spread over a year from tomorrow; first
    with --compare of them): a real `scheduled-d dispatcher` owning every partition claims
    --burst runs due at one instant (claims/s, peak RSS); the dispatcher's due read of the
    next minute over every partition is timed; bytes per stored job and per run-history
    row. On SQLite also the embedded burst (`scheduled-d all`): how long after the instant
    the last run was in the queue. Loads with COPY on Postgres. Use a scratch database."""
    from schedctl_bench import scale as bench_scale

    if compare >= future_jobs:
        from schedctl.core import errors

        raise errors.ValidationError("must be below --future-jobs (or 0)", field="compare")
    state = cli_state(ctx)
    store = state.store()
    url = store.engine.url.render_as_string(hide_password=False)
    result = bench_scale.run_scale(
        store,
        url,
        future_jobs=future_jobs,
        compare=compare,
        burst=burst,
        batch_size=batch_size,
        lead=lead,
        reads=reads,
        timeout=timeout,
        keep=keep,
        progress=_progress,
    )
    if store.dialect.embedded:
        result["embedded_burst"] = bench_scale.embedded_burst(
            store, url, burst=burst, lead=lead, timeout=timeout
        )
    fmt = output_format(ctx, output)
    if fmt is not OutputFormat.table:
        emit(result, fmt)
        return
    emit(_table(result), fmt, title="bench scale: figures by stored future jobs")
    rest = {k: v for k, v in result.items() if k != "levels"}
    emit(rest, fmt, title="bench scale")
