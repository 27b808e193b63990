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

import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from schedctl import errors, limits, retrying
from schedctl.config import command_env
from schedctl.leasing import CANCELLED_RUNNING_ERROR, Beat, Finish, LeaseBackend, Settlement
from schedctl.leasing import LeasedRun as Lease
from schedctl.scheduling.timeparse import format_instant
from scheduled_d.cgroups import containment
from scheduled_d.direct_backend import DirectBackend
from scheduled_d.output_log import RunOutputLog
from scheduled_d.ready import ReadyListener
from scheduled_d.spawn import Child, spawn

if TYPE_CHECKING:
    # the database layer is imported only by DirectBackend: `--api` workers never load it
    from schedctl.alerts.command import AlertCommand
    from schedctl.storage.db.store import Store
    from schedctl.storage.records.alerts import AlertRow

log = logging.getLogger(__name__)

READ_CHUNK = 65536
# After the command exits, how long to keep reading output that a background child of it
# may still be writing before the worker stops listening.
DRAIN_SECONDS = 2.0
# The longest the supervisor sleeps between looks at `force` (and at a group awaiting its
# SIGKILL whose leader is gone).
TICK_SECONDS = 0.25
# Without pidfds (an old kernel), how often a running command is asked whether it exited.
POLL_EXIT_SECONDS = 0.01
# The lease loop leases once concurrency / LEASE_BATCH_DIVISOR slots are free, or
# LEASE_LINGER_SECONDS after the first one freed: one lease statement serves several runs.
LEASE_BATCH_DIVISOR = 4
LEASE_LINGER_SECONDS = 0.02
# The settling thread waits up to SETTLE_LINGER_SECONDS for concurrency /
# SETTLE_GATHER_DIVISOR outcomes to record together (fewer, fuller transactions).
SETTLE_GATHER_DIVISOR = 4
SETTLE_LINGER_SECONDS = 0.01
# Outcomes waiting to be recorded beyond the running commands: concurrency / this (at least
# one). When recording falls behind (a slow or absent database), leasing waits for it.
RECORD_BACKLOG_DIVISOR = 2
# Threads starting commands side by side (at most; no more than concurrency).
SPAWN_THREADS = 16
# Outcomes recorded (or leases extended) in one backend call at most.
MAX_BATCH = 500
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
    - concurrency: runs leased and not yet recorded at once, so commands running at once
      (each job's max_concurrency still applies).
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
    - alert_command: the host's command run (alert JSON on stdin) for each command alert of
      this queue's jobs ([[worker]] alert_command); database workers only.
    - alert_command_for: instead of (or before) `alert_command`, the host's command for each
      alert, looked up per alert (the host worker: the alert_command of the job file's job);
      None, or a SchedError it raises, when the host has none: the alert fails with why.
    - alert_lane: instead of those (database workers), what runs this queue's due command
      alerts when the worker is idle (the host worker over the API).

    Three threads besides the lease loop (the caller's): one supervises every command
    (one selector over all their pipes and exits, and their timers), one records outcomes
    (all that ended together, in one backend call: `settle_many`) and one extends leases
    (all that are due together: `beat_many`). No thread per run, and nothing in the
    supervising thread waits for the backend.
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
        alert_command_for: Callable[[AlertRow], Sequence[str] | AlertCommand | None] | None = None,
        alert_lane: Callable[[], object] | None = None,
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
        # runs leased whose command has not ended (or not started yet): what `concurrency`
        # bounds. A slot frees when its command ends, not when the outcome is recorded: the
        # record waits for a batch and a transaction (about half of a slot's cycle running
        # /bin/true), and the command's slot need not.
        self._in_flight = 0
        # outcomes handed to the settler and not recorded yet: at most `_record_backlog`, so
        # a worker killed -9 leaves at most concurrency + that many runs to be redelivered
        self._unrecorded = 0
        self._record_backlog = max(1, concurrency // RECORD_BACKLOG_DIVISOR)
        self._unavailable = False
        self.store_errors = 0  # backend calls of the lease loop that found it unavailable
        # the host's alert command (OnFailure=-like), run for this queue's command alerts
        self.alert_command = list(alert_command)
        self.alert_command_for = alert_command_for
        self.alert_lane = alert_lane
        self.resolve = resolve
        self._supervisor: _Supervisor | None = None
        self._spawners: _Spawners | None = None
        self._listener: ReadyListener | None = None
        self._settler: _Batcher[_Ending] | None = None
        self._beater: _Batcher[_BeatRequest] | None = None
        # the base of every command's environment, read once
        self._base_env = {
            name: os.environ[name] for name in INHERITED_VARIABLES if name in os.environ
        }
        self._base_env.update(self.env)
        # each run in a cgroup of its own, or the process group only (said once, at start)
        self._containment = containment()

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
        self._settler = _Batcher(
            self._record_endings,
            f"worker-{self.queue}-settle",
            gather=max(1, self.concurrency // SETTLE_GATHER_DIVISOR),
            linger=SETTLE_LINGER_SECONDS,
        )
        self._beater = _Batcher(self._beat_runs, f"worker-{self.queue}-beat")
        self._supervisor = _Supervisor(self)
        self._spawners = _Spawners(self, min(self.concurrency, SPAWN_THREADS))
        feed = self.backend.ready_feed(self.queue)
        if feed is not None:
            self._listener = ReadyListener(feed, self.wake, f"worker-{self.queue}-listen")
        # a batch of leases once this many slots are free (or after LEASE_LINGER_SECONDS)
        batch = max(1, self.concurrency // LEASE_BATCH_DIVISOR)
        first_free: float | None = None  # when a slot first stood free, not yet leased
        try:
            while not stop.is_set() and not self._force.is_set():
                if max_runs is not None and taken >= max_runs:
                    break
                self._slot_freed.clear()
                if time.monotonic() >= next_reap:
                    self._reap()
                    next_reap = time.monotonic() + self.reap_seconds
                with self._lock:
                    active = self._in_flight
                    unrecorded = self._unrecorded
                free = min(
                    self.concurrency - active,
                    self.concurrency + self._record_backlog - active - unrecorded,
                )
                leases: Sequence[Lease] = ()
                if 0 < free < batch and active > 0:
                    # a few slots free while others run: wait a moment for more, so that one
                    # lease statement serves several runs
                    now = time.monotonic()
                    first_free = now if first_free is None else first_free
                    if now - first_free < LEASE_LINGER_SECONDS:
                        self._slot_freed.wait(first_free + LEASE_LINGER_SECONDS - now)
                        continue
                if free > 0:
                    first_free = None
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
                    if leases:
                        self._start(leases)
                    taken += len(leases)
                if leases:
                    continue  # more may be ready: ask again before sleeping
                self._alerts()
                # idle: asked with nothing running and got nothing. Not when every slot was
                # busy (nothing was asked): those runs may have ended since, with more ready
                if idle_exit and free > 0 and active == 0 and self._active_count() == 0:
                    break
                self._slot_freed.wait(self.poll_seconds)
        finally:
            # even when the loop fails, the commands in flight finish and get recorded
            self._drain()
        log.info("worker %s: stopped after %d run(s)", self.owner, taken)
        return taken

    def _alerts(self) -> None:
        """Run the host's alert commands for this queue's due command alerts: its
        `alert_lane` when it has one (the host worker over the API), else from the
        database (a tenant worker over the API has no alert lane)."""
        if self.alert_lane is not None:
            try:
                self.alert_lane()
            except errors.StoreUnavailable as exc:
                self._store_down("cannot lease alerts", exc)
            return
        has_command = bool(self.alert_command) or self.alert_command_for is not None
        if not has_command or not isinstance(self.backend, DirectBackend):
            return
        from schedctl.alerts.command import run_alert_commands  # database workers only

        try:
            run_alert_commands(
                self.backend.store,
                tenant_id=self.backend.tenant_id,
                queue=self.queue,
                owner=self.owner,
                command=self.alert_command,
                command_for=self.alert_command_for,
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
        """Runs leased and not yet recorded (running, or their outcome on its way)."""
        with self._lock:
            return self._in_flight + self._unrecorded

    def _start(self, leases: Sequence[Lease]) -> None:
        with self._lock:
            self._in_flight += len(leases)
        assert self._spawners is not None
        for lease in leases:
            self._spawners.submit(lease)

    def wake(self) -> None:
        """Runs may be ready (an in-process claim queued them): lease now, not after the
        poll interval."""
        self._slot_freed.set()

    def _release(self, count: int) -> None:
        """`count` runs ended with nothing to record (or given up): their slots are free."""
        with self._lock:
            self._in_flight -= count
        self._slot_freed.set()

    def _to_record(self, endings: list[_Ending]) -> None:
        """The outcomes of runs whose commands are over go to the settler: their slots are
        free now, and they count against the record backlog until recorded."""
        with self._lock:
            self._in_flight -= len(endings)
            self._unrecorded += len(endings)
        assert self._settler is not None
        self._settler.submit(endings)
        self._slot_freed.set()

    def _settled(self, count: int) -> None:
        """`count` outcomes are recorded (or given up)."""
        with self._lock:
            self._unrecorded -= count
        self._slot_freed.set()

    def _drain(self) -> None:
        """Wait for the runs in flight (the supervisor watches `force` itself), then end the
        worker's threads."""
        while True:
            with self._lock:
                if self._in_flight == 0 and self._unrecorded == 0:
                    break
            self._slot_freed.wait(TICK_SECONDS)
            self._slot_freed.clear()
        for part in (
            self._listener,
            self._spawners,
            self._supervisor,
            self._beater,
            self._settler,
        ):
            if part is not None:
                part.close()

    def _reap(self) -> None:
        try:
            settled = self.backend.reap()
        except errors.StoreUnavailable as exc:
            self._store_down("cannot reap expired leases", exc)
            return
        if settled:
            log.info("worker %s: settled %d expired lease(s)", self.owner, settled)

    # -- one run -----------------------------------------------------------------------------

    def _environment(self, lease: Lease, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Built, not inherited: a few harmless variables of the worker, then the configured
        ones (and the run's RunSpec's), then the run's own."""
        env = dict(self._base_env)
        if extra:
            env.update(extra)
        env["SCHED_JOB_ID"] = lease.job_id
        env["SCHED_SCHEDULED_AT"] = format_instant(lease.scheduled_at)
        env["SCHED_ATTEMPT"] = str(lease.attempt)
        env["SCHED_IDEMPOTENCY_KEY"] = lease.idempotency_key
        return env

    def _launch(self, lease: Lease) -> _Run | _Ending:
        """Start the run's command: the run to supervise, or the failed attempt when it
        could not start (nothing runs)."""
        if log.isEnabledFor(logging.DEBUG):  # DEBUG, as the success: one line a run is costly
            log.debug(
                "run %s attempt %d: starting (job %s)", lease.idempotency_key, lease.attempt,
                lease.job_id,
            )  # fmt: skip
        started_at = datetime.now(UTC)
        if self.resolve is not None:
            try:
                spec = self.resolve(lease)
            except errors.SchedError as exc:
                log.warning("run %s attempt %d: not run: %s", lease.idempotency_key,
                            lease.attempt, exc)  # fmt: skip
                return _failed(lease, str(exc), started_at)
        else:
            spec = RunSpec(self.command, json.dumps(lease.payload).encode())
        cgroup = self._containment.new_run(getattr(lease, "run_limits", None))
        try:
            child = spawn(
                spec.argv,
                self._environment(lease, spec.env),
                user=spec.user,
                group=spec.group,
                extra_groups=spec.extra_groups,
                workdir=spec.workdir,
                cgroup=cgroup,
            )
        except OSError as exc:
            if spec.on_end is not None:
                spec.on_end()
            if cgroup is not None:
                cgroup.release()
            return _failed(lease, f"cannot start the command: {exc}", started_at)
        run = _Run(self, lease, child, spec.stdin, started_at, spec, keep_output=spec.keep_output)
        run.feed_stdin()  # a payload that fits the pipe is written now, without a select
        return run

    def _ended(self, run: _Run) -> _Ending | None:
        """What is recorded for a supervised run whose command is over (None: nothing, the
        lease was lost)."""
        lease, outcome = run.lease, run.outcome
        finished_at = datetime.now(UTC)
        tail = None if run.keep_output else _combine_tails(run.stdout.text(), run.stderr.text())
        code = outcome.returncode
        exit_code = code if code is not None and code >= 0 else None
        if outcome.cancelled and not outcome.lease_lost:
            how = f"killed by {_signal_name(-code)}" if code is not None and code < 0 else (
                f"exit code {code}")  # fmt: skip
            error = f"{CANCELLED_RUNNING_ERROR} ({how})"
            settlement = Settlement(
                Finish.cancelled, error, exit_code, tail, run.started_at, finished_at
            )
            return _Ending(lease, settlement, error)
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
            return _Ending(lease, settlement, "succeeded", logging.DEBUG)
        if outcome.forced:
            error = "killed: the worker was forced to stop"
        elif outcome.timed_out:
            error = f"timed out after {run.timeout_seconds}s"
        elif code is not None and code < 0:
            error = f"killed by signal {_signal_name(-code)}"
        else:
            error = f"exit code {code}"
        log.info("run %s attempt %d: failed: %s", lease.idempotency_key, lease.attempt, error)
        settlement = Settlement(Finish.failed, error, exit_code, tail, run.started_at, finished_at)
        return _Ending(lease, settlement, None)

    # -- the backend's threads ---------------------------------------------------------------

    def _beat_runs(self, requests: list[_BeatRequest]) -> None:
        """The heartbeats due together, in one backend call; the results go back to the
        supervisor."""
        try:
            beats: Sequence[Beat | errors.StoreUnavailable] = self.backend.beat_many(
                [(r.run.lease, r.output_tail) for r in requests], self.lease_seconds
            )
        except errors.StoreUnavailable as exc:
            beats = [exc] * len(requests)
        results: list[tuple[_Run, Beat | None]] = []
        for request, beat in zip(requests, beats, strict=True):
            if isinstance(beat, errors.StoreUnavailable):
                # the backend could not say: the next heartbeat sends the output again
                log.warning("run %s: heartbeat failed: %s", request.run.lease.idempotency_key,
                            beat)  # fmt: skip
                results.append((request.run, None))
                continue
            request.run.output_sent = request.output_seen
            results.append((request.run, beat))
        assert self._supervisor is not None
        self._supervisor.beaten(results)

    def _record_endings(self, endings: list[_Ending]) -> None:
        """Store the outcomes that ended together, in one backend call, retrying those the
        backend could not take while it is away; after a whole lease of retries a run
        belongs to the reaper (it will be redelivered: at least once)."""
        pending = endings
        given_up_at = time.monotonic() + max(self.lease_seconds, 10.0)
        backoff = retrying.Backoff(retrying.STORE_UNAVAILABLE)
        try:
            while pending:
                try:
                    results: Sequence[bool | errors.StoreUnavailable] = self.backend.settle_many(
                        [(e.lease, e.settlement) for e in pending]
                    )
                except errors.StoreUnavailable as exc:
                    results = [exc] * len(pending)
                retry: list[_Ending] = []
                for ending, result in zip(pending, results, strict=True):
                    if isinstance(result, errors.StoreUnavailable):
                        retry.append(ending)
                    else:
                        self._recorded(ending, result)
                if len(retry) < len(pending):
                    # one wake of the lease loop for the batch
                    self._settled(len(pending) - len(retry))
                pending = retry
                if not retry:
                    return
                error = next(r for r in results if isinstance(r, errors.StoreUnavailable))
                if time.monotonic() >= given_up_at or self._force.is_set():
                    for ending in retry:
                        log.error(
                            "run %s attempt %d: could not record the outcome: %s; the run "
                            "will be redelivered after its lease expires",
                            ending.lease.idempotency_key,
                            ending.lease.attempt,
                            error,
                        )
                    self._settled(len(retry))
                    return
                # unknown, not lost: the commit may have gone through with its answer lost
                # (a failover); settling again finds an outcome already recorded (as
                # recorded, once) or records it now
                log.warning(
                    "%d outcome(s), first run %s: recording failed or its answer was lost "
                    "(%s); outcome unknown, settling again",
                    len(retry),
                    retry[0].lease.idempotency_key,
                    error,
                )
                backoff.wait(self._force)
        except BaseException:
            log.exception("worker %s: recording %d outcome(s) failed", self.owner, len(pending))
            self._settled(len(pending))  # their leases expire and the reaper redelivers them
            raise

    def _recorded(self, ending: _Ending, recorded: bool) -> None:
        lease = ending.lease
        if not recorded:
            log.warning(
                "run %s attempt %d: finished after its lease was lost; outcome not recorded",
                lease.idempotency_key,
                lease.attempt,
            )
        elif ending.said is not None and log.isEnabledFor(ending.level):
            log.log(
                ending.level, "run %s attempt %d: %s", lease.idempotency_key, lease.attempt,
                ending.said,
            )  # fmt: skip


@dataclass
class _Ending:
    """A run's outcome to record, and what to log once it is (None: nothing), at `level`."""

    lease: Lease
    settlement: Settlement
    said: str | None
    level: int = logging.INFO


@dataclass
class _BeatRequest:
    """A heartbeat to send: the run, its output so far when it grew (`schedctl logs
    --follow`), and how much output that was."""

    run: _Run
    output_tail: str | None
    output_seen: tuple[int, int]


def _failed(lease: Lease, error: str, started_at: datetime) -> _Ending:
    """An attempt that failed before its command started."""
    settlement = Settlement(Finish.failed, error, None, None, started_at, datetime.now(UTC))
    return _Ending(lease, settlement, None)


Item = TypeVar("Item")


class _Batcher(Generic[Item]):
    """A thread that hands `call` everything submitted while its previous call ran (at
    most MAX_BATCH at a time): one backend call for what arrives together. Nobody waits
    for the call: its results go where `call` sends them.

    With `gather` > 1, fewer than `gather` items wait up to `linger` seconds (from the
    first one's arrival) for more: a backend call costs about as much as thirty items
    in it, so a busy worker settles in fewer, fuller calls."""

    def __init__(
        self,
        call: Callable[[list[Item]], None],
        name: str,
        *,
        gather: int = 1,
        linger: float = 0.0,
    ) -> None:
        self._call = call
        self._pending: list[Item] = []
        self._wake = threading.Condition()
        self._closed = False
        self._gather = gather
        self._linger = linger
        self._first_at = 0.0  # when the first of the pending items arrived
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[Item]) -> None:
        with self._wake:
            if not self._pending:
                self._first_at = time.monotonic()
            self._pending.extend(items)
            if len(self._pending) >= self._gather or self._closed:
                self._wake.notify()
            elif len(self._pending) == len(items):
                self._wake.notify()  # the first: the thread starts its linger

    def close(self) -> None:
        """Finish what was submitted, then end the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(TICK_SECONDS * 40)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                while 0 < len(self._pending) < self._gather and not self._closed:
                    left = self._first_at + self._linger - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if not self._pending:
                    return
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            try:
                self._call(batch)
            except Exception:
                log.exception("%s: failed", self._thread.name)


class _Run:
    """One command being supervised: its pipes, output tails and timers."""

    def __init__(
        self,
        worker: Worker,
        lease: Lease,
        child: Child,
        stdin: bytes,
        started_at: datetime,
        spec: RunSpec | None = None,
        *,
        keep_output: bool = False,
    ) -> None:
        self.lease = lease
        timeout = spec.timeout_seconds if spec is not None else None
        self.timeout_seconds = lease.timeout_seconds if timeout is None else timeout
        self._on_end = spec.on_end if spec is not None else None
        self.child = child
        self.started_at = started_at
        self.outcome = _Outcome()
        # output kept on the host: no tail is held, so none can be sent
        self.keep_output = keep_output
        tail_bytes = 0 if keep_output else worker.output_tail_bytes
        self.stdout = TailBuffer(tail_bytes)
        self.stderr = TailBuffer(tail_bytes)
        self.sinks: dict[int, TailBuffer] = {child.stdout: self.stdout, child.stderr: self.stderr}
        self.streams = {child.stdout: "stdout", child.stderr: "stderr"}
        self.pending = memoryview(stdin)
        # each line also goes to the daemon's log, tagged with the job and the run (bounded)
        self.output_log = RunOutputLog(lease)
        begun = time.monotonic()
        self.deadline = begun + self.timeout_seconds if self.timeout_seconds > 0 else None
        self.next_heartbeat = begun + worker.heartbeat_seconds
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


class _Spawners:
    """The threads that start commands: Popen waits for each child to exec (without the
    interpreter lock), and on a busy machine that wait is most of a start, so several
    start side by side; each run started goes to the supervisor."""

    def __init__(self, worker: Worker, count: int) -> None:
        self.worker = worker
        self._leases: SimpleQueue[Lease | None] = SimpleQueue()
        self._threads = [
            threading.Thread(
                target=self._serve, name=f"worker-{worker.queue}-spawn-{i}", daemon=True
            )
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, lease: Lease) -> None:
        self._leases.put(lease)

    def close(self) -> None:
        for _ in self._threads:
            self._leases.put(None)
        for thread in self._threads:
            thread.join(TICK_SECONDS * 40)

    def _serve(self) -> None:
        worker = self.worker
        while (lease := self._leases.get()) is not None:
            try:
                started = worker._launch(lease)
            except Exception:
                # the lease expires and the reaper redelivers the run: nothing is lost
                log.exception(
                    "worker %s: run of job %s failed unexpectedly", worker.owner, lease.job_id
                )
                worker._release(1)
                continue
            if isinstance(started, _Ending):
                worker._to_record([started])
            else:
                assert worker._supervisor is not None
                worker._supervisor.watch(started)


class _Supervisor:
    """The thread that supervises every command of a worker: one selector over all their
    pipes (stdin fed, stdout and stderr read into their tails) and exits (pidfds), and
    each run's timers (timeout, heartbeat, SIGKILL after the grace, the output drain)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._inbox: SimpleQueue[tuple[str, Any]] = SimpleQueue()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._runs: set[_Run] = set()
        self._endings: list[_Ending] = []  # runs over in this turn, not yet handed on
        self._closing = False
        self._thread = threading.Thread(
            target=self._serve, name=f"worker-{worker.queue}-runs", daemon=True
        )
        self._thread.start()

    # -- from other threads --------------------------------------------------------------

    def watch(self, run: _Run) -> None:
        self._post("run", run)

    def beaten(self, results: list[tuple[_Run, Beat | None]]) -> None:
        self._post("beats", results)

    def close(self) -> None:
        self._post("close", None)
        self._thread.join(TICK_SECONDS * 40)

    def _post(self, kind: str, value: Any) -> None:
        self._inbox.put((kind, value))
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    # -- the thread ------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not (self._closing and not self._runs):
                try:
                    self._turn()
                except Exception:  # a bug: said, and the loop goes on (runs are not lost)
                    log.exception("worker %s: the supervisor failed", self.worker.owner)
                    time.sleep(TICK_SECONDS)
        finally:
            # only an unexpected end gets here with commands alive: never leave them orphaned
            for run in list(self._runs):
                self._abandon(run)
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _turn(self) -> None:
        """One turn of the loop: new work, the runs whose time has come, one select."""
        self._take_inbox()
        now = time.monotonic()
        if self.worker._force.is_set():
            for run in self._runs:
                if run.child.returncode is None and not run.outcome.forced:
                    run.outcome.forced = True
                    run.child.signal_group(signal.SIGKILL)
                    run.kill_at = None
                    run.wake = now
        for run in [run for run in self._runs if run.wake <= now]:
            self._check(run, now)
        self._hand_on()
        wake = min((run.wake for run in self._runs), default=now + TICK_SECONDS)
        timeout = min(max(0.0, wake - time.monotonic()), TICK_SECONDS)
        touched: list[_Run] = []
        for key, _events in self._selector.select(timeout):
            if key.data is None:
                self._drain_wake()
                continue
            run, what = key.data
            if run in self._runs:
                self._event(run, key.fd, what)
                touched.append(run)
        now = time.monotonic()
        for run in dict.fromkeys(touched):
            if run in self._runs:
                self._check(run, now)
        self._hand_on()

    def _hand_on(self) -> None:
        """The outcomes of the runs that ended in this turn, to be recorded together."""
        if self._endings:
            self.worker._to_record(self._endings)
            self._endings = []

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, value = self._inbox.get_nowait()
            except Empty:
                return
            if kind == "run":
                self._watch(value)
            elif kind == "beats":
                self._apply_beats(value)
            else:
                self._closing = True

    def _watch(self, run: _Run) -> None:
        child = run.child
        self._runs.add(run)
        for fd in run.sinks:
            self._selector.register(fd, selectors.EVENT_READ, (run, "out"))
        if child.exit_fd is not None:
            self._selector.register(child.exit_fd, selectors.EVENT_READ, (run, "exit"))
        if child.stdin is not None:  # the payload did not fit the pipe at once
            self._selector.register(child.stdin, selectors.EVENT_WRITE, (run, "in"))

    def _event(self, run: _Run, fd: int, what: str) -> None:
        try:
            if what == "out":
                self._read(run, fd)
            elif what == "in":
                self._write(run, fd)
            else:
                self._selector.unregister(fd)
                run.child.reap()
        except Exception:
            log.exception(
                "worker %s: run of job %s failed unexpectedly", self.worker.owner, run.lease.job_id
            )
            self._abandon(run)

    def _read(self, run: _Run, fd: int) -> None:
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        if chunk:
            run.sinks[fd].write(chunk)
            run.output_log.feed(run.streams[fd], chunk)
        else:
            self._selector.unregister(fd)
            run.child.close(fd)
            del run.sinks[fd]

    def _write(self, run: _Run, fd: int) -> None:
        if not run.feed_stdin():
            self._selector.unregister(fd)

    def _check(self, run: _Run, now: float) -> None:
        """Look at one run: its timers, its exit; hands its outcome on once it is over."""
        try:
            if self._over(run, now):
                self._finish(run)
        except Exception:
            log.exception(
                "worker %s: run of job %s failed unexpectedly", self.worker.owner, run.lease.job_id
            )
            self._abandon(run)

    def _over(self, run: _Run, now: float) -> bool:
        """Enforce the run's timers; whether it is over (exited and its output drained, or
        its group SIGKILLed); else sets when to look at it next."""
        worker, child, outcome = self.worker, run.child, run.outcome
        if child.exit_fd is None:
            child.reap()  # no pidfd: polled
        running = child.returncode is None
        if not running and run.exited_at is None:
            run.exited_at = now
        if (
            run.exited_at is not None
            and run.kill_at is None
            and (not run.sinks or now - run.exited_at >= DRAIN_SECONDS)
        ):
            # a background child still holding the output pipes does not hold up the run:
            # after DRAIN_SECONDS the worker stops listening
            return True
        if run.kill_at is not None and (
            now >= run.kill_at
            or worker._force.is_set()
            or (not running and not child.group_alive())
        ):
            # after a SIGTERM the group always gets SIGKILL, whether or not its leader is
            # still there: a child that ignores SIGTERM and outlives the leader must not
            # overlap the next attempt. (Once nothing of the group is left the SIGKILL finds
            # nothing, and the grace is not waited out.)
            child.signal_group(signal.SIGKILL)
            run.kill_at = None
            if not running and not run.sinks:
                return True
        if running and run.deadline is not None and now >= run.deadline and not outcome.timed_out:
            outcome.timed_out = True
            log.warning(
                "run %s attempt %d: timed out after %ss; terminating",
                run.lease.idempotency_key,
                run.lease.attempt,
                run.timeout_seconds,
            )
            self._terminate(run, now)
        # unconfirmed for a whole lease: the reaper may have handed the run to another
        # worker, and two copies must not run at once (nor anything left of this one: the
        # group is terminated even if the leader is gone)
        if not outcome.lease_lost and now - run.last_confirmed >= worker.lease_seconds:
            outcome.lease_lost = True
            self._terminate(run, now)
        # also while draining the output of an exited command: the outcome is not recorded
        # yet, and the lease must still be ours when it is
        if now >= run.next_heartbeat and not outcome.lease_lost and not run.beating:
            run.beating = True
            output_seen = (run.stdout.total, run.stderr.total)
            tail = (
                _combine_tails(run.stdout.text(), run.stderr.text())
                if output_seen != run.output_sent and not run.keep_output
                else None
            )
            assert worker._beater is not None
            worker._beater.submit([_BeatRequest(run, tail, output_seen)])
        # only the events still ahead: a passed deadline must not make this spin
        wake: list[float] = []
        if not outcome.lease_lost and not run.beating:
            wake.append(run.next_heartbeat)
        if not outcome.lease_lost:
            wake.append(run.last_confirmed + worker.lease_seconds)
        if run.deadline is not None and not outcome.timed_out and run.exited_at is None:
            wake.append(run.deadline)
        if run.kill_at is not None:
            wake.append(run.kill_at)
            if not running:
                wake.append(now + TICK_SECONDS)  # is anything of the group left?
        if run.exited_at is not None and run.sinks:
            wake.append(run.exited_at + DRAIN_SECONDS)
        if running and child.exit_fd is None:
            wake.append(now + POLL_EXIT_SECONDS)
        run.wake = min(wake) if wake else now + TICK_SECONDS
        return False

    def _terminate(self, run: _Run, now: float) -> None:
        # SIGTERM to the whole group now, SIGKILL to it after the grace period (an earlier
        # pending SIGKILL is not postponed)
        run.child.signal_group(signal.SIGTERM)
        grace_end = now + self.worker.kill_grace_seconds
        run.kill_at = grace_end if run.kill_at is None else min(run.kill_at, grace_end)

    def _apply_beats(self, results: list[tuple[_Run, Beat | None]]) -> None:
        now = time.monotonic()
        for run, beat in results:
            run.beating = False
            if run not in self._runs:
                continue  # over meanwhile: its settle tells whether the lease was still ours
            outcome = run.outcome
            run.next_heartbeat = now + self.worker.heartbeat_seconds
            if beat is Beat.extended or beat is Beat.cancelled:
                run.last_confirmed = now
            if beat is Beat.cancelled and not outcome.cancelled and run.exited_at is None:
                # the cancel reaches running work: SIGTERM now, SIGKILL after the grace
                outcome.cancelled = True
                log.warning(
                    "run %s attempt %d: job cancelled; terminating the command",
                    run.lease.idempotency_key,
                    run.lease.attempt,
                )
                self._terminate(run, now)
            if beat is Beat.lost and not outcome.lease_lost:
                outcome.lease_lost = True
                self._terminate(run, now)
            run.wake = now

    def _close_pipes(self, run: _Run) -> None:
        child = run.child
        for fd in list(run.sinks):
            self._selector.unregister(fd)
            child.close(fd)
        run.sinks.clear()
        if child.stdin is not None:
            self._selector.unregister(child.stdin)
            child.close_stdin()
        if child.exit_fd is not None:
            with contextlib.suppress(KeyError):
                self._selector.unregister(child.exit_fd)

    def _finish(self, run: _Run) -> None:
        self._runs.discard(run)
        run.output_log.close()
        self._close_pipes(run)
        forced = run.child.returncode is None or run.kill_at is not None
        if forced:
            # only a forced stop gets here with the command alive or its SIGKILL pending:
            # never leave it orphaned
            run.child.signal_group(signal.SIGKILL)
        run.outcome.returncode = run.child.wait()
        # a forced stop takes everything in the run's cgroup with it; a command that
        # exited by itself keeps its background children, as under cron
        run.child.release(kill=forced)
        run.ended()
        ending = self.worker._ended(run)
        if ending is None:
            self.worker._release(1)
        else:
            self._endings.append(ending)

    def _abandon(self, run: _Run) -> None:
        """After an unexpected error: the command is killed and nothing recorded (the lease
        expires and the reaper redelivers the run)."""
        self._runs.discard(run)
        with contextlib.suppress(Exception):
            run.output_log.close()
        with contextlib.suppress(Exception):
            self._close_pipes(run)
        run.child.signal_group(signal.SIGKILL)
        with contextlib.suppress(Exception):
            run.child.wait()
        with contextlib.suppress(Exception):
            run.child.release()
        run.ended()
        self.worker._release(1)


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
