"""Owns `schedctl db`: schema migrations (upgrade, idempotent) and the schema status."""

from __future__ import annotations

import typer

from schedctl.cli.common import OutputOption, cli_state, output_format, say
from schedctl.cli.output import OutputFormat, emit
from schedctl.storage.engine import check_connection, make_engine, redact
from schedctl.storage.migrate import current_revision, head_revision, upgrade_engine
from schedctl.storage.store import Store

app = typer.Typer(
    help="Database schema: upgrade to this version's schema, or show its status.",
    no_args_is_help=True,
)


@app.command()
def upgrade(ctx: typer.Context, output: OutputOption = None) -> None:
    """Migrate the database to this version's schema (safe to run again: then a no-op)."""
    state = cli_state(ctx)
    config = state.config()
    store = Store(make_engine(state.database_url()))
    try:
        before, after = upgrade_engine(store.engine)
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


@app.command()
def status(ctx: typer.Context, output: OutputOption = None) -> None:
    """The database's schema revision and the one this version needs."""
    state = cli_state(ctx)
    engine = make_engine(state.database_url())
    try:
        check_connection(engine)
        current = current_revision(engine)
    finally:
        engine.dispose()
    head = head_revision()
    result = {
        "database": redact(str(engine.url)),
        "current": current,
        "head": head,
        "up_to_date": current == head,
    }
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(result, fmt)
        return
    emit(result, fmt, title="schema")
    if current != head:
        say("run `schedctl db upgrade` to bring it up to date")
