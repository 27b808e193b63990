"""Owns the day partitions of run history, a capability of Postgres only (SQLite keeps runs
in one table, pruned by retention's deletes): which days have one and whether this
session's role may make and drop them, creating one, and dropping those before a cutoff.
run_partitioning(dialect) is None where runs is one table."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import text
from sqlalchemy.engine import Connection

from schedctl.storage.backend.dialect import Dialect


@dataclass(frozen=True)
class RunPartitions:
    """The day partitions of runs: the days that have one, and whether the session's role
    owns runs (may create and drop them: the owner role does, the daemons' runtime role
    does not)."""

    days: frozenset[date]
    owned: bool


class PostgresRunPartitions:
    """The day partitions of runs on Postgres."""

    def read(self, connection: Connection) -> RunPartitions | None:
        # owning runs (or a role that does, superusers too) is what CREATE TABLE ...
        # PARTITION OF and DROP TABLE of a partition need
        row = connection.execute(
            text(
                "SELECT pg_has_role(current_user, p.relowner, 'USAGE'), ARRAY("
                " SELECT c.relname::text FROM pg_inherits i JOIN pg_class c"
                " ON c.oid = i.inhrelid WHERE i.inhparent = p.oid"
                " AND c.relname ~ '^runs_[0-9]{8}$') "
                "FROM pg_class p WHERE p.oid = to_regclass('runs') AND p.relkind = 'p'"
            )
        ).one_or_none()
        if row is None:
            return None
        days = frozenset(datetime.strptime(name[5:], "%Y%m%d").date() for name in row[1])
        return RunPartitions(days=days, owned=bool(row[0]))

    def create(self, connection: Connection, name: str, start: datetime, end: datetime) -> bool:
        exists = connection.execute(
            text("SELECT to_regclass(:name) IS NOT NULL"), {"name": name}
        ).scalar_one()
        if exists:
            return False
        connection.execute(
            text(
                f"CREATE TABLE {name} PARTITION OF runs "
                f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
            )
        )
        return True

    def drop_before(self, connection: Connection, cutoff: datetime) -> int:
        names = connection.execute(
            text(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = 'runs' "
                "AND c.relname ~ '^runs_[0-9]{8}$'"
            )
        ).scalars()
        dropped = 0
        for name in list(names):
            day = datetime.strptime(name[5:], "%Y%m%d").replace(tzinfo=UTC)
            if day + timedelta(days=1) <= cutoff:
                connection.execute(text(f"DROP TABLE {name}"))
                dropped += 1
        return dropped


def run_partitioning(dialect: Dialect) -> PostgresRunPartitions | None:
    """The run partitions of the dialect's backend; None where runs is one table (SQLite)."""
    return _POSTGRES if dialect.name == "postgresql" else None


_POSTGRES = PostgresRunPartitions()
