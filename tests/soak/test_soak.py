"""Soak on a real Postgres: 500 interval jobs due every second (500 runs/s), executed by
real workers running /bin/true, for SOAK_SECONDS (default 60) per topology (SOAK_JOBS
and SOAK_DRAIN_SECONDS too; not SCHEDULED_*, which conftest removes):

- `scheduled-d all` with a [[worker]] (concurrency 16) in one process;
- `scheduled-d dispatcher` + `scheduled-d relay` + two `scheduled-d worker` processes.

This is the load under which the claim's update of job rows used to deadlock with the
worker's lease. Afterwards every due occurrence must have exactly one run and it must have
succeeded (counted from the run history), no process may have died, and no log may show
an exception escaping a loop or a thread. The counts, the claim and start lateness
(p50/p99) and the deadlocks Postgres detected (each one retried) are printed, not
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests
from sqlalchemy import func, select, text, update

from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl_bench.consumers import SCHEDULED_D, Consumers, trouble_in
from schedctl_bench.storage.bulk import insert_once_jobs
from tests.factories import make_tenant, set_tenant
from tests.services.ports import free_port

SOAK_SECONDS = int(os.environ.get("SOAK_SECONDS", "60"))
JOBS = int(os.environ.get("SOAK_JOBS", "500"))  # each every second: runs/s
QUEUE = "soak"
LEAD_SECONDS = 10  # from creating the jobs to their first run: the daemons start meanwhile
# The bound of the wait for the backlog to drain after the load: a Python worker runs on
# the order of 100-300 /bin/true a second per core, so at 500 runs/s on a small machine
# the queue grows during the load and is worked off afterwards (what is asserted is that
# every run is executed, not how fast; the figures say how fast).
DRAIN_SECONDS = int(os.environ.get("SOAK_DRAIN_SECONDS", str(max(900, 8 * SOAK_SECONDS))))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.timeout(LEAD_SECONDS + SOAK_SECONDS + DRAIN_SECONDS + 300),
]


@dataclass
class Load:
    start: datetime
    end: datetime  # jobs end here: occurrences start + k s for k in range(SOAK_SECONDS)
    tenant_id: str


def _create_load(store: Store) -> Load:
    tenant_id = make_tenant(store, "soak")
    set_tenant(store, tenant_id, dispatch_rate_per_second=1_000_000)
    start = (datetime.now(UTC) + timedelta(seconds=LEAD_SECONDS)).replace(microsecond=0)
    end = start + timedelta(seconds=SOAK_SECONDS - 0.5)
    ids = insert_once_jobs(store, tenant_id, [start] * JOBS, queue=QUEUE, name="soak")
    schedule = json.dumps({"kind": "interval", "every_seconds": 1, "anchor": format_instant(start)})
    with store.tx() as connection:
        # every occurrence must run, however late (run_all), and the jobs end by themselves
        connection.execute(
            update(schema.jobs)
            .where(schema.jobs.c.job_id.in_(ids))
            .values(schedule=schedule, misfire_policy="run_all", end_at=end, max_attempts=5)
        )
    return Load(start, end, tenant_id)


def _deadlocks(store: Store) -> int:
    with store.read() as connection:
        return int(
            connection.execute(
                text("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            ).scalar_one()
        )


def _counts(store: Store) -> dict[str, int]:
    with store.read() as connection:
        rows = connection.execute(
            select(schema.runs.c.status, func.count()).group_by(schema.runs.c.status)
        ).all()
    return {status: int(n) for status, n in rows}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _lateness(store: Store) -> str:
    with store.read() as connection:
        rows = connection.execute(
            select(
                schema.runs.c.scheduled_at,
                schema.runs.c.fire_at,
                schema.runs.c.dispatched_at,
                schema.runs.c.started_at,
            )
        ).all()
    claim = sorted((d - f).total_seconds() for _, f, d, _ in rows if f and d)
    start = sorted((st - s).total_seconds() for s, _, _, st in rows if st)
    return (
        f"claim lateness (dispatched - fire time) p50 {_pct(claim, 0.5):.3f} s, "
        f"p99 {_pct(claim, 0.99):.3f} s, max {claim[-1] if claim else float('nan'):.3f} s; "
        f"start lateness (command started - scheduled) p50 {_pct(start, 0.5):.3f} s, "
        f"p99 {_pct(start, 0.99):.3f} s, max {start[-1] if start else float('nan'):.3f} s"
    )


def _wait(condition: Callable[[], bool], seconds: float, alive: Callable[[], None]) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive()
        if condition():
            return True
        time.sleep(1.0)
    return condition()


def _soak(
    store: Store, topology: str, alive: Callable[[], None], logs: Callable[[], dict[str, list[str]]]
) -> None:
    """Wait out the load and the drain, then check and print."""
    deadlocks_before = _deadlocks(store)
    load = _create_load(store)
    expected = JOBS * SOAK_SECONDS
    began = time.monotonic()
    _wait(lambda: datetime.now(UTC) > load.end + timedelta(seconds=1), 2 * SOAK_SECONDS + 60, alive)
    at_end = _counts(store)
    drained = _wait(lambda: _counts(store).get("succeeded", 0) >= expected, DRAIN_SECONDS, alive)
    took = time.monotonic() - began
    counts = _counts(store)
    with store.read() as connection:
        per_job = connection.execute(
            select(
                func.count(func.distinct(schema.runs.c.job_id)),
                func.min(schema.runs.c.scheduled_at),
                func.max(schema.runs.c.scheduled_at),
                func.count(),
            )
        ).one()
        still_active = connection.execute(
            select(func.count()).select_from(schema.jobs).where(schema.jobs.c.status == "active")
        ).scalar_one()
    deadlocks = _deadlocks(store) - deadlocks_before
    print(
        f"\n== soak, {topology}: {JOBS} jobs every second = {JOBS} runs/s with /bin/true for "
        f"{SOAK_SECONDS} s on Postgres\n"
        f"expected runs {expected}; run rows {per_job[3]} for {per_job[0]} jobs, scheduled "
        f"{per_job[1]} .. {per_job[2]}; by status {counts}\n"
        f"at the end of the load: {at_end}; all executed "
        + (f"{took - SOAK_SECONDS - LEAD_SECONDS:.1f} s after it" if drained else "NOT in time")
        + f"\n{_lateness(store)}\n"
        f"deadlocks detected by Postgres (each retried by its transaction's caller): {deadlocks}"
    )
    trouble = logs()
    assert not trouble, f"exceptions in the logs: {trouble}"
    assert drained, f"not every due run executed within {DRAIN_SECONDS} s: {counts}"
    assert per_job[3] == expected and counts == {"succeeded": expected}, counts
    assert still_active == 0  # every job reached its end


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    store = Store.open(pg_url)
    yield store
    store.close()


def _daemon_env(pg_url: str, name: str) -> dict[str, str]:
    """The daemons' environment: `pg_url` is the runtime role's (no DDL), as deployed."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")},
        "SCHEDULED_DATABASE_URL": pg_url,
        "SCHEDULED_NODE_NAME": name,
        "SCHEDULED_LOG_LEVEL": "INFO",
        "SCHEDULED_POLL_INTERVAL_SECONDS": "0.2",
    }


def test_soak_all_in_one_process_with_a_worker(
    pg_runtime_url: str, store: Store, tmp_path: Path
) -> None:
    port = free_port()
    config = tmp_path / "scheduled.toml"
    config.write_text(
        f'metrics_listen = "127.0.0.1:{port}"\n'
        "[[worker]]\n"
        f'queue = "{QUEUE}"\n'
        'command = ["/bin/true"]\n'
        "concurrency = 16\n"
        "lease_seconds = 30\n"
    )
    log_path = tmp_path / "all.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(SCHEDULED_D), "all", "--config", str(config)],
            env=_daemon_env(pg_runtime_url, "soak-all"),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    healthz = f"http://127.0.0.1:{port}/healthz"

    def alive() -> None:
        assert process.poll() is None, f"scheduled-d all exited: {log_path.read_text()[-3000:]}"

    try:
        _soak(store, "scheduled-d all + [[worker]] (concurrency 16)", alive, lambda: {})
        assert requests.get(healthz, timeout=30).status_code == 200
        process.terminate()
        assert process.wait(120) == 0
        trouble = trouble_in(log_path)
        assert not trouble, trouble
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def test_soak_dispatcher_relay_and_two_workers(
    pg_runtime_url: str, store: Store, tmp_path: Path
) -> None:
    dispatcher_log = tmp_path / "dispatcher.log"
    with dispatcher_log.open("wb") as log:
        dispatcher = subprocess.Popen(
            [str(SCHEDULED_D), "dispatcher"],
            env=_daemon_env(pg_runtime_url, "soak-dispatcher"),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    consumers = Consumers(pg_runtime_url, QUEUE, workers=2, concurrency=16, logdir=tmp_path)

    def alive() -> None:
        assert dispatcher.poll() is None, dispatcher_log.read_text()[-3000:]
        assert not consumers.dead(), consumers.dead()

    def trouble() -> dict[str, list[str]]:
        found = consumers.trouble()
        if lines := trouble_in(dispatcher_log):
            found["dispatcher"] = lines
        return found

    try:
        consumers.start()
        _soak(store, "dispatcher + relay + 2 workers (concurrency 16 each)", alive, trouble)
        dispatcher.terminate()
        assert dispatcher.wait(120) == 0
        assert consumers.stop() == dict.fromkeys(["relay", "worker-0", "worker-1"], 0)
        assert not trouble()
    finally:
        consumers.kill()
        if dispatcher.poll() is None:
            dispatcher.kill()
            dispatcher.wait(30)
