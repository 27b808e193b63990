"""Owns `schedctl apply`: a jobs.d directory in, the central jobs made to match it (as this
host sees it), shown as a diff table or JSON; --dry-run only shows, --prune also removes
what this host applied earlier from files that are gone.

With `--api URL` (a cron host with its host token, no database URL) it goes through the
REST API: the token decides the tenant, and a host token must be this host's, serve its
groups, and be allowed every write of the plan before the first is made. Without --db and
--api, the [host] table's api_url and token_file (the worker's) say the same."""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from schedctl.app import jobfiles_apply as applying
from schedctl.cli.common import CliState, OutputOption, actor, cli_state, output_format, say
from schedctl.cli.output import OutputFormat, emit_json, emit_table, err_console
from schedctl.core import errors
from schedctl.domain import jobfiles
from schedctl.domain.config import DEFAULT_CONFIG_PATH, load_config
from schedctl.domain.host_scope import HostScope
from schedctl.domain.jobfiles import placement

COLUMNS = ("action", "name", "detail")
SHOWN_DIGEST = 12


def apply(
    ctx: typer.Context,
    directory: Annotated[
        Path, typer.Argument(help="The jobs.d directory.", metavar="DIR", show_default=True)
    ] = jobfiles.DEFAULT_DIR,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would change; write nothing.")
    ] = False,
    keep_removed: Annotated[
        bool,
        typer.Option(
            "--keep-removed",
            help="Keep the central jobs this host applied that its files no longer define "
            "(removed by default).",
        ),
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Write nothing; exit 1 when the central jobs differ from the files "
            "(for a monitoring timer), 0 when in step.",
        ),
    ] = False,
    prune: Annotated[
        bool,
        typer.Option("--prune", hidden=True, help="Deprecated: removing is the default."),
    ] = False,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            metavar="NAME",
            help="This host's name (default: host.name of --config, else the node name).",
        ),
    ] = None,
    group: Annotated[
        list[str] | None,
        typer.Option(
            "--group",
            metavar="GROUP",
            help="A host group this host is in (repeat; default: host.groups of --config).",
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", "-t", help="Tenant name or id (default: the only tenant)."),
    ] = None,
    mail_domain: Annotated[
        str | None,
        typer.Option(
            "--mail-domain",
            help="Domain for local mailboxes of the alerts (MAILTO=root becomes "
            "root@DOMAIN; default: this host's fully qualified name, when it has a dot).",
        ),
    ] = None,
    output: OutputOption = None,
) -> None:
    """Make the central jobs match the job files of DIR, by name: created, changed,
    unchanged, removed (jobs this host applied that its files no longer define, unless
    --keep-removed). Every file is validated before anything is written. An operator's
    pause survives; `enabled = false` in a file pauses."""
    if prune:
        err_console.print(
            "note: --prune is deprecated and does nothing: apply removes by default",
            markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip
    dry_run = dry_run or check
    root = Path(os.path.abspath(directory))  # references are absolute paths
    files = jobfiles.load_dir(root)
    state = cli_state(ctx)
    config = state.config_path or (
        str(DEFAULT_CONFIG_PATH) if DEFAULT_CONFIG_PATH.exists() else None
    )
    name, groups = applying.read_host(config)
    if host is not None:
        name = placement.check_host(host, "--host")
    if group:
        groups = tuple(group)
    scope: HostScope | None = None
    jobs: applying.Jobs
    if not state.api_url and not state.db and config is not None:
        _api_of_host_table(state, config)  # a cron host: [host] api_url and token_file
    if state.api_url:
        # imported here: the API client loads requests, which `schedctl --help` must not
        from schedctl.clients.client import ApiClient

        client = state.scheduler()
        assert isinstance(client, ApiClient)
        me = client.whoami()
        owner = str(me.get("name"))
        client._check_tenant(tenant)
        scope = _token_scope(me, name, groups)
        jobs, now = client, datetime.now(UTC)
    else:
        database = state.database()
        owner = tenant or _only_tenant([t.name for t in database.list_tenants()])
        jobs, now = database, database.store.now()
    plan = applying.plan(
        files,
        name,
        groups,
        applying.read_central(jobs, owner),
        directory=root,
        now=now,
        keep_removed=keep_removed,
        mail_domain=mail_domain or _fqdn_domain(),
    )
    if scope is not None:
        applying.check_host_scope(plan, scope)
    if not dry_run:
        applying.execute(jobs, owner, plan, actor=actor())
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit_json(plan.as_dict(applied=not dry_run))
    else:
        _table(plan, drift_only=check)
        counts = ", ".join(f"{len(plan.of(a))} {a.value}" for a in applying.Action)
        note = " (dry run: nothing written)" if dry_run and plan.writes and not check else ""
        if check:
            note = " (drift: run `schedctl apply`)" if plan.writes else " (in step)"
        say(f"host {plan.host}: {counts}, {len(plan.skipped)} skipped{note}")
    if check and plan.writes:
        raise typer.Exit(1)


def _api_of_host_table(state: CliState, config: str) -> None:
    """With neither --db nor --api: the REST API and the host token of the [host] table
    (api_url, token_file) when it names them, as the host's worker uses them."""
    host = load_config(config).host
    if host is None or host.api_url is None:
        return
    state.api_url = host.api_url
    if not state.api_token and host.token_file is not None:
        try:
            state.api_token = Path(host.token_file).read_text().strip()
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read the token file {host.token_file!r}: {exc.strerror}",
                field="host.token_file",
            ) from exc


def _token_scope(me: dict[str, Any], host: str, groups: tuple[str, ...]) -> HostScope | None:
    """The host token's scope (None: a tenant token), which must be `host`'s and serve
    each of its `groups`: else a ValidationError before anything is read or written."""
    token_host = me.get("host")
    if token_host is None:
        return None
    if token_host != host:
        raise errors.ValidationError(
            f"the API token is the host token of {token_host!r}, and this host is {host!r} "
            "(--host, or host.name of --config)",
            field="host",
        )
    token_groups = tuple(str(g) for g in me.get("groups") or ())
    missing = sorted(set(groups) - set(token_groups))
    if missing:
        raise errors.ValidationError(
            f"the host token of {host!r} does not serve group(s) {', '.join(missing)}",
            field="group",
        )
    return HostScope(host, token_groups)


def _fqdn_domain() -> str | None:
    fqdn = socket.getfqdn()
    return fqdn if "." in fqdn and not fqdn.startswith("localhost") else None


def _only_tenant(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    raise errors.ValidationError(
        f"a tenant is required (--tenant): {len(names)} tenants exist", field="tenant"
    )


def _table(plan: applying.Plan, *, drift_only: bool = False) -> None:
    rows: list[dict[str, Any]] = []
    for action in applying.Action:
        if drift_only and action is applying.Action.unchanged:
            continue
        for entry in plan.of(action):
            rows.append({"action": action.value, "name": entry.name, "detail": _detail(entry)})
    for skip in plan.skipped:
        kind = "boot" if skip.reason == applying.BOOT else "skipped"
        rows.append({"action": kind, "name": skip.name, "detail": skip.reason})
    if rows:
        emit_table(rows, COLUMNS)


def _detail(entry: applying.Entry) -> str:
    if entry.action is applying.Action.changed:
        parts = [
            f"{k}: {_value(k, old)} -> {_value(k, new)}" for k, (old, new) in entry.fields.items()
        ]
        return "; ".join(parts) + (" (replaced)" if entry.replace else "")
    if entry.action is applying.Action.removed:
        return "not in the job files any more"
    body = entry.body or {}
    target = body.get("target", {}).get("name", "")
    when = body.get("schedule", {})
    schedule = ", ".join(f"{k}={v}" for k, v in when.items())
    if when.get("boot"):
        schedule = "@reboot (run by the host once per boot)"
    elif "after" in body:
        schedule = "after " + ", ".join(body["after"])
    return f"{schedule} -> {target}" if entry.action is applying.Action.created else ""


def _value(key: str, value: Any) -> str:
    if key.endswith("digest") and isinstance(value, str):
        return value[:SHOWN_DIGEST]
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
