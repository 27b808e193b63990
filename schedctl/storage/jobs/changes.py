"""Job-change notifications: how a dispatcher hears that a job was created or moved into
its preload window. Postgres: LISTEN/NOTIFY, sent in the changing transaction. SQLite (one
machine): a change counter in `settings`, bumped in the changing transaction and read on
every short poll (claims, acks and deliveries do not bump it, so they cause no reload).
Each backend's side is its dialect's (storage/backend/dialect.py)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.engine import Connection

from schedctl.storage.backend.dialect import ChangeFeed as ChangeFeed
from schedctl.storage.backend.dialect import Changes as Changes
from schedctl.storage.backend.dialect import dialect_of
from schedctl.storage.db.store import Store


def notify_job_change(connection: Connection, job_id: str, partition: int) -> None:
    """Tell the dispatchers (at commit) that this job's next run may have moved."""
    dialect_of(connection).notify_job_changes(connection, [(job_id, partition)])


def notify_job_changes(connection: Connection, changed: Sequence[tuple[str, int]]) -> None:
    """notify_job_change for many (job_id, partition) pairs in one statement."""
    if changed:
        dialect_of(connection).notify_job_changes(connection, changed)


def open_change_feed(store: Store, poll_seconds: float = 0.25) -> ChangeFeed:
    return store.dialect.change_feed(store.engine, poll_seconds)
