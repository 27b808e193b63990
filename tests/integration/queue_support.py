"""Test support for the built-in queue and the worker: jobs with queue targets, manual runs,
row readers, bounded waits, and a worker child process (``python -m`` this module) that
tests can kill -9.

As a program: ``python -m tests.integration.queue_support DB_URL QUEUE OWNER LEASE HEARTBEAT
-- COMMAND...`` runs one Worker until it is killed or receives SIGTERM.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select

from schedctl.models import RetryPolicy
from schedctl.storage import schema
from schedctl.storage.jobs import JobRepo
from schedctl.storage.store import Store
from tests.factories import ahead, create_job, make_tenant, once_at

WAIT_SECONDS = 60.0


def queue_job(
    store: Store,
    *,
    queue: str = "q",
    tenant: str | None = None,
    max_attempts: int = 3,
    base: float = 0.0,
    cap: float = 0.0,
    max_concurrency: int = 1,
    timeout: int = 0,
    payload: Any = None,
) -> str:
    """A job targeting `queue` whose own schedule is far away: its runs come from trigger()."""
    if tenant is None:
        tenant = existing_tenant(store)
    job_spec = dataclasses.replace(
        once_at(
            ahead(86_400),
            queue=queue,
            max_attempts=max_attempts,
            max_concurrency=max_concurrency,
            timeout=timeout,
            payload=payload,
        ),
        retry=RetryPolicy(
            max_attempts=max_attempts, base_delay_seconds=base, max_delay_seconds=cap
        ),
    )
    return create_job(store, tenant, job_spec)


def existing_tenant(store: Store) -> str:
    with store.read() as connection:
        found = connection.execute(select(schema.tenants.c.tenant_id)).scalars().first()
    return found if found is not None else make_tenant(store)


def trigger(store: Store, job_id: str) -> datetime:
    """A manual run: a run row plus an outbox row; returns its scheduled_at."""
    return JobRepo(store).trigger(job_id, actor="test").scheduled_at


def run_row(store: Store, job_id: str, scheduled_at: datetime) -> dict[str, Any]:
    with store.read() as connection:
        row = (
            connection.execute(
                select(schema.runs).where(
                    schema.runs.c.job_id == job_id, schema.runs.c.scheduled_at == scheduled_at
                )
            )
            .mappings()
            .one()
        )
    return dict(row)


def attempts(store: Store, job_id: str, scheduled_at: datetime) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = (
            connection.execute(
                select(schema.run_attempts)
                .where(
                    schema.run_attempts.c.job_id == job_id,
                    schema.run_attempts.c.scheduled_at == scheduled_at,
                )
                .order_by(schema.run_attempts.c.id)
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


def messages(store: Store) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = (
            connection.execute(select(schema.queue_messages).order_by(schema.queue_messages.c.id))
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


def dead_letters(store: Store) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = connection.execute(select(schema.dead_letters)).mappings().all()
    return [dict(r) for r in rows]


def outbox_count(store: Store) -> int:
    with store.read() as connection:
        return len(connection.execute(select(schema.outbox.c.id)).all())


def wait_for(predicate: Callable[[], bool], what: str, seconds: float = WAIT_SECONDS) -> None:
    """Poll until `predicate` holds; the deadline is generous, only there to end a hang."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    from scheduled_d.worker import Worker

    separator = argv.index("--")
    url, queue, owner, lease, heartbeat = argv[:separator]
    command = argv[separator + 1 :]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    store = Store.open(url)
    worker = Worker(
        store,
        queue,
        command,
        lease_seconds=float(lease),
        heartbeat_seconds=float(heartbeat),
        poll_seconds=0.1,
        owner=owner,
    )
    worker.run(stop)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
