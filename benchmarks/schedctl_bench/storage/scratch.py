"""Owns scratch databases for benchmarks that need a database of their own: a new, empty
database on the server of a URL (created, then dropped with its connections), the URL of
another database of that server, its libpq form, and which backend a URL names."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import text
from sqlalchemy.engine import make_url

from schedctl.storage.db.engine import make_engine


def backend(url: str) -> str:
    """The backend a database URL names, by SQLAlchemy's name for it."""
    return str(make_url(url).get_backend_name())


def database_url(url: str, name: str) -> str:
    """The URL of database `name` on the server of `url` (password kept)."""
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def libpq_dsn(url: str) -> str:
    """The same database as a libpq connection string (what other programs connect with)."""
    parsed = make_url(url)
    parts = {
        "host": parsed.host or "127.0.0.1",
        "port": str(parsed.port or 5432),
        "user": parsed.username or "postgres",
        "dbname": parsed.database or "postgres",
    }
    if parsed.password:
        parts["password"] = str(parsed.password)
    return " ".join(f"{key}={value}" for key, value in parts.items())


@contextlib.contextmanager
def fresh_database(url: str, name: str) -> Iterator[str]:
    """A new, empty database `name` on the (Postgres) server of `url`, dropped afterwards;
    yields its URL."""
    engine = make_engine(url)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield database_url(url, name)
        finally:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()
