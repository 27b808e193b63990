"""Owns the server processes of the test harness: start one in its own session with its
output in a log file, wait for it with a bounded readiness probe (every probe with its own
timeout: a probe of a server still starting can hang, ZOOKEEPER-5051), stop or kill it by
PID, helpers included, and put its log tail into every failure.

Postgres, ZooKeeper and RabbitMQ each say how to start and how to ask "ready?"; the
waiting, the stopping and the failure reports are the same for all and live here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self, TypeVar

from tests.services.ports import ServiceError, child_pids, pid_alive, tail

T = TypeVar("T")

LOG_TAIL_LINES = 40
_REAP_SECONDS = 15.0
_POLL_SECONDS = 0.01
# helpers of helpers (beam -> erl_child_setup -> inet_gethost): deep enough for every server
_DESCENDANT_DEPTH = 4


def failure(message: str, logs: Mapping[str, str]) -> ServiceError:
    """A ServiceError whose message ends with the tails of the given logs (title -> text)."""
    sections = "".join(f"\n--- {title} ---\n{text}" for title, text in logs.items())
    return ServiceError(message + sections)


def poll_ready(
    probe: Callable[[float], T | None],
    *,
    what: str,
    timeout: float,
    probe_timeout: float,
    interval: float = 0.1,
    check_alive: Callable[[], None] = lambda: None,
    logs: Callable[[], Mapping[str, str]] = dict,
) -> T:
    """The first answer of `probe` that is not None, polling every `interval` s.

    Each probe gets at most `probe_timeout` s (it must honour it); `check_alive` raises if
    the server died meanwhile. After `timeout` s: a ServiceError with the logs attached.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    for _ in range(int(timeout / max(interval, 0.001)) + 10):
        check_alive()
        remaining = deadline - time.monotonic()
        last = probe(max(0.05, min(probe_timeout, remaining)))
        if last is not None:
            return last
        if time.monotonic() > deadline:
            break
        time.sleep(interval)
    raise failure(f"{what} not ready after {timeout:g} s", logs())


def kill_and_reap(pids: Iterable[int], timeout: float = _REAP_SECONDS) -> None:
    """SIGKILL every PID and return once none of them is alive (zombies count as gone)."""
    victims = list(pids)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / _POLL_SECONDS) + 1):
        if not any(pid_alive(pid) for pid in victims):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(_POLL_SECONDS)
    raise ServiceError(f"processes {victims} survived SIGKILL")


def descendants(pid: int, depth: int = _DESCENDANT_DEPTH) -> list[int]:
    """The PIDs below `pid` (children, their children...), `depth` levels down."""
    found: list[int] = []
    frontier = [pid]
    for _ in range(depth):
        frontier = [child for parent in frontier for child in child_pids(parent)]
        found.extend(frontier)
    return found


class ServerProcess:
    """One server command run in its own session (so its group can be signalled) with
    stdout and stderr appended to `log_path`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        cwd: Path | str = "/",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.env = dict(env) if env is not None else None
        self._popen: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"ServerProcess({self.name!r}, pid={self.pid})"

    def start(self, banner: str | None = None) -> None:
        """Start the command (no-op while it runs); does not wait for it to serve."""
        if self.is_running():
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            if banner:
                log.write(f"\n===== {banner} =====\n".encode())
                log.flush()
            self._popen = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def is_running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    @property
    def pid(self) -> int | None:
        """The PID while the process runs."""
        return self._popen.pid if self.is_running() and self._popen is not None else None

    def check_alive(self) -> None:
        """ServiceError with the log tail if the process is not running."""
        if self._popen is None:
            raise ServiceError(f"{self.name} is not started")
        code = self._popen.poll()
        if code is not None:
            self._popen = None
            raise failure(f"{self.name} exited with code {code}", self.logs())

    def stop(self, timeout: float, *, whole_tree: bool = False) -> None:
        """SIGTERM the process (a server shuts its own helpers down), wait up to `timeout`
        s, then SIGKILL its group, and with `whole_tree` every helper still left."""
        popen = self._popen
        if popen is None:
            return
        if popen.poll() is None:
            tree = descendants(popen.pid) if whole_tree else []
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(popen, signal.SIGKILL)
                popen.wait(timeout=_REAP_SECONDS)
            if tree:
                kill_and_reap(tree)
        self._popen = None

    def kill(self, *, whole_tree: bool = False) -> None:
        """SIGKILL the process group (a crash) and reap it."""
        popen = self._popen
        if popen is None:
            return
        if popen.poll() is None:
            tree = descendants(popen.pid) if whole_tree else []
            self._signal_group(popen, signal.SIGKILL)
            popen.wait(timeout=_REAP_SECONDS)
            if tree:
                kill_and_reap(tree)
        self._popen = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return tail(self.log_path, lines)

    def logs(self, lines: int = LOG_TAIL_LINES) -> dict[str, str]:
        """Its log tail, titled, for failure reports."""
        return {f"{self.name} log ({self.log_path})": self.log_tail(lines)}

    @staticmethod
    def _signal_group(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        try:
            os.killpg(popen.pid, sig)  # its own group: start_new_session=True
        except ProcessLookupError:
            pass
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(sig)


class Service:
    """A test server used as a context manager: started on entering the block, stopped and
    deleted on leaving it. Subclasses define ``start()`` and ``cleanup()``."""

    def start(self) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


def run_until_enter(
    service: contextlib.AbstractContextManager[object], describe: Callable[[], str]
) -> int:
    """``python -m tests.services.X``: run the service until Enter is pressed, then delete it."""
    with service:
        print(describe(), flush=True)
        with contextlib.suppress(EOFError, KeyboardInterrupt):
            input("press Enter to stop and delete it ")
    return 0


class ServerAtUrl(contextlib.AbstractContextManager[object], Protocol):
    """A single test server that says where it listens and where its files are."""

    base_dir: Path

    def url(self) -> str: ...


def serve_until_enter(name: str, server: ServerAtUrl) -> int:
    """``python -m tests.services.NAME`` of one server: run_until_enter, saying its URL."""
    return run_until_enter(
        server, lambda: f"{name} running: {server.url()}  (dir {server.base_dir})"
    )
