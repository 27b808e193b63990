"""Owns reading the database's clock: the one place that knows how each dialect tells the
time, used by every transaction (`db_now`) and by the Store outside one (`Store.now`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime

from sqlalchemy import text
from sqlalchemy.engine import Connection

# clock_timestamp(), not now(): now() stays at the start of the transaction
_POSTGRES_CLOCK = text("SELECT clock_timestamp()")


def dialect_now(
    dialect: str, connect: Callable[[], AbstractContextManager[Connection]]
) -> datetime:
    """The database's now for `dialect`; `connect` is asked for a connection only when the
    dialect has a clock of its own to read (SQLite shares this machine's, and opening a
    transaction there would take its write lock for nothing)."""
    if dialect != "postgresql":
        return datetime.now(UTC)
    with connect() as connection:
        value = connection.execute(_POSTGRES_CLOCK).scalar_one()
    assert isinstance(value, datetime)
    return value.astimezone(UTC)


def db_now(connection: Connection) -> datetime:
    """The database's now, read inside the caller's transaction."""
    return dialect_now(connection.dialect.name, lambda: nullcontext(connection))
