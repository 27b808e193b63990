"""jobs.metrics: a job that asks for per-job run counts and durations on /metrics
(`"metrics": true`); false for every job that exists.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0018"


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("metrics", sa.Boolean(), nullable=False, server_default=sa.false())
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("metrics")
