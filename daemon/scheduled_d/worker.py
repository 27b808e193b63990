"""The queue worker (the cron replacement): leases runs from one built-in queue and runs the
worker's own command once per run, with heartbeats, timeouts, output tails and retries; a
heartbeat that finds the job cancelled stops the command (SIGTERM, SIGKILL after a grace).

The command is always the one the worker was started with, never anything taken from a
message: a message only selects *when* the command runs and what it reads on stdin.

Where runs come from is a `schedctl.leasing.LeaseBackend`: `DirectBackend` over the database
(the operator worker) or `schedctl.queue_client.ApiLeaseBackend` over the REST API (the tenant
worker, `--api`, no database credentials); the supervision below is the same for both.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from queue import SimpleQueue
from typing import TYPE_CHECKING

from schedctl import errors, limits, retrying
from schedctl.config import command_env
from schedctl.leasing import CANCELLED_RUNNING_ERROR, Beat, LeaseBackend
from schedctl.leasing import LeasedRun as Lease
from schedctl.scheduling.timeparse import format_instant
from scheduled_d.direct_backend import DirectBackend
from scheduled_d.output_log import RunOutputLog

if TYPE_CHECKING:
    # the database layer is imported only by DirectBackend: `--api` workers never load it
    from schedctl.storage.store import Store

log = logging.getLogger(__name__)

READ_CHUNK = 65536
# After the command exits, how long to keep reading output that a background child of it
# may still be writing before the worker stops listening.
DRAIN_SECONDS = 2.0
# The longest the run loop sleeps between checks of the process, the clock and `force`.
TICK_SECONDS = 0.25
# The only variables of the worker's own environment that reach a command (when set): the
# rest -- SCHEDULED_DATABASE_URL, SCHEDULED_PAYLOAD_KEYS, SCHEDULED_API_TOKEN... -- never do.
INHERITED_VARIABLES = ("PATH", "LANG", "TZ", "HOME")


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
class _Outcome:
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
    working directory (None: the worker's)."""

    argv: Sequence[str]
    stdin: bytes = b""
    env: Mapping[str, str] = field(default_factory=dict)
    user: int | None = None
    group: int | None = None
    extra_groups: Sequence[int] | None = None
    workdir: str | None = None


class Worker:
    """Runs `command` once per message of `queue`, up to `concurrency` at a time.

    - store: the Store to lease from (Postgres or SQLite), or a LeaseBackend (e.g. the REST
      API's, schedctl.queue_client.ApiLeaseBackend, whose token names the tenant).
    - queue: the built-in queue this worker consumes, of tenant `tenant`.
    - tenant: with a Store, the queue's tenant (name or id); may be left out while only one
      tenant exists (ConfigError otherwise).
    - command: argv of the command to run (e.g. ["/usr/local/bin/backup.sh"]); it gets
      SCHED_JOB_ID, SCHED_SCHEDULED_AT, SCHED_ATTEMPT, SCHED_IDEMPOTENCY_KEY in its
      environment and the job's payload JSON on stdin.
    - concurrency: commands running at once (each job's max_concurrency still applies).
    - lease_seconds: visibility timeout of a lease; heartbeat_seconds must be shorter.
    - poll_seconds: how long to wait between polls when the queue is empty.
    - owner: this worker's lease owner name (default: host:pid:random).
    - output_tail_bytes: how much of the end of stdout and of stderr (each) is kept in the
      run history ([[worker]] output_bytes; at most limits.MAX_OUTPUT_BYTES).
    - kill_grace_seconds: after SIGTERM (timeout, cancel, lost lease), when SIGKILL follows;
      both go to the command's whole process group, even once the command has exited.
    - reap_seconds: how often to settle expired leases of any queue (default lease/2).
    - env: variables added to the command's environment ([worker.env], --env); the rest of
      it is PATH, LANG, TZ and HOME of the worker and the SCHED_* run variables, nothing
      else of the worker's own environment.
    - resolve: instead of `command`, what each run executes (RunSpec), decided when it
      starts; a SchedError it raises fails the attempt with its message, running nothing.
    """

    def __init__(
        self,
        store: Store | LeaseBackend,
        queue: str,
        command: Sequence[str],
        *,
        concurrency: int = 1,
        lease_seconds: float = 30.0,
        heartbeat_seconds: float = 5.0,
        poll_seconds: float = 0.5,
        owner: str | None = None,
        output_tail_bytes: int = limits.DEFAULT_OUTPUT_BYTES,
        kill_grace_seconds: float = 5.0,
        reap_seconds: float | None = None,
        env: Mapping[str, str] | None = None,
        tenant: str | None = None,
        alert_command: Sequence[str] = (),
        resolve: Callable[[Lease], RunSpec] | None = None,
    ) -> None:
        if not command and resolve is None:
            raise errors.ConfigError("the worker needs a command to run", field="command")
        if concurrency < 1:
            raise errors.ConfigError("must be at least 1", field="concurrency")
        if lease_seconds <= 0 or heartbeat_seconds <= 0:
            raise errors.ConfigError("lease and heartbeat times must be positive")
        if heartbeat_seconds >= lease_seconds:
            raise errors.ConfigError(
                f"heartbeat ({heartbeat_seconds} s) must be shorter than the lease "
                f"({lease_seconds} s)",
                field="heartbeat_seconds",
            )
        if not 0 <= output_tail_bytes <= limits.MAX_OUTPUT_BYTES:
            raise errors.ConfigError(
                f"must be from 0 to {limits.MAX_OUTPUT_BYTES}", field="output_tail_bytes"
            )
        self.backend: LeaseBackend = (
            store if isinstance(store, LeaseBackend) else DirectBackend(store, tenant)
        )
        self.queue = queue
        self.command = list(command)
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.poll_seconds = poll_seconds
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.output_tail_bytes = output_tail_bytes
        self.kill_grace_seconds = kill_grace_seconds
        self.env = dict(command_env(env or {}, "env"))
        self.reap_seconds = reap_seconds if reap_seconds is not None else max(lease_seconds / 2, 1)
        self._force = threading.Event()
        self._slot_freed = threading.Event()
        self._lock = threading.Lock()
        # Run threads are kept and reused: starting a thread per run waits for the new
        # thread to get the interpreter lock, which under load cost more than the run.
        self._runs: SimpleQueue[Lease | None] = SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle_threads = 0  # threads waiting for a run (and not promised one)
        # runs leased and not yet recorded: what `concurrency` bounds, so that a worker
        # killed -9 leaves at most `concurrency` runs to be redelivered
        self._in_flight = 0
        self._sequence = 0
        self._unavailable = False
        self.store_errors = 0  # backend calls of the lease loop that found it unavailable
        # the host's alert command (OnFailure=-like), run for this queue's command alerts
        self.alert_command = list(alert_command)
        self.resolve = resolve

    # -- the loop ----------------------------------------------------------------------------

    @property
    def tenant_id(self) -> str | None:
        """The tenant whose queue this worker serves (None over the API: the token names it)."""
        tenant_id = getattr(self.backend, "tenant_id", None)
        return tenant_id if isinstance(tenant_id, str) else None

    def run(
        self,
        stop: threading.Event,
        *,
        max_runs: int | None = None,
        idle_exit: bool = False,
        force: threading.Event | None = None,
    ) -> int:
        """Lease and run until `stop` is set, then finish the runs in flight (warm shutdown)
        and return the number of runs taken. Setting `force` kills the commands in flight
        (their attempt is recorded as failed and retried per policy) and returns.

        - max_runs: stop taking leases after this many (then finish them and return).
        - idle_exit: return as soon as nothing is ready and nothing is running (delayed
          retries do not count as ready).
        """
        self._force = force if force is not None else threading.Event()
        taken = 0
        next_reap = 0.0
        backoff = retrying.Backoff(retrying.STORE_UNAVAILABLE)
        log.info(
            "worker %s: tenant %s, queue %r, concurrency %d, command %s",
            self.owner,
            self.tenant_id or "of the API token",
            self.queue,
            self.concurrency,
            self.command[0] if self.command else "of the job files",
        )
        try:
            while not stop.is_set() and not self._force.is_set():
                if max_runs is not None and taken >= max_runs:
                    break
                self._slot_freed.clear()
                if time.monotonic() >= next_reap:
                    self._reap()
                    next_reap = time.monotonic() + self.reap_seconds
                free = self.concurrency - self._active_count()
                leases: Sequence[Lease] = ()
                if free > 0:
                    want = free if max_runs is None else min(free, max_runs - taken)
                    try:
                        leases = self.backend.lease(
                            self.queue, self.owner, self.lease_seconds, want
                        )
                    except errors.StoreUnavailable as exc:
                        self._store_down("cannot lease", exc)
                        backoff.wait(stop)
                        continue
                    self._store_up()
                    backoff.reset()
                    for lease in leases:
                        self._start(lease)
                    taken += len(leases)
                if leases:
                    continue  # more may be ready: ask again before sleeping
                self._alerts()
                if idle_exit and self._active_count() == 0:
                    break
                self._slot_freed.wait(self.poll_seconds)
        finally:
            # even when the loop fails, the commands in flight finish and get recorded
            self._drain()
        log.info("worker %s: stopped after %d run(s)", self.owner, taken)
        return taken

    def _alerts(self) -> None:
        """Run the alert command for this queue's due command alerts (database workers
        only: an API worker has no alert lane)."""
        if not self.alert_command or not isinstance(self.backend, DirectBackend):
            return
        from schedctl.alerts.command import run_alert_commands  # database workers only

        try:
            run_alert_commands(
                self.backend.store,
                tenant_id=self.backend.tenant_id,
                queue=self.queue,
                command=self.alert_command,
                owner=self.owner,
            )
        except errors.StoreUnavailable as exc:
            self._store_down("cannot read alerts", exc)

    def _store_down(self, what: str, exc: errors.StoreUnavailable) -> None:
        self.store_errors += 1
        if not self._unavailable:
            # once per outage: a worker polling a dead database must not flood the log
            log.warning("worker %s: %s: %s; retrying", self.owner, what, exc)
        self._unavailable = True

    def _store_up(self) -> None:
        if self._unavailable:
            log.info("worker %s: the queue is reachable again", self.owner)
        self._unavailable = False

    def _active_count(self) -> int:
        with self._lock:
            return self._in_flight

    def _start(self, lease: Lease) -> None:
        with self._lock:
            self._in_flight += 1
            if self._idle_threads > 0:
                self._idle_threads -= 1  # promised this run: it takes one from the queue
                thread = None
            else:
                self._sequence += 1
                thread = threading.Thread(
                    target=self._serve,
                    name=f"worker-{self.queue}-{self._sequence}",
                    daemon=True,
                )
                self._threads.append(thread)
        self._runs.put(lease)
        if thread is not None:
            thread.start()

    def _serve(self) -> None:
        """One run thread: runs what it is handed until told to stop (None)."""
        while True:
            lease = self._runs.get()
            if lease is None:
                return
            self._run_one(lease)
            with self._lock:
                self._idle_threads += 1

    def _drain(self) -> None:
        """Wait for the runs in flight (each run watches `force` itself), then end the run
        threads."""
        while True:
            with self._lock:
                if self._in_flight == 0:
                    threads, self._threads = self._threads, []
                    self._idle_threads = 0
                    break
            self._slot_freed.wait(TICK_SECONDS)
            self._slot_freed.clear()
        for _ in threads:
            self._runs.put(None)
        for thread in threads:
            thread.join(TICK_SECONDS * 40)

    def _reap(self) -> None:
        try:
            settled = self.backend.reap()
        except errors.StoreUnavailable as exc:
            self._store_down("cannot reap expired leases", exc)
            return
        if settled:
            log.info("worker %s: settled %d expired lease(s)", self.owner, settled)

    # -- one run -----------------------------------------------------------------------------

    def _run_one(self, lease: Lease) -> None:
        try:
            self._execute(lease)
        except Exception:
            # the lease expires and the reaper redelivers the run: nothing is lost
            log.exception("worker %s: run of job %s failed unexpectedly", self.owner, lease.job_id)
        finally:
            with self._lock:
                self._in_flight -= 1
            self._slot_freed.set()

    def _environment(self, lease: Lease, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Built, not inherited: a few harmless variables of the worker, then the configured
        ones (and the run's RunSpec's), then the run's own."""
        env = {name: os.environ[name] for name in INHERITED_VARIABLES if name in os.environ}
        env.update(self.env)
        env.update(extra or {})
        env.update(
            SCHED_JOB_ID=lease.job_id,
            SCHED_SCHEDULED_AT=format_instant(lease.scheduled_at),
            SCHED_ATTEMPT=str(lease.attempt),
            SCHED_IDEMPOTENCY_KEY=lease.idempotency_key,
        )
        return env

    def _execute(self, lease: Lease) -> None:
        log.info(
            "run %s attempt %d: starting (job %s)",
            lease.idempotency_key,
            lease.attempt,
            lease.job_id,
        )
        started_at = datetime.now(UTC)
        spec = RunSpec(self.command, json.dumps(lease.payload).encode())
        if self.resolve is not None:
            try:
                spec = self.resolve(lease)
            except errors.SchedError as exc:
                log.warning("run %s attempt %d: not run: %s", lease.idempotency_key,
                            lease.attempt, exc)  # fmt: skip
                self._settle_failure(
                    lease, error=str(exc), exit_code=None, output_tail=None, started_at=started_at
                )
                return
        try:
            process = subprocess.Popen(
                spec.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # its own process group: a timeout or lost lease kills the command and
                # everything it started, and the worker's own signals do not reach it
                start_new_session=True,
                env=self._environment(lease, spec.env),
                cwd=spec.workdir,
                user=spec.user,
                group=spec.group,
                extra_groups=spec.extra_groups,
            )
        except OSError as exc:
            self._settle_failure(
                lease,
                error=f"cannot start the command: {exc}",
                exit_code=None,
                output_tail=None,
                started_at=started_at,
            )
            return
        stdout, stderr = TailBuffer(self.output_tail_bytes), TailBuffer(self.output_tail_bytes)
        outcome = self._supervise(lease, process, spec.stdin, stdout, stderr)
        finished_at = datetime.now(UTC)
        tail = _combine_tails(stdout.text(), stderr.text())
        if outcome.cancelled and not outcome.lease_lost:
            self._settle_cancelled(lease, outcome, tail, started_at, finished_at)
            return
        if outcome.lease_lost:
            log.warning(
                "run %s attempt %d: lease lost; the command was stopped and the run is "
                "another worker's now",
                lease.idempotency_key,
                lease.attempt,
            )
            return
        code = outcome.returncode
        exit_code = code if code is not None and code >= 0 else None
        if code == 0 and not outcome.timed_out and not outcome.forced:
            self._settle_success(lease, tail, started_at, finished_at)
            return
        if outcome.forced:
            error = "killed: the worker was forced to stop"
        elif outcome.timed_out:
            error = f"timed out after {lease.timeout_seconds}s"
        elif code is not None and code < 0:
            error = f"killed by signal {_signal_name(-code)}"
        else:
            error = f"exit code {code}"
        log.info("run %s attempt %d: failed: %s", lease.idempotency_key, lease.attempt, error)
        self._settle_failure(
            lease,
            error=error,
            exit_code=exit_code,
            output_tail=tail,
            started_at=started_at,
            finished_at=finished_at,
        )

    def _supervise(
        self,
        lease: Lease,
        process: subprocess.Popen[bytes],
        stdin_data: bytes,
        stdout: TailBuffer,
        stderr: TailBuffer,
    ) -> _Outcome:
        """Feed stdin, collect output tails, heartbeat, enforce the timeout; returns when
        the command has exited (and its output is drained) or had to be killed."""
        assert process.stdin and process.stdout and process.stderr
        outcome = _Outcome()
        selector = selectors.DefaultSelector()
        sinks: dict[int, TailBuffer] = {
            process.stdout.fileno(): stdout,
            process.stderr.fileno(): stderr,
        }
        pending = memoryview(stdin_data)
        stdin_fd = process.stdin.fileno()
        # non-blocking pipes in one selector: a command that never reads stdin, or writes
        # megabytes, can block neither the heartbeat nor the timeout
        for fd in (*sinks, stdin_fd):
            os.set_blocking(fd, False)
        for fd in sinks:
            selector.register(fd, selectors.EVENT_READ)
        # each line also goes to the daemon's log, tagged with the job and the run (bounded)
        output_log = RunOutputLog(lease)
        streams = {process.stdout.fileno(): "stdout", process.stderr.fileno(): "stderr"}

        def on_output(fd: int, chunk: bytes) -> None:
            output_log.feed(streams[fd], chunk)

        if pending:
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            process.stdin.close()

        begun = time.monotonic()
        deadline = begun + lease.timeout_seconds if lease.timeout_seconds > 0 else None
        next_heartbeat = begun + self.heartbeat_seconds
        last_confirmed = begun  # when the lease was last known to be ours
        output_sent = (0, 0)  # output bytes of (stdout, stderr) when a heartbeat last sent it
        # after a SIGTERM (timeout, cancel, lost lease): when the group gets SIGKILL
        kill_at: float | None = None
        exited_at: float | None = None

        def terminate(now: float) -> None:
            # SIGTERM to the whole group now, SIGKILL to it after the grace period (an
            # earlier pending SIGKILL is not postponed)
            nonlocal kill_at
            _kill_group(process, signal.SIGTERM)
            grace_end = now + self.kill_grace_seconds
            kill_at = grace_end if kill_at is None else min(kill_at, grace_end)

        try:
            while True:
                now = time.monotonic()
                running = process.poll() is None
                if not running and exited_at is None:
                    exited_at = now
                if (
                    exited_at is not None
                    and kill_at is None
                    and (not sinks or now - exited_at >= DRAIN_SECONDS)
                ):
                    # a background child still holding the output pipes does not hold up
                    # the run: after DRAIN_SECONDS the worker stops listening
                    break
                if kill_at is not None and (
                    now >= kill_at
                    or self._force.is_set()
                    or (not running and not _group_alive(process))
                ):
                    # after a SIGTERM the group always gets SIGKILL, whether or not its
                    # leader is still there: a child that ignores SIGTERM and outlives the
                    # leader must not overlap the next attempt. (Once nothing of the group
                    # is left the SIGKILL finds nothing, and the grace is not waited out.)
                    _kill_group(process, signal.SIGKILL)
                    kill_at = None
                if running:
                    if self._force.is_set() and not outcome.forced:
                        outcome.forced = True
                        _kill_group(process, signal.SIGKILL)
                        kill_at = None
                    elif deadline is not None and now >= deadline and not outcome.timed_out:
                        outcome.timed_out = True
                        log.warning(
                            "run %s attempt %d: timed out after %ss; terminating",
                            lease.idempotency_key,
                            lease.attempt,
                            lease.timeout_seconds,
                        )
                        terminate(now)
                # also while draining the output of an exited command: the outcome is not
                # recorded yet, and the lease must still be ours when it is
                if now >= next_heartbeat and not outcome.lease_lost:
                    next_heartbeat = now + self.heartbeat_seconds
                    # the output so far rides along when it grew (`schedctl logs --follow`)
                    output_seen = (stdout.total, stderr.total)
                    grown = output_seen != output_sent
                    beat = self._heartbeat(
                        lease, _combine_tails(stdout.text(), stderr.text()) if grown else None
                    )
                    if beat is not None:  # else the next heartbeat sends it again
                        output_sent = output_seen
                    if beat is Beat.extended or beat is Beat.cancelled:
                        last_confirmed = now
                    if beat is Beat.cancelled and not outcome.cancelled and exited_at is None:
                        # the cancel reaches running work: SIGTERM now, SIGKILL after the
                        # grace period
                        outcome.cancelled = True
                        log.warning(
                            "run %s attempt %d: job cancelled; terminating the command",
                            lease.idempotency_key,
                            lease.attempt,
                        )
                        terminate(time.monotonic())
                    # unconfirmed for a whole lease: the reaper may have handed the run to
                    # another worker, and two copies must not run at once (nor anything
                    # left of this one: the group is terminated even if the leader is gone)
                    if beat is Beat.lost or now - last_confirmed >= self.lease_seconds:
                        outcome.lease_lost = True
                        terminate(time.monotonic())

                # only the events still ahead: a passed deadline must not make this spin
                wake = [now + TICK_SECONDS]
                if not outcome.lease_lost:
                    wake.append(next_heartbeat)
                if deadline is not None and not outcome.timed_out and exited_at is None:
                    wake.append(deadline)
                if kill_at is not None:
                    wake.append(kill_at)
                timeout = max(0.0, min(wake) - time.monotonic())
                if selector.get_map():
                    for key, _events in selector.select(timeout):
                        pending = self._pump(key.fd, selector, sinks, process, pending, on_output)
                elif exited_at is None:
                    try:
                        process.wait(timeout)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    # the leader is gone and the group awaits its SIGKILL
                    self._force.wait(timeout)
        finally:
            output_log.close()
            selector.close()
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None and not stream.closed:
                    stream.close()
            if process.poll() is None or kill_at is not None:
                # only an exception gets here with the command alive or its SIGKILL still
                # pending: never leave it orphaned
                _kill_group(process, signal.SIGKILL)
            outcome.returncode = process.wait()
        return outcome

    def _heartbeat(self, lease: Lease, output_tail: str | None = None) -> Beat | None:
        """Extend the lease and learn whether the job was cancelled; None when the
        backend could not say. `output_tail`: the output so far, when it grew."""
        try:
            return self.backend.beat(lease, self.lease_seconds, output_tail)
        except errors.StoreUnavailable as exc:
            log.warning("run %s: heartbeat failed: %s", lease.idempotency_key, exc)
            return None

    @staticmethod
    def _pump(
        fd: int,
        selector: selectors.BaseSelector,
        sinks: dict[int, TailBuffer],
        process: subprocess.Popen[bytes],
        pending: memoryview,
        on_output: Callable[[int, bytes], None] | None = None,
    ) -> memoryview:
        """Move bytes for one ready pipe; returns what is left to write to stdin. Output
        read also goes to `on_output(fd, chunk)` (the daemon log's copy)."""
        if fd in sinks:
            try:
                chunk = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return pending
            if chunk:
                sinks[fd].write(chunk)
                if on_output is not None:
                    on_output(fd, chunk)
            else:
                selector.unregister(fd)
                del sinks[fd]
            return pending
        assert process.stdin is not None
        try:
            written = os.write(fd, pending)
        except BlockingIOError:
            return pending
        except (BrokenPipeError, OSError):
            written = len(pending)  # the command does not read stdin: that is its right
        pending = pending[written:]
        if not pending:
            selector.unregister(fd)
            process.stdin.close()
        return pending

    # -- recording outcomes ------------------------------------------------------------------

    def _settle_success(
        self, lease: Lease, tail: str, started_at: datetime, finished_at: datetime
    ) -> None:
        def ack() -> bool:
            return self.backend.ack(
                lease,
                exit_code=0,
                output_tail=tail,
                started_at=started_at,
                finished_at=finished_at,
            )

        if self._record(lease, ack):
            log.info("run %s attempt %d: succeeded", lease.idempotency_key, lease.attempt)

    def _settle_failure(
        self,
        lease: Lease,
        *,
        error: str,
        exit_code: int | None,
        output_tail: str | None,
        started_at: datetime,
        finished_at: datetime | None = None,
    ) -> None:
        finished = finished_at or datetime.now(UTC)

        def fail() -> bool:
            return self.backend.fail(
                lease,
                error=error,
                exit_code=exit_code,
                output_tail=output_tail,
                started_at=started_at,
                finished_at=finished,
            )

        self._record(lease, fail)

    def _settle_cancelled(
        self,
        lease: Lease,
        outcome: _Outcome,
        tail: str,
        started_at: datetime,
        finished_at: datetime,
    ) -> None:
        code = outcome.returncode
        how = (
            f"killed by {_signal_name(-code)}"
            if code is not None and code < 0
            else (f"exit code {code}")
        )
        error = f"{CANCELLED_RUNNING_ERROR} ({how})"

        def stop() -> bool:
            return self.backend.stop_cancelled(
                lease,
                exit_code=code if code is not None and code >= 0 else None,
                output_tail=tail,
                started_at=started_at,
                finished_at=finished_at,
                error=error,
            )

        if self._record(lease, stop):
            log.info("run %s attempt %d: %s", lease.idempotency_key, lease.attempt, error)

    def _record(self, lease: Lease, action: Callable[[], bool]) -> bool:
        """Store an outcome, retrying while the backend is away; after a whole lease of
        retries the run belongs to the reaper (it will be redelivered: at least once)."""
        try:
            recorded = retrying.call_with_retries(
                action,
                policy=retrying.STORE_UNAVAILABLE,
                retry_on=errors.StoreUnavailable,
                give_up_after=max(self.lease_seconds, 10.0),
                stop=self._force,
                on_retry=lambda exc: log.warning(
                    "run %s: recording the outcome failed: %s; retrying",
                    lease.idempotency_key,
                    exc,
                ),
            )
        except errors.StoreUnavailable as exc:
            log.error(
                "run %s attempt %d: could not record the outcome: %s; the run "
                "will be redelivered after its lease expires",
                lease.idempotency_key,
                lease.attempt,
                exc,
            )
            return False
        if not recorded:
            log.warning(
                "run %s attempt %d: finished after its lease was lost; outcome not recorded",
                lease.idempotency_key,
                lease.attempt,
            )
        return recorded


def _kill_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the command's whole process group, the leader's children included, even when
    the leader itself has exited (the group lives on as long as any member does)."""
    try:
        # start_new_session made the command a group leader: its pid is the group id, and
        # the kernel does not hand that number out again while any member of the group lives
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already (or beyond the worker's reach)


def _group_alive(process: subprocess.Popen[bytes]) -> bool:
    """Whether anything of the command's process group is left (zombies included)."""
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a member the worker cannot signal: still there
    return True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _combine_tails(stdout: str, stderr: str) -> str:
    if not stderr:
        return stdout
    if not stdout:
        return stderr
    return f"{stdout}\n--- stderr ---\n{stderr}"


def run_api_worker(
    api_url: str,
    token: str,
    queue: str,
    command: Sequence[str],
    *,
    concurrency: int,
    lease_seconds: float,
    max_runs: int | None,
    env: Mapping[str, str] | None = None,
    output_bytes: int = limits.DEFAULT_OUTPUT_BYTES,
) -> None:
    """The tenant worker (`scheduled-d worker --api URL`): leases, heartbeats and settles
    through the REST API with the tenant's token; no database, no database code."""
    from schedctl.queue_client import ApiLeaseBackend
    from scheduled_d.signals import stop_on_signals

    heartbeat = min(5.0, lease_seconds / 3)
    backend = ApiLeaseBackend(
        api_url,
        token,
        timeout=max(1.0, min(10.0, lease_seconds / 3)),
        connections=concurrency,
    )
    try:
        with stop_on_signals() as (stop, force):
            worker = Worker(
                backend,
                queue,
                command,
                concurrency=concurrency,
                lease_seconds=lease_seconds,
                heartbeat_seconds=heartbeat,
                env=env,
                output_tail_bytes=output_bytes,
            )
            worker.run(stop, max_runs=max_runs, force=force)
    finally:
        backend.close()
