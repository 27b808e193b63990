"""Owns `schedctl db`: schema migrations (online upgrade, idempotent; downgrade), the schema
status with its compatibility (storage/db/migrate.py: the rule), the
runtime role's grants and the owner's run-history maintenance (day partitions made ahead,
expired ones dropped), backup and restore, and payload encryption keys (make a new key,
re-encrypt every payload and signing secret after a rotation)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format, say
from schedctl.cli.output import OutputFormat, emit, err_console
from schedctl.core import errors

# the storage modules (sqlalchemy, alembic, the drivers) are imported inside each command:
# `schedctl --help` must not load them

SCHEMA_BEHIND_EXIT = 2  # `db status`: the schema is not this version's (see --help)

app = typer.Typer(
    help=(
        "Database schema: upgrade (online) to this version's schema, downgrade, or show its "
        "status and compatibility; backup and restore; retention and grants; payload "
        "encryption keys."
    ),
    no_args_is_help=True,
)


@app.command()
def upgrade(ctx: typer.Context, output: OutputOption = None) -> None:
    """Migrate the database to this version's schema (safe to run again: then a no-op)."""
    from schedctl.storage.db.engine import make_engine, redact
    from schedctl.storage.db.migrate import current_revision, upgrade_steps
    from schedctl.storage.db.store import Store

    state = cli_state(ctx)
    config = state.config()
    store = Store(make_engine(state.database_url()))
    try:
        before = current_revision(store.engine)
        steps = upgrade_steps(store.engine)
        after = current_revision(store.engine)
        store.ensure_settings(config.partition_count)
        partitions = store.partition_count
    finally:
        store.close()
    result = {
        "database": redact(str(store.engine.url)),
        "before": before,
        "after": after,
        "changed": before != after,
        "partition_count": partitions,
        "steps": _steps_json(steps),
    }
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(result, fmt)
        return
    if before == after:
        say(f"{result['database']}: already at revision {after}")
    else:
        say(f"{result['database']}: upgraded {before or '(empty)'} -> {after}")
    if partitions != config.partition_count:
        # the partition count is fixed when the database is created; config cannot move it
        say(
            f"note: this database keeps partition_count={partitions} "
            f"(the configuration says {config.partition_count})"
        )


def _steps_json(steps: list[Any]) -> list[dict[str, Any]]:
    """Each migration step as run: from, to, attempts (lock timeouts retried), seconds."""
    return [
        {"from": s.source, "to": s.target, "attempts": s.attempts, "seconds": round(s.seconds, 3)}
        for s in steps
    ]


@app.command()
def downgrade(
    ctx: typer.Context,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help="Go back to this revision (one before the current); default: the previous one.",
            show_default=False,
        ),
    ] = None,
    output: OutputOption = None,
) -> None:
    """Return the schema to the previous revision (or --to REV), one migration at a time,
    each with the lock timeout of `db upgrade`. Only before any daemon of the newer release
    has written data into what the downgrade drops (its new tables and columns): that data
    goes with them. Refused at the first revision, and on a revision this version does not
    know (run the downgrade with the schedctl of the release that made it)."""
    from schedctl.storage.db.engine import make_engine, redact
    from schedctl.storage.db.migrate import current_revision, downgrade_steps

    state = cli_state(ctx)
    engine = make_engine(state.database_url())
    try:
        before = current_revision(engine)
        steps = downgrade_steps(engine, to)
        after = current_revision(engine)
    finally:
        engine.dispose()
    result = {
        "database": redact(str(engine.url)),
        "before": before,
        "after": after,
        "changed": before != after,
        "steps": _steps_json(steps),
    }
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(result, fmt)
    elif before == after:
        say(f"{result['database']}: already at revision {after}")
    else:
        say(f"{result['database']}: downgraded {before} -> {after}")


@app.command()
def status(ctx: typer.Context, output: OutputOption = None) -> None:
    """The database's schema revision, the one this version needs (head) and whether this
    version's daemons may run against it: at head, or at a newer release's revision declared
    compatible with head (`compatible`), exit 0; behind (run `schedctl db upgrade`) or newer
    and not compatible (install the newer release), exit 2."""
    from schedctl.storage.db.engine import check_connection, make_engine, redact
    from schedctl.storage.db.migrate import schema_check

    state = cli_state(ctx)
    engine = make_engine(state.database_url())
    try:
        check_connection(engine)
        check = schema_check(engine)
    finally:
        engine.dispose()
    result = {
        "database": redact(str(engine.url)),
        "current": check.current,
        "head": check.head,
        "compatible_with": check.floor,
        "compatibility": check.state,
        "up_to_date": check.current == check.head,
    }
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(result, fmt)
    else:
        emit(result, fmt, title="schema")
        if check.state != "current":
            say(check.message("the database"))
    if not check.usable:
        raise typer.Exit(SCHEMA_BEHIND_EXIT)


def warn(message: str) -> None:
    """A line on stderr: stdout keeps only the statements (`db grant ROLE | psql`)."""
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)


@app.command()
def grant(
    ctx: typer.Context,
    role: Annotated[str, typer.Argument(help="The daemons' runtime role (it must exist).")],
    apply: Annotated[
        bool,
        typer.Option("--apply", help="Run the statements (as the owner), not only print them."),
    ] = False,
    output: OutputOption = None,
) -> None:
    """Print (or with --apply run) the GRANT statements that give ROLE what the dispatcher,
    relay, worker and API need: SELECT, INSERT, UPDATE and DELETE on the scheduler's
    tables, USAGE on their sequences, SELECT on the schema version; no DDL, no TRUNCATE.
    Default privileges of the owner (the role of this command's URL) cover the tables later
    migrations create; running it again after `db upgrade` changes nothing. Postgres only:
    a SQLite file has no roles."""
    from schedctl.storage.db.engine import has_roles
    from schedctl.storage.db.roles import apply_grants, check_role_name, runtime_grants

    state = cli_state(ctx)
    check_role_name(role)
    if not has_roles(state.database_url()):
        # before opening it: a SQLite file would be created by the look
        raise errors.ValidationError(
            "database roles do not apply to an embedded file database: the file's owner "
            "and mode decide who may open it",
            field="database_url",
        )
    store = state.store()
    grants = runtime_grants(store, role)
    if apply:
        apply_grants(store, grants)
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(
            {
                "role": role,
                "statements": list(grants.statements),
                "notes": list(grants.notes),
                "applied": apply,
            },
            fmt,
        )
        return
    for statement in grants.statements:
        say(f"{statement};")
    for note in grants.notes:
        warn(f"note: {note}")
    if apply:
        warn(f"applied {len(grants.statements)} statements for {role!r}")


@app.command()
def maintain(
    ctx: typer.Context,
    days_ahead: Annotated[
        int,
        typer.Option(
            "--days-ahead", min=1, max=366, help="Make day partitions this many days ahead."
        ),
    ] = 7,
    retention_days: Annotated[
        int | None,
        typer.Option(
            "--retention-days",
            min=1,
            max=36500,
            help="Drop run history older than this; default: retention_days of the config.",
            show_default=False,
        ),
    ] = None,
    output: OutputOption = None,
) -> None:
    """Run-history maintenance as the database owner (from scheduled-d-maintain.timer):
        make the day partitions of runs up to --days-ahead days ahead and drop those older than
        the retention period, delete older rows, and dead letters, sent alerts and audit entries
    older than dead_letter_retention_days, alert_retention_days and audit_retention_days. The
    daemons run as the runtime role, which may
        not do DDL: they only delete expired rows, and warn when fewer than 2 days ahead have
        their partition (a missing day's runs go to the default partition: none is lost)."""
    from schedctl.storage.records.retention import RecordRetention, maintain_runs

    state = cli_state(ctx)
    config = state.config()
    keep = retention_days if retention_days is not None else config.retention_days
    records = RecordRetention(
        dead_letter_days=config.dead_letter_retention_days,
        alert_days=config.alert_retention_days,
        audit_days=config.audit_retention_days,
    )
    done = maintain_runs(
        state.store(),
        retention_days=keep,
        days_ahead=days_ahead,
        require_owner=True,
        records=records,
    )
    result = {
        "created": done.created,
        "removed": done.removed,
        "pruned": {
            "dead_letters": done.pruned.dead_letters,
            "alerts": done.pruned.alerts,
            "audit_log": done.pruned.audit_log,
        },
        "days_ahead": done.days_ahead,
        "retention_days": keep,
    }
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(result, fmt)
        return
    say(
        f"{len(done.created)} day partition(s) created, {done.removed} expired partition(s) "
        "and row(s) removed"
    )
    say(
        f"{done.pruned.dead_letters} dead letter(s), {done.pruned.alerts} alert(s) and "
        f"{done.pruned.audit_log} audit entr(ies) past their retention deleted"
    )
    if done.days_ahead is None:
        say("run history is one table here (not partitioned): expired rows deleted")
    else:
        say(f"day partitions ready for {done.days_ahead} day(s) after today")


@app.command("new-payload-key")
def new_payload_key() -> None:
    """Print a new payload encryption key (for SCHEDULED_PAYLOAD_KEYS_FILE; keep it secret).

    To rotate: put the new key FIRST in the key file and keep the old ones after it; restart
    the daemons and API servers; run `schedctl db rotate-payload-key`; then remove the old
    keys and restart again."""
    from schedctl.core.crypto import PayloadCipher

    say(PayloadCipher.generate_key())


@app.command("rotate-payload-key")
def rotate_payload_key(ctx: typer.Context, output: OutputOption = None) -> None:
    """Re-encrypt every stored job payload and tenant signing secret with the current
    (first) key; plaintext ones written before encryption was enabled get encrypted too. Safe
    to run again, and while the scheduler runs."""
    from schedctl.storage.jobs.payloads import payload_cipher, rotate_payloads
    from schedctl.storage.tenants.signing_secrets import rotate_signing_secrets

    cipher = payload_cipher()
    store = cli_state(ctx).store()
    result = rotate_payloads(store, cipher)
    secrets = rotate_signing_secrets(store, cipher)
    data: dict[str, Any] = {
        "examined": result.examined,
        "rewritten": result.rewritten,
        "already_current": result.already_current,
        "signing_secrets": {
            "examined": secrets.examined,
            "rewritten": secrets.rewritten,
            "already_current": secrets.already_current,
        },
        "keys": cipher.key_count if cipher is not None else 0,
    }
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(data, fmt)
        return
    say(
        f"{result.examined} payload(s): {result.rewritten} re-encrypted with the current key, "
        f"{result.already_current} already under it"
    )
    say(
        f"{secrets.examined} signing secret(s): {secrets.rewritten} re-encrypted, "
        f"{secrets.already_current} already under the current key"
    )
    if data["keys"] and int(data["keys"]) > 1:
        say("the older keys can now be removed from the key file (then restart the daemons)")


FileArgument = Annotated[str, typer.Argument(help="The backup file.", metavar="FILE")]
ForceOption = Annotated[
    bool, typer.Option("--force", help="Replace an existing FILE (backup) or database (restore).")
]


@app.command()
def backup(
    ctx: typer.Context, file: FileArgument, force: ForceOption = False, output: OutputOption = None
) -> None:
    """Write a backup of the database to FILE (mode 0600: it holds token digests, secrets
    and payloads). SQLite: a consistent copy through its online backup API, safe while the
    daemons run. Postgres: pg_dump in its custom format (the client tools of the server's
    major version must be on PATH; the password goes through the environment, never the
    command line). An existing FILE is replaced only with --force."""
    from schedctl.storage.db.backup import backup as make_backup

    state = cli_state(ctx)
    done = make_backup(state.database_url(), file, force=force)
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit({"file": done.file, "database": done.database, "bytes": done.bytes}, fmt)
        return
    say(f"{done.database}: backed up to {done.file} ({done.bytes} bytes)")


@app.command()
def restore(
    ctx: typer.Context, file: FileArgument, force: ForceOption = False, output: OutputOption = None
) -> None:
    """Replace the database's contents with the backup FILE. Stop every scheduled-d first:
    it is refused while a dispatcher holds the database's partitions, and a database that
    already holds a scheduler is replaced only with --force. SQLite: through the online
    backup API, all or nothing, the file kept 0600. Postgres: pg_restore --clean --if-exists
    --no-owner --no-privileges --single-transaction, run as the owner's URL; grants are
    not restored: run `schedctl db grant ROLE --apply` again for the runtime role. Then
    `schedctl db upgrade` if the backup is from an older version."""
    from schedctl.storage.db.backup import restore as restore_backup
    from schedctl.storage.db.engine import make_engine
    from schedctl.storage.db.migrate import current_revision, head_revision

    state = cli_state(ctx)
    url = state.database_url()
    done = restore_backup(url, file, force=force)
    engine = make_engine(url)
    try:
        revision = current_revision(engine)
    finally:
        engine.dispose()
    head = head_revision()
    result = {
        "file": done.file,
        "database": done.database,
        "revision": revision,
        "head": head,
        "up_to_date": revision == head,
    }
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(result, fmt)
        return
    say(f"{done.database}: restored from {done.file} (schema revision {revision})")
    if revision != head:
        say(f"run `schedctl db upgrade`: this version needs revision {head}")
    if done.backend == "postgresql":
        say("grants are not restored: run `schedctl db grant ROLE --apply` for the runtime role")
