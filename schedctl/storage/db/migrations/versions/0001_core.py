"""Core tables: settings, tenants, api tokens, jobs with the due index, runs, outbox, partitions.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from schedctl.storage.db.types import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0001"


def upgrade() -> None:
    op.create_table(
        "settings",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    op.create_table(
        "tenants",
        sa.Column("tenant_id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("signing_secret", sa.Text, nullable=False),
        sa.Column("max_jobs", sa.Integer, nullable=False),
        sa.Column("create_rate_per_minute", sa.Integer, nullable=False),
        sa.Column("dispatch_rate_per_second", sa.Integer, nullable=False),
        sa.Column("allow_list", sa.Text, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    op.create_table(
        "api_tokens",
        sa.Column("token_id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.tenant_id"), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("revoked_at", UTCDateTime, nullable=True),
    )
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.tenant_id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("schedule", sa.Text, nullable=False),
        sa.Column("target_type", sa.String(16), nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("retry_base_seconds", sa.Float, nullable=False),
        sa.Column("retry_max_seconds", sa.Float, nullable=False),
        sa.Column("misfire_policy", sa.String(16), nullable=False),
        sa.Column("grace_seconds", sa.Integer, nullable=False),
        sa.Column("window_seconds", sa.Integer, nullable=False),
        sa.Column("max_concurrency", sa.Integer, nullable=False),
        sa.Column("timeout_seconds", sa.Integer, nullable=False),
        sa.Column("start_at", UTCDateTime, nullable=True),
        sa.Column("end_at", UTCDateTime, nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("next_run_at", UTCDateTime, nullable=True),
        sa.Column("next_fire_at", UTCDateTime, nullable=True),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
        sa.UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency"),
    )
    op.create_index("ix_jobs_due", "jobs", ["partition", "next_fire_at"])
    op.create_index("ix_jobs_tenant", "jobs", ["tenant_id", "job_id"])
    op.create_table(
        "runs",
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("scheduled_at", UTCDateTime, nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("trigger", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("fire_at", UTCDateTime, nullable=True),
        sa.Column("dispatched_at", UTCDateTime, nullable=True),
        sa.Column("started_at", UTCDateTime, nullable=True),
        sa.Column("finished_at", UTCDateTime, nullable=True),
        sa.Column("exit_code", sa.Integer, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("output_tail", sa.Text, nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=True),
        sa.Column("job_version", sa.BigInteger, nullable=True),
        sa.PrimaryKeyConstraint("job_id", "scheduled_at", name="pk_runs"),
        postgresql_partition_by="RANGE (scheduled_at)",
    )
    if op.get_bind().dialect.name == "postgresql":
        # day partitions are added ahead of time by the store's maintenance; anything
        # outside them (far catch-up, manual runs before the first maintenance) lands here
        op.execute("CREATE TABLE runs_default PARTITION OF runs DEFAULT")
    op.create_table(
        "outbox",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("scheduled_at", UTCDateTime, nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("target_type", sa.String(16), nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("available_at", UTCDateTime, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    op.create_index("ix_outbox_available", "outbox", ["available_at"])
    op.create_table(
        "partitions",
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("updated_at", UTCDateTime, nullable=False),
    )


def downgrade() -> None:
    # the runs partitions made at run time go with their parent table on Postgres
    for table in ("partitions", "outbox", "runs", "jobs", "api_tokens", "tenants", "settings"):
        if table == "runs" and op.get_bind().dialect.name == "postgresql":
            op.execute("DROP TABLE runs CASCADE")
            continue
        op.drop_table(table)
