"""Owns the SQLite side of the Dialect (storage/backend/dialect.py): the embedded, one-machine
backend. Its transactions are BEGIN IMMEDIATE, i.e. serialized, so there are no row locks,
lock races or advisory locks to take; job changes bump a counter the dispatcher polls; no
word of ready work crosses processes (QuietFeed); batches are IN lists of chunks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Select,
    Table,
    bindparam,
    text,
)
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine, RowMapping

from schedctl.domain.leasing import ReadyFeed
from schedctl.storage.backend.dialect import (
    ChangeFeed,
    Changes,
    Lock,
)
from schedctl.storage.db.types import UTCDateTime

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
    single_writer = True

    def now(self, connection: Connection) -> datetime:
        # one machine: its clock is every process's clock
        return datetime.now(UTC)

    def locked_clock(self) -> Any:
        # this machine's clock, bound when the statement runs: the write lock is the
        # transaction's already, so no wait for a lock comes after it
        return bindparam("locked_clock", callable_=_utc_now, type_=UTCDateTime())

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

    def notify_job_changes(
        self, connection: Connection, changed: Sequence[tuple[str, int]]
    ) -> None:
        # one bump tells every dispatcher to reload, whatever changed
        connection.execute(
            text(
                "INSERT INTO settings (key, value) VALUES (:key, '1') ON CONFLICT (key) "
                "DO UPDATE SET value = CAST(CAST(settings.value AS INTEGER) + 1 AS TEXT)"
            ),
            {"key": COUNTER_KEY},
        )

    def change_feed(self, engine: Engine, poll_seconds: float) -> ChangeFeed:
        return SqliteChangeFeed(engine, poll_seconds)

    def notify_ready(self, connection: Connection, words: Collection[str]) -> None:
        pass  # one machine: `scheduled-d all` wakes its workers and relay in process

    def ready_feed(self, engine: Engine, word: str) -> ReadyFeed:
        return QuietFeed()

    def id_in(self, column: Any, ids: Sequence[int]) -> Any:
        return column.in_(ids)

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


class QuietFeed:
    """The ready feed of one machine's database: no word crosses processes (`scheduled-d
    all` wakes its workers and relay in process), so it answers, after each wait, that it
    heard nothing; the loop's own polling finds what other processes readied."""

    def __init__(self) -> None:
        self._closed = threading.Event()

    def wait(self, timeout: float) -> bool:
        self._closed.wait(timeout)
        return False

    def close(self) -> None:
        self._closed.set()


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


def _utc_now() -> datetime:
    return datetime.now(UTC)


def chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    """`items` in slices of IN_CHUNK, each one IN list of a statement."""
    return [items[i : i + IN_CHUNK] for i in range(0, len(items), IN_CHUNK)]


# The statements of the worker's lease and settle, built once: building and cache-keying a
# statement per call was about a fifth of the embedded daemon's CPU at 500 runs/s.


# ... and the claim's
