"""The payload a claimed run keeps when its job is updated: outbox.payload and
queue_messages.payload, null unless an update changed the job's payload while the run
waited for delivery (then the old stored payload, so the run never mixes definitions).

Revision ID: 0009
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0011"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0009"


def upgrade() -> None:
    op.add_column("outbox", sa.Column("payload", sa.Text(), nullable=True))
    op.add_column("queue_messages", sa.Column("payload", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("queue_messages", "payload")
    op.drop_column("outbox", "payload")
