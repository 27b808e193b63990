"""Job dependencies (`after`): one row per (dependent job, upstream job), indexed by
upstream so that settling an upstream run finds its dependents with one index read.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0011"


def upgrade() -> None:
    op.create_table(
        "job_dependencies",
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("upstream_job_id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "upstream_job_id", name="pk_job_dependencies"),
    )
    op.create_index("ix_job_dependencies_upstream", "job_dependencies", ["upstream_job_id"])


def downgrade() -> None:
    op.drop_index("ix_job_dependencies_upstream", table_name="job_dependencies")
    op.drop_table("job_dependencies")
