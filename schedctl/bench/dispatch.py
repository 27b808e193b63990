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

from schedctl import errors
from schedctl.bench.consumers import Consumers
from schedctl.storage import bench as bench_rows
from schedctl.storage.bulk import insert_once_jobs
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


def _bench_tenant(store: Store) -> tuple[str, str]:
    """A fresh tenant without dispatch pacing: (its id, its API token)."""
    tenant, token = TenantRepo(store).create(f"bench-{uuid.uuid4().hex[:8]}", actor="bench")
    # no pacing in a benchmark of raw claim speed
    bench_rows.set_tenant_columns(store, tenant.tenant_id, {"dispatch_rate_per_second": 10_000_000})
    return tenant.tenant_id, token


def _claimed(store: Store, tenant_id: str) -> int:
    return bench_rows.count_runs(store, tenant_id)


def _lateness(store: Store, tenant_id: str) -> list[float]:
    rows = bench_rows.claim_times(store, tenant_id)
    return sorted((d - f).total_seconds() for f, d in rows if f is not None and d is not None)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def _settings(store: Store) -> str:
    return bench_rows.database_settings(store)


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
    tenant_id, _token = _bench_tenant(store)
    due_at = datetime.now(UTC) + timedelta(seconds=lead_seconds + 30)
    load_started = time.monotonic()
    insert_once_jobs(store, tenant_id, [due_at] * jobs, name="bench-burst")
    load_seconds = time.monotonic() - load_started
    # the instant is set once loading is done, so it is the same lead for any size
    due_at = datetime.now(UTC) + timedelta(seconds=lead_seconds)
    bench_rows.move_jobs_due(store, tenant_id, due_at)
    dispatchers.start()
    try:
        claimed = _wait_claimed(store, tenant_id, jobs, timeout + lead_seconds)
    finally:
        dispatchers.stop()
    last = bench_rows.last_dispatched(store, tenant_id)
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


def _by_worker_kind(store: Store, tenant_id: str) -> tuple[dict[str, int], dict[str, list[float]]]:
    """The tenant's succeeded attempts by the kind of worker that ran them ("direct" or
    "api": an API worker's lease owner, kept in the attempt's `worker`, is
    `api:TOKEN_ID:DIGEST`): their count, and their start lateness (attempt start minus the
    run's due time), sorted."""
    counts = {"direct": 0, "api": 0}
    late: dict[str, list[float]] = {"direct": [], "api": []}
    for worker, at, started in bench_rows.succeeded_attempts(store, tenant_id):
        kind = "api" if (worker or "").startswith("api:") else "direct"
        counts[kind] += 1
        if started is not None:
            late[kind].append((started - at).total_seconds())
    return counts, {kind: sorted(values) for kind, values in late.items()}


def _executed(store: Store, tenant_id: str) -> int:
    return bench_rows.count_runs(store, tenant_id, status="succeeded")


def _start_lateness(store: Store, tenant_id: str) -> list[float]:
    rows = bench_rows.start_times(store, tenant_id)
    return sorted((started - at).total_seconds() for at, started in rows)


def steady(
    store: Store,
    *,
    rate: int,
    duration: float,
    dispatchers: Dispatchers,
    workers: int = 2,
    worker_concurrency: int = 16,
    api_workers: int = 0,
) -> dict[str, Any]:
    """`rate` runs a second, each due at its own instant, for `duration` seconds; reports
    the lateness (claim time minus fire time) distribution. With `workers`, a relay and
    that many `scheduled-d worker` processes running /bin/true consume the queue meanwhile,
    so claims compete with real leases and acks; their start lateness is reported too. With
    `api_workers`, a `scheduled-d api` and that many tenant workers over it (no database
    setting, the tenant's token) consume the same queue, beside or instead of those."""
    tenant_id, token = _bench_tenant(store)
    total = int(rate * duration)
    queue = f"bench-steady-{tenant_id[-8:]}"
    consumers = None
    if workers or api_workers:
        consumers = Consumers(
            dispatchers.url,
            queue,
            workers=workers,
            concurrency=worker_concurrency,
            tenant=_tenant_name(store, tenant_id),
            logdir=dispatchers.logdir,
            api_workers=api_workers,
            api_token=token,
        )
    executed = 0
    exits: dict[str, int | None] = {}
    try:
        if consumers is not None:
            # before the load: the API takes seconds to answer, which must not eat the lead
            consumers.start()
        start = datetime.now(UTC) + timedelta(seconds=5)
        times = [start + timedelta(seconds=i / rate) for i in range(total)]
        insert_once_jobs(store, tenant_id, times, name="bench-steady", queue=queue)
        dispatchers.start()
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
        counts, by_kind = _by_worker_kind(store, tenant_id)
        result.update(
            {
                "workers": workers,
                "api_workers": api_workers,
                "worker_concurrency": worker_concurrency,
                "executed": _executed(store, tenant_id),
                "executed_by_direct_workers": counts["direct"],
                "executed_by_api_workers": counts["api"],
                "start_lateness_p50_seconds": round(_pct(started, 0.50), 3),
                "start_lateness_p99_seconds": round(_pct(started, 0.99), 3),
            }
        )
        for kind, values in by_kind.items():
            if values:
                result[f"{kind}_start_lateness_p50_seconds"] = round(_pct(values, 0.50), 3)
                result[f"{kind}_start_lateness_p99_seconds"] = round(_pct(values, 0.99), 3)
        result.update(
            {
                "consumer_exit_codes": exits,
                "consumer_log_trouble": sum(len(v) for v in consumers.trouble().values()),
            }
        )
    result["logs"] = str(dispatchers.logdir)
    return result


def _tenant_name(store: Store, tenant_id: str) -> str:
    return bench_rows.tenant_name(store, tenant_id)


def _owners(store: Store) -> dict[int, tuple[str | None, int]]:
    return bench_rows.partition_owners(store)


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
