"""Owns the scale benchmark's reads of what a table takes on disk (its rows, indexes and
TOAST; on Postgres summed over its partitions) and of how many rows it has, and the upkeep
between its measurements: VACUUM ANALYZE (a large load needs statistics before its plans
mean anything, and a former level's deleted burst leaves dead index entries that the next
due read would walk) and VACUUM FULL (so that what a table grows by is only its new rows).
What differs per backend is the dialect's (table_bytes, vacuum)."""

from __future__ import annotations

from sqlalchemy import func, select

from schedctl.storage.db import schema
from schedctl.storage.db.store import Store


def table_bytes(store: Store, table: str) -> int | None:
    """Bytes of `table` with its indexes (and partitions); None where the database cannot
    tell (SQLite without the dbstat table)."""
    with store.read() as connection:
        return store.dialect.table_bytes(connection, schema.metadata.tables[table].name)


def row_count(store: Store, table: str) -> int:
    """Rows in `table` (every tenant's)."""
    with store.read() as connection:
        value = connection.execute(
            select(func.count()).select_from(schema.metadata.tables[table])
        ).scalar_one()
    return int(value)


def vacuum_analyze(store: Store, table: str) -> None:
    """Clear the dead rows a former measurement left in `table` and its indexes and refresh
    the planner's statistics (what autovacuum would do some time later)."""
    store.dialect.vacuum(store.engine, schema.metadata.tables[table].name, full=False)


# what a delivery reads and writes: the rows a claim, a move or a settle leaves dead
DELIVERY_TABLES = ("outbox", "queue_messages", "runs", "run_attempts")


def clear_dead_rows(store: Store) -> None:
    """Before a delivery measurement: vacuum_analyze the delivery tables, so that each
    measurement starts from the same state whatever ran before it (one bench relay after
    another, the outbox's dead rows slowed the claims to a third by the fourth run)."""
    for table in DELIVERY_TABLES:
        vacuum_analyze(store, table)


def compact(store: Store, table: str) -> None:
    """Give the space of deleted rows back, so that what a table grows by next is only what
    the next rows take (SQLite reuses freed pages and reports only those in use)."""
    store.dialect.vacuum(store.engine, schema.metadata.tables[table].name, full=True)


def backend(store: Store) -> str:
    """The backend's name, as a report states it."""
    return str(store.engine.url.get_backend_name())
