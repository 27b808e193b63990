"""Owns the Postgres side of the Dialect (storage/backend/dialect.py): clock_timestamp(), row
locks with SKIP LOCKED, LISTEN/NOTIFY feeds, keys bound as arrays; and the driver helpers
the hot paths' Postgres statements run through (pg_rows, pg_keyed, pg_binary: the
transaction's own psycopg cursor, arrays in binary, planned at execution where asked)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    Select,
    Table,
    Text,
    any_,
    bindparam,
    func,
    literal_column,
    select,
    text,
    true,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Engine, RowMapping

from schedctl.domain.leasing import ReadyFeed
from schedctl.storage.backend.dialect import (
    ChangeFeed,
    Changes,
    Lock,
)
from schedctl.storage.db.engine import session_kwargs

if TYPE_CHECKING:
    # the driver is loaded by the change feed only: a CLI command needs it not
    import psycopg

log = logging.getLogger(__name__)

# SQLSTATEs of a transaction that lost a lock race: deadlock_detected and
# serialization_failure. Nothing was committed; the same work can be tried again.
LOCK_RACE_SQLSTATES = frozenset({"40P01", "40001"})
CHANNEL = "scheduled_jobs"
# word that work is ready: payload queue_word(TENANT_ID, QUEUE) for a built-in queue's new
# ready messages, OUTBOX_WORD for new outbox rows (dialect.py)
QUEUE_CHANNEL = "scheduled_queues"


class PostgresDialect:
    name = "postgresql"
    driver = "psycopg"
    # row locks (in job_id order for claims): claim threads run side by side, and
    # writers that find nothing block nobody
    single_writer = False
    naive_instants = False  # timestamptz
    embedded = False

    def now(self, connection: Connection) -> datetime:
        value = connection.execute(text("SELECT clock_timestamp()")).scalar_one()
        assert isinstance(value, datetime)
        return value.astimezone(UTC)

    def locked_clock(self) -> Any:
        # the statement's start (statement_timestamp) would come before its wait for locks
        return func.clock_timestamp()

    def clock(self, begin: Callable[[], AbstractContextManager[Connection]]) -> datetime:
        with begin() as connection:
            return self.now(connection)

    def insert(self, table: Table) -> Any:
        return postgresql.insert(table)

    def lock(
        self, query: Any, mode: Lock = Lock.update, *, skip_locked: bool = False, of: Any = None
    ) -> Any:
        return query.with_for_update(
            read=mode is Lock.share,
            key_share=mode is Lock.no_key_update,
            skip_locked=skip_locked,
            of=of,
        )

    def lock_rows(self, connection: Connection, query: Any, mode: Lock = Lock.update) -> None:
        connection.execute(self.lock(query, mode))

    def is_lock_race(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) in LOCK_RACE_SQLSTATES

    def notify_job_changes(
        self, connection: Connection, changed: Sequence[tuple[str, int]]
    ) -> None:
        notify_all(connection, CHANNEL, [f"{part}:{job_id}" for job_id, part in changed])

    def change_feed(self, engine: Engine, poll_seconds: float) -> ChangeFeed:
        return PostgresChangeFeed(engine)

    def notify_ready(self, connection: Connection, words: Collection[str]) -> None:
        if words:
            notify_all(connection, QUEUE_CHANNEL, sorted(words))

    def ready_feed(self, engine: Engine, word: str) -> ReadyFeed:
        return PostgresReadyFeed(engine, word)

    def id_in(self, column: Any, ids: Sequence[int]) -> Any:
        # one array parameter (= ANY): one statement text whatever the batch size, which
        # psycopg parses once, instead of one placeholder per id (a new text, parsed again,
        # for every length; it cost the relay a tenth of its CPU)
        return column == any_(bindparam(None, list(ids), type_=ARRAY(BigInteger)))

    def checkpoint(self, engine: Engine) -> bool:
        # the server's own WAL and checkpoints: a clean stop of a client leaves nothing
        return True

    # -- text keys in one parameter (job creation, the built-in queue's move) ------------

    def text_in(self, column: Any, name: str) -> Any:
        # one array parameter: one statement text whatever the batch (see id_in)
        return column == any_(bindparam(name, type_=ARRAY(Text)))

    def select_each(self, query: Select[Any], column: Any, name: str) -> Select[Any]:
        # A probe per string, each limited to its one row. `column = ANY(:name)` could be
        # planned as one scan of the table or of the tenant's rows, and the same lateral
        # join without the LIMIT is flattened into a join that was (a hash of every job of
        # the tenant per batch): either way a 1,000-job batch's lookups grew with the table,
        # from 10 ms at 1,000 jobs to 75 ms at 20,000. The LIMIT keeps the subquery whole.
        wanted = (
            func.unnest(bindparam(name, type_=ARRAY(Text))).table_valued("value").render_derived()
        )
        probe = query.where(column == wanted.c.value).limit(literal_column("1")).lateral()
        return select(probe).select_from(wanted.join(probe, true()))

    def mappings_planned_now(
        self, connection: Connection, statement: Any, params: Mapping[str, Any]
    ) -> list[RowMapping]:
        # psycopg prepares a statement run five times, and Postgres may then keep one
        # generic plan until the table's next analyze. Made while the table was empty (a
        # fresh database, or a deleted tenant's jobs vacuumed away) it scans the table
        # for each key, and a first import's batches crawled until autovacuum's minute came
        # (figures in docs/performance.md).
        driver = connection.connection.driver_connection
        assert driver is not None
        threshold = driver.prepare_threshold
        driver.prepare_threshold = None  # psycopg: neither prepare nor use a prepared one
        try:
            return list(connection.execute(statement, params).mappings())
        finally:
            driver.prepare_threshold = threshold


def notify_all(connection: Connection, channel: str, payloads: list[str]) -> None:
    """NOTIFY `channel` once per payload, in one statement (sent at commit)."""
    connection.execute(
        text("SELECT pg_notify(:channel, p) FROM unnest(CAST(:payloads AS text[])) AS p"),
        {"channel": channel, "payloads": payloads},
    )


class _Listener:
    """A dedicated autocommit connection LISTENing on one channel (opened on first use),
    opened with the pool's own session arguments: every host of a multi-host URL,
    target_session_attrs (after a failover it follows the new primary: NOTIFY is sent on
    the primary only), TLS parameters, the process's application_name."""

    def __init__(self, engine: Engine, channel: str) -> None:
        self._kwargs = session_kwargs(engine, autocommit=True)
        self._channel = channel
        self._connection: psycopg.Connection[tuple[object, ...]] | None = None

    @property
    def listening(self) -> bool:
        return self._connection is not None and not self._connection.closed

    def connect(self) -> None:
        """Listen (psycopg.Error if the database cannot be reached)."""
        import psycopg

        self._connection = psycopg.connect(**self._kwargs)
        self._connection.execute(f"LISTEN {self._channel}")

    def payloads(self, timeout: float) -> list[str]:
        """The payloads of the notifications that arrive within `timeout` seconds,
        returning with the first (and what came with it); psycopg.Error when the connection
        is lost (it is closed then)."""
        import psycopg

        assert self._connection is not None
        found: list[str] = []
        try:
            for notice in self._connection.notifies(timeout=timeout, stop_after=1):
                found.append(notice.payload)
            # drain what else arrived with it, without waiting again
            for notice in self._connection.notifies(timeout=0.0, stop_after=10_000):
                found.append(notice.payload)
        except psycopg.Error:
            self.close()
            raise
        return found

    def close(self) -> None:
        import psycopg

        if self._connection is not None:
            try:
                self._connection.close()
            except psycopg.Error:
                pass
            self._connection = None


class PostgresChangeFeed:
    """The jobs channel for one dispatcher; after losing its connection (a database
    restart), it reconnects and asks for a reload, since notifications sent meanwhile are
    gone."""

    def __init__(self, engine: Engine) -> None:
        self._listener = _Listener(engine, CHANNEL)

    def wait(self, timeout: float) -> Changes:
        import psycopg

        if not self._listener.listening:
            try:
                self._listener.connect()
            except psycopg.Error as exc:
                log.warning("cannot LISTEN for job changes: %s", str(exc).splitlines()[0])
                time.sleep(max(0.0, min(timeout, 1.0)))
            return Changes(reload=True)  # anything may have changed while not listening
        try:
            payloads = self._listener.payloads(timeout)
        except psycopg.Error as exc:
            log.warning("lost the LISTEN connection: %s", str(exc).splitlines()[0])
            return Changes(reload=True)
        return Changes(job_ids=tuple(p.partition(":")[2] for p in payloads))

    def close(self) -> None:
        self._listener.close()


class PostgresReadyFeed:
    """QUEUE_CHANNEL for one worker or relay, answering True for its own `word`. After
    losing its connection it answers True once reconnected, since work readied meanwhile
    went unheard; while it cannot reconnect it sleeps and answers False (the worker's or
    relay's own polling and backoff carry on)."""

    def __init__(self, engine: Engine, word: str) -> None:
        self._listener = _Listener(engine, QUEUE_CHANNEL)
        self._word = word
        self._lost = False

    def wait(self, timeout: float) -> bool:
        import psycopg

        if not self._listener.listening:
            try:
                self._listener.connect()
            except psycopg.Error as exc:
                if not self._lost:  # once per outage: the worker says the rest
                    log.warning("cannot LISTEN for ready work: %s", str(exc).splitlines()[0])
                self._lost = True
                time.sleep(max(0.0, min(timeout, 1.0)))
                return False
            self._lost = False
            return True
        # other queues' words wake the connection too: wait on until ours or the timeout
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self._word in self._listener.payloads(max(0.0, deadline - time.monotonic())):
                    return True
                if time.monotonic() >= deadline:
                    return False
        except psycopg.Error as exc:
            log.warning("lost the LISTEN connection: %s", str(exc).splitlines()[0])
            self._lost = True
            return False

    def close(self) -> None:
        self._listener.close()


def pg_rows(
    connection: Connection, sql: str, params: dict[str, Any], *, prepare: bool | None = None
) -> list[Any]:
    """pg_binary for a worker's statements: the tuples as psycopg made them, no copy.
    `prepare=False`: planned anew at every execution (psycopg's default prepares a statement
    run five times, and the server may then keep one generic plan for every parameter)."""
    driver = connection.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cursor:
        cursor.execute(sql, params, prepare=prepare)
        return cursor.fetchall() if cursor.description else []


def pg_keyed(connection: Connection, sql: str, params: dict[str, Any]) -> list[Any]:
    """pg_rows (planned now) for a statement that joins runs or messages with a batch's
    unnested keys, with nested loops off for it. The batch's runs are new to the
    statistics, so Postgres expects one row where the batch has hundreds; with nested
    loops it then compared every row found with the whole batch (a join filter: 87 ms for
    500 runs, and the relay's settles and the worker's leases went quadratic in the batch).
    Without them it hashes the batch and reads the runs by their keys' index."""
    driver = connection.connection.driver_connection
    assert driver is not None
    driver.execute("SET LOCAL enable_nestloop = off")
    rows = pg_rows(connection, sql, params, prepare=False)
    # (after an error the transaction's rollback undoes the SET LOCAL)
    driver.execute("RESET enable_nestloop")
    return rows


def pg_binary(connection: Connection, sql: str, params: dict[str, Any]) -> list[Any]:
    """Run one statement on the transaction's own psycopg connection with parameters in
    binary format: big arrays dump about 7 times faster than as text."""
    driver = connection.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall()) if cursor.description else []


# The span of the runs' instants, besides each run's own key: a statement planned at its
# execution then touches the day partitions holding them only, not every partition of the
# run history (an Append over all of them, planned and opened for a handful of rows)
RUNS_SPAN = (
    " AND runs.scheduled_at BETWEEN CAST(%(first_at)b AS timestamptz)"
    " AND CAST(%(last_at)b AS timestamptz)"
)


def runs_span(instants: Sequence[datetime]) -> dict[str, datetime | None]:
    """RUNS_SPAN's parameters for these instants."""
    return {
        "first_at": min(instants, default=None),
        "last_at": max(instants, default=None),
    }


def json_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows (dicts) as a JSON array for _insert_from_json, as they are (a key that is
    no listed column is ignored, one missing is NULL): instants in RFC 3339 with their
    offset (a naive one is UTC, as everywhere in storage)."""
    import orjson

    return orjson.dumps(list(rows), option=orjson.OPT_NAIVE_UTC).decode()


def pg_arrays(
    rows: Sequence[Mapping[str, Any]], arrays: tuple[tuple[str, str], ...]
) -> dict[str, list[Any]]:
    return {name: [row.get(name) for row in rows] for name, _ in arrays}
