"""Owns the test of the pipeline benches' queue sampler: a run counts as delivered into the
built-in queue when a look first saw its message committed, not at the message's own
created_at (the claim's clock when its transaction began)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from schedctl.storage.db.store import Store
from schedctl_bench.pipeline import _QueueSampler
from tests.factories import insert_queue_message_row, insert_tenant_row


def test_a_message_counts_from_when_a_look_saw_it(store: Store) -> None:
    """A claim stamps its messages with its clock when its transaction began; they are in
    the queue only once it commits. An embedded burst's 10,000 runs, claimed in one
    transaction, all read 0.0 s after the instant that way. Fails when the sampler keeps
    created_at."""
    stamped = datetime.now(UTC) - timedelta(minutes=5)  # a transaction that began long ago
    with store.tx() as connection:
        insert_tenant_row(connection, "t1", "t1", created_at=stamped)
    sampler = _QueueSampler(store, "t1")
    sampler.start()
    try:
        time.sleep(0.2)  # a few empty looks first
        before_commit = datetime.now(UTC)
        with store.tx() as connection:
            insert_queue_message_row(connection, "j1", "t1", queue="q", at=stamped)
        deadline = time.monotonic() + 30
        while not sampler.seen and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        sampler.stop()
    assert list(sampler.seen) == [("j1", stamped)]
    seen = sampler.seen[("j1", stamped)]
    assert seen >= before_commit, (seen, before_commit)
