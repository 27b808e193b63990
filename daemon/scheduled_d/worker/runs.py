"""Owns one run of the worker's command while it is supervised (`Run`: its pipes, output
tails and timers), what it executes (`RunSpec`) and what is recorded once it is over
(`Ending`, from `ending_of`)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from schedctl.domain.leasing import CANCELLED_RUNNING_ERROR, Finish, Settlement
from schedctl.domain.leasing import LeasedRun as Lease
from scheduled_d.output_log import RunOutputLog
from scheduled_d.spawn import Child

log = logging.getLogger("scheduled_d.worker")


class TailBuffer:
    """Keeps only the last `limit` bytes written to it: a chatty command cannot make the
    worker buffer unbounded output."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._data = bytearray()
        self.total = 0

    def write(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if len(chunk) >= self.limit:
            self._data = bytearray(chunk[len(chunk) - self.limit :])
            return
        self._data += chunk
        excess = len(self._data) - self.limit
        if excess > 0:
            del self._data[:excess]

    def text(self) -> str:
        return bytes(self._data).decode("utf-8", errors="replace")


@dataclass
class RunState:
    """How a supervised run ended, as the supervisor saw it."""

    returncode: int | None = None
    timed_out: bool = False
    lease_lost: bool = False
    forced: bool = False
    cancelled: bool = False  # the job was cancelled while the command ran


@dataclass(frozen=True)
class RunSpec:
    """What one run executes, when a Worker's `resolve` decides it per run (the host worker:
    from its own job files): argv, stdin bytes, variables over the clean base, the account
    (user/group/extra_groups as subprocess takes them; None: the worker's own) and the
    working directory (None: the worker's); keep_output: the output stays on this host (the
    daemon's log only: no tail in heartbeats nor in the run history); its timeout (None:
    the lease's, the central job's; 0: none) and what to call once the run is over,
    whatever its end (on_end)."""

    argv: Sequence[str]
    stdin: bytes = b""
    env: Mapping[str, str] = field(default_factory=dict)
    user: int | None = None
    group: int | None = None
    extra_groups: Sequence[int] | None = None
    workdir: str | None = None
    keep_output: bool = False
    timeout_seconds: int | None = None
    on_end: Callable[[], None] | None = None


@dataclass
class Ending:
    """A run's outcome to record, and what to log once it is (None: nothing), at `level`."""

    lease: Lease
    settlement: Settlement
    said: str | None
    level: int = logging.INFO


@dataclass
class BeatRequest:
    """A heartbeat to send: the run, its output so far when it grew (`schedctl logs
    --follow`), and how much output that was."""

    run: Run
    output_tail: str | None
    output_seen: tuple[int, int]


def failed(lease: Lease, error: str, started_at: datetime) -> Ending:
    """An attempt that failed before its command started."""
    settlement = Settlement(Finish.failed, error, None, None, started_at, datetime.now(UTC))
    return Ending(lease, settlement, None)


class Run:
    """One command being supervised: its pipes, output tails and timers.

    - tail_bytes: how much of the end of stdout and of stderr (each) is kept.
    - heartbeat_seconds: when its first heartbeat is due."""

    def __init__(
        self,
        lease: Lease,
        child: Child,
        stdin: bytes,
        started_at: datetime,
        spec: RunSpec | None = None,
        *,
        tail_bytes: int,
        heartbeat_seconds: float,
        keep_output: bool = False,
    ) -> None:
        self.lease = lease
        timeout = spec.timeout_seconds if spec is not None else None
        self.timeout_seconds = lease.timeout_seconds if timeout is None else timeout
        self._on_end = spec.on_end if spec is not None else None
        self.child = child
        self.started_at = started_at
        self.outcome = RunState()
        # output kept on the host: no tail is held, so none can be sent
        self.keep_output = keep_output
        tail_bytes = 0 if keep_output else tail_bytes
        self.stdout = TailBuffer(tail_bytes)
        self.stderr = TailBuffer(tail_bytes)
        self.sinks: dict[int, TailBuffer] = {child.stdout: self.stdout, child.stderr: self.stderr}
        self.streams = {child.stdout: "stdout", child.stderr: "stderr"}
        self.pending = memoryview(stdin)
        # each line also goes to the daemon's log, tagged with the job and the run (bounded)
        self.output_log = RunOutputLog(lease)
        begun = time.monotonic()
        self.deadline = begun + self.timeout_seconds if self.timeout_seconds > 0 else None
        self.next_heartbeat = begun + heartbeat_seconds
        self.last_confirmed = begun  # when the lease was last known to be ours
        self.output_sent = (0, 0)  # output bytes of (stdout, stderr) when a heartbeat sent it
        self.beating = False  # a heartbeat is on its way
        # after a SIGTERM (timeout, cancel, lost lease): when the group gets SIGKILL
        self.kill_at: float | None = None
        self.exited_at: float | None = None
        self.wake = begun  # when the supervisor looks at it next

    def ended(self) -> None:
        """The command is over (or abandoned): its RunSpec's on_end, once."""
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    def tail(self) -> str:
        """The output kept so far, stdout then stderr."""
        return combine_tails(self.stdout.text(), self.stderr.text())

    def feed_stdin(self) -> bool:
        """Write what the pipe takes of the rest of stdin (closed once all is written, or
        once the command shows it does not read it); whether some is still left."""
        stdin = self.child.stdin
        if stdin is None:
            return False
        if self.pending:
            try:
                written = os.write(stdin, self.pending)
            except BlockingIOError:
                return True
            except OSError:  # BrokenPipeError among them
                written = len(self.pending)  # the command does not read stdin: its right
            self.pending = self.pending[written:]
        if self.pending:
            return True
        self.child.close_stdin()
        return False


def ending_of(run: Run) -> Ending | None:
    """What is recorded for a supervised run whose command is over (None: nothing, the
    lease was lost)."""
    lease, outcome = run.lease, run.outcome
    finished_at = datetime.now(UTC)
    tail = None if run.keep_output else run.tail()
    code = outcome.returncode
    exit_code = code if code is not None and code >= 0 else None
    if outcome.cancelled and not outcome.lease_lost:
        how = f"killed by {signal_name(-code)}" if code is not None and code < 0 else (
            f"exit code {code}")  # fmt: skip
        error = f"{CANCELLED_RUNNING_ERROR} ({how})"
        settlement = Settlement(
            Finish.cancelled, error, exit_code, tail, run.started_at, finished_at
        )
        return Ending(lease, settlement, error)
    if outcome.lease_lost:
        log.warning(
            "run %s attempt %d: lease lost; the command was stopped and the run is "
            "another worker's now",
            lease.idempotency_key,
            lease.attempt,
        )
        return None
    if code == 0 and not outcome.timed_out and not outcome.forced:
        settlement = Settlement(
            Finish.succeeded, None, exit_code, tail, run.started_at, finished_at
        )
        # DEBUG: at hundreds of runs a second a line each would be the worker's biggest
        # cost but one; the run history has every outcome
        return Ending(lease, settlement, "succeeded", logging.DEBUG)
    if outcome.forced:
        error = "killed: the worker was forced to stop"
    elif outcome.timed_out:
        error = f"timed out after {run.timeout_seconds}s"
    elif code is not None and code < 0:
        error = f"killed by signal {signal_name(-code)}"
    else:
        error = f"exit code {code}"
    log.info("run %s attempt %d: failed: %s", lease.idempotency_key, lease.attempt, error)
    settlement = Settlement(Finish.failed, error, exit_code, tail, run.started_at, finished_at)
    return Ending(lease, settlement, None)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def combine_tails(stdout: str, stderr: str) -> str:
    if not stderr:
        return stdout
    if not stdout:
        return stderr
    return f"{stdout}\n--- stderr ---\n{stderr}"
