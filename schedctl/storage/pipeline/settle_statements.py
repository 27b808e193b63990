"""Owns the settle path's writes (storage/pipeline/settle.py), Postgres's and SQLite's side
by side: attempt rows, run outcomes and the delivery rows whose runs ended, with the
dependency edges of the settled jobs, in one statement on Postgres."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Table, bindparam, delete, insert, update
from sqlalchemy.engine import Connection

from schedctl.storage.backend.dialect import Dialect
from schedctl.storage.backend.dialect_postgres import RUNS_SPAN, pg_keyed, runs_span
from schedctl.storage.db import schema
from schedctl.storage.pipeline import dependencies


@dataclass(frozen=True)
class OutcomeWrites:
    """The settle path's writes for a batch: attempt rows, run updates, the delivery rows
    (table, ids) whose runs ended, and the jobs whose dependents may now run."""

    attempts: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    gone: tuple[Table, Sequence[int]] | None
    upstreams: Sequence[str]


class SettleStatements(Protocol):
    """The settle path's statements on one backend, inside the caller's transaction."""

    def update_runs(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Set each run's outcome (status, attempt, started_at, finished_at, exit_code,
        error, output_tail) by (job_id, scheduled_at); one row per run."""
        ...

    def record_outcomes(
        self, connection: Connection, writes: OutcomeWrites
    ) -> list[tuple[str, str]]:
        """The attempts inserted, the runs updated (update_runs) and the rows writes.gone
        (table, ids) whose runs ended deleted; answers the dependency edges (job_id,
        upstream_job_id) out of writes.upstreams."""
        ...


class _Postgres:
    def update_runs(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        pg_keyed(
            connection,
            _UPDATE_RUNS,
            {name: [row[name] for row in rows] for name, _ in _RUN_ARRAYS}
            | runs_span([row["scheduled_at"] for row in rows]),
        )

    def record_outcomes(
        self, connection: Connection, writes: OutcomeWrites
    ) -> list[tuple[str, str]]:
        # one statement, one round trip: the three writes touch three different tables,
        # and the read of job_dependencies a fourth
        table_name = writes.gone[0].name if writes.gone is not None else schema.queue_messages.name
        # a run per attempt (each attempt of another run), in the same order: the runs'
        # columns are the attempts' (settle builds both rows from the same values) but for
        # the run's status, so only that array is sent for them -- psycopg dumps every array
        # element by element, and these were eight more arrays per batch
        aligned = len(writes.runs) == len(writes.attempts)
        key = (table_name, aligned)
        statement = _RECORD_OUTCOMES.get(key)
        if statement is None:
            statement = _RECORD_OUTCOMES[key] = _record_outcomes(table_name, aligned=aligned)
        runs = _ALIGNED_RUN_ARRAYS if aligned else _RUN_ARRAYS
        # Planned at each execution, never prepared (as lease_candidates): a worker that
        # settled its first runs while the queue and today's runs were near empty kept a
        # generic plan scanning both whole for every batch; at 2,000 runs/s that scan grew
        # with the run history until Postgres's CPU, not the workers, set the pace
        return pg_keyed(
            connection,
            statement,
            {
                "upstreams": list(writes.upstreams),
                **{
                    f"a_{name}": [row[name] for row in writes.attempts]
                    for name, _ in _ATTEMPT_ARRAYS
                },
                **{f"r_{name}": [row[name] for row in writes.runs] for name, _ in runs},
                **{
                    f"r_{k}": v
                    for k, v in runs_span([row["scheduled_at"] for row in writes.runs]).items()
                },
                "gone": list(writes.gone[1]) if writes.gone is not None else [],
            },
        )


class _Sqlite:
    def update_runs(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        connection.execute(
            _update_runs(), [{f"b_{key}": value for key, value in row.items()} for row in rows]
        )

    def record_outcomes(
        self, connection: Connection, writes: OutcomeWrites
    ) -> list[tuple[str, str]]:
        # in process: a statement costs no round trip, so one each
        connection.execute(insert(schema.run_attempts), writes.attempts)
        self.update_runs(connection, writes.runs)
        if writes.gone is not None:
            table, ids = writes.gone
            connection.execute(_delete_by_id(table), {"ids": ids})
        return dependencies.edges_out_of(connection, writes.upstreams)


_STATEMENTS: dict[str, SettleStatements] = {"postgresql": _Postgres(), "sqlite": _Sqlite()}


def settle_statements(dialect: Dialect) -> SettleStatements:
    """The settle statements of the dialect's backend."""
    return _STATEMENTS[dialect.name]


# Postgres: a batch of rows as one statement over arrays (unnest), one array per column: a
# constant statement text and C-speed parameter encoding, instead of one statement per row
# in a pipeline (executemany), which was a fifth of the relay's CPU. The arrays go in binary
# format (_pg_binary): as text, psycopg quotes every string element with a regular
# expression in Python, which cost the settler a tenth of its time.
_ATTEMPT_ARRAYS = (
    ("job_id", "text"),
    ("scheduled_at", "timestamptz"),
    ("attempt", "integer"),
    ("status", "text"),
    ("started_at", "timestamptz"),
    ("finished_at", "timestamptz"),
    ("exit_code", "integer"),
    ("error", "text"),
    ("output_tail", "text"),
    ("worker", "text"),
)


_INSERT_ATTEMPTS = (
    "INSERT INTO run_attempts ("
    + ", ".join(name for name, _ in _ATTEMPT_ARRAYS)
    + ") SELECT * FROM unnest("
    + ", ".join(f"CAST(%({name})b AS {kind}[])" for name, kind in _ATTEMPT_ARRAYS)
    + ")"
)


_RUN_ARRAYS = (
    ("job_id", "text"),
    ("scheduled_at", "timestamptz"),
    ("status", "text"),
    ("attempt", "integer"),
    ("started_at", "timestamptz"),
    ("finished_at", "timestamptz"),
    ("exit_code", "integer"),
    ("error", "text"),
    ("output_tail", "text"),
)


_UPDATE_RUNS = (
    "UPDATE runs SET "
    + ", ".join(f"{name} = v.{name}" for name, _ in _RUN_ARRAYS[2:])
    + " FROM unnest("
    + ", ".join(f"CAST(%({name})b AS {kind}[])" for name, kind in _RUN_ARRAYS)
    + ") AS v("
    + ", ".join(name for name, _ in _RUN_ARRAYS)
    + ") WHERE runs.job_id = v.job_id AND runs.scheduled_at = v.scheduled_at"
    + " AND runs.job_id = ANY(CAST(%(job_id)b AS text[]))"
    + RUNS_SPAN
)


def _record_outcomes(table_name: str, *, aligned: bool = False) -> str:
    """The statement of record_outcomes deleting from `table_name` (outbox, queue_messages);
    `aligned`: the runs' columns come from the attempts' arrays, all but their status."""
    assert table_name in (schema.outbox.name, schema.queue_messages.name)
    update_runs = _UPDATE_RUNS.replace("%(", "%(r_")
    if aligned:
        for name, _ in _RUN_ARRAYS:
            if name != "status":
                update_runs = update_runs.replace(f"%(r_{name})b", f"%(a_{name})b")
    return (
        "/* record_outcomes */ WITH attempts AS ("
        + _INSERT_ATTEMPTS.replace("%(", "%(a_")
        + f"), gone AS (DELETE FROM {table_name} WHERE id = ANY(CAST(%(gone)b AS bigint[])))"
        + ", runs_set AS ("
        + update_runs
        + ") SELECT job_id, upstream_job_id FROM job_dependencies"
        " WHERE upstream_job_id = ANY(CAST(%(upstreams)b AS text[]))"
    )


_RECORD_OUTCOMES: dict[tuple[str, bool], str] = {}


_ALIGNED_RUN_ARRAYS = tuple((name, kind) for name, kind in _RUN_ARRAYS if name == "status")


@functools.cache
def _update_runs() -> Any:
    r = schema.runs
    names = ("status", "attempt", "started_at", "finished_at", "exit_code", "error")
    return (
        update(r)
        .where(
            r.c.job_id == bindparam("b_job_id"),
            r.c.scheduled_at == bindparam("b_scheduled_at", type_=r.c.scheduled_at.type),
        )
        .values(
            {
                **{name: bindparam(f"b_{name}", type_=r.c[name].type) for name in names},
                "output_tail": bindparam("b_output_tail"),
            }
        )
    )


@functools.cache
def _delete_by_id(table: Table) -> Any:
    return delete(table).where(table.c.id.in_(bindparam("ids", expanding=True)))
