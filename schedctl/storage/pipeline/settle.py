"""Owns settling a run's attempt, the one path shared by the outbox relay (HTTP, RabbitMQ)
and the built-in queue (workers, the lease reaper): recording the attempt (a run_attempts
row and the runs row), deciding retry or dead letter, skipping a cancelled job's run,
creating or skipping the runs of dependent jobs (`after`, in the same transaction),
clipping output and errors, and the texts of lost and cancelled runs.

A run waiting for (or in) delivery is held by one row: an outbox row or a queue message.
Both carry the attempt number, the next try (`available_at`) and the lease owner, so one
retry rule serves both. Callers read and lock the rows and prove the lease is theirs;
everything here runs inside the caller's transaction.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Table,
    bindparam,
    delete,
    insert,
    or_,
    update,
)
from sqlalchemy.engine import Connection

from schedctl.core import limits
from schedctl.core.backoff import backoff_delay

# the worker side (no database) owns the text; settling records it
from schedctl.domain.leasing import CANCELLED_RUNNING_ERROR as CANCELLED_RUNNING_ERROR
from schedctl.domain.models import JobStatus, RunStatus
from schedctl.storage.backend.dialect import dialect_of
from schedctl.storage.db import schema
from schedctl.storage.pipeline import dependencies
from schedctl.storage.pipeline.settle_statements import OutcomeWrites, settle_statements
from schedctl.storage.records import alerts, run_metrics

LOST_ERROR = "lease expired: the worker or relay holding the run stopped"
CANCELLED_ERROR = "job cancelled before delivery"
HOST_NOT_LIVE_ERROR = "host not live at the occurrence: no worker of its every-host queue"
# Kept in the database no longer than a run history column should hold; the end of an
# output (or error) says why it ended, so the end is what is kept.
MAX_TEXT_CHARS = 16_384
# A command's output: what a worker keeps of it (its output_bytes, limits.DEFAULT_OUTPUT_BYTES)
# reaches the run history whole, up to this bound (1 Mi characters).
MAX_OUTPUT_CHARS = limits.MAX_OUTPUT_BYTES
# A cancelled job's run that has not started (again) is skipped from these statuses: waiting
# for its first delivery, or for a retry after a failed or lost attempt.
SKIPPABLE_STATUSES = (RunStatus.dispatched, RunStatus.failed, RunStatus.lost)
_WORKER_CHARS = 200  # run_attempts.worker
# A job in one of these statuses runs nothing more: a deleted job stops as a cancelled one.
STOPPED_JOB_STATUSES = frozenset({JobStatus.cancelled.value, JobStatus.deleted.value})


class Ending(enum.Enum):
    """How one attempt ended, and so what happens to the run."""

    succeeded = "succeeded"  # the run succeeded; its row leaves
    retryable = "retryable"  # failed; tried again after a backoff, dead after the last
    permanent = "permanent"  # failed for good (e.g. a 4xx); dead-lettered at once
    lost = "lost"  # its holder stopped (lease expired); like retryable, recorded as lost
    stopped = "stopped"  # stopped by a cancel: recorded failed, no retry, no dead letter


@dataclass(frozen=True)
class Held:
    """A run's delivery row (an outbox row or a queue message) with its job's retry policy,
    as the settling transaction read and locked it."""

    table: Table  # schema.outbox or schema.queue_messages
    row_id: int
    job_id: str
    scheduled_at: datetime
    tenant_id: str
    target_type: str  # what a dead letter records: queue, http, rabbitmq
    target: str
    attempt: int
    max_attempts: int  # 0 when the job row is gone: this attempt is the last
    retry_base_seconds: float
    retry_max_seconds: float


@dataclass(frozen=True)
class AttemptResult:
    """The outcome of one attempt, to be recorded."""

    ending: Ending
    started_at: datetime | None
    finished_at: datetime
    worker: str | None  # the worker or relay that made it
    error: str | None = None
    exit_code: int | None = None
    output_tail: str | None = None
    retry_after: float | None = None  # the target asked to wait at least this long


@dataclass
class Settled:
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    stopped: int = 0


def clip(text: str | None, limit: int = MAX_TEXT_CHARS) -> str | None:
    """The last `limit` characters, storable in any text column."""
    if text is None:
        return None
    # Postgres text cannot hold NUL: a command printing one must not make its outcome
    # unrecordable (the run would be delivered again forever)
    return text[-limit:].replace("\x00", "\ufffd")


def unexpected_error(exc: BaseException) -> str:
    """The error recorded when a delivery raised instead of returning an outcome."""
    return f"delivery failed unexpectedly: {type(exc).__name__}: {exc}"


def lost(*, started_at: datetime | None, now: datetime, worker: str | None) -> AttemptResult:
    """The attempt of a worker or relay whose lease ran out."""
    return AttemptResult(Ending.lost, started_at, now, worker, error=LOST_ERROR)


def run_by_key() -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    """The run of an executemany row, by its `b_job_id` and `b_scheduled_at` parameters."""
    r = schema.runs
    return (
        r.c.job_id == bindparam("b_job_id"),
        r.c.scheduled_at == bindparam("b_scheduled_at", type_=r.c.scheduled_at.type),
    )


def id_in(connection: Connection, column: Any, ids: Sequence[int]) -> ColumnElement[bool]:
    """`column IN ids` for a batch of row ids, in the form the backend parses fastest
    (Dialect.id_in)."""
    return dialect_of(connection).id_in(column, ids)  # type: ignore[no-any-return]


def settle(
    connection: Connection,
    items: Sequence[tuple[Held, AttemptResult]],
    *,
    now: datetime,
    rng: random.Random | None = None,
) -> Settled:
    """Record each attempt and move its run on: succeeded or stopped runs leave their
    table, failed and lost ones are retried after a backoff (at least retry_after) while
    attempts are left, and dead-lettered after the last one. The caller has locked the
    rows and checked that each lease is still its own."""
    result = Settled()
    attempts: list[dict[str, Any]] = []
    runs: dict[tuple[str, datetime], dict[str, Any]] = {}
    gone: dict[Table, list[int]] = {}
    retry: dict[Table, list[dict[str, Any]]] = {}
    dead: list[dict[str, Any]] = []
    failures: list[alerts.Failure] = []  # for the alerts hook
    observed: list[run_metrics.Observed] = []  # for the per-job series
    # runs that ended with this attempt, for their dependents (`after`)
    ok: list[tuple[str, datetime]] = []
    ended: list[tuple[str, datetime, str]] = []
    for held, attempt in items:
        error = clip(attempt.error)
        delay = _retry_delay(held, attempt, rng)
        if attempt.ending is Ending.succeeded:
            status = RunStatus.succeeded
            result.succeeded += 1
            ok.append((held.job_id, held.scheduled_at))
        elif attempt.ending is Ending.stopped:
            status = RunStatus.failed
            result.stopped += 1
            ended.append((held.job_id, held.scheduled_at, "stopped by a cancel"))
        elif delay is not None:
            status = RunStatus.lost if attempt.ending is Ending.lost else RunStatus.failed
            result.retried += 1
            retry.setdefault(held.table, []).append(
                {
                    "b_id": held.row_id,
                    "b_attempt": held.attempt + 1,
                    "b_available_at": now + timedelta(seconds=delay),
                    "b_error": error,
                }
            )
        else:
            status = RunStatus.dead
            result.dead += 1
            ended.append((held.job_id, held.scheduled_at, "dead-lettered"))
            dead.append(
                {
                    "job_id": held.job_id,
                    "scheduled_at": held.scheduled_at,
                    "tenant_id": held.tenant_id,
                    "target_type": held.target_type,
                    "target": held.target,
                    "attempts": held.attempt,
                    "last_error": error,
                    "created_at": now,
                }
            )
        if status in (RunStatus.failed, RunStatus.lost, RunStatus.dead) and (
            attempt.ending is not Ending.stopped
        ):
            failures.append(
                alerts.Failure(
                    tenant_id=held.tenant_id,
                    job_id=held.job_id,
                    scheduled_at=held.scheduled_at,
                    attempt=held.attempt,
                    error=error,
                    dead=status is RunStatus.dead,
                    target_type=held.target_type,
                    target=held.target,
                    max_attempts=held.max_attempts or None,
                    started_at=attempt.started_at,
                    finished_at=attempt.finished_at,
                    exit_code=attempt.exit_code,
                    output_tail=attempt.output_tail,
                    worker=attempt.worker,
                )
            )
        observed.append(
            run_metrics.Observed(
                held.job_id,
                "stopped" if attempt.ending is Ending.stopped else status.value,
                attempt.started_at,
                attempt.finished_at,
            )
        )
        if delay is None:  # the run ends with this attempt
            gone.setdefault(held.table, []).append(held.row_id)
        output = clip(attempt.output_tail, MAX_OUTPUT_CHARS)
        # the run_attempts row and the runs row, built once each (no renaming pass after)
        attempts.append(
            {
                "job_id": held.job_id,
                "scheduled_at": held.scheduled_at,
                "attempt": held.attempt,
                "status": _recorded(attempt.ending).value,
                "started_at": attempt.started_at,
                "finished_at": attempt.finished_at,
                "exit_code": attempt.exit_code,
                "error": error,
                "output_tail": output,
                "worker": attempt.worker[:_WORKER_CHARS] if attempt.worker else None,
            }
        )
        # one row per run: the last outcome wins, as it would one statement after another
        runs[(held.job_id, held.scheduled_at)] = {
            "job_id": held.job_id,
            "scheduled_at": held.scheduled_at,
            "status": status.value,
            "attempt": held.attempt,
            "started_at": attempt.started_at,
            "finished_at": attempt.finished_at,
            "exit_code": attempt.exit_code,
            "error": error,
            "output_tail": output,
        }
    if not runs:
        return result
    tables = list(gone.items())
    # the attempts, the runs, (for one table) the rows whose runs ended and the dependents
    # of the runs that ended: one statement where the backend can
    edges = settle_statements(dialect_of(connection)).record_outcomes(
        connection,
        OutcomeWrites(
            attempts,
            list(runs.values()),
            tables[0] if tables else None,
            sorted({job_id for job_id, _ in ok} | {job_id for job_id, _, _ in ended}),
        ),
    )
    for table, ids in tables[1:]:
        connection.execute(delete(table).where(id_in(connection, table.c.id, ids)))
    for table, rows in retry.items():
        _retry(connection, table, rows)
    if dead:
        connection.execute(insert(schema.dead_letters), dead)
    # the alerts hook: queued in this transaction, so a settled failure is never unalerted
    contexts = alerts.queue_for_failures(connection, failures, now)
    # the series' labels: tenant and job names (one statement by primary key)
    labels = run_metrics.names(
        connection, {o.job_id for o in observed}, named={f.job_id for f in failures}
    )
    alerts.count_failures(failures, {job_id: n.tenant for job_id, n in labels.items()}, contexts)
    run_metrics.record(observed, labels)
    # in this transaction: the upstream's outcome and its dependents' runs commit together
    dependencies.on_settled(connection, succeeded=ok, ended=ended, now=now, edges=edges)
    return result


def skip_cancelled(
    connection: Connection,
    table: Table,
    rows: Sequence[tuple[int, str, datetime]],
    *,
    now: datetime,
    error: str = CANCELLED_ERROR,
) -> None:
    """Drop the rows (id, job_id, scheduled_at) of a cancelled job's runs (or of runs that
    are not to happen for another `error`) from `table` and record those runs skipped, if
    they had not started (again)."""
    if not rows:
        return
    connection.execute(delete(table).where(id_in(connection, table.c.id, [r[0] for r in rows])))
    r = schema.runs
    connection.execute(
        update(r)
        .where(
            *run_by_key(),
            # not in_(): an expanding list cannot take part in an executemany
            or_(*(r.c.status == s.value for s in SKIPPABLE_STATUSES)),
        )
        .values(status=RunStatus.skipped.value, error=error, finished_at=now),
        [{"b_job_id": job_id, "b_scheduled_at": at} for _, job_id, at in rows],
    )
    dependencies.on_settled(
        connection, succeeded=(), ended=[(job_id, at, "skipped") for _, job_id, at in rows], now=now
    )


def _retry_delay(held: Held, attempt: AttemptResult, rng: random.Random | None) -> float | None:
    """Seconds until the next attempt, or None when there is none (dead letter)."""
    if attempt.ending not in (Ending.retryable, Ending.lost):
        return None
    if held.attempt >= held.max_attempts:
        return None
    delay = backoff_delay(held.attempt, held.retry_base_seconds, held.retry_max_seconds, rng)
    return max(delay, attempt.retry_after or 0.0)


def _recorded(ending: Ending) -> RunStatus:
    """The run_attempts status of an attempt."""
    if ending is Ending.succeeded:
        return RunStatus.succeeded
    return RunStatus.lost if ending is Ending.lost else RunStatus.failed


def _retry(connection: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    values: dict[str, Any] = {
        "attempt": bindparam("b_attempt"),
        "available_at": bindparam("b_available_at", type_=table.c.available_at.type),
        "lease_owner": None,
    }
    if "leased_until" in table.c:  # a queue message: visible to workers again
        values["leased_until"] = None
    if "last_error" in table.c:  # an outbox row keeps why its last attempt failed
        values["last_error"] = bindparam("b_error")
    keys = ("b_id", "b_attempt", "b_available_at") + (
        ("b_error",) if "last_error" in table.c else ()
    )
    connection.execute(
        update(table).where(table.c.id == bindparam("b_id")).values(**values),
        [{k: row[k] for k in keys} for row in rows],
    )
