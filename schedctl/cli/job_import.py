"""Owns `schedctl job import FILE.jsonl`: bulk creation from a JSON Lines file (one POST /v1/jobs
body per line), sent in batches of up to 1,000 (POST /v1/jobs:batch with --api, else straight
to the database), with a progress bar on stderr and a summary of what was created, replayed
and refused (by line number, with the error naming the field).

Each line is independent: a line that is not JSON, or a job the scheduler refuses, is
reported and the other lines of its batch are created all the same.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any

import orjson
import typer

from schedctl.cli.common import OutputOption, actor, cli_state, output_format, say
from schedctl.cli.output import OutputFormat, emit, emit_json, err_console
from schedctl.core import errors, limits

if TYPE_CHECKING:
    from schedctl.app.service import Scheduler
    from schedctl.clients.client import ApiClient
    from schedctl.domain.models import CreateOutcome

# a batch also stops short of this many bytes of job bodies, so that it stays under the
# API's request limit (1 MiB at least) whatever the payloads
MAX_BATCH_BYTES = 768 * 1024
# batches sent before the first is answered (each a transaction of its own)
IN_FLIGHT = 2
# failures listed in the table output (all of them in JSON)
SHOWN_FAILURES = 50


@dataclass
class _Summary:
    lines: int = 0
    created: int = 0
    replayed: int = 0
    # (line, error): recorded as batches are answered, two of them in flight
    refused: list[tuple[int, errors.SchedError]] = field(default_factory=list)

    def fail(self, line: int, error: errors.SchedError) -> None:
        self.refused.append((line, error))

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The failed lines in line order."""
        return [
            {"line": line, "code": e.code, "field": e.field, "message": e.message}
            for line, e in sorted(self.refused, key=lambda failure: failure[0])
        ]

    @property
    def first_error(self) -> errors.SchedError | None:
        """The failure of the first failed line (its exit code is the command's)."""
        return min(self.refused, key=lambda failure: failure[0])[1] if self.refused else None


def job_import(
    ctx: typer.Context,
    file: Annotated[
        Path,
        typer.Argument(
            help="JSON Lines: one job body per line, as POST /v1/jobs takes it ('-': stdin).",
            show_default=False,
        ),
    ],
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", "-t", help="Tenant name or id (with --api: the token's)."),
    ] = None,
    output: OutputOption = None,
) -> None:
    """Create many jobs from a JSON Lines file, one job body per line (the shape of POST
    /v1/jobs, idempotency_key included), in batches of up to 1,000 per transaction.

    Each line stands alone: a line that is not JSON or a job that is refused is reported
    with its line number and the error naming the field, and every other line is still
    created. Blank lines are skipped. Lines with an idempotency_key already used for the
    same job are replayed (counted, not created again), so an interrupted import can be run
    again. Exits non-zero (the first failure's exit code) when any line failed."""
    fmt = output_format(ctx, output)
    state = cli_state(ctx)
    scheduler = state.scheduler()
    from schedctl.clients.client import ApiClient

    if not isinstance(scheduler, ApiClient) and tenant is None:
        raise errors.ValidationError("a tenant is required (--tenant)", field="tenant")
    total = _count_lines(file)
    summary = _Summary()
    began = time.perf_counter()
    with (
        _open(file) as stream,
        _progress(total, enabled=fmt is not OutputFormat.json) as advance,
        ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="import") as pool,
    ):
        # the next batch is on its way while this one is answered and tallied: the server
        # (or the database) is not idle while this process reads and parses
        in_flight: deque[tuple[_Batch, Future[list[CreateOutcome]]]] = deque()
        for batch in _batches(stream, summary, raw=isinstance(scheduler, ApiClient)):
            in_flight.append((batch, pool.submit(_create, scheduler, tenant, batch)))
            if len(in_flight) >= IN_FLIGHT:
                _tally(*in_flight.popleft(), summary, advance)
        while in_flight:
            _tally(*in_flight.popleft(), summary, advance)
    elapsed = time.perf_counter() - began
    report = {
        "file": str(file),
        "lines": summary.lines,
        "created": summary.created,
        "replayed": summary.replayed,
        "failed": len(summary.failures),
        "elapsed_s": round(elapsed, 3),
        "jobs_per_s": round(summary.created / elapsed, 1) if elapsed > 0 else None,
        "failures": summary.failures,
    }
    if fmt is OutputFormat.json:
        emit_json(report)
    else:
        _print_report(report, fmt)
    if summary.first_error is not None:
        raise typer.Exit(summary.first_error.exit_code)


@dataclass
class _Batch:
    # parsed bodies, or with the API each line's JSON text, sent as it is (_api_text)
    bodies: list[Any] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)
    size: int = 0
    lines: int = 0  # lines read for this batch, bad and blank ones too (the progress)


def _batches(stream: IO[str], summary: _Summary, *, raw: bool) -> Iterator[_Batch]:
    """Batches of parsed bodies (`raw`: of checked JSON texts) with their line numbers;
    lines that are not JSON are recorded as failures on the way."""
    batch = _Batch()
    for number, line in enumerate(stream, start=1):
        summary.lines = number
        batch.lines += 1
        if not line.strip():
            continue
        try:
            body = _api_text(line) if raw else limits.parse_json(line, "line")
        except errors.SchedError as exc:
            reason = exc.message.removeprefix("line: ")
            summary.fail(number, errors.ValidationError(f"line {number} {reason}", field="line"))
            continue
        if batch.bodies and batch.size + len(line) > MAX_BATCH_BYTES:
            yield batch
            batch = _Batch()
        batch.bodies.append(body)
        batch.line_numbers.append(number)
        batch.size += len(line)
        if len(batch.bodies) >= limits.MAX_BATCH_JOBS:
            yield batch
            batch = _Batch()
    if batch.bodies or batch.lines:
        yield batch


def _api_text(line: str) -> str:
    """A line to send through the API as it was written, once it is known to be JSON that
    the server reads as json.loads reads the line (orjson, in C, first; what it refuses, such
    as NaN or a lone surrogate, is checked the slow way): parsing every line and encoding the
    batch again dominated an import's own CPU."""
    text = line.strip()
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        limits.parse_json(text, "line")
        try:  # stdin read with surrogateescape may hold undecodable bytes as surrogates
            text.encode()
        except UnicodeEncodeError:
            raise errors.ValidationError("is not UTF-8 text", field="line") from None
    # nesting past what the server reads inside a batch's envelope would refuse the whole
    # batch; deeper than a payload may be, it is this line's error alone
    if text.count("[") + text.count("{") > limits.MAX_PAYLOAD_DEPTH and limits.too_deep(text):
        raise errors.ValidationError(
            f"is nested deeper than {limits.MAX_PAYLOAD_DEPTH} levels", field="line"
        )
    return text


def _create(
    scheduler: Scheduler | ApiClient, tenant: str | None, batch: _Batch
) -> list[CreateOutcome]:
    """The batch's outcomes (in a pool thread); a batch refused as a whole raises."""
    if not batch.bodies:
        return []
    from schedctl.clients.client import ApiClient

    if isinstance(scheduler, ApiClient):
        return scheduler.import_many(tenant, batch.bodies)
    assert tenant is not None  # checked by the command
    return scheduler.create_many(tenant, batch.bodies, actor=actor())


def _tally(
    batch: _Batch,
    answer: Future[list[CreateOutcome]],
    summary: _Summary,
    advance: Callable[[int], None],
) -> None:
    try:
        outcomes = answer.result()
    except (errors.StoreUnavailable, errors.Unauthorized):
        raise  # nothing else will get through either
    except errors.SchedError as exc:
        # the batch as a whole was refused (too large for the API, say): each of its lines
        for number in batch.line_numbers:
            summary.fail(number, exc)
        advance(batch.lines)
        return
    for number, outcome in zip(batch.line_numbers, outcomes, strict=True):
        if outcome.error is not None:
            summary.fail(number, outcome.error)
        elif outcome.created:
            summary.created += 1
        else:
            summary.replayed += 1
    advance(batch.lines)


def _count_lines(file: Path) -> int | None:
    """The progress bar's total: the file's lines (None for stdin: unknown)."""
    if str(file) == "-":
        return None
    try:
        with file.open("rb") as stream:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: stream.read(1 << 20), b""))
    except OSError as exc:
        raise errors.ValidationError(
            f"cannot read {file}: {exc.strerror or exc}", field="file"
        ) from exc


@contextmanager
def _open(file: Path) -> Iterator[IO[str]]:
    """The file (or stdin) as text; a file that cannot be read is an error naming `file`."""
    if str(file) == "-":
        yield sys.stdin
        return
    try:
        stream = file.open(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise errors.ValidationError(
            f"cannot read {file}: {exc.strerror or exc}", field="file"
        ) from exc
    with stream:
        yield stream


@contextmanager
def _progress(total: int | None, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (off with -o json); yields `advance(lines)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("importing"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=not enabled,
    )
    task = progress.add_task("import", total=total)
    with progress:
        yield lambda lines: progress.advance(task, lines)


def _print_report(report: dict[str, Any], fmt: OutputFormat) -> None:
    failures = report["failures"]
    summary = {k: v for k, v in report.items() if k != "failures"}
    emit(summary, fmt, title="job import")
    if failures:
        shown = failures[:SHOWN_FAILURES]
        emit(shown, fmt, columns=("line", "code", "field", "message"), title="failed lines")
        if len(failures) > len(shown):
            say(f"... and {len(failures) - len(shown)} more (-o json lists them all)")
