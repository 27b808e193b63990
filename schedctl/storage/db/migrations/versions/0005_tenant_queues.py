"""Queues belong to tenants: a built-in queue is (tenant, name), so the ready index of
queue messages leads with tenant_id, and every message takes its tenant from its job (a
message written before queues had tenants is leased by its job's tenant's workers).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0005"


def upgrade() -> None:
    op.execute(
        """
        UPDATE queue_messages
           SET tenant_id = (SELECT jobs.tenant_id FROM jobs
                             WHERE jobs.job_id = queue_messages.job_id)
         WHERE EXISTS (SELECT 1 FROM jobs
                        WHERE jobs.job_id = queue_messages.job_id
                          AND jobs.tenant_id <> queue_messages.tenant_id)
        """
    )
    op.drop_index("ix_queue_messages_ready", table_name="queue_messages")
    op.create_index(
        "ix_queue_messages_ready", "queue_messages", ["tenant_id", "queue", "available_at"]
    )


def downgrade() -> None:
    # the messages' corrected tenants stay: they are right for the older schema too
    op.drop_index("ix_queue_messages_ready", table_name="queue_messages")
    op.create_index("ix_queue_messages_ready", "queue_messages", ["queue", "available_at"])
