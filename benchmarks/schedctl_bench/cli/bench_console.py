"""`schedctl bench console`: the command of the web console benchmark (schedctl_bench.console),
each /ui page's response time (p50/p99) with many jobs and runs stored; registered on the
`bench` group in plugin.py. The benchmark is imported when the command runs (`schedctl --help`
must not load sqlalchemy)."""

from __future__ import annotations

from typing import Annotated

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format, say
from schedctl.cli.output import OutputFormat, emit
from schedctl_bench.cli.bench_options import count, keep_option


def console(
    ctx: typer.Context,
    jobs: Annotated[int, count("--jobs", 1, 10_000_000, "Jobs to store")] = 100_000,
    runs: Annotated[
        int, count("--runs", 1, 100_000_000, "Runs to store (spread over the jobs)")
    ] = (1_000_000),
    requests: Annotated[int, count("--requests", 1, 10_000, "Timed requests per page")] = 20,
    keep: Annotated[bool, keep_option("tenant, jobs, runs and dead letters")] = False,
    output: OutputOption = None,
) -> None:
    """Each web console page's server time (p50/p99 of its Server-Timing header) and
    response time on loopback (server time plus a loopback round trip) with --jobs jobs,
    --runs runs over past days and 1,000 dead letters of one tenant stored; the target is
    under 300 ms server time per page at 100,000 jobs and 1,000,000 runs. `scheduled-d api`
    runs as its own process. Use a scratch database (Postgres to measure what production
    sees): the tenant and its rows are removed after unless --keep."""
    from schedctl_bench.cli.bench import _api_process
    from schedctl_bench.console import run_console_bench

    state = cli_state(ctx)
    store = state.database().store
    url = state.database_url()
    fmt = output_format(ctx, output)
    result = run_console_bench(
        store,
        lambda: _api_process(url),
        jobs=jobs,
        runs=runs,
        requests=requests,
        keep=keep,
        # progress lines only around a table: JSON output is the report alone
        progress=None if fmt is OutputFormat.json else say,
    )
    if fmt is OutputFormat.json:
        emit(result, fmt)
        return
    title = (
        f"bench console: {result['jobs']:,} jobs, {result['runs']:,} runs ({result['database']})"
    )
    emit(result["pages"], fmt, columns=COLUMNS, title=title)


COLUMNS = (
    "page",
    "path",
    "status",
    "server_p50_ms",
    "server_p99_ms",
    "p50_ms",
    "p99_ms",
    "bytes",
)
