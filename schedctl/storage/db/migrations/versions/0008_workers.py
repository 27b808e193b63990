"""Worker presence: each worker of a built-in queue (a direct worker, or an API worker by
its token) records when it was last seen leasing or heartbeating, so `schedctl status`
can say which queues have ready runs and no live worker (schedctl/storage/pipeline/workers.py).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from schedctl.storage.db.types import UTCDateTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0008"


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("queue", sa.String(200), nullable=False),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("last_seen", UTCDateTime, nullable=False),
        sa.Column("live_until", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "queue", "worker", name="pk_workers"),
    )


def downgrade() -> None:
    op.drop_table("workers")
