"""Job-change notifications: how a dispatcher hears that a job was created or moved into
its preload window. Postgres: LISTEN/NOTIFY, sent in the changing transaction. SQLite (one
machine): a change counter in `settings`, bumped in the changing transaction and read on
every short poll (claims, acks and deliveries do not bump it, so they cause no reload)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sqlalchemy import text
from sqlalchemy.engine import Connection

from schedctl.storage.store import Store

if TYPE_CHECKING:
    # the driver is loaded by the Postgres feed only: a CLI command on SQLite never needs it
    import psycopg

log = logging.getLogger(__name__)

CHANNEL = "scheduled_jobs"


COUNTER_KEY = "jobs_changed"


def notify_job_change(connection: Connection, job_id: str, partition: int) -> None:
    """Tell the dispatchers (at commit) that this job's next run may have moved."""
    if connection.dialect.name == "postgresql":
        connection.execute(
            text("SELECT pg_notify(:channel, :payload)"),
            {"channel": CHANNEL, "payload": f"{partition}:{job_id}"},
        )
    else:
        connection.execute(
            text(
                "INSERT INTO settings (key, value) VALUES (:key, '1') ON CONFLICT (key) "
                "DO UPDATE SET value = CAST(CAST(settings.value AS INTEGER) + 1 AS TEXT)"
            ),
            {"key": COUNTER_KEY},
        )


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


class PostgresChangeFeed:
    """A dedicated autocommit connection LISTENing on the jobs channel; after losing it
    (a database restart), it reconnects and asks for a reload, since notifications sent
    meanwhile are gone."""

    def __init__(self, store: Store) -> None:
        url = store.engine.url.set(drivername="postgresql")
        self._dsn = url.render_as_string(hide_password=False)
        self._connection: psycopg.Connection[tuple[object, ...]] | None = None

    def _connect(self) -> psycopg.Connection[tuple[object, ...]]:
        import psycopg

        connection = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5)
        connection.execute(f"LISTEN {CHANNEL}")
        return connection

    def wait(self, timeout: float) -> Changes:
        import psycopg

        deadline = time.monotonic() + timeout
        if self._connection is None or self._connection.closed:
            try:
                self._connection = self._connect()
            except psycopg.Error as exc:
                log.warning("cannot LISTEN for job changes: %s", str(exc).splitlines()[0])
                time.sleep(max(0.0, min(timeout, 1.0)))
                return Changes(reload=True)
            return Changes(reload=True)  # anything may have changed while not listening
        job_ids: list[str] = []
        try:
            remaining = max(0.0, deadline - time.monotonic())
            for notice in self._connection.notifies(timeout=remaining, stop_after=1):
                job_ids.append(notice.payload.partition(":")[2])
            # drain what else arrived with it, without waiting again
            for notice in self._connection.notifies(timeout=0.0, stop_after=10_000):
                job_ids.append(notice.payload.partition(":")[2])
        except psycopg.Error as exc:
            log.warning("lost the LISTEN connection: %s", str(exc).splitlines()[0])
            self.close()
            return Changes(reload=True)
        return Changes(job_ids=tuple(job_ids))

    def close(self) -> None:
        import psycopg

        if self._connection is not None:
            try:
                self._connection.close()
            except psycopg.Error:
                pass
            self._connection = None


class SqliteChangeFeed:
    """Polls the change counter; when it moved, the dispatcher reloads its window, which
    on one machine's SQLite is a cheap index read."""

    def __init__(self, store: Store, poll_seconds: float = 0.25) -> None:
        self._store = store
        self._poll = poll_seconds
        self._raw = store.engine.raw_connection()
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


def open_change_feed(store: Store, poll_seconds: float = 0.25) -> ChangeFeed:
    if store.is_postgres:
        return PostgresChangeFeed(store)
    return SqliteChangeFeed(store, poll_seconds)
