"""Delivery and audit tables: run attempts, built-in queue messages, dead letters, audit log.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from schedctl.storage.db.types import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0002"

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "run_attempts",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("scheduled_at", UTCDateTime, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", UTCDateTime, nullable=True),
        sa.Column("finished_at", UTCDateTime, nullable=True),
        sa.Column("exit_code", sa.Integer, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("output_tail", sa.Text, nullable=True),
        sa.Column("worker", sa.String(200), nullable=True),
    )
    op.create_index("ix_run_attempts_run", "run_attempts", ["job_id", "scheduled_at"])
    op.create_table(
        "queue_messages",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("queue", sa.String(200), nullable=False),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("scheduled_at", UTCDateTime, nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("available_at", UTCDateTime, nullable=False),
        sa.Column("leased_until", UTCDateTime, nullable=True),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.UniqueConstraint("job_id", "scheduled_at", name="uq_queue_messages_run"),
    )
    op.create_index("ix_queue_messages_ready", "queue_messages", ["queue", "available_at"])
    op.create_index("ix_queue_messages_job", "queue_messages", ["job_id"])
    op.create_table(
        "dead_letters",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("scheduled_at", UTCDateTime, nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("target_type", sa.String(16), nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("replayed_at", UTCDateTime, nullable=True),
    )
    op.create_index("ix_dead_letters_tenant", "dead_letters", ["tenant_id", "id"])
    op.create_table(
        "audit_log",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("at", UTCDateTime, nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=True),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(40), nullable=False),
        sa.Column("job_id", sa.String(40), nullable=True),
        sa.Column("detail", sa.Text, nullable=True),
    )
    op.create_index("ix_audit_log_tenant", "audit_log", ["tenant_id", "id"])


def downgrade() -> None:
    for table in ("audit_log", "dead_letters", "queue_messages", "run_attempts"):
        op.drop_table(table)
