"""Two fewer index entries for each queue message's insert and lease: ix_queue_messages_job
goes (uq_queue_messages_run, on (job_id, scheduled_at), answers every read by job_id), and
ix_queue_messages_ready holds unleased messages only (every read of it asks for those). A
lease updates leased_until, an indexed column, so Postgres wrote a new entry in every
index of the table for it; now in the three whose rows it still belongs to.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0015"

UNLEASED = sa.text("leased_until IS NULL")


def upgrade() -> None:
    op.drop_index("ix_queue_messages_job", table_name="queue_messages")
    op.drop_index("ix_queue_messages_ready", table_name="queue_messages")
    op.create_index(
        "ix_queue_messages_ready",
        "queue_messages",
        ["tenant_id", "queue", "available_at"],
        postgresql_where=UNLEASED,
        sqlite_where=UNLEASED,
    )


def downgrade() -> None:
    op.drop_index("ix_queue_messages_ready", table_name="queue_messages")
    op.create_index(
        "ix_queue_messages_ready", "queue_messages", ["tenant_id", "queue", "available_at"]
    )
    op.create_index("ix_queue_messages_job", "queue_messages", ["job_id"])
