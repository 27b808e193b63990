"""Owns the benchmarks' dispatcher processes (N `scheduled-d dispatcher` on one database),
the unpaced bench tenant, and the failover benchmark (re-own time after kill -9, SIGSTOP,
SIGTERM). The whole-path burst and steady benchmarks are in schedctl_bench.pipeline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedctl.core import errors
from schedctl.storage.db.store import Store
from schedctl.storage.tenants.tenants import TenantRepo
from schedctl_bench import children
from schedctl_bench.storage import bench as bench_rows

SCHEDULED_D = Path(sys.executable).parent / "scheduled-d"


@dataclass
class Dispatchers:
    """N dispatcher processes on one database (N > 1 needs ZooKeeper); with `mode` "all",
    N `scheduled-d all` processes (dispatcher, relay and `config`'s workers in one)."""

    url: str
    count: int = 1
    zookeeper: str | None = None
    batch_size: int = 5000
    extra_env: dict[str, str] = field(default_factory=dict)
    mode: str = "dispatcher"
    config: Path | None = None

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
            argv = [str(SCHEDULED_D), self.mode]
            if self.config is not None:
                argv += ["--config", str(self.config)]
            with (self.logdir / f"{self.mode}-{i}.log").open("w") as log:
                self.processes.append(
                    subprocess.Popen(
                        argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )

    def stop(self) -> dict[str, int | None]:
        """SIGTERM, then wait (SIGKILL after 30 s); `MODE-i` -> exit code (None: killed)."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for i, process in enumerate(self.processes):
            codes[f"{self.mode}-{i}"] = children.reap(process, 30)
        return codes


def bench_tenant(store: Store) -> tuple[str, str]:
    """A fresh tenant without dispatch pacing: (its id, its API token)."""
    tenant, token = TenantRepo(store).create(f"bench-{uuid.uuid4().hex[:8]}", actor="bench")
    # no pacing in a benchmark of raw claim speed
    bench_rows.set_tenant_columns(store, tenant.tenant_id, {"dispatch_rate_per_second": 10_000_000})
    return tenant.tenant_id, token


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
