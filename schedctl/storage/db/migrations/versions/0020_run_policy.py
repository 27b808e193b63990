"""A job's run policy (issue 32): `overlap` (allow, skip, queue, replace; existing jobs keep
today's `queue`) and the per-run cgroup limits memory_max, cpu_weight and tasks_max (null:
no limit).

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0020"


def upgrade() -> None:
    # ADD COLUMN on both backends: a constant default fills the existing rows
    op.add_column(
        "jobs", sa.Column("overlap", sa.String(16), nullable=False, server_default="queue")
    )
    op.add_column("jobs", sa.Column("memory_max", sa.BigInteger, nullable=True))
    op.add_column("jobs", sa.Column("cpu_weight", sa.Integer, nullable=True))
    op.add_column("jobs", sa.Column("tasks_max", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        for name in ("tasks_max", "cpu_weight", "memory_max", "overlap"):
            batch.drop_column(name)
