"""`schedctl bench peers`: the command of the side-by-side benchmark (schedctl_bench.peers)
against procrastinate and APScheduler 4, registered on the `bench` group in plugin.py; its
table view (a row per workload and system, with the ratio to scheduled-d). The benchmark is
imported when the command runs (`schedctl --help` must not load sqlalchemy)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format
from schedctl.cli.output import OutputFormat, emit
from schedctl_bench.cli.bench_options import ConcurrencyOption, count, seconds


def default_venv() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("schedctl")) / "peers-venv"


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per workload and system: started, last/p50/p99 seconds after due, and the
    ratio of each to scheduled-d's."""
    rows = []
    for workload in ("burst", "steady"):
        ratios = result.get(f"{workload}_ratio_to_scheduled_d", {})
        for system, f in result.get(workload, {}).items():
            ratio = ratios.get(system, {})
            rows.append(
                {
                    "workload": workload,
                    "system": f"{system} {f.get('version') or ''}".strip(),
                    "started": f"{f['started']}/{f['of']}",
                    "last_s": f["last_s"],
                    "p50_s": f["p50_s"],
                    "p99_s": f["p99_s"],
                    "ratio last/p50/p99": (
                        (">=" if ratio.get("lower_bound") else "")
                        + "/".join(str(ratio.get(k)) for k in ("last", "p50", "p99"))
                        if ratio
                        else "1"
                    ),
                    "load_s": f.get("load_seconds"),
                    # the machine's 1-minute load average when the system's run ended
                    "loadavg": (f.get("load_average") or [None])[0],
                    "error": f.get("error") or "",
                }
            )
    return rows


def peers(
    ctx: typer.Context,
    jobs: Annotated[int, count("--jobs", 1, 1_000_000, "Burst: jobs due at one instant")] = 10_000,
    rate: Annotated[int, count("--rate", 1, 100_000, "Steady: jobs due a second")] = 200,
    duration: Annotated[
        float, seconds("--duration", 1.0, 3600.0, "Steady: seconds of load")
    ] = 20.0,
    lead: Annotated[
        float,
        seconds(
            "--lead",
            1.0,
            600.0,
            "From the load's end to the first due instant (covers the processes' start-up)",
        ),
    ] = 20.0,
    timeout: Annotated[
        float, seconds("--timeout", 1.0, 3600.0, "Per system: wait after the last due instant")
    ] = 120.0,
    load_timeout: Annotated[
        float, seconds("--load-timeout", 1.0, 7200.0, "Per peer: the most its load may take")
    ] = 600.0,
    worker_concurrency: ConcurrencyOption = 16,
    venv: Annotated[
        Path | None,
        typer.Option(
            "--venv",
            help="The peers' virtual environment (made with python -m venv and pip on first "
            "use; default: the user cache directory's schedctl/peers-venv).",
        ),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            help="Comma-separated systems to run (scheduled-d, procrastinate, apscheduler); "
            "default all. Without a peer no venv is made.",
        ),
    ] = None,
    output: OutputOption = None,
) -> None:
    """scheduled-d, procrastinate and APScheduler 4 side by side on the same Postgres: a
    burst (--jobs due at one instant) and a steady load (--rate a second for --duration),
    each system on a fresh database of the --db server; for each, when its jobs started
    after their due instant (last, p50, p99) and each peer's figure over scheduled-d's.
    The peers are pip-installed into --venv the first time."""
    from schedctl.core import errors
    from schedctl_bench import peers as bench_peers

    systems: tuple[str, ...] = bench_peers.SYSTEMS
    if only is not None:
        systems = tuple(s.strip() for s in only.split(",") if s.strip())
        unknown = [s for s in systems if s not in bench_peers.SYSTEMS]
        if unknown or not systems:
            raise errors.ValidationError(
                f"must name some of {', '.join(bench_peers.SYSTEMS)}, not {only!r}", field="only"
            )
    url = cli_state(ctx).database_url()
    from schedctl_bench.storage.scratch import backend

    if backend(url) != "postgresql":
        raise errors.ValidationError("the peers run on Postgres: give a postgresql URL", field="db")
    workloads = bench_peers.Workloads(
        jobs=jobs,
        rate=rate,
        duration=duration,
        lead=lead,
        timeout=timeout,
        load_timeout=load_timeout,
        concurrency=worker_concurrency,
    )
    python = None
    if any(s in bench_peers.PEERS for s in systems):
        python = bench_peers.ensure_venv(venv or default_venv(), say=_progress)
    result = bench_peers.run_peers(url, workloads, python=python, systems=systems, say=_progress)
    fmt = output_format(ctx, output)
    if fmt is not OutputFormat.table:
        emit(result, fmt)
        return
    emit(table_rows(result), fmt, title="bench peers: started after the due instant (s)")
    emit(result["started_means"], fmt, title="what started means")
