"""Owns `schedctl logs JOB [RUN] [--follow]`: the output a job's runs left in the run history,
each attempt under a header line (attempt, status, started, finished, exit code), and with
--follow the output of the runs that come after, as they run and finish.

Where it reads: the database (every recorded attempt of a run, run_attempts), or with --api
the runs route of the REST API (the run's latest attempt only: the API shows runs, not
attempts). A running run's output so far is what the worker's last heartbeat sent (every few
seconds); the rest appears when the attempt finishes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from schedctl.cli.common import (
    CliState,
    OutputOption,
    TenantOption,
    cli_state,
    number_parser,
    output_format,
)
from schedctl.cli.output import OutputFormat
from schedctl.core import errors, limits
from schedctl.domain.models import AttemptLog, Run, RunStatus, run_key
from schedctl.scheduling.timeparse import format_instant, parse_instant

if TYPE_CHECKING:
    from schedctl.app.service import Scheduler
    from schedctl.clients.client import ApiClient

# runs looked at per poll of --follow (newest first): more runs than this finishing between
# two polls are shown only from the newest ones
FOLLOW_PAGE = 100
# --api has no lookup of one run: pages of the run history are read, at most this many
MAX_PAGES = 100
DEFAULT_INTERVAL_SECONDS = 1.0
# statuses of a run with nothing recorded yet, or nothing ever run
_NOT_STARTED = (RunStatus.dispatched, RunStatus.skipped)


@dataclass(frozen=True)
class RunOutput:
    run: Run
    attempts: tuple[AttemptLog, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.run.job_id,
            "scheduled_at": format_instant(self.run.scheduled_at),
            "run_key": run_key(self.run.job_id, self.run.scheduled_at),
            "status": self.run.status.value,
            "attempts": [attempt_dict(a) for a in self.attempts],
        }


def _instant(value: datetime | None) -> str | None:
    return None if value is None else format_instant(value)


def attempt_dict(attempt: AttemptLog) -> dict[str, Any]:
    return {
        "attempt": attempt.attempt,
        "status": attempt.status,
        "started_at": _instant(attempt.started_at),
        "finished_at": _instant(attempt.finished_at),
        "exit_code": attempt.exit_code,
        "error": attempt.error,
        "output": attempt.output,
    }


def _live(run: Run) -> AttemptLog:
    """The attempt a worker holds now, its output as of the last heartbeat."""
    return AttemptLog(
        run.attempt, run.status.value, run.started_at, None, None, None, run.output_tail
    )


def _latest_only(run: Run) -> AttemptLog:
    """What the runs row says of its latest attempt (all --api can see)."""
    return AttemptLog(
        run.attempt,
        run.status.value,
        run.started_at,
        run.finished_at,
        run.exit_code,
        run.error,
        run.output_tail,
    )


class Source:
    """Runs and their attempts, from the database or (with --api) the REST API."""

    def __init__(self, state: CliState, tenant: str | None) -> None:
        self.state = state
        self.tenant = tenant
        self.remote = bool(state.api_url)
        self.scheduler: Scheduler | ApiClient = state.scheduler()

    def job_id(self, ref: str) -> str:
        return self.scheduler.resolve_job(self.tenant, ref)

    def recent(self, job_id: str, limit: int) -> list[RunOutput]:
        """The newest `limit` runs, newest first."""
        page = self.scheduler.runs(job_id, self.tenant, limit=limit)
        return self._outputs(job_id, list(page.items))

    def one(self, job_id: str, at: datetime) -> RunOutput | None:
        if not self.remote:
            from schedctl.storage.records.run_output import get_run

            run = get_run(self.state.store(), job_id, at)
            return None if run is None else self._outputs(job_id, [run])[0]
        cursor: str | None = None
        for _ in range(MAX_PAGES):  # newest first: stop once past `at`
            page = self.scheduler.runs(job_id, self.tenant, limit=limits.MAX_PAGE, cursor=cursor)
            for run in page.items:
                if run.scheduled_at == at:
                    return self._outputs(job_id, [run])[0]
                if run.scheduled_at < at:
                    return None
            cursor = page.next_cursor
            if cursor is None:
                return None
        return None

    def _outputs(self, job_id: str, runs: Sequence[Run]) -> list[RunOutput]:
        if self.remote:
            return [
                RunOutput(r, () if r.status in _NOT_STARTED else (_latest_only(r),)) for r in runs
            ]
        from schedctl.storage.records.run_output import attempts

        recorded = attempts(self.state.store(), job_id, [r.scheduled_at for r in runs])
        result = []
        for r in runs:
            shown = list(recorded.get(r.scheduled_at, []))
            if r.status is RunStatus.running:
                shown.append(_live(r))
            result.append(RunOutput(r, tuple(shown)))
        return result


def parse_run(value: str, job_id: str) -> datetime:
    """RUN: a scheduled time (ISO 8601 with an offset) or a run key JOB_ID:TIME of this job."""
    text = value.strip()
    try:
        return parse_instant(text, "run")
    except errors.ValidationError:
        pass
    prefix, sep, rest = text.partition(":")
    if sep and prefix and rest[:4].isdigit():
        at = parse_instant(rest, "run")
        if not job_id.startswith(prefix):
            raise errors.ValidationError(
                f"run key {_clip(text)!r} is of another job than {job_id}", field="run"
            )
        return at
    raise errors.ValidationError(
        f"invalid run {_clip(text)!r}: expected its scheduled time (ISO 8601 with a UTC "
        "offset, e.g. 2026-03-01T08:00:00Z) or its run key JOB_ID:TIME",
        field="run",
    )


def _clip(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


# -- printing ------------------------------------------------------------------------------


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()  # a closed pipe is found now, and ends the command quietly


def header(run: Run, attempt: AttemptLog) -> str:
    parts = [f"attempt {attempt.attempt}: {attempt.status}"]
    if attempt.started_at is not None:
        parts.append(f"started {format_instant(attempt.started_at)}")
    if attempt.finished_at is not None:
        parts.append(f"finished {format_instant(attempt.finished_at)}")
    if attempt.exit_code is not None:
        parts.append(f"exit code {attempt.exit_code}")
    if attempt.error and attempt.error != f"exit code {attempt.exit_code}":
        parts.append(f"error: {attempt.error}")
    return f"=== job {run.job_id} run {format_instant(run.scheduled_at)} {', '.join(parts)}"


def _text(output: str | None) -> str:
    if not output:
        return ""
    return output if output.endswith("\n") else output + "\n"


@dataclass
class Progress:
    """What was printed of one run, so that --follow prints only what is new."""

    done: set[int] = field(default_factory=set)  # the finished attempts printed
    live_attempt: int | None = None  # the running attempt whose output is being printed
    live_text: str = ""
    said_waiting: bool = False


def show(item: RunOutput, progress: Progress, fmt: OutputFormat) -> None:
    """Print what `progress` has not shown yet of `item`."""
    finished = [a for a in item.attempts if a.status != RunStatus.running.value]
    live = [a for a in item.attempts if a.status == RunStatus.running.value]
    if fmt is OutputFormat.json:
        # one JSON object per line for each finished attempt (--follow)
        for a in finished:
            if a.attempt not in progress.done:
                progress.done.add(a.attempt)
                _write(json.dumps({**item.to_dict(), "attempts": [attempt_dict(a)]}) + "\n")
        return
    for a in finished:
        if a.attempt in progress.done:
            continue
        progress.done.add(a.attempt)
        _write(header(item.run, a) + "\n")
        output = a.output or ""
        if progress.live_attempt == a.attempt and output.startswith(progress.live_text):
            _write(_text(output[len(progress.live_text) :]) if output else "")
        else:
            _write(_text(output))
        progress.live_attempt, progress.live_text = None, ""
    for a in live:
        output = a.output or ""
        if progress.live_attempt != a.attempt:
            _write(header(item.run, a) + " (output so far)\n")
            progress.live_attempt, progress.live_text = a.attempt, ""
        if output.startswith(progress.live_text):
            new = output[len(progress.live_text) :]
        else:  # the kept tail moved on: the whole of it again
            new = "\n" + output
        # only whole lines while it runs: the rest of a line comes with the next one
        cut = new.rfind("\n") + 1
        if cut:
            _write(new[:cut])
            progress.live_text = output[: len(output) - len(new) + cut]
    if not item.attempts and not progress.said_waiting:
        progress.said_waiting = True
        state = f"{item.run.status.value}, no attempt yet"
        if item.run.status is RunStatus.skipped and item.run.error:
            # why it never ran (misfire, overlap, ...), as one line whatever it holds
            state = "skipped: " + limits.CONTROL_CHARS.sub("\ufffd", item.run.error)
        _write(f"=== job {item.run.job_id} run {format_instant(item.run.scheduled_at)}: {state}\n")


def _pick_latest(items: Sequence[RunOutput]) -> RunOutput | None:
    """The newest run that started, else the newest one."""
    for item in items:
        if item.attempts:
            return item
    return items[0] if items else None


# -- the command ---------------------------------------------------------------------------


def logs(
    ctx: typer.Context,
    job: Annotated[
        str, typer.Argument(help="The job: its id, its name, or an unambiguous id prefix.")
    ],
    run: Annotated[
        str | None,
        typer.Argument(
            help="The run: its scheduled time (ISO 8601 with an offset) or its run key "
            "JOB_ID:TIME. Default: the latest run."
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Keep printing: the output of the runs that come after, as they run "
            "(output so far, from each heartbeat) and finish. Ends at --timeout or Ctrl-C.",
        ),
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            help="With --follow: stop after this many seconds (default: until Ctrl-C).",
            parser=number_parser("timeout", 0, limits.MAX_DURATION_SECONDS),
        ),
    ] = None,
    interval: Annotated[
        float,
        typer.Option(
            help="With --follow: seconds between looks at the run history (0.1-60).",
            parser=number_parser("interval", 0.1, 60),
        ),
    ] = DEFAULT_INTERVAL_SECONDS,
    tenant: TenantOption = None,
    output: OutputOption = None,
) -> None:
    """The output of a job's run, each attempt under a header line (attempt, status,
    started, finished, exit code); -o json: the runs with their attempts and output."""
    fmt = output_format(ctx, output)
    source = Source(cli_state(ctx), tenant)
    job_id = source.job_id(job)
    if run is not None:
        at = parse_run(run, job_id)
        chosen = source.one(job_id, at)
        if chosen is None:
            raise errors.NotFound(
                f"job {job_id} has no run scheduled at {format_instant(at)}", field="run"
            )
    else:
        chosen = _pick_latest(source.recent(job_id, limits.MAX_PAGE if not follow else 50))
    if not follow:
        if fmt is OutputFormat.json:
            _write(
                json.dumps(
                    {"job_id": job_id, "runs": [chosen.to_dict()] if chosen else []}, indent=2
                )
                + "\n"
            )
        elif chosen is None:
            _write(f"job {job_id} has no runs yet\n")
        else:
            show(chosen, Progress(), fmt)
        return
    try:
        _follow(source, job_id, chosen, fmt, timeout, interval)
    except KeyboardInterrupt:
        return  # Ctrl-C is how --follow ends: quietly


def _follow(
    source: Source,
    job_id: str,
    chosen: RunOutput | None,
    fmt: OutputFormat,
    timeout: float | None,
    interval: float,
) -> None:
    shown: dict[datetime, Progress] = {}
    since: datetime | None = None
    if chosen is not None:
        since = chosen.run.scheduled_at
        shown[since] = Progress()
        show(chosen, shown[since], fmt)
    elif fmt is not OutputFormat.json:
        _write(f"job {job_id} has no runs yet; waiting\n")
    deadline = time.monotonic() + (timeout if timeout is not None else limits.MAX_DURATION_SECONDS)
    while True:  # bounded by the deadline (at most MAX_DURATION)
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(interval, left))
        for item in reversed(source.recent(job_id, FOLLOW_PAGE)):  # oldest first
            at = item.run.scheduled_at
            if since is not None and at < since:
                continue
            show(item, shown.setdefault(at, Progress()), fmt)
        if len(shown) > 10 * FOLLOW_PAGE:
            # runs long past the page are never looked at again: forget them
            for at in sorted(shown)[: len(shown) - FOLLOW_PAGE]:
                del shown[at]
