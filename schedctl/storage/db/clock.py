"""Owns reading the database's clock inside a transaction (`db_now`); how each backend
tells the time is its dialect's (`Dialect.now`, and `Dialect.clock` for `Store.now`)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.engine import Connection

from schedctl.storage.backend.dialect import dialect_of


def db_now(connection: Connection) -> datetime:
    """The database's now, read inside the caller's transaction."""
    return dialect_of(connection).now(connection)
