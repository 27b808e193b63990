"""Quota bounds on tenants: upper bounds on a tenant's jobs holding a max_jobs slot and on
its creates since an instant, kept by each create, so that a create far from both quotas
counts no jobs (storage/jobs/quotas.py). NULL: not known, the next create counts.

Revision ID: 0013
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from schedctl.storage.db.types import UTCDateTime

revision = "0013"
down_revision = "0009"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0013"


def upgrade() -> None:
    op.add_column("tenants", sa.Column("quota_slots_bound", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("quota_rate_since", UTCDateTime(), nullable=True))
    op.add_column("tenants", sa.Column("quota_rate_bound", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("quota_rate_bound")
        batch.drop_column("quota_rate_since")
        batch.drop_column("quota_slots_bound")
