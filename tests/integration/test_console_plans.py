"""Owns the test of how Postgres plans the console's two reads that grew with the tenant
(issue 34: each page under 300 ms with 100,000 jobs and 1,000,000 runs): the late page's
failing jobs read ix_runs_tenant_failed (migration 0021), and the jobs page's name search
ix_job_names_name_trgm (0023). The statements are the ones the code sends (caught on the
engine), planned by EXPLAIN (FORMAT JSON) with their own parameters; the index is looked for
among the plan's nodes. Without the index the same statement plans without it (the test's
check is live)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from psycopg import sql
from sqlalchemy import event, text

from schedctl.app.service import Scheduler
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.records import console
from schedctl_bench.storage import bench_console as bench_rows
from schedctl_bench.storage.bench_sizes import vacuum_analyze
from schedctl_bench.storage.bulk_future import load_future_jobs

pytestmark = pytest.mark.postgres

JOBS = 10_000
RUNS_PER_JOB = 3


@pytest.fixture
def loaded(pg_url: str) -> Iterator[tuple[Store, str, str]]:
    """A tenant with JOBS jobs named console-<id> and RUNS_PER_JOB runs each over past days
    (one in fifty failed), analyzed; the tenant id and a job id from the middle."""
    store = Store.open(pg_url)
    try:
        tenant, _ = Scheduler(store).create_tenant("plans", "test")
        now = store.now()
        load_future_jobs(
            store,
            tenant.tenant_id,
            JOBS,
            first_at=now + timedelta(hours=1),
            spacing=timedelta(seconds=1),
            name="console",
            queue="console",
        )
        bench_rows.load_runs(store, tenant.tenant_id, RUNS_PER_JOB, now)
        for table in ("jobs", "job_names", "runs"):
            vacuum_analyze(store, table)
        middle, _, _ = bench_rows.sample_ids(store, tenant.tenant_id)
        yield store, tenant.tenant_id, middle
    finally:
        store.close()


def _sent(store: Store, call: Any, marker: str) -> tuple[str, Any]:
    """The statement (and its parameters) `call` sent whose text holds `marker`."""
    seen: list[tuple[str, Any]] = []

    def catch(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", catch)
    try:
        call()
    finally:
        event.remove(store.engine, "before_cursor_execute", catch)
    matching = [item for item in seen if marker in item[0]]
    assert len(matching) == 1, [statement for statement, _ in seen]
    return matching[0]


def _indexes(store: Store, statement: str, parameters: Any) -> set[str]:
    """Every index named in the plan of `statement` with its parameters."""
    with store.read() as connection:
        (document,) = connection.exec_driver_sql(
            "EXPLAIN (FORMAT JSON) " + statement, parameters
        ).one()
    return _names(document)


def _names(document: Any) -> set[str]:
    names: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        if "Index Name" in node:
            names.add(str(node["Index Name"]))
        for child in node.get("Plans", ()):
            walk(child)

    walk(document[0]["Plan"])
    return names


def _generic_indexes(store: Store, statement: str, parameters: dict[str, Any]) -> set[str]:
    """Every index named in the generic plan of `statement` (made without its parameters'
    values), as Postgres may keep for a statement psycopg prepared after five executions."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    numbered = re.sub(r"%\((\w+)\)s", number, statement)
    with store.read() as connection:
        connection.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        connection.exec_driver_sql(f"PREPARE console_generic AS {numbered}")
        # quoted here: a utility statement (EXPLAIN EXECUTE) takes no bound parameters
        driver = connection.connection.driver_connection
        arguments = ", ".join(sql.Literal(parameters[name]).as_string(driver) for name in order)
        (document,) = connection.exec_driver_sql(
            # the driver still reads % as a placeholder's start
            f"EXPLAIN (FORMAT JSON) EXECUTE console_generic({arguments})".replace("%", "%%")
        ).one()
        connection.exec_driver_sql("DEALLOCATE console_generic")
    return _names(document)


def _partition_indexes(store: Store, parent: str) -> set[str]:
    """The parent index and its partitions' copies (runs_YYYYMMDD_..._idx)."""
    with store.read() as connection:
        rows = connection.execute(
            text(
                "SELECT c.relname FROM pg_partition_tree(CAST(:parent AS regclass)) AS t"
                " JOIN pg_class AS c ON c.oid = t.relid"
            ),
            {"parent": parent},
        ).scalars()
        return {str(name) for name in rows}


def _drop(store: Store, index: str, table: str = "jobs") -> None:
    with store.tx() as connection:
        connection.execute(text(f"DROP INDEX {index}"))
    vacuum_analyze(store, table)


def test_the_late_pages_failing_jobs_read_the_failed_runs_index(
    loaded: tuple[Store, str, str],
) -> None:
    store, tenant_id, _ = loaded
    statement, parameters = _sent(
        store, lambda: console.lateness(store, tenant_id), "GROUP BY runs.job_id"
    )
    copies = _partition_indexes(store, "ix_runs_tenant_failed")
    assert len(copies) > 1  # the parent's and each day partition's
    assert _indexes(store, statement, parameters) & copies
    # the statuses are the statement's literals: a generic plan proves the predicate too
    assert _generic_indexes(store, statement, parameters) & copies
    _drop(store, "ix_runs_tenant_failed")
    assert not _indexes(store, statement, parameters) & copies


@pytest.mark.parametrize("found", [True, False], ids=["a-match", "no-match"])
def test_the_name_search_reads_the_trigram_index(
    loaded: tuple[Store, str, str], found: bool
) -> None:
    store, tenant_id, middle = loaded
    query = middle[-10:] if found else "no-such-name"
    page = console.search_jobs(store, tenant_id, name=query)
    assert [job.job_id for job in page.items] == ([middle] if found else [])
    statement, parameters = _sent(
        store, lambda: console.search_jobs(store, tenant_id, name=query), "ILIKE"
    )
    assert "ix_job_names_name_trgm" in _indexes(store, statement, parameters)
    assert "ix_job_names_name_trgm" in _generic_indexes(store, statement, parameters)
    _drop(store, "ix_job_names_name_trgm", "job_names")
    assert "ix_job_names_name_trgm" not in _indexes(store, statement, parameters)


# lateness in seconds of the runs dispatched in the last hour: one dispatched before its
# fire time (counted as 0), one without a fire time (measured from scheduled_at)
LATENESS = (-3.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 300.0)


@pytest.mark.parametrize("url", ["sqlite_url", pytest.param("pg_url", marks=pytest.mark.postgres)])
def test_lateness_percentiles_are_the_nearest_rank_on_both_dialects(
    request: pytest.FixtureRequest, url: str
) -> None:
    """Postgres takes the percentiles in the database, SQLite in Python: the same numbers."""
    store = Store.open(request.getfixturevalue(url))
    try:
        tenant, _ = Scheduler(store).create_tenant("late", "test")
        now = store.now()
        rows = []
        for n, late in enumerate(LATENESS):
            scheduled = (now - timedelta(minutes=30 + n)).replace(microsecond=0)
            fire = None if n == 2 else scheduled + timedelta(seconds=7)
            rows.append(
                {
                    "job_id": f"{n:040x}",
                    "scheduled_at": scheduled,
                    "tenant_id": tenant.tenant_id,
                    "partition": 0,
                    "trigger": "schedule",
                    "status": "succeeded",
                    "attempt": 1,
                    "fire_at": fire,
                    "dispatched_at": (fire or scheduled) + timedelta(seconds=late),
                }
            )
        with store.tx() as connection:
            connection.execute(schema.runs.insert(), rows)
        result = console.lateness(store, tenant.tenant_id)
    finally:
        store.close()
    ordered = sorted(max(0.0, late) for late in LATENESS)
    assert result.measured == len(LATENESS)
    assert result.p50_seconds == ordered[5] == 8.0  # rank ceil(11 * 0.5) = 6
    assert result.p99_seconds == ordered[10] == 300.0  # rank ceil(11 * 0.99) = 11
