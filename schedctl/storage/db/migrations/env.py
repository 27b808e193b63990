"""Alembic environment: runs migrations on the connection that schedctl.storage.db.migrate
hands it."""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy.engine import Connection

from schedctl.storage.db.schema import metadata

connection = context.config.attributes.get("connection")
if not isinstance(connection, Connection):
    raise RuntimeError("run migrations through `schedctl db upgrade`, not the alembic CLI")


def _record_floor(ctx: Any, step: Any, heads: Any, run_args: Any) -> None:
    # in the migration's own transaction, beside alembic's version row: the database's
    # revision and its recorded floor (the compatibility rule's input) change together
    del step, run_args
    from schedctl.storage.db.migrate import record_floor

    after = sorted(heads)
    record_floor(ctx.connection, after[0] if len(after) == 1 else None)


context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    transaction_per_migration=True,
    on_version_apply=_record_floor,
)
with context.begin_transaction():
    context.run_migrations()
