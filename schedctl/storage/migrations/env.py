"""Alembic environment: runs migrations on the connection that schedctl.storage.migrate hands it."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from schedctl.storage.schema import metadata

connection = context.config.attributes.get("connection")
if not isinstance(connection, Connection):
    raise RuntimeError("run migrations through `schedctl db upgrade`, not the alembic CLI")

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    transaction_per_migration=True,
)
with context.begin_transaction():
    context.run_migrations()
