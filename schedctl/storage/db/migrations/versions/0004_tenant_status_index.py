"""An index on jobs (tenant_id, status): the active-jobs quota counts one tenant's active
jobs at every create, without reading its ended ones.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0004"


def upgrade() -> None:
    op.create_index("ix_jobs_tenant_status", "jobs", ["tenant_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_status", table_name="jobs")
