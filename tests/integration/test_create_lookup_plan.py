"""Owns the test of how Postgres plans job creation's lookup (idempotency keys and names):
one unique-index probe per key for a tenant the planner's statistics do not know yet, the
state of every new tenant's first import, whatever the table holds."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from schedctl.app.service import Scheduler
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.job_create import IN_CHUNK, _lookup

pytestmark = pytest.mark.postgres

JOBS_PER_TENANT = 3000


def _create(sched: Scheduler, tenant_id: str, prefix: str) -> None:
    for start in range(0, JOBS_PER_TENANT, 1000):
        bodies = [
            {
                "schedule": {"delay": "365d"},
                "target": {"type": "queue", "name": "q"},
                "idempotency_key": f"{prefix}-{n}",
            }
            for n in range(start, start + 1000)
        ]
        outcomes = sched.create_many(tenant_id, bodies, actor="test")
        assert all(o.error is None for o in outcomes)


def test_a_new_tenants_lookup_probes_the_unique_indexes(pg_url: str) -> None:
    sched = Scheduler(Store.open(pg_url))
    try:
        with sched.store.tx() as connection:
            # no analyze behind the test's back: the statistics stay those taken below
            connection.execute(text("ALTER TABLE jobs SET (autovacuum_enabled = false)"))
        known, _ = sched.create_tenant("known", "test")
        fresh, _ = sched.create_tenant("fresh", "test")
        for tenant in (known, fresh):
            sched.set_quotas(
                tenant.tenant_id, max_jobs=10_000, create_rate_per_minute=100_000, actor="test"
            )
        _create(sched, known.tenant_id, "k")
        with sched.store.engine.connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE jobs"))
        # what the statistics say of `fresh`: nothing (about one row)
        _create(sched, fresh.tenant_id, "f")
        statement = str(_lookup(sched.store.dialect).compile(dialect=sched.store.engine.dialect))
        with sched.store.read() as connection:
            names = [
                row[0]
                for row in connection.execute(
                    text("SELECT name FROM jobs WHERE tenant_id = :t LIMIT :n"),
                    {"t": fresh.tenant_id, "n": IN_CHUNK},
                )
            ]
            plan = "\n".join(
                row[0]
                for row in connection.exec_driver_sql(
                    "EXPLAIN " + statement,
                    {
                        "tenant_id": fresh.tenant_id,
                        "keys": [f"f-{n}" for n in range(IN_CHUNK)],
                        "names": names,
                    },
                )
            )
    finally:
        sched.store.close()
    assert "uq_jobs_tenant_idempotency" in plan, plan
    assert "uq_jobs_tenant_name" in plan, plan
    # neither every job of the table nor every job of the tenant for each key
    assert "Seq Scan on jobs" not in plan, plan
    assert "ix_jobs_tenant_status" not in plan, plan
    assert "Hash" not in plan, plan


def test_the_lookup_is_planned_at_every_execution_never_kept_from_an_empty_table(
    pg_url: str,
) -> None:
    """psycopg prepares a statement run five times, and Postgres may then keep one generic
    plan until the table's next analyze. An API whose connections ran the lookup while
    `jobs` was empty kept a seq scan of the table per key: batches of an import of 100,000
    took 48-66 s each instead of 0.1 until autovacuum's minute came. Fails when the lookup
    is prepared on its connection."""
    store = Store.open(pg_url)
    sched = Scheduler(store)
    try:
        tenant, _ = sched.create_tenant("first", "test")
        with store.engine.connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE jobs"))
        lookup = _lookup(store.dialect)
        with store.tx() as connection:
            for n in range(8):
                rows = store.dialect.mappings_planned_now(
                    connection,
                    lookup,
                    {"tenant_id": tenant.tenant_id, "keys": [f"k-{n}"], "names": [f"n-{n}"]},
                )
                assert rows == []
            prepared = connection.execute(
                text("SELECT statement FROM pg_prepared_statements")
            ).scalars()
            kept = [s for s in prepared if "idempotency_key" in s]
    finally:
        store.close()
    assert kept == [], kept
