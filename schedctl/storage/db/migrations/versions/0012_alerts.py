"""Alerts: per-job and per-tenant alert settings, and the alerts outbox (one row per run,
kind and channel, delivered at least once by the relay's alert lane).

Revision ID: 0012
Revises: 0007 (merge note: revise the latest head)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from schedctl.storage.db.types import UTCDateTime

revision = "0012"
down_revision = "0008"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0012"

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "alert_settings",
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "job_id", name="pk_alert_settings"),
    )
    op.create_table(
        "alerts",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("scheduled_at", UTCDateTime, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("run_attempt", sa.Integer, nullable=False),
        sa.Column("channel", sa.String(16), nullable=False),
        sa.Column("destination", sa.Text, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("available_at", UTCDateTime, nullable=False),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("delivered_at", UTCDateTime, nullable=True),
        sa.UniqueConstraint(
            "job_id", "scheduled_at", "kind", "run_attempt", "channel", name="uq_alerts_dedupe"
        ),
    )
    op.create_index("ix_alerts_due", "alerts", ["status", "channel", "available_at"])


def downgrade() -> None:
    op.drop_index("ix_alerts_due", table_name="alerts")
    op.drop_table("alerts")
    op.drop_table("alert_settings")
