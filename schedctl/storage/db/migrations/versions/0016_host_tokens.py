"""Host tokens: an API token may be bound to one cron host (`host`) and its host groups
(`groups`, a JSON list), `schedctl tenant token create TENANT --host H [--group G]...`.
Such a token leases and settles only that host's queues and applies only the jobs its
files define (schedctl/domain/host_scope.py); a tenant token has both NULL.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0016"


def upgrade() -> None:
    # batch: SQLite alters a table by copying it; Postgres adds the columns in place
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("host", sa.String(63), nullable=True))
        batch.add_column(sa.Column("groups", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("groups")
        batch.drop_column("host")
