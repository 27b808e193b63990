"""The due read is an index range read: EXPLAIN on Postgres with 100,000 jobs shows no
sequential scan of jobs, whether the dispatcher owns every partition or a share of them."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.dialects import postgresql

from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.claim import due_query
from tests.factories import bulk_once_jobs, make_tenant

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def explain(store: Store, query: object) -> str:
    compiled = query.compile(  # type: ignore[attr-defined]
        dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}
    )
    with store.read() as connection:
        rows = connection.execute(text(f"EXPLAIN (FORMAT JSON) {compiled}")).scalar_one()
    return json.dumps(rows)


def test_due_read_uses_the_index_with_100k_jobs(pg_url: str) -> None:
    store = Store.open(pg_url)
    try:
        tenant = make_tenant(store)
        now = datetime.now(UTC)
        rng = random.Random(7)
        # a day of jobs spread out; about one in a thousand due in the next minute
        times = [now + timedelta(seconds=rng.uniform(60, 86_400)) for _ in range(99_900)]
        times += [now + timedelta(seconds=rng.uniform(0, 60)) for _ in range(100)]
        bulk_once_jobs(store, tenant, times)
        with store.tx() as connection:
            connection.execute(text("ANALYZE jobs"))
            assert connection.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 100_000
        horizon = now + timedelta(seconds=60)
        all_partitions = explain(store, due_query(range(1024), horizon, 1000))
        some_partitions = explain(store, due_query(range(0, 1024, 3), horizon, 1000))
        for plan in (all_partitions, some_partitions):
            assert "Seq Scan" not in plan, plan
            assert "ix_jobs_due" in plan or "Index" in plan, plan
    finally:
        store.close()
