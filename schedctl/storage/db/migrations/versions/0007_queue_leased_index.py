"""A partial index of the queue messages that are leased, by job: the lease counts each
candidate job's leased messages (max_concurrency), and without it every lease read all of
a job's queued messages from the heap for every ready message: the lease slowed with the
backlog, so a worker that fell behind never caught up.

Revision ID: 0007
Revises: 0004 (merge note: revise the latest head; 0005 and 0006 are other branches')
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0007"


def upgrade() -> None:
    op.create_index(
        "ix_queue_messages_leased_job",
        "queue_messages",
        ["job_id"],
        postgresql_where=sa.text("leased_until IS NOT NULL"),
        sqlite_where=sa.text("leased_until IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_queue_messages_leased_job", table_name="queue_messages")
