"""Schema migrations with alembic: upgrade to head (idempotent), current and head revisions.

Alembic itself is imported only to migrate: the revision checks every command makes read
the migration files' `revision`/`down_revision` lines and the `alembic_version` table
directly, so a CLI command on an up-to-date database does not load alembic (tests check the
answers equal alembic's)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from schedctl import errors
from schedctl.storage.engine import check_connection, first_line, make_engine

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "alembic_version"  # alembic's default; env.py does not change it
_ASSIGNMENT = re.compile(r"^(revision|down_revision)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)


def _config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@cache
def revisions() -> dict[str, str | None]:
    """Every migration's revision -> its down_revision, from the files in versions/."""
    found: dict[str, str | None] = {}
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        values = dict(_ASSIGNMENT.findall(path.read_text(encoding="utf-8")))
        if "revision" not in values:
            continue
        down = values.get("down_revision", "None").strip("\"'")
        found[values["revision"].strip("\"'")] = None if down == "None" else down
    return found


def head_revision() -> str:
    """The one revision no other revision revises (alembic's head of a linear history)."""
    graph = revisions()
    heads = sorted(set(graph) - {down for down in graph.values() if down is not None})
    if len(heads) != 1:
        raise errors.SchedError(f"the migrations have {len(heads)} heads: {heads}")
    return heads[0]


def current_revision(engine: Engine) -> str | None:
    """The database's revision (None: never migrated); several rows are joined with ','."""
    with engine.connect() as connection:
        if not inspect(connection).has_table(VERSION_TABLE):
            return None
        rows = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars()
        found = sorted(str(row) for row in rows)
    return ",".join(found) if found else None


def is_empty(engine: Engine) -> bool:
    """True when the database has no tables at all (a new SQLite file, say)."""
    with engine.connect() as connection:
        return not inspect(connection).get_table_names()


def upgrade_engine(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade to `revision`; returns (before, after). Running it again changes nothing."""
    check_connection(engine)
    before = current_revision(engine)
    from alembic import command

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
