"""Postgres analyzes `jobs` after every 10,000 changed rows, not after a tenth of the table:
the planner's statistics otherwise take a new tenant for a tenant of about one job until
the table has changed by a tenth (a million rows at 10 million jobs), and plan its lookups
by id, name or idempotency key as a walk through every job of the tenant
(ix_jobs_tenant_status, then a filter) -- after an import of 100,000 jobs, 100,000 rows
read for each one-job request. An ANALYZE samples a fixed number of rows whatever the
table's size, so analyzing more often costs little. Nothing changes on SQLite.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0014"

ANALYZE_EVERY = "autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 10000"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE jobs SET ({ANALYZE_EVERY})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "ALTER TABLE jobs RESET (autovacuum_analyze_scale_factor, autovacuum_analyze_threshold)"
        )
