"""host_drift: what each cron host's worker last found different between its job files and
the central jobs (`schedctl apply --check`'s drift), for `schedctl status`.

Revision ID: 0022
Revises: 0021
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from schedctl.storage.db.types import UTCDateTime

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None
# additive (a new table): the daemons of 0021 work on this schema unchanged
compatible_with = "0021"


def upgrade() -> None:
    op.create_table(
        "host_drift",
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("host", sa.String(63), nullable=False),
        sa.Column("drift", sa.Text(), nullable=False),
        sa.Column("checked_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "host", name="pk_host_drift"),
    )


def downgrade() -> None:
    op.drop_table("host_drift")
