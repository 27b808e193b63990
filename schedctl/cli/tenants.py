"""Owns `schedctl tenant`: create (prints the API token once), list, show, quota, and
`tenant token create|list|revoke` (API tokens: issued once, stored hashed, revocable)."""

from __future__ import annotations

from typing import Annotated

import typer

from schedctl.app.views import tenant_to_dict, token_to_dict
from schedctl.cli.common import OutputOption, actor, cli_state, int_parser, output_format, say
from schedctl.cli.output import OutputFormat, emit
from schedctl.core import limits

app = typer.Typer(
    help="Tenants: who owns jobs, with their API tokens and quotas.", no_args_is_help=True
)

TENANT_COLUMNS = (
    "name",
    "tenant_id",
    "max_jobs",
    "create_rate_per_minute",
    "dispatch_rate_per_second",
    "created_at",
)
TOKEN_COLUMNS = ("token_id", "host", "groups", "created_at", "revoked_at", "active")

token_app = typer.Typer(
    help="API tokens of a tenant: create another, list, revoke.", no_args_is_help=True
)
app.add_typer(token_app, name="token")


@app.command()
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Letters, digits, '.', '_' and '-'; 1-200.")],
    output: OutputOption = None,
) -> None:
    """Create a tenant and print its API token (shown this once only)."""
    tenant, token = cli_state(ctx).database().create_tenant(name, actor())
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
    tenants = [tenant_to_dict(t) for t in cli_state(ctx).database().list_tenants()]
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
    found = cli_state(ctx).database().get_tenant(tenant)
    emit(tenant_to_dict(found), output_format(ctx, output), title=f"tenant {found.name}")


@app.command()
def quota(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="Tenant name or id.")],
    max_jobs: Annotated[
        int | None,
        typer.Option(
            "--max-jobs",
            help=f"Active (and paused) jobs the tenant may have (0-{limits.MAX_QUOTA}).",
            parser=int_parser("max_jobs", 0, limits.MAX_QUOTA),
        ),
    ] = None,
    create_rate: Annotated[
        int | None,
        typer.Option(
            "--create-rate",
            help=f"Jobs the tenant may create per minute (0-{limits.MAX_QUOTA}).",
            parser=int_parser("create_rate_per_minute", 0, limits.MAX_QUOTA),
        ),
    ] = None,
    output: OutputOption = None,
) -> None:
    """Change a tenant's quotas; over them the API answers 429 with Retry-After."""
    found = (
        cli_state(ctx)
        .database()
        .set_quotas(tenant, max_jobs=max_jobs, create_rate_per_minute=create_rate, actor=actor())
    )
    emit(tenant_to_dict(found), output_format(ctx, output), title=f"tenant {found.name}")


@token_app.command("create")
def token_create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="Tenant name or id.")],
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            metavar="NAME",
            help="A host token for the cron host NAME: it can only lease and settle runs of "
            "that host's queues, report its presence and apply the jobs its files define.",
        ),
    ] = None,
    group: Annotated[
        list[str] | None,
        typer.Option(
            "--group", metavar="GROUP", help="With --host: a host group it serves (repeat)."
        ),
    ] = None,
    output: OutputOption = None,
) -> None:
    """Issue another API token (e.g. to rotate one); it is shown this once only. With
    --host, a host token for a cron host (no database URL needed there)."""
    groups = tuple(group or ())
    token = cli_state(ctx).database().new_token(tenant, actor=actor(), host=host, groups=groups)
    fmt = output_format(ctx, output)
    token_id = token.split("_")[1]
    if fmt is OutputFormat.json:
        emit(
            {
                "tenant": tenant,
                "token_id": token_id,
                "token": token,
                "host": host,
                "groups": sorted(set(groups)),
            },
            fmt,
        )
        return
    kind = f"host token for host {host}" if host is not None else "token"
    say(f"{kind} {token_id} created for tenant {tenant}")
    say("API token (it will not be shown again; store it now):")
    say(token)


@token_app.command("list")
def token_list(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="Tenant name or id.")],
    output: OutputOption = None,
) -> None:
    """The tenant's tokens: ids and dates (a token itself is never stored)."""
    tokens = [token_to_dict(t) for t in cli_state(ctx).database().list_tokens(tenant)]
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(tokens, fmt)
    elif not tokens:
        say(f"tenant {tenant} has no API tokens")
    else:
        emit(tokens, fmt, columns=TOKEN_COLUMNS)


@token_app.command("revoke")
def token_revoke(
    ctx: typer.Context,
    token: Annotated[
        str, typer.Argument(help="The token id (from `token list`) or the whole token.")
    ],
    output: OutputOption = None,
) -> None:
    """Revoke an API token: the API refuses it (401) from its next request on."""
    token_id = cli_state(ctx).database().revoke_token(token, actor=actor())
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit({"token_id": token_id, "revoked": True}, fmt)
        return
    say(f"token {token_id} revoked")
