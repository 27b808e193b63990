"""Dispatch benchmarks against real `scheduled-d dispatcher` processes: a burst of runs
due at one instant, and a steady stream, measured from the run history's timestamps."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update

from schedctl import errors
from schedctl.bench.consumers import Consumers
from schedctl.bench.load import insert_once_jobs
from schedctl.storage import schema
from schedctl.storage.store import Store
from schedctl.storage.tenants import TenantRepo

SCHEDULED_D = Path(sys.executable).parent / "scheduled-d"


@dataclass
class Dispatchers:
    """N dispatcher processes on one database (N > 1 needs ZooKeeper)."""

    url: str
    count: int = 1
    zookeeper: str | None = None
    batch_size: int = 5000
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.count > 1 and not self.zookeeper:
            raise errors.ValidationError(
                "more than one dispatcher needs --zookeeper", field="dispatchers"
            )
        self.logdir = Path(tempfile.mkdtemp(prefix="schedctl-bench-"))
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for i in range(self.count):
            env = {
                **os.environ,
                "SCHEDULED_DATABASE_URL": self.url,
                "SCHEDULED_NODE_NAME": f"bench-{i}",
                "SCHEDULED_CLAIM_BATCH_SIZE": str(self.batch_size),
                "SCHEDULED_LOG_LEVEL": "WARNING",
            }
            if self.zookeeper:
                env["SCHEDULED_ZOOKEEPER"] = self.zookeeper
            env.update(self.extra_env)
            with (self.logdir / f"dispatcher-{i}.log").open("w") as log:
                self.processes.append(
                    subprocess.Popen(
                        [str(SCHEDULED_D), "dispatcher"],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _bench_tenant(store: Store) -> str:
    tenant, _token = TenantRepo(store).create(f"bench-{uuid.uuid4().hex[:8]}", actor="bench")
    with store.tx() as connection:
        # no pacing in a benchmark of raw claim speed
        connection.execute(
            update(schema.tenants)
            .where(schema.tenants.c.tenant_id == tenant.tenant_id)
            .values(dispatch_rate_per_second=10_000_000)
        )
    return tenant.tenant_id


def _claimed(store: Store, tenant_id: str) -> int:
    with store.read() as connection:
        return int(
            connection.execute(
                select(func.count())
                .select_from(schema.runs)
                .where(schema.runs.c.tenant_id == tenant_id)
            ).scalar_one()
        )


def _lateness(store: Store, tenant_id: str) -> list[float]:
    with store.read() as connection:
        rows = connection.execute(
            select(schema.runs.c.fire_at, schema.runs.c.dispatched_at).where(
                schema.runs.c.tenant_id == tenant_id
            )
        ).all()
    return sorted((d - f).total_seconds() for f, d in rows if f is not None and d is not None)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def _settings(store: Store) -> str:
    with store.read() as connection:
        return store.dialect.describe(connection)


def _wait_claimed(store: Store, tenant_id: str, total: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    claimed = 0
    while time.monotonic() < deadline:
        claimed = _claimed(store, tenant_id)
        if claimed >= total:
            break
        time.sleep(0.2)
    return claimed


def burst(
    store: Store,
    *,
    jobs: int,
    lead_seconds: float,
    dispatchers: Dispatchers,
    timeout: float,
) -> dict[str, Any]:
    """`jobs` one-time runs all due at one instant `lead_seconds` after the dispatchers
    start; the figure is how long after that instant the last one was claimed."""
    tenant_id = _bench_tenant(store)
    due_at = datetime.now(UTC) + timedelta(seconds=lead_seconds + 30)
    load_started = time.monotonic()
    insert_once_jobs(store, tenant_id, [due_at] * jobs, name="bench-burst")
    load_seconds = time.monotonic() - load_started
    # the instant is set once loading is done, so it is the same lead for any size
    due_at = datetime.now(UTC) + timedelta(seconds=lead_seconds)
    with store.tx() as connection:
        connection.execute(
            update(schema.jobs)
            .where(schema.jobs.c.tenant_id == tenant_id)
            .values(next_run_at=due_at, next_fire_at=due_at)
        )
    dispatchers.start()
    try:
        claimed = _wait_claimed(store, tenant_id, jobs, timeout + lead_seconds)
    finally:
        dispatchers.stop()
    with store.read() as connection:
        last = connection.execute(
            select(func.max(schema.runs.c.dispatched_at)).where(
                schema.runs.c.tenant_id == tenant_id
            )
        ).scalar_one()
    late = _lateness(store, tenant_id)
    return {
        "benchmark": "burst",
        "database": _settings(store),
        "dispatchers": dispatchers.count,
        "batch_size": dispatchers.batch_size,
        "jobs": jobs,
        "claimed": claimed,
        "load_seconds": round(load_seconds, 2),
        "all_claimed_after_due_seconds": round((last - due_at).total_seconds(), 3)
        if last
        else None,
        "claims_per_second": round(claimed / max((last - due_at).total_seconds(), 1e-3), 1)
        if last
        else None,
        "lateness_p50_seconds": round(_pct(late, 0.50), 3),
        "lateness_p99_seconds": round(_pct(late, 0.99), 3),
        "logs": str(dispatchers.logdir),
    }


def _executed(store: Store, tenant_id: str) -> int:
    with store.read() as connection:
        return int(
            connection.execute(
                select(func.count())
                .select_from(schema.runs)
                .where(schema.runs.c.tenant_id == tenant_id, schema.runs.c.status == "succeeded")
            ).scalar_one()
        )


def _start_lateness(store: Store, tenant_id: str) -> list[float]:
    with store.read() as connection:
        rows = connection.execute(
            select(schema.runs.c.scheduled_at, schema.runs.c.started_at).where(
                schema.runs.c.tenant_id == tenant_id, schema.runs.c.started_at.is_not(None)
            )
        ).all()
    return sorted((started - at).total_seconds() for at, started in rows)


def steady(
    store: Store,
    *,
    rate: int,
    duration: float,
    dispatchers: Dispatchers,
    workers: int = 2,
    worker_concurrency: int = 16,
) -> dict[str, Any]:
    """`rate` runs a second, each due at its own instant, for `duration` seconds; reports
    the lateness (claim time minus fire time) distribution. With `workers`, a relay and
    that many `scheduled-d worker` processes running /bin/true consume the queue meanwhile,
    so claims compete with real leases and acks; their start lateness is reported too."""
    tenant_id = _bench_tenant(store)
    start = datetime.now(UTC) + timedelta(seconds=5)
    total = int(rate * duration)
    times = [start + timedelta(seconds=i / rate) for i in range(total)]
    queue = f"bench-steady-{tenant_id[-8:]}"
    insert_once_jobs(store, tenant_id, times, name="bench-steady", queue=queue)
    consumers = None
    if workers:
        consumers = Consumers(
            dispatchers.url,
            queue,
            workers=workers,
            concurrency=worker_concurrency,
            tenant=_tenant_name(store, tenant_id),
            logdir=dispatchers.logdir,
        )
    dispatchers.start()
    executed = 0
    exits: dict[str, int | None] = {}
    try:
        if consumers is not None:
            consumers.start()
        claimed = _wait_claimed(store, tenant_id, total, duration + 60)
        if consumers is not None:
            deadline = time.monotonic() + duration + 120
            while time.monotonic() < deadline and not consumers.dead():
                executed = _executed(store, tenant_id)
                if executed >= total:
                    break
                time.sleep(0.2)
    finally:
        dispatchers.stop()
        if consumers is not None:
            exits = consumers.stop()
    late = _lateness(store, tenant_id)
    result: dict[str, Any] = {
        "benchmark": "steady",
        "database": _settings(store),
        "dispatchers": dispatchers.count,
        "rate_per_second": rate,
        "duration_seconds": duration,
        "runs": total,
        "claimed": claimed,
        "lateness_p50_seconds": round(_pct(late, 0.50), 3),
        "lateness_p95_seconds": round(_pct(late, 0.95), 3),
        "lateness_p99_seconds": round(_pct(late, 0.99), 3),
        "lateness_max_seconds": round(late[-1], 3) if late else None,
        "lateness_mean_seconds": round(statistics.fmean(late), 3) if late else None,
    }
    if consumers is not None:
        started = _start_lateness(store, tenant_id)
        result.update(
            {
                "workers": workers,
                "worker_concurrency": worker_concurrency,
                "executed": _executed(store, tenant_id),
                "start_lateness_p50_seconds": round(_pct(started, 0.50), 3),
                "start_lateness_p99_seconds": round(_pct(started, 0.99), 3),
                "consumer_exit_codes": exits,
                "consumer_log_trouble": sum(len(v) for v in consumers.trouble().values()),
            }
        )
    result["logs"] = str(dispatchers.logdir)
    return result


def _tenant_name(store: Store, tenant_id: str) -> str:
    with store.read() as connection:
        return str(
            connection.execute(
                select(schema.tenants.c.name).where(schema.tenants.c.tenant_id == tenant_id)
            ).scalar_one()
        )


def _owners(store: Store) -> dict[int, tuple[str | None, int]]:
    with store.read() as connection:
        rows = connection.execute(
            select(
                schema.partitions.c.partition, schema.partitions.c.owner, schema.partitions.c.epoch
            )
        ).all()
    return {int(p): (o, int(e)) for p, o, e in rows}


def _wait_owned(store: Store, names: set[str], partitions: int, timeout: float) -> float:
    """Seconds until every partition is owned by one of `names`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        owners = _owners(store)
        if len(owners) >= partitions and all(o in names for o, _ in owners.values()):
            return time.monotonic() - started
        time.sleep(0.05)
    raise errors.SchedError(f"partitions were not all owned by {sorted(names)} in {timeout:.0f} s")


def _wait_shared(store: Store, names: set[str], timeout: float) -> None:
    """Until each of `names` owns some partitions (the woken process has its share back)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if names <= {o for o, _ in _owners(store).values()}:
            return
        time.sleep(0.05)
    raise errors.SchedError(f"{sorted(names)} did not share the partitions in {timeout:.0f} s")


def failover(
    store: Store, *, url: str, zookeeper: str, session_timeout: float, timeout: float
) -> dict[str, Any]:
    """Three dispatchers share the partitions; then one is killed with -9, one is stopped
    with SIGSTOP past its session, and one is stopped with SIGTERM: for each, the seconds
    until its partitions are owned again (with higher epochs) by the others."""
    partitions = store.partition_count
    root = f"/schedctl-bench-{uuid.uuid4().hex[:8]}"
    group = Dispatchers(
        url,
        3,
        zookeeper,
        extra_env={
            "SCHEDULED_SESSION_TIMEOUT_SECONDS": str(session_timeout),
            "SCHEDULED_ZOOKEEPER_ROOT": root,
        },
    )
    names = [f"bench-{i}" for i in range(3)]
    group.start()
    result: dict[str, Any] = {
        "benchmark": "failover",
        "partitions": partitions,
        "session_timeout_seconds": session_timeout,
    }
    try:
        result["all_owned_after_start_seconds"] = round(
            _wait_owned(store, set(names), partitions, timeout), 3
        )
        before = _owners(store)
        # kill -9: the session has to expire before anyone may take over
        group.processes[0].kill()
        group.processes[0].wait(10)
        result["reown_after_kill9_seconds"] = round(
            _wait_owned(store, set(names[1:]), partitions, timeout), 3
        )
        after_kill = _owners(store)
        moved = [p for p, (o, _) in before.items() if o == names[0]]
        result["epochs_increased"] = all(after_kill[p][1] > before[p][1] for p in moved)
        # SIGSTOP past the session: the same, and the woken process is fenced
        group.processes[1].send_signal(signal.SIGSTOP)
        result["reown_after_sigstop_seconds"] = round(
            _wait_owned(store, {names[2]}, partitions, timeout), 3
        )
        group.processes[1].send_signal(signal.SIGCONT)
        _wait_shared(store, set(names[1:]), timeout)
        # SIGTERM: a warm stop hands the partitions over at once
        group.processes[1].send_signal(signal.SIGTERM)
        result["reown_after_sigterm_seconds"] = round(
            _wait_owned(store, {names[2]}, partitions, timeout), 3
        )
    finally:
        for process in group.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        group.stop()
    result["logs"] = str(group.logdir)
    return result
