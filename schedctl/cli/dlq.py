"""Owns `schedctl dlq`: the dead-letter store -- runs whose delivery failed for good, with
their last error -- listed, shown with their attempt history, replayed and purged.

Replaying sends the run again from attempt 1 (a fresh retry budget) to the target it had,
under its own identity (job_id, scheduled_at): receivers deduplicating on the idempotency
key see the same key again. A replayed letter stays in the store, marked replayed_at, until
it is purged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from schedctl.cli.common import (
    OutputOption,
    TenantOption,
    actor,
    cli_state,
    cursor_option,
    emit_page,
    id_parser,
    limit_option,
    output_format,
    say,
)
from schedctl.cli.output import OutputFormat, emit
from schedctl.core import errors, limits
from schedctl.scheduling.timeparse import format_instant, parse_duration

if TYPE_CHECKING:
    from schedctl.storage.pipeline.dead_letters import DeadLetter, DeadLetterRepo

app = typer.Typer(
    help="Dead letters: runs that exhausted their retries. list, show, replay, purge.",
    no_args_is_help=True,
)

LETTER_COLUMNS = (
    "id",
    "tenant",
    "job",
    "job_id",
    "scheduled_at",
    "target",
    "attempts",
    "last_error",
    "created_at",
    "replayed_at",
)
ERROR_COLUMN_CHARS = 80

IdArgument = Annotated[
    int | None,
    typer.Argument(help="The dead letter's id (see `dlq list`).", parser=id_parser("id")),
]


def _all_option(help_text: str) -> Any:
    """The --all flag of list, replay and purge: every letter instead of one (or a page)."""
    return typer.Option("--all", help=help_text)


def letter_to_dict(letter: DeadLetter) -> dict[str, Any]:
    return {
        "id": letter.id,
        "tenant": letter.tenant,
        "tenant_id": letter.tenant_id,
        "job": letter.job,
        "job_id": letter.job_id,
        "scheduled_at": format_instant(letter.scheduled_at),
        "idempotency_key": letter.idempotency_key,
        "target_type": letter.target_type,
        "target": letter.target,
        "attempts": letter.attempts,
        "last_error": letter.last_error,
        "created_at": format_instant(letter.created_at),
        "replayed_at": format_instant(letter.replayed_at) if letter.replayed_at else None,
    }


def _row(letter: DeadLetter) -> dict[str, Any]:
    row = letter_to_dict(letter)
    row["target"] = f"{letter.target_type}:{letter.target}"
    error = letter.last_error or ""
    if len(error) > ERROR_COLUMN_CHARS:
        error = error[: ERROR_COLUMN_CHARS - 3] + "..."
    row["last_error"] = error
    return row


def _repo(ctx: typer.Context) -> DeadLetterRepo:
    from schedctl.storage.pipeline.dead_letters import DeadLetterRepo

    return DeadLetterRepo(cli_state(ctx).store())


def _tenant_id(ctx: typer.Context, tenant: str | None) -> str | None:
    return None if tenant is None else cli_state(ctx).database().get_tenant(tenant).tenant_id


def _job_id(ctx: typer.Context, tenant: str | None, job: str) -> str:
    # a name or id prefix too; an unknown one filters to nothing, as an unknown id did
    try:
        return cli_state(ctx).database().resolve_job(tenant, job)
    except errors.NotFound:
        return job


@app.command("list")
def list_(
    ctx: typer.Context,
    tenant: TenantOption = None,
    job: Annotated[str | None, typer.Option("--job", help="Only this job's runs.")] = None,
    all_: Annotated[bool, _all_option("Include letters already replayed.")] = False,
    limit: Annotated[int, limit_option("Letters")] = 50,
    cursor: Annotated[str | None, cursor_option()] = None,
    output: OutputOption = None,
) -> None:
    """Dead letters, newest first (not yet replayed, unless --all)."""
    page = _repo(ctx).list_letters(
        tenant_id=_tenant_id(ctx, tenant),
        job_id=None if job is None else _job_id(ctx, tenant, job),
        include_replayed=all_,
        limit=limit,
        cursor=cursor,
    )
    emit_page(
        output_format(ctx, output),
        page,
        letter_to_dict,
        columns=LETTER_COLUMNS,
        empty="no dead letters",
        title="dead letters",
        table_rows=lambda letters: _rows(ctx, tenant, letters),
    )


def _rows(
    ctx: typer.Context, tenant: str | None, letters: list[DeadLetter]
) -> list[dict[str, Any]]:
    """Table rows: job ids at their shortest unique prefix (commands accept it back)."""
    short = cli_state(ctx).database().short_job_ids(tenant, [x.job_id for x in letters])
    return [{**_row(x), "job_id": short.get(x.job_id, x.job_id)} for x in letters]


@app.command()
def show(
    ctx: typer.Context,
    letter_id: Annotated[int, typer.Argument(help="The dead letter's id.", parser=id_parser("id"))],
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """One dead letter in full, with every attempt of its run."""
    repo = _repo(ctx)
    letter = repo.get(letter_id, _tenant_id(ctx, tenant))
    data = letter_to_dict(letter)
    data["attempt_history"] = [
        {
            "attempt": a["attempt"],
            "status": a["status"],
            "started_at": format_instant(a["started_at"]) if a["started_at"] else None,
            "finished_at": format_instant(a["finished_at"]) if a["finished_at"] else None,
            "error": a["error"],
            "by": a["worker"],
        }
        for a in repo.attempts(letter)
    ]
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(data, fmt)
        return
    history = data.pop("attempt_history")
    emit(data, fmt, title=f"dead letter {letter.id}")
    if history:
        emit(
            history,
            fmt,
            columns=("attempt", "status", "started_at", "finished_at", "error", "by"),
            title="attempts",
        )


@app.command()
def replay(
    ctx: typer.Context,
    letter_id: IdArgument = None,
    all_: Annotated[bool, _all_option("Replay every pending letter (of --tenant).")] = False,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """Deliver a dead-lettered run again, from attempt 1 (ID, or --all)."""
    _one_or_all(letter_id, all_)
    repo = _repo(ctx)
    tenant_id = _tenant_id(ctx, tenant)
    fmt = output_format(ctx, output)
    if letter_id is not None:
        letter = repo.replay(letter_id, tenant_id=tenant_id, actor=actor())
        if fmt is OutputFormat.json:
            emit(letter_to_dict(letter), fmt)
        else:
            say(f"dead letter {letter.id} replayed: run {letter.idempotency_key} is queued again")
        return
    replayed, skipped = repo.replay_all(tenant_id=tenant_id, actor=actor())
    if fmt is OutputFormat.json:
        emit({"replayed": replayed, "skipped_cancelled": skipped}, fmt)
        return
    say(f"{replayed} dead letter(s) replayed")
    if skipped:
        say(f"{skipped} skipped: their job is cancelled")


@app.command()
def purge(
    ctx: typer.Context,
    letter_id: IdArgument = None,
    all_: Annotated[bool, _all_option("Purge every letter (of --tenant, --older-than).")] = False,
    older_than: Annotated[
        str | None,
        typer.Option("--older-than", help="With --all: only letters older than this (7d, 12h)."),
    ] = None,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """Delete dead letters for good: ID, or --all [--older-than 7d] [--tenant T]."""
    if older_than is not None and not all_:
        raise errors.ValidationError("--older-than goes with --all", field="older_than")
    _one_or_all(letter_id, all_)
    age: timedelta | None = None
    if older_than is not None:
        age = parse_duration(older_than, "older_than")
        if age <= timedelta(0) or age > limits.MAX_AGE:
            raise errors.ValidationError(
                f"must be positive and at most {limits.MAX_AGE.days} days", field="older_than"
            )
    repo = _repo(ctx)
    tenant_id = _tenant_id(ctx, tenant)
    fmt = output_format(ctx, output)
    if letter_id is not None:
        repo.purge(letter_id, tenant_id=tenant_id, actor=actor())
        count = 1
    else:
        count = repo.purge_all(tenant_id=tenant_id, older_than=age, actor=actor())
    if fmt is OutputFormat.json:
        emit({"purged": count}, fmt)
    else:
        say(f"{count} dead letter(s) purged")


def _one_or_all(letter_id: int | None, all_: bool) -> None:
    if letter_id is None and not all_:
        raise errors.ValidationError("give a dead letter ID, or --all", field="id")
    if letter_id is not None and all_:
        raise errors.ValidationError("give a dead letter ID or --all, not both", field="id")
