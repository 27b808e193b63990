"""Job names unique per tenant among jobs not deleted: a partial unique index on
(tenant_id, name) where status <> 'deleted'.

Databases from before may hold duplicate names (creates accepted them). The index cannot be
built over them, so each duplicate but the oldest (smallest id) of a (tenant, name) among
jobs not deleted is renamed by suffixing "-2", "-3", ... (the first free suffix; the name is
cut so it stays within 200 characters). Renamed jobs keep their ids, runs and history.

Revision ID: 0010
Revises: 0007 (merge note: revise the latest head)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0012"
branch_labels = None
depends_on = None
# the oldest daemons' revision that works on this schema (rule: storage/db/migrate.py);
# its own, as for every migration made before the rule: their daemons accepted only their own
compatible_with = "0010"

MAX_NAME = 200
# a bound on the suffixes tried per duplicate: far above any real count of duplicates
MAX_SUFFIX = 1_000_000


def _rename_duplicates(connection: sa.engine.Connection) -> None:
    live = "status <> 'deleted'"
    groups = connection.execute(
        sa.text(
            f"SELECT tenant_id, name FROM jobs WHERE {live} "
            "GROUP BY tenant_id, name HAVING COUNT(*) > 1"
        )
    ).all()
    for tenant_id, name in groups:
        taken = set(
            connection.execute(
                sa.text(f"SELECT name FROM jobs WHERE tenant_id = :t AND {live}"), {"t": tenant_id}
            ).scalars()
        )
        ids = connection.execute(
            sa.text(
                f"SELECT job_id FROM jobs WHERE tenant_id = :t AND name = :n AND {live} "
                "ORDER BY job_id"
            ),
            {"t": tenant_id, "n": name},
        ).scalars()
        suffix = 1
        for job_id in list(ids)[1:]:  # the oldest keeps its name
            while suffix < MAX_SUFFIX:
                suffix += 1
                tail = f"-{suffix}"
                candidate = name[: MAX_NAME - len(tail)] + tail
                if candidate not in taken:
                    break
            else:
                raise RuntimeError(f"no free name for job {job_id} ({name!r})")
            taken.add(candidate)
            connection.execute(
                sa.text("UPDATE jobs SET name = :n WHERE job_id = :j"),
                {"n": candidate, "j": job_id},
            )


def upgrade() -> None:
    _rename_duplicates(op.get_bind())
    op.create_index(
        "uq_jobs_tenant_name",
        "jobs",
        ["tenant_id", "name"],
        unique=True,
        postgresql_where=sa.text("status <> 'deleted'"),
        sqlite_where=sa.text("status <> 'deleted'"),
    )


def downgrade() -> None:
    # renamed duplicates keep their new names: unique names are valid in the older schema
    op.drop_index("uq_jobs_tenant_name", table_name="jobs")
