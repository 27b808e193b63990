"""Owns `schedctl audit`: the audit log (who created, changed, cancelled, paused, resumed or
triggered which job, and when), newest first, one page at a time."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from schedctl.app.views import audit_to_dict
from schedctl.cli.common import (
    OutputOption,
    TenantOption,
    cli_state,
    cursor_option,
    emit_page,
    limit_option,
    output_format,
)

AUDIT_COLUMNS = ("at", "tenant", "actor", "action", "job_id", "detail")


def audit(
    ctx: typer.Context,
    tenant: TenantOption = None,
    job: Annotated[str | None, typer.Option("--job", "-j", help="Only this job's entries.")] = None,
    action: Annotated[
        str | None,
        typer.Option(
            "--action",
            help="Only this action: create, reschedule, cancel, pause, resume, trigger, "
            "tenant_create, token_create, token_revoke, tenant_quota.",
        ),
    ] = None,
    limit: Annotated[int, limit_option("Entries")] = 50,
    cursor: Annotated[str | None, cursor_option()] = None,
    output: OutputOption = None,
) -> None:
    """The audit log, newest first: who changed which job, and when.

    The actor is `token:ID` for API calls (the token id, see `schedctl tenant token list`)
    and `cli:USER` for schedctl."""
    page = (
        cli_state(ctx)
        .database()
        .audit(tenant, job_id=job, action=action, limit=limit, cursor=cursor)
    )
    emit_page(
        output_format(ctx, output),
        page,
        audit_to_dict,
        columns=AUDIT_COLUMNS,
        empty="no audit entries",
        title="audit log",
        table_rows=lambda entries: [_row(audit_to_dict(e)) for e in entries],
    )


def _row(item: dict[str, Any]) -> dict[str, Any]:
    detail = item["detail"]
    return {
        **item,
        "tenant": item["tenant"] or item["tenant_id"],
        "detail": json.dumps(detail, sort_keys=True) if detail else None,
    }
