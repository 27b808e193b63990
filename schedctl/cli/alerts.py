"""Owns the alert commands: `schedctl tenant alerts TENANT` (the tenant's default) and
`schedctl job alerts JOB` (a job's own, which replace the default). With no option they
show the settings; options set them (all at once: what is left out is off); --clear
removes them. `job alerts` also works through --api; `tenant alerts` needs the database."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format, say
from schedctl.cli.output import OutputFormat, emit
from schedctl.core import errors
from schedctl.domain.alerts.model import AlertConfig

Webhook = Annotated[
    str | None, typer.Option("--webhook", help="URL POSTed the alert, signed like deliveries.")
]
Email = Annotated[
    list[str] | None, typer.Option("--email", help="An address to e-mail (repeatable).")
]
On = Annotated[
    str | None,
    typer.Option("--on", help="dead_letter (default), failure, or dead_letter,failure."),
]
Command = Annotated[
    bool, typer.Option("--command", help="Run the queue worker host's alert_command.")
]
NoSuccess = Annotated[
    str | None,
    typer.Option("--no-success", help="Alert once when no run succeeded for this long (PT26H)."),
]
Clear = Annotated[bool, typer.Option("--clear", help="Remove the settings.")]


def _body(
    webhook: str | None,
    email: list[str] | None,
    on: str | None,
    command: bool,
    no_success: str | None,
) -> dict[str, Any] | None:
    if webhook is None and not email and on is None and not command and no_success is None:
        return None
    body: dict[str, Any] = {"command": command}
    if on is not None:
        body["on"] = [k.strip() for k in on.split(",") if k.strip()]
    if webhook is not None:
        body["webhook"] = webhook
    if email:
        body["email"] = list(email)
    if no_success is not None:
        body["no_success"] = no_success
    return body


def _show(ctx: typer.Context, what: str, config: AlertConfig | None, output: Any) -> None:
    fmt = output_format(ctx, output)
    data = config.to_dict() if config is not None else None
    if fmt is OutputFormat.json:
        emit({"alerts": data, "of": what}, fmt)
    elif data is None:
        say(f"no alerts of {what}")
    else:
        emit(data, fmt, title=f"alerts of {what}")


def tenant_alerts(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="Tenant name or id.")],
    webhook: Webhook = None,
    email: Email = None,
    on: On = None,
    command: Command = False,
    no_success: NoSuccess = None,
    clear: Clear = False,
    output: OutputOption = None,
) -> None:
    """Show or set TENANT's default alerts, used by its jobs without alerts of their own."""
    scheduler = cli_state(ctx).database()
    body = _body(webhook, email, on, command, no_success)
    if clear and body is not None:
        raise errors.ValidationError("give either --clear or settings", field="--clear")
    if clear or body is not None:
        scheduler.set_alerts(tenant, body)
    _show(ctx, f"tenant {tenant}", scheduler.get_alerts(tenant), output)


def job_alerts(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job id.")],
    webhook: Webhook = None,
    email: Email = None,
    on: On = None,
    command: Command = False,
    no_success: NoSuccess = None,
    clear: Clear = False,
    output: OutputOption = None,
) -> None:
    """Show or set JOB's own alerts (--clear: back to its tenant's default); works with
    --api too."""
    scheduler = cli_state(ctx).scheduler()
    found = scheduler.get_job(job)
    body = _body(webhook, email, on, command, no_success)
    if clear and body is not None:
        raise errors.ValidationError("give either --clear or settings", field="--clear")
    if clear or body is not None:
        scheduler.set_alerts(found.tenant_id, body, found.job_id)
    _show(ctx, f"job {found.job_id}", scheduler.get_alerts(found.tenant_id, found.job_id), output)
