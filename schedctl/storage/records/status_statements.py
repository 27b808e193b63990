"""Owns the due-lag read of `schedctl status` (storage/records/status.py), Postgres's and
SQLite's side by side: the oldest due fire time of active jobs and how many are due."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from sqlalchemy import func, select, text
from sqlalchemy.engine import Connection

from schedctl.storage.backend.dialect import Dialect
from schedctl.storage.db import schema


class StatusStatements(Protocol):
    def due_lag(
        self, connection: Connection, now: datetime, partition_count: int
    ) -> tuple[datetime | None, int]:
        """The oldest due fire time of active jobs and how many are due."""
        ...


class _Postgres:
    def due_lag(
        self, connection: Connection, now: datetime, partition_count: int
    ) -> tuple[datetime | None, int]:
        # one probe of the (partition, next_fire_at) index per partition
        row = connection.execute(
            text(
                """
                SELECT min(d.oldest), coalesce(sum(d.due), 0)
                  FROM generate_series(0, :last) AS p(partition)
                 CROSS JOIN LATERAL (
                       SELECT min(j.next_fire_at) AS oldest, count(*) AS due
                         FROM jobs AS j
                        WHERE j.partition = p.partition
                          AND j.next_fire_at <= :now
                          AND j.status = 'active'
                       ) AS d
                """
            ),
            {"last": partition_count - 1, "now": now},
        ).one()
        return row[0], int(row[1])


class _Sqlite:
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


_STATEMENTS: dict[str, StatusStatements] = {"postgresql": _Postgres(), "sqlite": _Sqlite()}


def status_statements(dialect: Dialect) -> StatusStatements:
    """The status statements of the dialect's backend."""
    return _STATEMENTS[dialect.name]
