"""Schema migrations with alembic: upgrade to head (idempotent), current and head revisions."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from schedctl import errors
from schedctl.storage.engine import check_connection, first_line, make_engine

MIGRATIONS = Path(__file__).with_name("migrations")


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade_engine(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade to `revision`; returns (before, after). Running it again changes nothing."""
    check_connection(engine)
    before = current_revision(engine)
    try:
        with engine.connect() as connection:
            command.upgrade(_config(connection), revision)
            connection.commit()
    except SQLAlchemyError as exc:
        raise errors.StoreUnavailable(f"migration failed: {first_line(exc)}") from exc
    return before, current_revision(engine)


def upgrade(url: str, revision: str = "head") -> tuple[str | None, str | None]:
    engine = make_engine(url)
    try:
        return upgrade_engine(engine, revision)
    finally:
        engine.dispose()
