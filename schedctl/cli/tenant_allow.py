"""Owns the delivery commands of `schedctl tenant`: `allow` / `disallow` (the HTTP destination
allow-list of the SSRF guard), `delivery` (concurrency and rate at delivery), `broker` (the
tenant's RabbitMQ) and `signing-secret` (the key a tenant verifies deliveries with:
`signing-secret TENANT` shows it, `signing-secret rotate TENANT --grace 24h` replaces it while
the old one keeps signing for the grace period).

They are defined on this module's own `app`; the tenant group attaches the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from schedctl.cli.common import OutputOption, actor, cli_state, int_parser, output_format, say
from schedctl.cli.output import OutputFormat, emit
from schedctl.core import errors, limits
from schedctl.scheduling.timeparse import format_instant, parse_duration

if TYPE_CHECKING:
    from schedctl.storage.tenants.tenant_delivery import TenantDeliveryRepo

app = typer.Typer(help="Tenant delivery settings: allow-list, limits, broker, signing secret.")

TenantArgument = Annotated[str, typer.Argument(help="Tenant name or id.")]
EntryArgument = Annotated[
    str,
    typer.Argument(
        help="A host name (exact, e.g. hooks.internal) or a CIDR (10.0.0.0/8, fd00::/8, "
        "or one address)."
    ),
]


def _repo(ctx: typer.Context) -> TenantDeliveryRepo:
    from schedctl.storage.tenants.tenant_delivery import TenantDeliveryRepo

    return TenantDeliveryRepo(cli_state(ctx).store())


def _show_allow_list(
    ctx: typer.Context,
    output: OutputFormat | None,
    tenant: str,
    entries: list[str],
    *,
    changed: bool,
    done: str,
) -> None:
    """TENANT's allow-list after allow or disallow: JSON, or the line `done` and the list."""
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit({"tenant": tenant, "allow_list": entries, "changed": changed}, fmt)
        return
    say(done)
    say(f"allow-list of {tenant}: {', '.join(entries) or '(empty)'}")


@app.command()
def allow(
    ctx: typer.Context,
    tenant: TenantArgument,
    entry: EntryArgument,
    output: OutputOption = None,
) -> None:
    """Let TENANT's HTTP jobs call HOST or CIDR even where the SSRF guard refuses by default
    (loopback, private, link-local, CGNAT, ...). Public destinations need no entry."""
    from schedctl.core.ssrf import normalize_entry  # loads asyncio: only when needed

    entries, changed = _repo(ctx).allow(tenant, normalize_entry(entry), actor=actor())
    done = f"{'allowed' if changed else 'already allowed'}: {entries[-1] if changed else entry}"
    _show_allow_list(ctx, output, tenant, entries, changed=changed, done=done)


@app.command()
def disallow(
    ctx: typer.Context,
    tenant: TenantArgument,
    entry: EntryArgument,
    output: OutputOption = None,
) -> None:
    """Remove HOST or CIDR from TENANT's allow-list; deliveries check it at once, so runs
    already scheduled to that destination are refused from now on."""
    try:
        from schedctl.core.ssrf import normalize_entry

        canonical = normalize_entry(entry)
    except errors.ValidationError:
        canonical = entry.strip().lower()  # as stored, whatever it is
    entries = _repo(ctx).disallow(tenant, canonical, actor=actor(), given=entry)
    _show_allow_list(ctx, output, tenant, entries, changed=True, done=f"disallowed: {entry}")


@app.command()
def delivery(
    ctx: typer.Context,
    tenant: TenantArgument,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency",
            help="Deliveries in flight at once per kind (HTTP, RabbitMQ), "
            f"1-{limits.MAX_DELIVERY_CONCURRENCY}.",
            parser=int_parser("delivery_concurrency", 1, limits.MAX_DELIVERY_CONCURRENCY),
        ),
    ] = None,
    rate: Annotated[
        int | None,
        typer.Option(
            "--rate",
            help=f"Runs dispatched and delivered per second (1-{limits.MAX_RATE_PER_SECOND}).",
            parser=int_parser("dispatch_rate_per_second", 1, limits.MAX_RATE_PER_SECOND),
        ),
    ] = None,
    output: OutputOption = None,
) -> None:
    """Show TENANT's delivery settings, or change its concurrency and rate limits."""
    repo = _repo(ctx)
    if concurrency is None and rate is None:
        settings = repo.settings(tenant)
    else:
        settings = repo.set_delivery(
            tenant, concurrency=concurrency, rate_per_second=rate, actor=actor()
        )
    emit(settings.to_dict(), output_format(ctx, output), title=f"delivery of {settings.name}")


@app.command()
def broker(
    ctx: typer.Context,
    tenant: TenantArgument,
    url: Annotated[
        str | None,
        typer.Argument(help="amqp://user:password@host:5672/vhost of the tenant's RabbitMQ."),
    ] = None,
    builtin: Annotated[
        bool, typer.Option("--builtin", help="Use the built-in queue again.")
    ] = False,
    output: OutputOption = None,
) -> None:
    """Publish TENANT's queue targets to its RabbitMQ broker (URL), or back to the built-in
    queue (--builtin). Messages are persistent and published with confirms."""
    if (url is None) == (not builtin):
        raise errors.ValidationError("give a broker URL or --builtin", field="broker_url")
    settings = _repo(ctx).set_broker(tenant, None if builtin else url, actor=actor())
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(settings.to_dict(), fmt)
        return
    where = settings.broker_url or "the built-in queue"
    say(f"queue targets of {settings.name} now go to {where}")


class _ShowByDefault(TyperGroup):
    """`signing-secret TENANT` is `signing-secret show TENANT` (the command before rotation
    existed); `signing-secret rotate TENANT` rotates. A tenant named like a subcommand is
    shown with `signing-secret show NAME`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] != "--help":
            args = ["show", *args]
        return super().parse_args(ctx, args)


signing_app = typer.Typer(
    cls=_ShowByDefault,
    help="The secret TENANT's deliveries are signed with: show it (the default), or rotate it.",
    no_args_is_help=True,
)


@signing_app.command("show")
def signing_secret(
    ctx: typer.Context,
    tenant: TenantArgument,
    output: OutputOption = None,
) -> None:
    """Print the secret TENANT verifies its deliveries' signatures with (see
    schedctl.signing.verify); hand it over like a password."""
    from schedctl.storage.tenants.tenants import TenantRepo

    repo = TenantRepo(cli_state(ctx).store())
    secret = repo.signing_secret(tenant)
    if output_format(ctx, output) is OutputFormat.json:
        emit({"tenant": tenant, "signing_secret": secret}, OutputFormat.json)
        return
    say(secret)


@signing_app.command("rotate")
def rotate_signing_secret(
    ctx: typer.Context,
    tenant: TenantArgument,
    grace: Annotated[
        str,
        typer.Option(
            "--grace",
            help="How long the old secret keeps signing next to the new one (e.g. 24h, "
            "90m, 0 for not at all; at most 30d).",
        ),
    ] = "24h",
    output: OutputOption = None,
) -> None:
    """Give TENANT a new signing secret and print it. During the grace period every
    delivery carries two signatures (`v2=<new>, v2=<old>`), so the receiver can switch to the
    new secret at any time within it; afterwards only the new secret signs."""
    from schedctl.storage.tenants.signing_secrets import DEFAULT_GRACE, SigningSecretRepo

    period = parse_duration(grace, "grace") if grace.strip() else DEFAULT_GRACE
    keys, secret = SigningSecretRepo(cli_state(ctx).store()).rotate(
        tenant, grace=period, actor=actor()
    )
    until = format_instant(keys.previous_until) if keys.previous_until else None
    data: dict[str, Any] = {
        "tenant": tenant,
        "signing_secret": secret,
        "grace_seconds": period.total_seconds(),
        "previous_until": until,
    }
    if output_format(ctx, output) is OutputFormat.json:
        emit(data, OutputFormat.json)
        return
    say(secret)
    if until:
        say(f"the previous secret keeps signing too until {until}; give the receiver the new one")
    else:
        say("the previous secret no longer signs")
