"""job_names: the console's name search moves off jobs into a table of its own.

0021's pg_trgm GIN index on jobs.name made every claim dearer: a claim updates its job's
next fire time (an indexed column), so the update is never heap-only and each new row
version was also entered into the trigram index (`bench burst --jobs 100000 --target
queue --workers 0`: 9.9 s of the dispatcher's Postgres CPU instead of 5.6 s, claims/s
halved). job_names (job_id, tenant_id, name) holds every job's name, and the trigram index
now sits on it; a claim never writes there.

The database keeps it, not the code: triggers on jobs copy a created job's name (one
statement-level trigger per INSERT, with its new rows as a transition table), a rename
(`AFTER UPDATE OF name, tenant_id`: it fires only for an UPDATE whose SET names one of
those columns, so a claim's UPDATE pays nothing) and a removal. So the daemons of 0021 and
0022, which know nothing of job_names, keep it right during a rolling upgrade, and so do
bulk loads (COPY fires the INSERT trigger). SQLite has the same table and triggers (row
triggers) and the same search, without a trigram index (a scan, at embedded scale).

Online: the table and triggers are made in one short transaction (CREATE TRIGGER waits for
the writes in flight on jobs, within the lock timeout). The existing names are then copied
in batches of BATCH jobs, each its own transaction, reading the jobs FOR KEY SHARE (a
delete in flight is waited for and skipped; claims and renames are not blocked) and
skipping a name a trigger wrote first; a rename's trigger upserts, so a batch that read
the old name cannot win over it. Last the trigram index is built concurrently and 0021's
dropped concurrently. Every step is idempotent: a rerun (after a lock timeout, or a
failure half-way) finishes the job.

Compatibility: additive for the daemons of 0021 and 0022 (a new table kept by triggers;
the index they never named is gone, their search scans the tenant's jobs until they are
upgraded), so the floor stays 0021.

Revision ID: 0023
Revises: 0022
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None
# additive (a table kept by triggers): the daemons of 0021 and 0022 work on this schema
compatible_with = "0021"

log = logging.getLogger(__name__)

BATCH = 5_000  # jobs copied per transaction

_PG_FUNCTIONS = {
    # a created job's name: one statement per INSERT (or COPY), whatever its row count
    "job_names_inserted": (
        "INSERT INTO job_names (job_id, tenant_id, name)"
        " SELECT job_id, tenant_id, name FROM created_jobs; RETURN NULL;"
    ),
    # an upsert, not an UPDATE: a rename during the copy of 0023 lands whichever comes first
    "job_names_renamed": (
        "INSERT INTO job_names (job_id, tenant_id, name) VALUES (NEW.job_id, NEW.tenant_id,"
        " NEW.name) ON CONFLICT (job_id) DO UPDATE SET tenant_id = EXCLUDED.tenant_id,"
        " name = EXCLUDED.name; RETURN NULL;"
    ),
    "job_names_removed": (
        "DELETE FROM job_names AS n USING removed_jobs AS r WHERE n.job_id = r.job_id; RETURN NULL;"
    ),
}
_PG_TRIGGERS = {
    "job_names_inserted": (
        "AFTER INSERT ON jobs REFERENCING NEW TABLE AS created_jobs FOR EACH STATEMENT"
    ),
    "job_names_renamed": (
        "AFTER UPDATE OF name, tenant_id ON jobs FOR EACH ROW"
        " WHEN (OLD.name IS DISTINCT FROM NEW.name OR OLD.tenant_id IS DISTINCT FROM"
        " NEW.tenant_id)"
    ),
    "job_names_removed": (
        "AFTER DELETE ON jobs REFERENCING OLD TABLE AS removed_jobs FOR EACH STATEMENT"
    ),
}
_SQLITE_TRIGGERS = {
    "job_names_inserted": (
        "AFTER INSERT ON jobs BEGIN INSERT INTO job_names (job_id, tenant_id, name)"
        " VALUES (NEW.job_id, NEW.tenant_id, NEW.name); END"
    ),
    "job_names_renamed": (
        "AFTER UPDATE OF name, tenant_id ON jobs"
        " WHEN OLD.name IS NOT NEW.name OR OLD.tenant_id IS NOT NEW.tenant_id"
        " BEGIN UPDATE job_names SET tenant_id = NEW.tenant_id, name = NEW.name"
        " WHERE job_id = NEW.job_id; END"
    ),
    "job_names_removed": (
        "AFTER DELETE ON jobs BEGIN DELETE FROM job_names WHERE job_id = OLD.job_id; END"
    ),
}


def upgrade() -> None:
    bind = op.get_bind()
    exists = sa.inspect(bind).has_table("job_names")
    if exists and not _kept(bind):
        # no trigger keeps it: left over (say, by the restore of an older backup over this
        # database), its rows are not to be trusted; made and filled again
        op.drop_table("job_names")
        exists = False
    if not exists:
        op.create_table(
            "job_names",
            sa.Column("job_id", sa.String(40), nullable=False),
            sa.Column("tenant_id", sa.String(40), nullable=False),
            sa.Column("name", sa.String(200), nullable=False),
            sa.PrimaryKeyConstraint("job_id", name="pk_job_names"),
        )
    if bind.dialect.name != "postgresql":
        for trigger, body in _SQLITE_TRIGGERS.items():
            op.execute(f"CREATE TRIGGER IF NOT EXISTS {trigger} {body}")
        # one writer at a time and embedded sizes: one statement
        op.execute(
            "INSERT INTO job_names (job_id, tenant_id, name) SELECT job_id, tenant_id, name"
            " FROM jobs WHERE true ON CONFLICT (job_id) DO NOTHING"
        )
        return
    for function, body in _PG_FUNCTIONS.items():
        op.execute(
            f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql"
            f" AS $$ BEGIN {body} END $$"
        )
    for trigger, when in _PG_TRIGGERS.items():
        op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON jobs")
        op.execute(f"CREATE TRIGGER {trigger} {when} EXECUTE FUNCTION {trigger}()")
    trigram = _trgm_installed(bind)
    if not trigram:
        log.warning(
            "pg_trgm is not installed (migration 0021 could not create it): the console's "
            "name search scans the tenant's job names"
        )
    # the triggers are in place for every write from now on: commit them, then copy
    with op.get_context().autocommit_block():
        _copy_names(bind)
        if trigram:
            # a build left INVALID by a failed earlier attempt is rebuilt
            op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_job_names_name_trgm")
            op.create_index(
                "ix_job_names_name_trgm",
                "job_names",
                ["name"],
                postgresql_using="gin",
                postgresql_ops={"name": "gin_trgm_ops"},
                postgresql_concurrently=True,
            )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_jobs_name_trgm")


def _copy_names(bind: sa.Connection) -> None:
    """The names of the jobs that existed before the triggers, BATCH jobs per statement
    (each its own transaction: the caller is in autocommit), in job_id order."""
    after = ""
    while True:
        last = bind.execute(
            sa.text(
                "SELECT max(job_id) FROM (SELECT job_id FROM jobs WHERE job_id > :after"
                " ORDER BY job_id LIMIT :batch) AS b"
            ),
            {"after": after, "batch": BATCH},
        ).scalar_one()
        if last is None:
            return
        bind.execute(
            sa.text(
                "INSERT INTO job_names (job_id, tenant_id, name)"
                " SELECT job_id, tenant_id, name FROM jobs"
                " WHERE job_id > :after AND job_id <= :last FOR KEY SHARE"
                " ON CONFLICT (job_id) DO NOTHING"
            ),
            {"after": after, "last": last},
        )
        after = str(last)


def _kept(bind: sa.Connection) -> bool:
    """The trigger that copies created jobs' names is on jobs (made with the table, in one
    transaction, by this migration)."""
    query = (
        "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = CAST('jobs' AS regclass)"
        " AND tgname = 'job_names_inserted')"
        if bind.dialect.name == "postgresql"
        else "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'trigger'"
        " AND name = 'job_names_inserted')"
    )
    return bool(bind.execute(sa.text(query)).scalar_one())


def _trgm_installed(bind: sa.Connection) -> bool:
    return bool(
        bind.execute(
            sa.text("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm')")
        ).scalar_one()
    )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        for trigger in _SQLITE_TRIGGERS:
            op.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        op.drop_table("job_names")
        return
    for trigger in _PG_TRIGGERS:
        op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON jobs")
    for function in _PG_FUNCTIONS:
        op.execute(f"DROP FUNCTION IF EXISTS {function}()")
    op.execute("DROP TABLE IF EXISTS job_names")
    if not _trgm_installed(bind):
        return
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_jobs_name_trgm")
        op.create_index(
            "ix_jobs_name_trgm",
            "jobs",
            ["name"],
            postgresql_using="gin",
            postgresql_ops={"name": "gin_trgm_ops"},
            postgresql_concurrently=True,
        )
