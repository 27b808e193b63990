"""Owns the inserts of job creation (storage/jobs/job_create.py) and of audit entries,
Postgres's and SQLite's side by side: a batch's jobs, audit entries and change
notifications in one statement on Postgres (rows as JSON documents), statement by statement
in process on SQLite."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from schedctl.domain.models import JobStatus
from schedctl.storage.backend.dialect import Dialect, dialect_of
from schedctl.storage.backend.dialect_postgres import (
    CHANNEL,
    json_rows,
    pg_arrays,
    pg_binary,
    pg_rows,
)
from schedctl.storage.db import schema


class CreateStatements(Protocol):
    """Job creation's inserts on one backend, inside the caller's transaction."""

    def insert_jobs(self, connection: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert job rows (every column of `jobs` in each) in one statement."""
        ...

    def insert_audit_entries(
        self, connection: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> None:
        """Insert audit_log rows (at, tenant_id, actor, action, job_id, detail)."""
        ...

    def insert_created_jobs(
        self,
        connection: Connection,
        rows: Sequence[Mapping[str, Any]],
        audit_rows: Sequence[Mapping[str, Any]],
        changed: Sequence[tuple[str, int]],
    ) -> set[str]:
        """insert_jobs, insert_audit_entries and the job-change notifications (any may be
        empty) in as few statements as the backend can. Answers the ids of the jobs left
        out, with their audit entries and notifications, because a job of the tenant (not
        deleted) holds their name: a create that committed after this one read the names.
        Where writers are serialized (SQLite) none is; a name taken raises IntegrityError."""
        ...


class _Postgres:
    def insert_jobs(self, connection: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        import psycopg

        try:
            pg_binary(connection, _INSERT_JOBS, pg_arrays(rows, _JOB_ARRAYS))
        except psycopg.IntegrityError as exc:
            # the driver's own cursor: wrapped as SQLAlchemy would, for job_create's retry
            # of a key or a name a concurrent create took
            raise IntegrityError(_INSERT_JOBS, None, exc) from exc

    def insert_audit_entries(
        self, connection: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> None:
        pg_binary(connection, _INSERT_AUDIT, pg_arrays(rows, _AUDIT_ARRAYS))

    def insert_created_jobs(
        self,
        connection: Connection,
        rows: Sequence[Mapping[str, Any]],
        audit_rows: Sequence[Mapping[str, Any]],
        changed: Sequence[tuple[str, int]],
    ) -> set[str]:
        import psycopg

        # one round trip, not three (each a wait on the server and a hand-over of the
        # interpreter lock, per combiner round of single creates); the rows go as one
        # JSON document each (orjson, in C), not one array per column: psycopg dumps an
        # array element by element in Python, 32 arrays per statement, which cost more
        # than the rest of a small batch's insert
        params = {
            "jobs": json_rows(rows),
            "audit": json_rows(audit_rows),
            "channel": CHANNEL,
            "payloads": [f"{part}:{job_id}" for job_id, part in changed],
        }
        try:
            ((written, _),) = pg_binary(connection, _INSERT_CREATED, params)
        except psycopg.IntegrityError as exc:  # as insert_jobs
            raise IntegrityError(_INSERT_CREATED, None, exc) from exc
        if written == len(rows):
            return set()
        ids = [row["job_id"] for row in rows]
        kept = pg_rows(connection, _JOBS_WRITTEN, {"ids": ids})
        return set(ids) - {r[0] for r in kept}


class _Sqlite:
    def insert_jobs(self, connection: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        connection.execute(insert(schema.jobs), list(rows))

    def insert_audit_entries(
        self, connection: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> None:
        connection.execute(insert(schema.audit_log), list(rows))

    def insert_created_jobs(
        self,
        connection: Connection,
        rows: Sequence[Mapping[str, Any]],
        audit_rows: Sequence[Mapping[str, Any]],
        changed: Sequence[tuple[str, int]],
    ) -> set[str]:
        # in process: a statement costs no round trip here
        if rows:
            self.insert_jobs(connection, rows)
        if audit_rows:
            self.insert_audit_entries(connection, audit_rows)
        if changed:
            dialect_of(connection).notify_job_changes(connection, changed)
        return set()


_STATEMENTS: dict[str, CreateStatements] = {"postgresql": _Postgres(), "sqlite": _Sqlite()}


def create_statements(dialect: Dialect) -> CreateStatements:
    """The job creation statements of the dialect's backend."""
    return _STATEMENTS[dialect.name]


# Job creation: a batch's jobs and its audit entries as one INSERT over arrays each (see
# _ATTEMPT_ARRAYS), instead of an executemany of a statement per row.
_JOB_ARRAYS = (
    ("job_id", "text"),
    ("tenant_id", "text"),
    ("name", "text"),
    ("schedule", "text"),
    ("target_type", "text"),
    ("target", "text"),
    ("payload", "text"),
    ("max_attempts", "integer"),
    ("retry_base_seconds", "float8"),
    ("retry_max_seconds", "float8"),
    ("misfire_policy", "text"),
    ("grace_seconds", "integer"),
    ("window_seconds", "integer"),
    ("max_concurrency", "integer"),
    ("timeout_seconds", "integer"),
    ("overlap", "text"),
    ("memory_max", "bigint"),
    ("cpu_weight", "integer"),
    ("tasks_max", "integer"),
    ("start_at", "timestamptz"),
    ("end_at", "timestamptz"),
    ("status", "text"),
    ("next_run_at", "timestamptz"),
    ("next_fire_at", "timestamptz"),
    ("partition", "integer"),
    ("version", "bigint"),
    ("idempotency_key", "text"),
    ("request_hash", "text"),
    ("created_at", "timestamptz"),
    ("updated_at", "timestamptz"),
    ("metrics", "boolean"),
)


_AUDIT_ARRAYS = (
    ("at", "timestamptz"),
    ("tenant_id", "text"),
    ("actor", "text"),
    ("action", "text"),
    ("job_id", "text"),
    ("detail", "text"),
)


def _insert_over_arrays(table: str, arrays: tuple[tuple[str, str], ...]) -> str:
    return (
        f"INSERT INTO {table} ("
        + ", ".join(f'"{name}"' for name, _ in arrays)
        + ") SELECT * FROM unnest("
        + ", ".join(f"CAST(%({name})b AS {kind}[])" for name, kind in arrays)
        + ")"
    )


_INSERT_JOBS = _insert_over_arrays("jobs", _JOB_ARRAYS)


_INSERT_AUDIT = _insert_over_arrays("audit_log", _AUDIT_ARRAYS)


def _insert_from_json(table: str, columns: tuple[tuple[str, str], ...], param: str) -> str:
    """INSERT of the rows of a JSON array of objects (`param`), each column converted by
    json_populate_recordset to the table's own type."""
    names = ", ".join(f'"{name}"' for name, _ in columns)
    return (
        f"INSERT INTO {table} ({names}) SELECT {names} "
        f"FROM json_populate_recordset(NULL::{table}, CAST(%({param})s AS json))"
    )


# the jobs, their audit entries and their notifications in one statement (data-modifying
# CTEs run whether or not the query reads them; notifications go out at commit). A job
# whose name a create committed since this one read the names is left out, with its
# audit entry and notification; the statement answers how many jobs it wrote (and reads
# `notified`, a plain CTE, so that it runs).
_INSERT_CREATED = (
    f"WITH created AS ({_insert_from_json('jobs', _JOB_ARRAYS, 'jobs')}"
    f" ON CONFLICT (tenant_id, name) WHERE status <> '{JobStatus.deleted.value}' DO NOTHING"
    " RETURNING job_id), "
    f"audited AS ({_insert_from_json('audit_log', _AUDIT_ARRAYS, 'audit')}"
    " WHERE job_id IN (SELECT job_id FROM created)), "
    "notified AS (SELECT pg_notify(%(channel)s, p) FROM unnest(CAST(%(payloads)b AS text[])) AS p"
    " WHERE split_part(p, ':', 2) IN (SELECT job_id FROM created)) "
    "SELECT (SELECT count(*) FROM created), (SELECT count(*) FROM notified)"
)


_JOBS_WRITTEN = "SELECT job_id FROM jobs WHERE job_id = ANY(CAST(%(ids)b AS text[]))"
