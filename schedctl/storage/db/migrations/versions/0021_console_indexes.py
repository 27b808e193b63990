"""Two indexes for the web console's slowest pages (issue 34: each page under 300 ms with
100,000 jobs and 1,000,000 runs).

ix_runs_tenant_failed: the late page's "failing jobs" asks for a tenant's failed, dead and
lost runs of the last day; runs had no index by tenant, so Postgres read every run of the
day's partitions (all tenants') to find them. The index holds those runs only (a few in a
hundred), keyed (tenant_id, scheduled_at, job_id): the read is a range of it. Made on the
partitioned parent, it is made on every partition, and on each new day partition with it.
Its predicate names status, which a run's every transition updates: those updates can no
longer be heap-only (HOT) ones. The runs pages are full when written (fillfactor 100), so
few were.

ix_jobs_name_trgm (Postgres): the jobs page's name search is a case-insensitive substring
(ILIKE '%text%'), which no b-tree answers; without a match the search walked every job of
the tenant. A pg_trgm GIN index answers it. pg_trgm is a trusted extension (Postgres 13+):
the database's owner creates it with the CREATE privilege on the database, and the runtime
role needs nothing more. Where the migrating role may not create it, the index is left out
with a warning and the search scans as before. SQLite keeps its scan (embedded scale).

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None
# additive (two indexes): the daemons of 0020 work on this schema unchanged
compatible_with = "0020"

log = logging.getLogger(__name__)

FAILED = sa.text("status IN ('failed', 'dead', 'lost')")


def upgrade() -> None:
    op.create_index(
        "ix_runs_tenant_failed",
        "runs",
        ["tenant_id", "scheduled_at", "job_id"],
        postgresql_where=FAILED,
        sqlite_where=FAILED,
    )
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    if not _trgm_available(bind):
        log.warning(
            "pg_trgm cannot be created by this role (it needs the CREATE privilege on the "
            "database): the console's name search scans the tenant's jobs"
        )
        return
    op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    op.create_index(
        "ix_jobs_name_trgm",
        "jobs",
        ["name"],
        postgresql_using="gin",
        postgresql_ops={"name": "gin_trgm_ops"},
    )


def _trgm_available(bind: sa.Connection) -> bool:
    """pg_trgm is installed, or this role may install it (a superuser, or a trusted
    extension with CREATE on the database) and the server has it."""
    installed, shipped, allowed = bind.execute(
        sa.text(
            "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm'),"
            " EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm'),"
            " (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
            " OR has_database_privilege(current_database(), 'CREATE')"
        )
    ).one()
    return bool(installed or (shipped and allowed))


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("DROP INDEX IF EXISTS ix_jobs_name_trgm")
    op.drop_index("ix_runs_tenant_failed", table_name="runs")
