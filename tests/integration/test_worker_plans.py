"""Owns the test that a worker's lease and settle statements are planned at each execution
on Postgres, never answered by a generic plan kept from when the queue was empty."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection

from schedctl.storage.backend.dialect import dialect_of
from schedctl.storage.backend.dialect_postgres import runs_span
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.lease_statements import LeaseMark, lease_statements
from schedctl.storage.pipeline.settle_statements import OutcomeWrites, settle_statements
from schedctl.storage.records.retention import ensure_run_partitions
from schedctl_bench.storage.bulk_future import load_future_jobs
from tests.factories import make_tenant

pytestmark = pytest.mark.postgres

# each statement's tag (the comment it starts with in lease_statements.py or
# settle_statements.py), which
# pg_prepared_statements and auto_explain show as part of its text
TAGS = {
    name: f"/* {name} */"
    for name in ("mark_leased", "leased_counts", "held_messages", "record_outcomes")
}


def test_lease_and_settle_statements_are_never_prepared(pg_store: Store) -> None:
    """psycopg prepares a statement run five times, and Postgres may then keep one generic
    plan until the table's next analyze. Two workers whose first leases met a near-empty
    queue kept seq scans of the queue and of today's runs for every lease and settle, and
    their runs started later and later. Fails when any of them is prepared on its
    connection, or was not run (by its tag: a check by a phrase of the text passed
    silently once the text changed)."""
    prepared: list[str] = []
    executed = _executed_plans(pg_store, lambda c: prepared.extend(_lease_and_settle(c)))
    ran = {name for name, tag in TAGS.items() if any(tag in plan for plan in executed)}
    assert ran == set(TAGS), executed
    kept = {name for name, tag in TAGS.items() if any(tag in s for s in prepared)}
    assert kept == set(), kept


def _lease_and_settle(connection: Connection) -> list[str]:
    """Each tagged statement run 8 times (past psycopg's prepare threshold of 5) on
    `connection`; the statements then prepared on it."""
    dialect = dialect_of(connection)
    leases, settles = lease_statements(dialect), settle_statements(dialect)
    now = datetime.now(UTC)
    for n in range(8):
        leases.mark_leased(
            connection,
            [(-1 - n, f"none-{n}", now, 1)],
            LeaseMark("worker/1", now + timedelta(seconds=30), now),
        )
        assert leases.leased_counts(connection, [f"none-{n}"]) == {}
        assert leases.held_messages(connection, [-1 - n])[1] == []
        settles.record_outcomes(
            connection,
            OutcomeWrites(
                attempts=[],
                runs=[],
                gone=(schema.queue_messages, [-1 - n]),
                upstreams=[f"none-{n}"],
            ),
        )
    return list(connection.execute(text("SELECT statement FROM pg_prepared_statements")).scalars())


def _connect(store: Store) -> psycopg.Connection[Any]:
    """A plain psycopg connection (autocommit) to the store's database."""
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    return psycopg.connect(url, autocommit=True)


def _plan(store: Store, statement: str, params: dict[str, Any]) -> str:
    """EXPLAIN of `statement` planned with these parameters (as the worker runs it)."""
    with _connect(store) as connection:
        rows = connection.execute("EXPLAIN " + statement, params, prepare=False).fetchall()
    return "\n".join(row[0] for row in rows)


def _lease_params(instants: list[datetime]) -> dict[str, Any]:
    n = len(instants)
    return {
        "ids": list(range(1, n + 1)),
        "job_ids": [f"job-{i}" for i in range(n)],
        "scheduled_ats": instants,
        "attempts": [1] * n,
        "owners": ["worker/1"] * n,
        "leased_until": instants[0],
        "now": instants[0],
        **runs_span(instants),
    }


def test_a_lease_updates_only_the_day_partitions_of_its_runs(pg_store: Store) -> None:
    """The run history is partitioned by day: a lease's runs are updated in the partitions
    holding them, not in an Append over every day's (planned and opened for a handful of
    rows). A batch across midnight touches both days. Fails without the span bounds."""
    from schedctl.storage.pipeline.lease_statements import _MARK_LEASED

    ensure_run_partitions(pg_store)  # today's and the next days'
    today = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    one_day = _plan(pg_store, _MARK_LEASED, _lease_params([today, today + timedelta(minutes=1)]))
    assert one_day.count("Update on runs_") == 1, one_day
    midnight = today.replace(hour=23, minute=59, second=59)
    two_days = _plan(
        pg_store, _MARK_LEASED, _lease_params([midnight, midnight + timedelta(seconds=2)])
    )
    assert two_days.count("Update on runs_") == 2, two_days


def test_settling_runs_newer_than_the_statistics_is_not_quadratic(pg_store: Store) -> None:
    """A relay settling 500 runs of one job queued after today's partition was last
    analyzed. With the span starting at the batch's first run, Postgres found no rows in
    those few milliseconds of its histogram, expected one, and compared every run it
    found with the whole batch (a join filter in a nested loop: settling went quadratic
    in the batch). Fails on that plan."""
    ensure_run_partitions(pg_store)
    tenant = make_tenant(pg_store, "settler")
    noon = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    later = noon + timedelta(hours=1)
    insert = (
        "INSERT INTO runs (job_id, scheduled_at, tenant_id, partition, trigger, status,"
        " attempt) SELECT 'job-1', %s + i * interval '1 ms', %s, 0, 'schedule',"
        " 'dispatched', 1 FROM generate_series(1, %s) AS i"
    )
    with _connect(pg_store) as connection:
        connection.execute(insert, (noon, tenant, 50_000))
        connection.execute(
            "INSERT INTO runs (job_id, scheduled_at, tenant_id, partition, trigger, status,"
            " attempt) SELECT 'other-' || i, %s, %s, 0, 'schedule', 'dispatched', 1"
            " FROM generate_series(1, 50000) AS i",
            (noon, tenant),
        )
        connection.execute("ANALYZE runs")
        connection.execute(insert, (later, tenant, 500))  # after the statistics
    instants = [later + timedelta(milliseconds=i) for i in range(1, 501)]
    rows = [
        {
            "job_id": "job-1",
            "scheduled_at": at,
            "status": "succeeded",
            "attempt": 1,
            "started_at": at,
            "finished_at": at,
            "exit_code": 0,
            "error": None,
            "output_tail": None,
        }
        for at in instants
    ]
    plans = _executed_plans(
        pg_store, lambda c: settle_statements(pg_store.dialect).update_runs(c, rows)
    )
    assert any("Update on runs" in plan for plan in plans), plans
    assert not any("Join Filter" in plan for plan in plans), plans


def _executed_plans(store: Store, run: Callable[[Connection], object]) -> list[str]:
    """The plans of the statements `run` executes in a transaction (auto_explain, sent to
    this session as notices), without the arrays' values."""
    plans: list[str] = []
    with store.tx() as connection:
        driver = connection.connection.driver_connection
        assert driver is not None
        driver.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
        driver.execute("LOAD 'auto_explain'")
        driver.execute("SET LOCAL auto_explain.log_min_duration = 0")
        driver.execute("SET LOCAL auto_explain.log_level = 'notice'")
        run(connection)
        driver.execute("SET LOCAL auto_explain.log_min_duration = -1")
    return [re.sub(r"'\{[^}]*\}'", "'{...}'", plan) for plan in plans]


def test_the_lease_reads_unleased_messages_by_the_partial_ready_index(pg_store: Store) -> None:
    """ix_queue_messages_ready holds unleased messages only (0015): the lease's candidate
    read must state `leased_until IS NULL` for Postgres to use it at all."""
    from schedctl.storage.pipeline.lease_statements import _LEASE_CANDIDATES

    tenant = make_tenant(pg_store, "reader")
    with _connect(pg_store) as connection:
        connection.execute(
            "INSERT INTO queue_messages (queue, job_id, scheduled_at, tenant_id, attempt,"
            " available_at, created_at, leased_until)"
            " SELECT 'q' || (i %% 50), 'job-' || i, now(), %s, 1, now(), now(),"
            " CASE WHEN i %% 2 = 0 THEN now() END FROM generate_series(1, 20000) AS i",
            (tenant,),
        )
        connection.execute("ANALYZE queue_messages")
    plan = _plan(pg_store, _LEASE_CANDIDATES, {"tenant_id": tenant, "queue": "q1", "fetch": 20})
    assert "ix_queue_messages_ready" in plan, plan
    assert "Seq Scan on queue_messages m" not in plan, plan


def _planning_buffers(connection: psycopg.Connection[Any], statement: str, params: Any) -> int:
    """Buffers the planner touched planning `statement` (EXPLAIN's "Planning: Buffers")."""
    with connection.transaction(force_rollback=True):
        lines = [
            row[0]
            for row in connection.execute(
                "EXPLAIN (ANALYZE, BUFFERS, SUMMARY) " + statement, params, prepare=False
            )
        ]
    if "Planning:" not in lines:
        return 0  # nothing read at all
    return sum(int(n) for n in re.findall(r"=(\d+)", lines[lines.index("Planning:") + 1]))


def test_planning_a_lease_reads_nothing_of_the_jobs_index(pg_store: Store) -> None:
    """A lease's reads (the candidates, the held messages) take each message's job. Planned
    as a join of the queue with jobs, Postgres costed a merge join by reading the ends of
    jobs_pkey, and when the newest jobs have been deleted (a bench's clean-up, an
    operator's) or updated those ends are dead entries, walked at every planning, longer
    while a dispatcher updated jobs. Read by a LATERAL primary-key lookup, the planner
    never looks there. Fails on the join."""
    from schedctl.storage.pipeline.lease_statements import _HELD_MESSAGES, _LEASE_CANDIDATES

    tenant = make_tenant(pg_store, "planner")
    with pg_store.tx() as connection:
        # no vacuum behind the test's back: the dead entries stay
        connection.execute(text("ALTER TABLE jobs SET (autovacuum_enabled = false)"))
    load_future_jobs(
        pg_store,
        tenant,
        20_000,
        first_at=datetime.now(UTC) + timedelta(days=1),
        spacing=timedelta(seconds=1),
    )
    with _connect(pg_store) as connection:
        connection.execute(
            "INSERT INTO queue_messages (queue, job_id, scheduled_at, tenant_id, attempt,"
            " available_at, created_at)"
            " SELECT 'q', job_id, next_run_at, tenant_id, 1, now(), now() FROM jobs"
            " WHERE tenant_id = %s LIMIT 2000",
            (tenant,),
        )
        connection.execute("ANALYZE jobs")  # statistics of both sides of the join
        connection.execute("ANALYZE queue_messages")
        candidates = {"tenant_id": tenant, "queue": "q", "fetch": 20}
        held = {"ids": [1, 2, 3]}
        _planning_buffers(connection, _LEASE_CANDIDATES, candidates)  # catalogs warm
        _planning_buffers(connection, _HELD_MESSAGES, held)
        connection.execute("DELETE FROM queue_messages WHERE tenant_id = %s", (tenant,))
        connection.execute("DELETE FROM jobs WHERE tenant_id = %s", (tenant,))
        read = (
            _planning_buffers(connection, _LEASE_CANDIDATES, candidates),
            _planning_buffers(connection, _HELD_MESSAGES, held),
        )
        connection.execute("ALTER TABLE jobs RESET (autovacuum_enabled)")
    # a lookup's own index root at most; the join read hundreds of buffers for each
    assert max(read) < 20, read
