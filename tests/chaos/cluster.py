"""Owns the chaos harness: real `scheduled-d dispatcher`, `relay`, `worker` and `api`
processes and tenant workers over the API (`worker --api`) (started, stopped with SIGTERM,
killed with SIGKILL, paused with SIGSTOP and continued), each logging to its own file, and
the outside views the tests poll: who owns which partition under which epoch, and who is a
member in ZooKeeper.

Every daemon is configured through the environment only (SCHEDULED_DATABASE_URL,
SCHEDULED_ZOOKEEPER, SCHEDULED_ZOOKEEPER_ROOT, SCHEDULED_NODE_NAME,
SCHEDULED_SESSION_TIMEOUT_SECONDS, SCHEDULED_POLL_INTERVAL_SECONDS) plus an empty config file,
so nothing from the machine's /etc leaks in. A tenant worker over the API gets none of these:
only the API's URL and the tenant's token (SCHEDULED_API_TOKEN). `close()` continues and
kills every process it started, by PID; every wait here is bounded in both count and time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

from sqlalchemy import text

from schedctl.app.cluster_status import read_members
from schedctl.coordination.assignment import assignment
from schedctl.core import errors
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.partitions import PartitionRepo
from schedctl_bench.api_workers import (
    api_argv,
    api_url,
    api_worker_argv,
    api_worker_env,
    wait_healthy,
)
from schedctl_bench.consumers import worker_argv
from tests.services.ports import free_port, tail

SCHEDULED_D = Path(sys.executable).parent / "scheduled-d"
STOP_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.05

T = TypeVar("T")


class DaemonDied(RuntimeError):
    """A daemon the test is waiting for exited by itself (its log says why)."""


@dataclass
class Daemon:
    """One daemon name; a restart is a new process under the same name (and log file)."""

    name: str
    mode: str  # "dispatcher", "relay", "worker", "api" or "api-worker"
    log_path: Path
    argv: list[str] = field(default_factory=list)  # after scheduled-d
    env: dict[str, str] | None = None  # instead of the cluster's (an API worker's)
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    paused: bool = False
    starts: int = 0
    exits: list[int] = field(default_factory=list)  # exit codes of processes that ended

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def wait_until(
    condition: Callable[[], T | None], timeout: float, interval: float = POLL_SECONDS
) -> tuple[T | None, float]:
    """Poll `condition` until it returns something truthy or `timeout` passes; returns
    (that value or None, seconds waited). Database and ZooKeeper hiccups count as "not
    yet" (the tests poll straight through restarts)."""
    start = time.monotonic()
    for _ in range(int(timeout / interval) + 2):
        with contextlib.suppress(errors.SchedError):
            value = condition()
            if value:
                return value, time.monotonic() - start
        if time.monotonic() - start >= timeout:
            break
        time.sleep(interval)
    return None, time.monotonic() - start


class Cluster:
    """Dispatchers and relays as child processes of the test, all on loopback."""

    def __init__(
        self,
        workdir: Path,
        *,
        db_url: str,
        zookeeper: str,
        zookeeper_root: str,
        partition_count: int,
        session_timeout: float = 4.0,
        poll_interval: float = 0.1,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.db_url = db_url
        self.zookeeper = zookeeper
        self.zookeeper_root = zookeeper_root
        self.partition_count = partition_count
        self.session_timeout = session_timeout
        self.daemons: dict[str, Daemon] = {}
        self.config_path = self.workdir / "scheduled.toml"
        self.config_path.write_text("# the chaos harness configures daemons by environment\n")
        self._env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")},
            "SCHEDULED_CONFIG": str(self.config_path),
            "SCHEDULED_DATABASE_URL": db_url,
            "SCHEDULED_ZOOKEEPER": zookeeper,
            "SCHEDULED_ZOOKEEPER_ROOT": zookeeper_root,
            "SCHEDULED_SESSION_TIMEOUT_SECONDS": str(session_timeout),
            "SCHEDULED_POLL_INTERVAL_SECONDS": str(poll_interval),
            "SCHEDULED_LOG_LEVEL": "INFO",
            **(extra_env or {}),
        }
        self.store = Store.open(db_url)

    # -- processes -----------------------------------------------------------------------

    def start_worker(self, name: str, queue: str, *, tenant: str | None = None) -> Daemon:
        """A direct worker (database access) running /bin/true for each run of `queue`:
        runs are leased, executed and acked while the faults happen. The command line is
        built by worker_argv, which passes `tenant` once workers take one."""
        argv = worker_argv(queue, ["/bin/true"], tenant=tenant, concurrency=4, lease_seconds=10)
        return self.start(name, "worker", argv=argv[1:])

    def start_api(self, name: str = "api", timeout: float = 60.0) -> str:
        """`scheduled-d api` on a free loopback port; returns its URL once /healthz answers
        (DaemonDied if it exits first, RuntimeError if it is not healthy in `timeout`)."""
        port = free_port()
        self.start(name, "api", argv=api_argv(port)[1:])
        url = api_url(port)
        if not wait_healthy(url, timeout, self.daemons[name].running):
            self.check_alive([name])
            raise RuntimeError(f"{name} at {url} not healthy after {timeout:g} s")
        return url

    def start_api_worker(self, name: str, queue: str, url: str, token: str) -> Daemon:
        """A tenant worker over the API at `url` running /bin/true for each run of the
        token's tenant's `queue`; its environment holds no database setting at all."""
        argv = api_worker_argv(url, queue, ["/bin/true"], concurrency=4, lease_seconds=10)
        env = api_worker_env(
            self._env, token, SCHEDULED_LOG_LEVEL="INFO", SCHEDULED_CONFIG=str(self.config_path)
        )
        return self.start(name, "api-worker", argv=argv[1:], env=env)

    def start(
        self,
        name: str,
        mode: str = "dispatcher",
        *,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Daemon:
        """Start (or restart) daemon `name` in `mode` (`argv`: the arguments after
        scheduled-d, default just the mode; `env`: its whole environment, default the
        cluster's); returns at once."""
        daemon = self.daemons.get(name)
        if daemon is None:
            daemon = Daemon(name, mode, self.workdir / f"{name}.log", argv=argv or [mode], env=env)
            self.daemons[name] = daemon
        if daemon.running():
            raise RuntimeError(f"{name} is already running (pid {daemon.pid})")
        if daemon.log_file is None:
            daemon.log_file = daemon.log_path.open("ab")
        daemon.log_file.write(f"\n===== start {daemon.starts + 1} of {name} =====\n".encode())
        daemon.log_file.flush()
        daemon.process = subprocess.Popen(
            [str(SCHEDULED_D), *daemon.argv],
            env={**(daemon.env or self._env), "SCHEDULED_NODE_NAME": name},
            stdin=subprocess.DEVNULL,
            stdout=daemon.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C of the test run is not delivered to it
        )
        daemon.paused = False
        daemon.starts += 1
        return daemon

    def kill(self, name: str) -> None:
        """kill -9, and reap it."""
        daemon = self.daemons[name]
        if daemon.running():
            assert daemon.process is not None
            daemon.process.send_signal(signal.SIGKILL)
            daemon.exits.append(daemon.process.wait(STOP_TIMEOUT_SECONDS))
        daemon.paused = False

    def pause(self, name: str) -> None:
        """SIGSTOP: the process and its ZooKeeper heartbeats freeze; its session expires."""
        daemon = self.daemons[name]
        assert daemon.process is not None and daemon.running()
        daemon.process.send_signal(signal.SIGSTOP)
        daemon.paused = True

    def resume(self, name: str) -> None:
        daemon = self.daemons[name]
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGCONT)
        daemon.paused = False

    def terminate(self, name: str, timeout: float = STOP_TIMEOUT_SECONDS) -> int | None:
        """SIGTERM and wait for a clean exit; returns its exit code (None: it had to be
        killed after `timeout`)."""
        daemon = self.daemons[name]
        if not daemon.running():
            return None
        assert daemon.process is not None
        if daemon.paused:
            self.resume(name)
        daemon.process.send_signal(signal.SIGTERM)
        try:
            code = daemon.process.wait(timeout)
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.exits.append(daemon.process.wait(STOP_TIMEOUT_SECONDS))
            return None
        daemon.exits.append(code)
        return code

    def dead(self) -> dict[str, int]:
        """Daemons that ended by themselves (none should: they must ride out every fault):
        name -> exit code. Processes the harness killed or stopped are not listed."""
        found = {}
        for name, daemon in self.daemons.items():
            if daemon.process is not None and not daemon.paused:
                code = daemon.process.poll()
                if code is not None and len(daemon.exits) < daemon.starts:
                    found[name] = code
        return found

    def running_dispatchers(self) -> list[str]:
        """Dispatchers whose process exists (paused ones included)."""
        return sorted(n for n, d in self.daemons.items() if d.mode == "dispatcher" and d.running())

    def close(self) -> None:
        """Continue, then kill every process started here, by PID; close the log files."""
        for daemon in self.daemons.values():
            if daemon.process is not None and daemon.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    daemon.process.send_signal(signal.SIGCONT)
                    daemon.process.send_signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    daemon.process.wait(STOP_TIMEOUT_SECONDS)
            if daemon.log_file is not None:
                daemon.log_file.close()
                daemon.log_file = None
        self.store.close()

    def log_tails(self, lines: int = 60) -> dict[str, str]:
        for daemon in self.daemons.values():
            if daemon.log_file is not None:
                daemon.log_file.flush()
        return {name: tail(d.log_path, lines) for name, d in self.daemons.items()}

    def count_in_logs(self, needle: str) -> dict[str, int]:
        """How many log lines of each daemon contain `needle` (e.g. fenced claims)."""
        counts = {}
        for name, daemon in self.daemons.items():
            try:
                content = daemon.log_path.read_text(errors="replace")
            except OSError:
                continue
            counts[name] = sum(1 for line in content.splitlines() if needle in line)
        return counts

    # -- outside views ---------------------------------------------------------------------

    def ownership(self) -> dict[int, tuple[int, str | None]]:
        """partition -> (epoch, owner) as the partitions table says now."""
        return PartitionRepo(self.store).epochs()

    def members(self, timeout: float = 3.0) -> list[str]:
        """The dispatchers registered in ZooKeeper now."""
        return sorted(read_members(self.zookeeper, self.zookeeper_root, timeout=timeout))

    def owned_by(self, name: str) -> dict[int, int]:
        """partition -> epoch of the partitions the table says `name` owns."""
        return {p: e for p, (e, owner) in self.ownership().items() if owner == name}

    def check_alive(self, names: list[str]) -> None:
        """DaemonDied if one of `names` exited by itself (waiting for it is pointless)."""
        dead = {name: code for name, code in self.dead().items() if name in names}
        if dead:
            tails = "\n".join(f"--- {n} ---\n{self.log_tails(15)[n]}" for n in dead)
            raise DaemonDied(f"exited by themselves: {dead}\n{tails}")

    def balanced(self, expected: list[str]) -> bool:
        """Every partition is owned, in the table, by the member the assignment of
        `expected` names, and ZooKeeper lists exactly `expected` (read second: the table is
        the cheap check)."""
        self.check_alive(expected)
        wanted = assignment(expected, self.partition_count)
        table = self.ownership()
        if any(table.get(p, (0, None))[1] != owner for p, owner in wanted.items()):
            return False
        return self.members() == sorted(expected)

    def wait_balanced(self, expected: list[str], timeout: float = 60.0) -> float | None:
        """Seconds until `balanced(expected)`, or None if it did not happen in `timeout`."""
        done, took = wait_until(lambda: self.balanced(expected), timeout, interval=0.1)
        return took if done else None

    def sessions_report(self) -> str:
        """The database sessions that are not idle, with whom they wait for: what to look
        at when a takeover hangs (an epoch write waiting for a claim left open)."""
        with self.store.read() as connection:
            rows = connection.execute(
                text(
                    "SELECT pid, state, wait_event_type, pg_blocking_pids(pid)::text, "
                    "round(extract(epoch FROM clock_timestamp() - xact_start)::numeric, 1), "
                    "left(regexp_replace(query, '\\s+', ' ', 'g'), 90) "
                    "FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND state <> 'idle'"
                )
            ).all()
        return (
            "\n".join(
                f"  pid {pid} {state} wait={wait} blocked_by={blockers} tx_age={age}s: {query}"
                for pid, state, wait, blockers, age, query in rows
            )
            or "  (no busy session)"
        )

    def wait_reowned(self, before: Mapping[int, int], timeout: float = 60.0) -> float | None:
        """Seconds until every partition in `before` (partition -> epoch) is recorded under
        a higher epoch, i.e. owned again by someone; None if not within `timeout`."""

        def reowned() -> bool:
            table = self.ownership()
            return all(table.get(p, (0, None))[0] > e for p, e in before.items())

        done, took = wait_until(reowned, timeout)
        return took if done else None
