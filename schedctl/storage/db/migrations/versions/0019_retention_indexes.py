"""Retention of dead letters, alerts and the audit log (dead_letter_retention_days,
alert_retention_days, audit_retention_days): the hourly maintenance deletes the rows older
than a cutoff; an index on each table's time column finds them without reading the table.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0019"


def upgrade() -> None:
    op.create_index("ix_dead_letters_created", "dead_letters", ["created_at"])
    op.create_index("ix_alerts_created", "alerts", ["created_at"])
    op.create_index("ix_audit_log_at", "audit_log", ["at"])


def downgrade() -> None:
    op.drop_index("ix_audit_log_at", table_name="audit_log")
    op.drop_index("ix_alerts_created", table_name="alerts")
    op.drop_index("ix_dead_letters_created", table_name="dead_letters")
