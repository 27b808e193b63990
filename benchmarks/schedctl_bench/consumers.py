"""Queue consumers for benchmarks, soak and chaos runs: `scheduled-d relay` processes,
`scheduled-d worker --queue Q -- CMD` processes (direct workers, with database access) and,
beside or instead of them, a `scheduled-d api` with tenant workers over it (`scheduled-d
worker --api URL`, the tenant's token, no database setting), so that runs are really leased,
executed and acknowledged while the load or the faults happen.

`worker_argv` is the one place that builds a worker's command line: when workers need a
tenant (`--tenant NAME`, tenant-scoped queues), it is passed there, and only if this
`scheduled-d worker` accepts it.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from schedctl.core import errors
from schedctl_bench import children
from schedctl_bench.api_workers import (
    api_argv,
    api_url,
    api_worker_argv,
    api_worker_env,
    loopback_port,
    wait_healthy,
)

SCHEDULED_D = Path(sys.executable).parent / "scheduled-d"
STOP_SECONDS = 60.0
API_READY_SECONDS = 60.0
API_PORT_TRIES = 3  # another process may take the picked port before the API binds it
# what a log must never contain: an exception that escaped a thread or a supervised loop
TROUBLE = re.compile(r"Traceback|Exception in thread|failed unexpectedly| died\b|CRITICAL")


@functools.cache
def worker_accepts_tenant() -> bool:
    """Whether `scheduled-d worker` has a --tenant option (tenant-scoped queues)."""
    done = subprocess.run(
        [str(SCHEDULED_D), "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    return "--tenant" in done.stdout


def worker_argv(
    queue: str,
    command: Sequence[str],
    *,
    tenant: str | None = None,
    concurrency: int = 16,
    lease_seconds: float = 30.0,
) -> list[str]:
    """`scheduled-d worker ... -- COMMAND` for `queue` (of `tenant`, where queues are)."""
    argv = [str(SCHEDULED_D), "worker", "--queue", queue]
    if tenant is not None and worker_accepts_tenant():
        argv += ["--tenant", tenant]
    argv += ["--concurrency", str(concurrency), "--lease-seconds", f"{lease_seconds:g}"]
    return [*argv, "--", *command]


@dataclass
class Process:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class Consumers:
    """`relays` relays, `workers` direct worker processes and `api_workers` API worker processes
    (with a `scheduled-d api` for them; the tenant's `api_token` needed) on `queue`, each
    logging to its own file."""

    url: str
    queue: str
    workers: int = 2
    command: Sequence[str] = ("/bin/true",)
    concurrency: int = 16
    tenant: str | None = None
    relays: int = 1
    logdir: Path | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    api_workers: int = 0
    api_token: str | None = None
    api_url: str | None = None  # set by start() when API workers run
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.api_workers and not self.api_token:
            raise errors.ValidationError("API workers need the tenant's token", field="api_token")
        if self.logdir is None:
            self.logdir = Path(tempfile.mkdtemp(prefix="schedctl-consumers-"))
        self.logdir.mkdir(parents=True, exist_ok=True)

    def _env(self) -> dict[str, str]:
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")},
            "SCHEDULED_DATABASE_URL": self.url,
            "SCHEDULED_LOG_LEVEL": "INFO",
            **self.extra_env,
        }

    def start(self) -> None:
        """The API first (and healthy) when API workers run, then the relay and workers."""
        if self.api_workers:
            self.api_url = self._start_api()
        planned: list[tuple[str, list[str], dict[str, str]]] = []
        for i in range(self.relays):
            name = "relay" if self.relays == 1 else f"relay-{i}"
            planned.append((name, [str(SCHEDULED_D), "relay"], self._env()))
        for i in range(self.workers):
            argv = worker_argv(
                self.queue, self.command, tenant=self.tenant, concurrency=self.concurrency
            )
            planned.append((f"worker-{i}", argv, self._env()))
        for i in range(self.api_workers):
            assert self.api_url is not None and self.api_token is not None
            argv = api_worker_argv(
                self.api_url, self.queue, self.command, concurrency=self.concurrency
            )
            env = api_worker_env(self._env(), self.api_token, SCHEDULED_LOG_LEVEL="INFO")
            planned.append((f"api-worker-{i}", argv, env))
        for name, argv, env in planned:
            self._spawn(name, argv, env)

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str]) -> Process:
        assert self.logdir is not None
        process = Process(name, argv, self.logdir / f"{name}.log")
        with process.log_path.open("ab") as log:
            process.popen = subprocess.Popen(
                argv,
                env={**env, "SCHEDULED_NODE_NAME": name},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def _start_api(self) -> str:
        """`scheduled-d api` on a free loopback port, once /healthz answers; returns its
        URL. A port taken meanwhile (the process exits) is tried again on another one."""
        for _ in range(API_PORT_TRIES):
            port = loopback_port()
            process = self._spawn("api", api_argv(port), self._env())
            url = api_url(port)
            if wait_healthy(url, API_READY_SECONDS, process.alive):
                return url
            if process.alive():
                break  # running but not healthy: a new port will not help
            self.processes.remove(process)
        self.kill()
        raise errors.SchedError(
            f"scheduled-d api did not become healthy (see the logs in {self.logdir})"
        )

    def dead(self) -> dict[str, int]:
        """Processes that exited by themselves: name -> exit code."""
        return {
            p.name: p.popen.returncode
            for p in self.processes
            if p.popen is not None and p.popen.poll() is not None
        }

    def stop(self) -> dict[str, int | None]:
        """SIGTERM, then wait (SIGKILL after STOP_SECONDS); name -> exit code (None:
        killed). The API stops last, so that the API workers settle what they hold."""
        codes: dict[str, int | None] = {}
        api = [p for p in self.processes if p.name == "api"]
        for group in ([p for p in self.processes if p not in api], api):
            for p in group:
                if p.alive():
                    assert p.popen is not None
                    p.popen.send_signal(signal.SIGTERM)
            for p in group:
                assert p.popen is not None
                codes[p.name] = children.reap(p.popen, STOP_SECONDS)
        return codes

    def kill(self) -> None:
        """SIGKILL whatever still runs (cleanup after a failure)."""
        for p in self.processes:
            if p.alive():
                assert p.popen is not None
                p.popen.kill()
                p.popen.wait(10)

    def trouble(self) -> dict[str, list[str]]:
        """Log lines of each process that show an exception escaping a loop or a thread."""
        return {p.name: trouble_in(p.log_path) for p in self.processes if trouble_in(p.log_path)}


def trouble_in(path: Path) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if TROUBLE.search(line)]
