"""Owns the test that a worker's lease and settle statements are planned at each execution
on Postgres, never answered by a generic plan kept from when the queue was empty."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from schedctl.storage import schema
from schedctl.storage.dialect import LeaseMark, OutcomeWrites
from schedctl.storage.store import Store

pytestmark = pytest.mark.postgres

# a phrase of each statement's text, as pg_prepared_statements shows it
STATEMENTS = {
    "mark_leased": "SET leased_until = CAST",
    "leased_counts": "SELECT job_id, count(*) FROM queue_messages",
    "held_messages": "LEFT JOIN jobs AS j ON j.job_id = m.job_id",
    "record_outcomes": "WITH attempts AS (INSERT INTO run_attempts",
}


def test_lease_and_settle_statements_are_never_prepared(pg_store: Store) -> None:
    """psycopg prepares a statement run five times, and Postgres may then keep one generic
    plan until the table's next analyze. Two workers whose first leases met a near-empty
    queue kept seq scans of the queue and of today's runs for every lease and settle: at
    2,000 runs/s (`bench steady`) the lease took 6 ms instead of 0.5 and the runs started
    40 s late instead of 20. Fails when any of them is prepared on its connection."""
    store = pg_store
    dialect = store.dialect
    now = datetime.now(UTC)
    with store.tx() as connection:
        for n in range(8):
            dialect.mark_leased(
                connection,
                [(-1 - n, f"none-{n}", now, 1)],
                LeaseMark("worker/1", now + timedelta(seconds=30), now),
            )
            assert dialect.leased_counts(connection, [f"none-{n}"]) == {}
            assert dialect.held_messages(connection, [-1 - n])[1] == []
            dialect.record_outcomes(
                connection,
                OutcomeWrites(
                    attempts=[],
                    runs=[],
                    gone=(schema.queue_messages, [-1 - n]),
                    upstreams=[f"none-{n}"],
                ),
            )
        prepared = list(
            connection.execute(text("SELECT statement FROM pg_prepared_statements")).scalars()
        )
    kept = {name for name, phrase in STATEMENTS.items() if any(phrase in s for s in prepared)}
    assert kept == set(), kept
