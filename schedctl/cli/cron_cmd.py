"""`schedctl cron next`: preview when a cron expression fires in a time zone, DST included."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import islice
from typing import Annotated

import typer

from schedctl.cli.common import OutputOption, int_parser, output_format
from schedctl.cli.output import emit, err_console
from schedctl.core import limits
from schedctl.core.errors import SchedError
from schedctl.scheduling.cron import CronFire, CronSchedule, FireKind
from schedctl.scheduling.timeparse import format_instant, parse_instant

app = typer.Typer(help="Preview cron schedules.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Preview cron schedules."""
    # A callback keeps `next` a subcommand even while it is the only one.


def _note(fire: CronFire) -> str | None:
    wall = fire.wall.strftime("%H:%M")
    if fire.kind is FireKind.shifted:
        return f"{wall} skipped by DST (clocks forward); runs at the end of the gap"
    if fire.kind is FireKind.repeated:
        return f"{wall} repeated by DST (clocks back); 2nd occurrence"
    return None


@app.command("next")
def next_times(
    ctx: typer.Context,
    expr: Annotated[str, typer.Argument(help="5-field cron expression or @macro, quoted.")],
    tz: Annotated[str, typer.Option("--tz", help="IANA time zone, e.g. Europe/Berlin.")] = "UTC",
    from_: Annotated[
        str | None,
        typer.Option("--from", help="Start after this time (ISO 8601 with offset); default now."),
    ] = None,
    count: Annotated[
        int,
        typer.Option(
            "-n",
            "--count",
            help=f"How many fire times (1-{limits.MAX_CRON_COUNT}).",
            parser=int_parser("count", 1, limits.MAX_CRON_COUNT),
        ),
    ] = 5,
    output: OutputOption = None,
) -> None:
    """Print the next fire times of EXPR in UTC and in local time."""
    try:
        schedule = CronSchedule.parse(expr, tz)
        after = parse_instant(from_, "from") if from_ is not None else datetime.now(UTC)
        rows = [
            {
                "utc": format_instant(fire.instant),
                "local": fire.instant.astimezone(schedule.zone).isoformat(),
                "note": _note(fire),
            }
            for fire in islice(schedule.fires_after(after), count)
        ]
    except SchedError as error:
        err_console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(code=error.exit_code) from None
    emit(
        rows,
        output_format(ctx, output),
        columns=("utc", "local", "note"),
        title=f"{schedule.expr} ({schedule.timezone})",
    )
