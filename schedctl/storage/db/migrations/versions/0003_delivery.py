"""HTTP and RabbitMQ delivery: outbox leases and retry errors, per-lane outbox indexes,
per-tenant delivery concurrency and broker.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0003"


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(
            sa.Column("delivery_concurrency", sa.Integer, nullable=False, server_default="16")
        )
        batch.add_column(sa.Column("broker_url", sa.Text, nullable=True))
    with op.batch_alter_table("outbox") as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(200), nullable=True))
        batch.add_column(sa.Column("last_error", sa.Text, nullable=True))
    op.drop_index("ix_outbox_available", table_name="outbox")
    op.create_index("ix_outbox_type_available", "outbox", ["target_type", "available_at"])
    op.create_index("ix_outbox_lane", "outbox", ["tenant_id", "target_type", "available_at"])


def downgrade() -> None:
    op.drop_index("ix_outbox_lane", table_name="outbox")
    op.drop_index("ix_outbox_type_available", table_name="outbox")
    op.create_index("ix_outbox_available", "outbox", ["available_at"])
    with op.batch_alter_table("outbox") as batch:
        batch.drop_column("last_error")
        batch.drop_column("lease_owner")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("broker_url")
        batch.drop_column("delivery_concurrency")
