"""The per-tenant alert rate limit counts a tenant's alerts delivered in the last hour at
every pass of the alert lane: ix_alerts_tenant_delivered answers it from the index instead
of reading the whole alerts table (it is never pruned).

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0017"


def upgrade() -> None:
    op.create_index("ix_alerts_tenant_delivered", "alerts", ["tenant_id", "delivered_at"])


def downgrade() -> None:
    op.drop_index("ix_alerts_tenant_delivered", table_name="alerts")
