"""Queue consumers for benchmarks, soak and chaos runs: a `scheduled-d relay` and
`scheduled-d worker --queue Q -- CMD` processes (direct workers, with database access),
so that runs are really leased, executed and acknowledged while the load or the faults
happen.

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

SCHEDULED_D = Path(sys.executable).parent / "scheduled-d"
STOP_SECONDS = 60.0
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
    """A relay and `workers` worker processes on `queue`, each logging to its own file."""

    url: str
    queue: str
    workers: int = 2
    command: Sequence[str] = ("/bin/true",)
    concurrency: int = 16
    tenant: str | None = None
    relay: bool = True
    logdir: Path | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
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
        assert self.logdir is not None
        planned: list[tuple[str, list[str]]] = []
        if self.relay:
            planned.append(("relay", [str(SCHEDULED_D), "relay"]))
        for i in range(self.workers):
            argv = worker_argv(
                self.queue, self.command, tenant=self.tenant, concurrency=self.concurrency
            )
            planned.append((f"worker-{i}", argv))
        for name, argv in planned:
            process = Process(name, argv, self.logdir / f"{name}.log")
            with process.log_path.open("ab") as log:
                process.popen = subprocess.Popen(
                    argv,
                    env={**self._env(), "SCHEDULED_NODE_NAME": name},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.processes.append(process)

    def dead(self) -> dict[str, int]:
        """Processes that exited by themselves: name -> exit code."""
        return {
            p.name: p.popen.returncode
            for p in self.processes
            if p.popen is not None and p.popen.poll() is not None
        }

    def stop(self) -> dict[str, int | None]:
        """SIGTERM, then wait (SIGKILL after STOP_SECONDS); name -> exit code (None:
        killed)."""
        for p in self.processes:
            if p.alive():
                assert p.popen is not None
                p.popen.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for p in self.processes:
            assert p.popen is not None
            try:
                codes[p.name] = p.popen.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(10)
                codes[p.name] = None
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
