"""Owns where Postgres and SQLite differ: the Dialect interface the storage modules call, and
the choice of one implementation per engine (storage/backend/dialect_postgres.py and
storage/backend/dialect_sqlite.py). A change of locking, or a third backend, is one file.

The differences: the database clock; row locks (FOR UPDATE / SKIP LOCKED / FOR SHARE on
Postgres; SQLite's BEGIN IMMEDIATE transactions are serialized already); upserts and
insert-or-ignore; how a lost lock race and a lost connection look; the per-job advisory
locks of the worker lease; job-change notification (LISTEN/NOTIFY, or a counter the
dispatcher polls); word to idle workers and relays that work is ready (LISTEN/NOTIFY, or
none: embedded, the claim wakes them in process); and how a batch of keys is bound.

The hot paths' statements are not here: each lives, Postgres's beside SQLite's, in the
module of its path (pipeline/claim_statements.py, lease_statements.py,
outbox_statements.py, settle_statements.py, jobs/create_statements.py), and the day
partitions of run history in records/run_partitions.py.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Select, Table
from sqlalchemy.engine import Connection, Engine, RowMapping

from schedctl.domain.leasing import ReadyFeed

# The words that new work is ready (Dialect.ready_feed): a built-in queue's new ready
# messages, and new outbox rows for the relays.
OUTBOX_WORD = "outbox"


def queue_word(tenant_id: str, queue: str) -> str:
    """The word for a tenant's queue (insert_runs writes it in SQL the same way)."""
    return f"{tenant_id}:{queue}"


class Lock(enum.Enum):
    """How a locking read locks its rows (where the backend has row locks)."""

    update = "update"  # FOR UPDATE: the row will be changed or deleted
    no_key_update = "no_key_update"  # FOR NO KEY UPDATE: changed, but not its key
    share = "share"  # FOR SHARE: read, and must not change until commit


@dataclass(frozen=True)
class Changes:
    """What changed since the last look: some jobs, or possibly anything (reload)."""

    job_ids: tuple[str, ...] = ()
    reload: bool = False


class ChangeFeed(Protocol):
    def wait(self, timeout: float) -> Changes:
        """Block up to `timeout` seconds for changes; return early when there are some."""
        ...

    def close(self) -> None: ...


class Dialect(Protocol):
    """What storage asks of a backend. Every method runs inside the caller's transaction
    unless it says otherwise."""

    name: str  # SQLAlchemy's dialect name
    driver: str  # the DB-API module, whose own OperationalError means "connection lost"
    naive_instants: bool  # instants are bound as naive UTC (compared as stored text)
    embedded: bool  # a file of this machine (the embedded default), not a shared server
    # one writer at a time (a database-wide write lock): a dispatcher's claim threads
    # would only queue for it, so it runs one; a poller first reads, in a transaction
    # that takes no write lock, whether it has anything to write
    single_writer: bool

    def now(self, connection: Connection) -> datetime:
        """The database's clock, aware UTC: every process agrees on "now"."""
        ...

    def locked_clock(self) -> Any:
        """`now` as an SQL expression to read in a statement that does other work (one
        round trip less), read after the statement locked its rows (in the RETURNING of
        an UPDATE: a wait for the lock comes before it)."""
        ...

    def clock(self, begin: Callable[[], AbstractContextManager[Connection]]) -> datetime:
        """`now` outside a transaction: `begin` opens one only if the clock needs it."""
        ...

    def insert(self, table: Table) -> Any:
        """An INSERT that takes on_conflict_do_nothing / on_conflict_do_update."""
        ...

    def lock(
        self, query: Any, mode: Lock = Lock.update, *, skip_locked: bool = False, of: Any = None
    ) -> Any:
        """The SELECT, locking the rows it reads; with skip_locked, rows another transaction
        holds are left out instead of waited for."""
        ...

    def lock_rows(self, connection: Connection, query: Any, mode: Lock = Lock.update) -> None:
        """Lock the rows `query` selects until commit (nothing to do where transactions
        are serialized)."""
        ...

    def is_lock_race(self, exc: BaseException) -> bool:
        """This one exception (not its causes) says the transaction lost a lock race
        (deadlock, serialization failure): nothing committed, it may be tried again."""
        ...

    def notify_job_changes(
        self, connection: Connection, changed: Sequence[tuple[str, int]]
    ) -> None:
        """Tell the dispatchers (at commit) that these jobs' (job_id, partition) next runs
        may have moved, in one statement."""
        ...

    def change_feed(self, engine: Engine, poll_seconds: float) -> ChangeFeed:
        """A feed of job changes for one dispatcher (its own connection)."""
        ...

    def notify_ready(self, connection: Connection, words: Collection[str]) -> None:
        """Tell the workers and relays waiting for these words (queue_word, OUTBOX_WORD)
        that work is ready, at commit. (insert_runs tells them itself.)"""
        ...

    def ready_feed(self, engine: Engine, word: str) -> ReadyFeed:
        """A feed of one word (queue_word for a worker's queue, OUTBOX_WORD for a relay), on
        its own connection (one that hears nothing where no word crosses processes)."""
        ...

    def id_in(self, column: Any, ids: Sequence[int]) -> Any:
        """`column IN ids` for a batch of row ids, in the form this backend parses fastest."""
        ...

    def checkpoint(self, engine: Engine) -> bool:
        """At a clean stop: fold whatever a write-ahead log beside the database file holds
        into the file itself, so that the file alone (a copy, a backup) holds every
        committed row. False when another process kept it from finishing (it checkpoints
        at its own stop); True when done or nothing to do (a server database)."""
        ...

    # -- text keys in one parameter (job creation, the built-in queue's move) ------------

    def text_in(self, column: Any, name: str) -> Any:
        """`column IN :name` for a batch of strings (idempotency keys, names, job ids) bound
        as a list under `name` at execution, in the form this backend parses fastest (one
        statement text whatever the batch size)."""
        ...

    def select_each(self, query: Select[Any], column: Any, name: str) -> Select[Any]:
        """The row of `query` whose `column` equals each of the strings bound as a list under
        `name` (`column` is unique among query's rows: an idempotency key, a job's name),
        answered by one index probe per string whatever the table's size or statistics."""
        ...

    def mappings_planned_now(
        self, connection: Connection, statement: Any, params: Mapping[str, Any]
    ) -> list[RowMapping]:
        """`statement`'s rows as mappings, the statement planned for the table as it is now:
        never prepared, so never answered by a plan kept from when the table was empty."""
        ...


_DIALECTS: dict[str, Dialect] = {}


def known_dialects() -> dict[str, Dialect]:
    """Every backend this version supports, by SQLAlchemy dialect name."""
    if not _DIALECTS:
        # imported here: the implementations import the schema, which imports this module
        from schedctl.storage.backend.dialect_postgres import PostgresDialect
        from schedctl.storage.backend.dialect_sqlite import SqliteDialect

        # typed: mypy proves each implementation has every method of the interface
        implementations: tuple[Dialect, ...] = (PostgresDialect(), SqliteDialect())
        for dialect in implementations:
            _DIALECTS[dialect.name] = dialect
    return _DIALECTS


def dialect_named(name: str) -> Dialect:
    try:
        return known_dialects()[name]
    except KeyError:
        raise ValueError(f"unsupported database {name!r}") from None


def dialect_of(connection: Connection) -> Dialect:
    """The Dialect of a connection (for functions handed only a connection)."""
    return dialect_named(connection.dialect.name)
