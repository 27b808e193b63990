"""Owns the scale benchmark's reads of what a table takes on disk (its rows, indexes and
TOAST; on Postgres summed over its partitions) and of how many rows it has, and the upkeep
between its measurements: VACUUM ANALYZE (a large load needs statistics before its plans
mean anything, and a former level's deleted burst leaves dead index entries that the next
due read would walk) and VACUUM FULL (so that what a table grows by is only its new rows).
Postgres reads sizes from pg_partition_tree, SQLite from its dbstat table."""

from __future__ import annotations

from sqlalchemy import func, select, text

from schedctl.storage.db import schema
from schedctl.storage.db.store import Store


def table_bytes(store: Store, table: str) -> int | None:
    """Bytes of `table` with its indexes (and partitions); None where the database cannot
    tell (SQLite without the dbstat table)."""
    name = schema.metadata.tables[table].name
    with store.read() as connection:
        if store.dialect.embedded:
            try:
                value = connection.execute(
                    text(
                        "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat WHERE name = :table OR "
                        "name IN (SELECT name FROM sqlite_master WHERE type = 'index' AND "
                        "tbl_name = :table)"
                    ),
                    {"table": name},
                ).scalar_one()
            except Exception:  # dbstat is a compile-time option of SQLite
                return None
            return int(value)
        value = connection.execute(
            # a plain table is its own tree's only member (a partitioned one's root has no
            # storage of its own, its leaves have it all)
            text(
                "SELECT COALESCE(SUM(pg_total_relation_size(relid)), 0) FROM "
                "(SELECT relid FROM pg_partition_tree(CAST(:table AS regclass)) UNION "
                "SELECT CAST(:table AS regclass)) AS tree"
            ),
            {"table": name},
        ).scalar_one()
    return int(value)


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
    _vacuum(store, schema.metadata.tables[table].name, full=False)


def _vacuum(store: Store, table: str, *, full: bool) -> None:
    """Outside any transaction: clear the dead rows of `table` and refresh its planner
    statistics; with `full`, also give the space of deleted rows back."""
    if store.dialect.embedded:
        # freed pages are reused and only pages in use are counted: nothing to give back
        if not full:
            with store.engine.begin() as connection:
                connection.execute(text(f"ANALYZE {table}"))
        return
    command = "VACUUM FULL" if full else "VACUUM ANALYZE"
    with store.engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT").execute(
            text(f"{command} {table}")
        )


# what a delivery reads and writes: the rows a claim, a move or a settle leaves dead
DELIVERY_TABLES = ("outbox", "queue_messages", "runs", "run_attempts")


def clear_dead_rows(store: Store) -> None:
    """Before a delivery measurement: vacuum_analyze the delivery tables, so that each
    measurement starts from the same state whatever ran before it (the dead rows of the
    runs before it would slow its claims, more with each run)."""
    for table in DELIVERY_TABLES:
        vacuum_analyze(store, table)


def compact(store: Store, table: str) -> None:
    """Give the space of deleted rows back, so that what a table grows by next is only what
    the next rows take (SQLite reuses freed pages and reports only those in use)."""
    _vacuum(store, schema.metadata.tables[table].name, full=True)


def backend(store: Store) -> str:
    """The backend's name, as a report states it."""
    return str(store.engine.url.get_backend_name())
