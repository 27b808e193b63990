"""Owns the scale benchmark's reads of what a table takes on disk (its rows, indexes and
TOAST; on Postgres summed over its partitions) and of how many rows it has, and the upkeep
between its measurements: VACUUM ANALYZE (a large load needs statistics before its plans
mean anything, and a former level's deleted burst leaves dead index entries that the next
due read would walk) and VACUUM FULL (so that what a table grows by is only its new rows)."""

from __future__ import annotations

from sqlalchemy import func, select, text

from schedctl.storage import schema
from schedctl.storage.store import Store


def table_bytes(store: Store, table: str) -> int | None:
    """Bytes of `table` with its indexes (and partitions); None where the database cannot
    tell (SQLite without the dbstat table)."""
    with store.read() as connection:
        if store.dialect.name == "postgresql":
            value = connection.execute(
                # a plain table is its own tree's only member (a partitioned one's root
                # has no storage of its own, its leaves have it all)
                text(
                    "SELECT COALESCE(SUM(pg_total_relation_size(relid)), 0) FROM "
                    "(SELECT relid FROM pg_partition_tree(CAST(:table AS regclass)) UNION "
                    "SELECT CAST(:table AS regclass)) AS tree"
                ),
                {"table": table},
            ).scalar_one()
            return int(value)
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


def row_count(store: Store, table: str) -> int:
    """Rows in `table` (every tenant's)."""
    with store.read() as connection:
        value = connection.execute(
            select(func.count()).select_from(schema.metadata.tables[table])
        ).scalar_one()
    return int(value)


def vacuum_analyze(store: Store, table: str) -> None:
    """Clear the dead rows a former measurement left in `table` and its indexes and refresh
    the planner's statistics (Postgres VACUUM ANALYZE, outside a transaction: what autovacuum
    would do some time later); ANALYZE on SQLite."""
    name = schema.metadata.tables[table].name
    if store.dialect.name != "postgresql":
        with store.tx() as connection:
            connection.execute(text(f"ANALYZE {name}"))
        return
    with store.engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT").execute(
            text(f"VACUUM ANALYZE {name}")
        )


def compact(store: Store, table: str) -> None:
    """Give the space of deleted rows back (Postgres VACUUM FULL, outside a transaction),
    so that what a table grows by next is only what the next rows take; SQLite reuses
    freed pages and reports only those in use."""
    if store.dialect.name != "postgresql":
        return
    name = schema.metadata.tables[table].name
    with store.engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT").execute(
            text(f"VACUUM FULL {name}")
        )
