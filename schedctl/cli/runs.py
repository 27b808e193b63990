"""Owns `schedctl runs JOB`: a job's run history, newest first, one page at a time."""

from __future__ import annotations

from typing import Annotated

import typer

from schedctl.app.views import run_to_dict
from schedctl.cli.common import (
    OutputOption,
    TenantOption,
    cli_state,
    cursor_option,
    emit_page,
    limit_option,
    output_format,
)

RUN_COLUMNS = (
    "scheduled_at",
    "status",
    "attempt",
    "trigger",
    "dispatched_at",
    "started_at",
    "finished_at",
    "exit_code",
    "error",
)


def runs(
    ctx: typer.Context,
    job_id: Annotated[
        str, typer.Argument(help="The job: its id, its name, or an unambiguous id prefix.")
    ],
    limit: Annotated[int, limit_option("Runs")] = 50,
    cursor: Annotated[str | None, cursor_option()] = None,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """Run history of a job, newest first: status, attempt, times, exit code, error."""
    page = cli_state(ctx).scheduler().runs(job_id, tenant, limit=limit, cursor=cursor)
    emit_page(
        output_format(ctx, output),
        page,
        run_to_dict,
        columns=RUN_COLUMNS,
        empty=f"job {job_id} has no runs yet",
        title=f"runs of job {job_id}",
    )
