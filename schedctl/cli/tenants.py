"""Owns `schedctl tenant`: create (prints the API token once), list, show."""

from __future__ import annotations

from typing import Annotated

import typer

from schedctl.cli.common import OutputOption, actor, cli_state, output_format, say
from schedctl.cli.output import OutputFormat, emit
from schedctl.views import tenant_to_dict

app = typer.Typer(
    help="Tenants: who owns jobs, with their API tokens and quotas.", no_args_is_help=True
)

TENANT_COLUMNS = ("name", "tenant_id", "max_jobs", "dispatch_rate_per_second", "created_at")


@app.command()
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Letters, digits, '.', '_' and '-'; 1-200.")],
    output: OutputOption = None,
) -> None:
    """Create a tenant and print its API token (shown this once only)."""
    tenant, token = cli_state(ctx).scheduler().create_tenant(name, actor())
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit({**tenant_to_dict(tenant), "token": token}, fmt)
        return
    say(f"tenant {tenant.name} created (id {tenant.tenant_id})")
    say("API token (it will not be shown again; store it now):")
    # printed bare on its own line so it can be copied or piped whole
    say(token)


@app.command("list")
def list_(ctx: typer.Context, output: OutputOption = None) -> None:
    """All tenants."""
    tenants = [tenant_to_dict(t) for t in cli_state(ctx).scheduler().list_tenants()]
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(tenants, fmt)
    elif not tenants:
        say("no tenants yet: create one with `schedctl tenant create NAME`")
    else:
        emit(tenants, fmt, columns=TENANT_COLUMNS)


@app.command()
def show(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="Tenant name or id.")],
    output: OutputOption = None,
) -> None:
    """One tenant: id, quotas, HTTP allow-list."""
    found = cli_state(ctx).scheduler().get_tenant(tenant)
    emit(tenant_to_dict(found), output_format(ctx, output), title=f"tenant {found.name}")
