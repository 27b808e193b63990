"""Owns the SQLite side of the Dialect (storage/backend/dialect.py): the embedded, one-machine
backend. Its transactions are BEGIN IMMEDIATE, i.e. serialized, so there are no row locks,
lock races or advisory locks to take; job changes bump a counter the dispatcher polls; the
claim and the lane reads go row by row; run history is one table, pruned by retention."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Integer,
    Select,
    Table,
    and_,
    bindparam,
    cast,
    delete,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine, RowMapping

from schedctl import errors
from schedctl.leasing import ReadyFeed
from schedctl.models import EVERY_HOST_QUEUE_PREFIX, JobStatus, Lane, RunStatus, TargetType
from schedctl.storage.backend.dialect import (
    ChangeFeed,
    Changes,
    LeasedRow,
    LeaseMark,
    Lock,
    OutcomeWrites,
    RoleGrants,
    RunPartitions,
    ServerSessions,
)
from schedctl.storage.db import schema

COUNTER_KEY = "jobs_changed"
# bound values per IN list: well under SQLite's limit of variables in one statement
IN_CHUNK = 5000
# how long a checkpoint at a clean stop waits for other processes' transactions
CHECKPOINT_WAIT_MS = 2000


class SqliteDialect:
    name = "sqlite"
    driver = "sqlite3"
    # SQLite compares the stored text, so every value must be naive UTC in one format
    naive_instants = True
    embedded = True
    generates_rows = False
    single_writer = True

    def now(self, connection: Connection) -> datetime:
        # one machine: its clock is every process's clock
        return datetime.now(UTC)

    def locked_clock(self) -> None:
        return None  # `now` is this machine's clock: no round trip to save

    def clock(self, begin: Callable[[], AbstractContextManager[Connection]]) -> datetime:
        return datetime.now(UTC)

    def insert(self, table: Table) -> Any:
        return sqlite.insert(table)

    def lock(
        self, query: Any, mode: Lock = Lock.update, *, skip_locked: bool = False, of: Any = None
    ) -> Any:
        return query  # the transaction holds the whole database already

    def lock_rows(self, connection: Connection, query: Any, mode: Lock = Lock.update) -> None:
        return None

    def is_lock_race(self, exc: BaseException) -> bool:
        return False  # serialized transactions cannot deadlock

    def lock_job_slots(self, connection: Connection, job_ids: Sequence[str]) -> None:
        return None

    def lease_candidates(
        self, connection: Connection, tenant_id: str, queue: str, fetch: int
    ) -> tuple[datetime, Sequence[Sequence[Any]]]:
        now = self.now(connection)
        rows = connection.execute(
            _lease_candidates(),
            {"tenant_id": tenant_id, "queue": queue, "now": now, "fetch": fetch},
        ).all()
        return now, rows

    def leased_counts(self, connection: Connection, job_ids: Sequence[str]) -> dict[str, int]:
        rows = connection.execute(_leased_counts(), {"job_ids": job_ids}).all()
        return {job_id: count for job_id, count in rows}

    def mark_leased(
        self, connection: Connection, leases: Sequence[LeasedRow], mark: LeaseMark
    ) -> None:
        if isinstance(mark.owner, str):
            connection.execute(
                _mark_leased(),
                {
                    "ids": [x[0] for x in leases],
                    "b_leased_until": mark.leased_until,
                    "b_lease_owner": mark.owner,
                },
            )
        else:
            # each message its own owner (an API lease's secret): still one statement, the
            # owners a JSON object by message id
            connection.execute(
                _mark_leased_each(),
                {
                    "b_leased_until": mark.leased_until,
                    "b_owners": json.dumps(
                        {str(x[0]): owner for x, owner in zip(leases, mark.owner, strict=True)}
                    ),
                },
            )
        # the previous attempt's outcome lives on in run_attempts
        self.update_runs(
            connection,
            [
                {
                    "job_id": job_id,
                    "scheduled_at": scheduled_at,
                    "status": RunStatus.running.value,
                    "attempt": attempt,
                    "started_at": mark.now,
                    "finished_at": None,
                    "exit_code": None,
                    "error": None,
                    "output_tail": None,
                }
                for _, job_id, scheduled_at, attempt in leases
            ],
        )

    def held_messages(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime, Sequence[Sequence[Any]]]:
        rows = connection.execute(_held_messages(), {"ids": ids}).all()
        return self.now(connection), rows

    def notify_job_change(self, connection: Connection, job_id: str, partition: int) -> None:
        connection.execute(
            text(
                "INSERT INTO settings (key, value) VALUES (:key, '1') ON CONFLICT (key) "
                "DO UPDATE SET value = CAST(CAST(settings.value AS INTEGER) + 1 AS TEXT)"
            ),
            {"key": COUNTER_KEY},
        )

    def notify_job_changes(
        self, connection: Connection, changed: Sequence[tuple[str, int]]
    ) -> None:
        # one bump tells every dispatcher to reload, whatever changed
        self.notify_job_change(connection, "", 0)

    def change_feed(self, engine: Engine, poll_seconds: float) -> ChangeFeed:
        return SqliteChangeFeed(engine, poll_seconds)

    def notify_ready(self, connection: Connection, words: Collection[str]) -> None:
        pass  # one machine: `scheduled-d all` wakes its workers and relay in process

    def ready_feed(self, engine: Engine, word: str) -> ReadyFeed | None:
        return None

    def advance_jobs(
        self, connection: Connection, updates: list[dict[str, Any]], now: datetime
    ) -> set[str]:
        # The transaction is BEGIN IMMEDIATE: no other writer until it ends, so the jobs
        # read active at their version here are exactly those the conditional UPDATE
        # matches. One read and one executemany of one compiled UPDATE, instead of a
        # statement built per job (the claim of a 10,000 burst took 15 s of CPU so).
        stored: dict[str, tuple[int, str]] = {}
        for chunk in _chunks(sorted({u["job_id"] for u in updates})):
            found = connection.execute(_job_versions(), {"ids": chunk})
            stored.update({j: (v, st) for j, v, st in found})
        advancing: dict[str, dict[str, Any]] = {}
        for u in updates:
            if u["job_id"] not in advancing and stored.get(u["job_id"]) == (
                u["version"],
                JobStatus.active.value,
            ):
                advancing[u["job_id"]] = u  # a job listed twice advances once
        if not advancing:
            return set()
        outcome = connection.execute(
            _advance_job(),
            [
                {
                    "b_job_id": u["job_id"],
                    "b_version": u["version"],
                    "b_next_run_at": u["next_run_at"],
                    "b_next_fire_at": u["next_fire_at"],
                    "b_status": u["status"],
                    "b_now": now,
                }
                for u in advancing.values()
            ],
        )
        if outcome.rowcount != len(advancing):
            # cannot happen under the write lock; if it did, claim nothing rather than guess
            raise errors.StoreUnavailable(
                f"claim: {outcome.rowcount} of {len(advancing)} jobs advanced; rolled back"
            )
        return set(advancing)

    def id_in(self, column: Any, ids: Sequence[int]) -> Any:
        return column.in_(ids)

    def insert_attempts(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        connection.execute(insert(schema.run_attempts), rows)

    def record_outcomes(
        self, connection: Connection, writes: OutcomeWrites
    ) -> list[tuple[str, str]] | None:
        self.insert_attempts(connection, writes.attempts)
        self.update_runs(connection, writes.runs)
        if writes.gone is not None:
            table, ids = writes.gone
            connection.execute(_delete_by_id(table), {"ids": ids})
        return None  # no round trip to save: on_settled reads the edges

    def update_runs(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        connection.execute(
            _update_runs(), [{f"b_{key}": value for key, value in row.items()} for row in rows]
        )

    def insert_runs(
        self, connection: Connection, rows: list[dict[str, Any]], now: datetime
    ) -> list[tuple[str, datetime, str]]:
        # as in advance_jobs, the write lock makes "not there yet" the same as "inserted":
        # read which runs exist (both keys: not a recurring job's whole history), then one
        # executemany for the runs and one for the outbox rows
        r = schema.runs
        existing: set[tuple[str, datetime]] = set()
        for chunk in _chunks(rows):
            found = connection.execute(
                _existing_runs(),
                {
                    "job_ids": list({row["job_id"] for row in chunk}),
                    "instants": list({row["scheduled_at"] for row in chunk}),
                },
            )
            existing.update((j, at) for j, at in found)
        new: list[dict[str, Any]] = []
        for row in rows:
            key = (row["job_id"], row["scheduled_at"])
            if key not in existing:
                existing.add(key)  # a run listed twice is inserted once
                new.append(row)
        if not new:
            return []
        outcome = connection.execute(
            _insert_new(r),
            [{k: v for k, v in row.items() if k not in ("target_type", "target")} for row in new],
        )
        if outcome.rowcount != len(new):
            raise errors.StoreUnavailable(
                f"claim: {outcome.rowcount} of {len(new)} runs inserted; rolled back"
            )
        sent = [row for row in new if row["status"] == RunStatus.dispatched.value]
        if not sent:
            return [(row["job_id"], row["scheduled_at"], row["status"]) for row in new]
        brokers = set(connection.execute(_broker_tenants()).scalars())
        queued = [row for row in sent if _straight_to_queue(row, brokers)]
        if queued:
            connection.execute(
                _insert_new(schema.queue_messages),
                [
                    {
                        "queue": row["target"],
                        "job_id": row["job_id"],
                        "scheduled_at": row["scheduled_at"],
                        "tenant_id": row["tenant_id"],
                        "attempt": 1,
                        "available_at": now,
                        "created_at": now,
                    }
                    for row in queued
                ],
            )
        outbox_rows = [
            {
                "job_id": row["job_id"],
                "scheduled_at": row["scheduled_at"],
                "tenant_id": row["tenant_id"],
                "target_type": row["target_type"],
                "target": row["target"],
                "attempt": 1,
                "available_at": now,
                "created_at": now,
            }
            for row in sent
            if not _straight_to_queue(row, brokers)
        ]
        if outbox_rows:
            connection.execute(schema.outbox.insert(), outbox_rows)
        return [(row["job_id"], row["scheduled_at"], row["status"]) for row in new]

    def due_outbox_rows(
        self, connection: Connection, wanted: Mapping[Lane, int], now: datetime
    ) -> list[RowMapping]:
        o = schema.outbox
        rows: list[RowMapping] = []
        for lane, cap in wanted.items():
            rows.extend(
                connection.execute(
                    select(
                        o.c.id,
                        o.c.job_id,
                        o.c.scheduled_at,
                        o.c.tenant_id,
                        o.c.target_type,
                        o.c.target,
                        o.c.attempt,
                        o.c.lease_owner,
                        o.c.payload,
                    )
                    .where(
                        o.c.tenant_id == lane.tenant_id,
                        o.c.target_type == str(lane.kind),
                        o.c.available_at <= now,
                    )
                    .order_by(o.c.available_at)
                    .limit(cap)
                )
                .mappings()
                .all()
            )
        return rows

    def lease_outbox_rows(
        self,
        connection: Connection,
        wanted: Mapping[Lane, int],
        token: str,
        lease_seconds: float,
    ) -> list[tuple[Any, ...]] | None:
        return None  # transactions are serialized and local: the steps cost no round trips

    def lock_outbox_leases(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime | None, dict[int, tuple[str | None, int]]] | None:
        return None  # no row locks, and a local clock

    def runtime_grants(self, connection: Connection, role: str) -> RoleGrants | None:
        return None  # a file: who may open it is the file system's business

    def run_partitions(self, connection: Connection) -> RunPartitions | None:
        return None  # one runs table; retention deletes old rows

    def create_run_partition(
        self, connection: Connection, name: str, start: datetime, end: datetime
    ) -> bool:
        return False

    def drop_run_partitions(self, connection: Connection, cutoff: datetime) -> int:
        return 0

    def due_lag(
        self, connection: Connection, now: datetime, partition_count: int
    ) -> tuple[datetime | None, int]:
        j = schema.jobs
        oldest, due = connection.execute(
            select(func.min(j.c.next_fire_at), func.count()).where(
                j.c.next_fire_at <= now, j.c.status == "active"
            )
        ).one()
        return oldest, int(due)

    def describe(self, connection: Connection) -> str:
        return "sqlite (WAL, synchronous=NORMAL)"

    def server_sessions(self, connection: Connection) -> ServerSessions | None:
        return None  # a file, no server

    def table_bytes(self, connection: Connection, table: str) -> int | None:
        try:
            value = connection.execute(
                text(
                    "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat WHERE name = :table OR name IN "
                    "(SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = :table)"
                ),
                {"table": table},
            ).scalar_one()
        except Exception:  # dbstat is a compile-time option of SQLite
            return None
        return int(value)

    def generate_once_jobs(
        self, connection: Connection, columns: Sequence[str], params: dict[str, Any]
    ) -> None:
        raise NotImplementedError("SQLite's benchmark rows are made in Python")

    def set_jobs_due(self, connection: Connection, due: Sequence[tuple[str, datetime]]) -> None:
        j = schema.jobs
        statement = (
            update(j)
            .where(j.c.job_id == bindparam("b_job_id"))
            .values(next_run_at=bindparam("b_at"), next_fire_at=bindparam("b_at"))
        )
        for start in range(0, len(due), 2000):
            connection.execute(
                statement,
                [{"b_job_id": job_id, "b_at": at} for job_id, at in due[start : start + 2000]],
            )

    def vacuum(self, engine: Engine, table: str, *, full: bool) -> None:
        # freed pages are reused and only pages in use are counted: nothing to give back
        if not full:
            with engine.begin() as connection:
                connection.execute(text(f"ANALYZE {table}"))

    def checkpoint(self, engine: Engine) -> bool:
        # TRUNCATE waits (the busy handler) for other connections' readers and writer to
        # finish: briefly only, a daemon still running beside this command must not hold
        # up its exit, and that daemon checkpoints at its own stop
        with engine.connect() as connection:
            driver = connection.connection.driver_connection
            assert driver is not None
            driver.execute(f"PRAGMA busy_timeout={CHECKPOINT_WAIT_MS}")
            busy, _log_pages, _moved = driver.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            driver.execute("PRAGMA busy_timeout=30000")
        return not busy

    # -- text keys in one parameter (job creation, the built-in queue's move) ------------

    def text_in(self, column: Any, name: str) -> Any:
        # a batch is at most a few thousand: within SQLite's limit of bound variables
        return column.in_(bindparam(name, expanding=True))

    def select_each(self, query: Select[Any], column: Any, name: str) -> Select[Any]:
        return query.where(self.text_in(column, name))

    def mappings_planned_now(
        self, connection: Connection, statement: Any, params: Mapping[str, Any]
    ) -> list[RowMapping]:
        # SQLite plans each statement when it is compiled, with no statistics to go stale
        return list(connection.execute(statement, params).mappings())

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
            self.notify_job_changes(connection, changed)
        return set()


class SqliteChangeFeed:
    """Polls the change counter; when it moved, the dispatcher reloads its window, which
    on one machine's SQLite is a cheap index read."""

    def __init__(self, engine: Engine, poll_seconds: float = 0.25) -> None:
        self._poll = poll_seconds
        self._raw = engine.raw_connection()
        self._version: int | None = None

    def _counter(self) -> int:
        cursor = self._raw.cursor()
        try:
            cursor.execute("SELECT value FROM settings WHERE key = ?", (COUNTER_KEY,))
            row = cursor.fetchone()
        finally:
            cursor.close()
        return int(row[0]) if row else 0

    def wait(self, timeout: float) -> Changes:
        deadline = time.monotonic() + timeout
        while True:
            version = self._counter()
            changed = self._version is not None and version != self._version
            self._version = version
            if changed:
                return Changes(reload=True)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Changes()
            time.sleep(min(self._poll, remaining))

    def close(self) -> None:
        self._raw.close()


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    """`items` in slices of IN_CHUNK, each one IN list of a statement."""
    return [items[i : i + IN_CHUNK] for i in range(0, len(items), IN_CHUNK)]


def _straight_to_queue(row: Mapping[str, Any], brokers: set[str]) -> bool:
    """Whether the claim writes this dispatched run's queue message itself (see
    Dialect.insert_runs): a built-in queue target that needs no relay decision."""
    return (
        row["target_type"] == TargetType.queue.value
        and not str(row["target"]).startswith(EVERY_HOST_QUEUE_PREFIX)
        and row["tenant_id"] not in brokers
    )


# The statements of the worker's lease and settle, built once: building and cache-keying a
# statement per call was about a fifth of the embedded daemon's CPU at 500 runs/s.


@functools.cache
def _lease_candidates() -> Any:
    m, j = schema.queue_messages, schema.jobs
    held = m.alias("held")
    # Held = leased, expired or not: an expired lease's command may still be running
    # until the reaper settles it, and "no overlapping runs" must hold meanwhile.
    in_use = (
        select(func.count())
        .select_from(held)
        .where(held.c.job_id == m.c.job_id, held.c.leased_until.is_not(None))
        .scalar_subquery()
    )
    return (
        select(
            m.c.id,
            m.c.job_id,
            m.c.scheduled_at,
            m.c.attempt,
            j.c.max_attempts,
            j.c.retry_base_seconds,
            j.c.retry_max_seconds,
            j.c.max_concurrency,
            j.c.timeout_seconds,
            # the snapshot of an update made after the claim wins (0009)
            func.coalesce(m.c.payload, j.c.payload),
            j.c.status,
            j.c.overlap,
            j.c.memory_max,
            j.c.cpu_weight,
            j.c.tasks_max,
        )
        .join(j, j.c.job_id == m.c.job_id)
        .where(
            # the (tenant_id, queue, available_at) index: one tenant's queue in due order
            m.c.tenant_id == bindparam("tenant_id"),
            m.c.queue == bindparam("queue"),
            m.c.available_at <= bindparam("now", type_=m.c.available_at.type),
            m.c.leased_until.is_(None),
            # max_concurrency 0 is "no limit" (null in the API)
            # and a first attempt of another overlap policy than queue is admitted (or
            # skipped, or replaces) in queue.py
            or_(
                j.c.max_concurrency <= 0,
                j.c.overlap == "allow",
                and_(j.c.overlap != "queue", m.c.attempt == 1),
                in_use < j.c.max_concurrency,
            ),
        )
        # oldest first along ix_queue_messages_ready, stopping after `fetch` rows (a
        # tie-break on id would sort the whole backlog on every lease)
        .order_by(m.c.available_at)
        .limit(bindparam("fetch"))
    )


@functools.cache
def _leased_counts() -> Any:
    m = schema.queue_messages
    return (
        select(m.c.job_id, func.count())
        .where(m.c.job_id.in_(bindparam("job_ids", expanding=True)), m.c.leased_until.is_not(None))
        .group_by(m.c.job_id)
    )


@functools.cache
def _mark_leased() -> Any:
    m = schema.queue_messages
    return (
        update(m)
        .where(m.c.id.in_(bindparam("ids", expanding=True)))
        .values(
            leased_until=bindparam("b_leased_until", type_=m.c.leased_until.type),
            lease_owner=bindparam("b_lease_owner"),
        )
    )


@functools.cache
def _mark_leased_each() -> Any:
    m = schema.queue_messages
    owners = func.json_each(bindparam("b_owners")).table_valued("key", "value")
    return (
        update(m)
        .where(m.c.id == cast(owners.c.key, Integer))
        .values(
            leased_until=bindparam("b_leased_until", type_=m.c.leased_until.type),
            lease_owner=owners.c.value,
        )
    )


@functools.cache
def _held_messages() -> Any:
    m, j = schema.queue_messages, schema.jobs
    return (
        select(
            m.c.id,
            m.c.queue,
            m.c.job_id,
            m.c.scheduled_at,
            m.c.tenant_id,
            m.c.attempt,
            j.c.max_attempts,
            j.c.retry_base_seconds,
            j.c.retry_max_seconds,
            m.c.lease_owner,
        )
        # outer join: a message whose job row is gone still gets settled (dead-lettered)
        .outerjoin(j, j.c.job_id == m.c.job_id)
        .where(m.c.id.in_(bindparam("ids", expanding=True)), m.c.leased_until.is_not(None))
        .order_by(m.c.id)
    )


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


# ... and the claim's


@functools.cache
def _job_versions() -> Any:
    jobs = schema.jobs
    return select(jobs.c.job_id, jobs.c.version, jobs.c.status).where(
        jobs.c.job_id.in_(bindparam("ids", expanding=True))
    )


@functools.cache
def _advance_job() -> Any:
    jobs = schema.jobs
    return (
        update(jobs)
        .where(
            jobs.c.job_id == bindparam("b_job_id"),
            jobs.c.version == bindparam("b_version"),
            jobs.c.status == JobStatus.active.value,
        )
        .values(
            next_run_at=bindparam("b_next_run_at", type_=jobs.c.next_run_at.type),
            next_fire_at=bindparam("b_next_fire_at", type_=jobs.c.next_fire_at.type),
            status=bindparam("b_status"),
            version=jobs.c.version + 1,
            updated_at=bindparam("b_now", type_=jobs.c.updated_at.type),
        )
    )


@functools.cache
def _existing_runs() -> Any:
    r = schema.runs
    return select(r.c.job_id, r.c.scheduled_at).where(
        r.c.job_id.in_(bindparam("job_ids", expanding=True)),
        r.c.scheduled_at.in_(bindparam("instants", expanding=True, type_=r.c.scheduled_at.type)),
    )


@functools.cache
def _insert_new(table: Table) -> Any:
    return sqlite.insert(table).on_conflict_do_nothing()


@functools.cache
def _broker_tenants() -> Any:
    t = schema.tenants
    return select(t.c.tenant_id).where(t.c.broker_url.is_not(None))
