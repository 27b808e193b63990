"""The queue worker (the cron replacement): leases runs from one built-in queue and runs the
worker's own command once per run, with heartbeats, timeouts, output tails and retries; a
heartbeat that finds the job cancelled stops the command (SIGTERM, SIGKILL after a grace).
This module owns `Worker`, the lease loop; its components are the package's other modules
(admission: the slots; launch: starting commands; supervisor: watching them; recording:
outcomes and heartbeats to the backend; runs: one run).

The command is always the one the worker was started with, never anything taken from a
message: a message only selects *when* the command runs and what it reads on stdin.

Where runs come from is a `schedctl.domain.leasing.LeaseBackend`: `DirectBackend` over the
database (the operator worker) or `schedctl.clients.queue_client.ApiLeaseBackend` over the
REST API (the tenant worker, `--api`, no database credentials); the supervision below is the
same for both.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from schedctl.core import errors, limits, retrying
from schedctl.domain.config import command_env
from schedctl.domain.leasing import LeaseBackend
from schedctl.domain.leasing import LeasedRun as Lease
from scheduled_d.direct_backend import DirectBackend
from scheduled_d.ready import ReadyListener
from scheduled_d.worker.admission import LEASE_LINGER_SECONDS, Slots
from scheduled_d.worker.launch import SPAWN_THREADS, Launcher, Spawners
from scheduled_d.worker.recording import Recorder
from scheduled_d.worker.runs import Ending, RunSpec
from scheduled_d.worker.supervisor import TICK_SECONDS, Supervisor

if TYPE_CHECKING:
    # the database layer is imported only by DirectBackend: `--api` workers never load it
    from schedctl.app.alerts.command import AlertCommand
    from schedctl.storage.db.store import Store
    from schedctl.storage.records.alerts import AlertRow

log = logging.getLogger("scheduled_d.worker")


class Worker:
    """Runs `command` once per message of `queue`, up to `concurrency` at a time.

    - store: the Store to lease from (Postgres or SQLite), or a LeaseBackend (e.g. the REST
      API's, schedctl.clients.queue_client.ApiLeaseBackend, whose token names the tenant).
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
        self._slots = Slots(concurrency)
        self._unavailable = False
        self.store_errors = 0  # backend calls of the lease loop that found it unavailable
        # the host's alert command (OnFailure=-like), run for this queue's command alerts
        self.alert_command = list(alert_command)
        self.alert_command_for = alert_command_for
        self.alert_lane = alert_lane
        self.resolve = resolve
        self._launcher = Launcher(
            self.command,
            self.env,
            resolve=resolve,
            tail_bytes=output_tail_bytes,
            heartbeat_seconds=heartbeat_seconds,
        )
        self._supervisor: Supervisor | None = None
        self._spawners: Spawners | None = None
        self._listener: ReadyListener | None = None
        self._recorder: Recorder | None = None

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
        self._start_threads()
        feed = self.backend.ready_feed(self.queue)
        if feed is not None:
            self._listener = ReadyListener(feed, self.wake, f"worker-{self.queue}-listen")
        # a batch of leases once this many slots are free (or after LEASE_LINGER_SECONDS)
        batch = self._slots.batch
        first_free: float | None = None  # when a slot first stood free, not yet leased
        try:
            while not stop.is_set() and not self._force.is_set():
                if max_runs is not None and taken >= max_runs:
                    break
                self._slots.clear()
                if time.monotonic() >= next_reap:
                    self._reap()
                    next_reap = time.monotonic() + self.reap_seconds
                free, active = self._slots.free()
                leases: Sequence[Lease] = ()
                if 0 < free < batch and active > 0:
                    # a few slots free while others run: wait a moment for more, so that one
                    # lease statement serves several runs
                    now = time.monotonic()
                    first_free = now if first_free is None else first_free
                    if now - first_free < LEASE_LINGER_SECONDS:
                        self._slots.wait(first_free + LEASE_LINGER_SECONDS - now)
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
                if idle_exit and free > 0 and active == 0 and self._slots.active() == 0:
                    break
                self._slots.wait(self.poll_seconds)
        finally:
            # even when the loop fails, the commands in flight finish and get recorded
            self._drain()
        log.info("worker %s: stopped after %d run(s)", self.owner, taken)
        return taken

    def _alerts(self) -> None:
        """Run the host's alert commands for this queue's due command alerts: its
        `alert_lane` when it has one (the host worker over the API), else through the
        backend (the database's; a tenant worker over the API has no alert lane)."""
        if self.alert_lane is not None:
            try:
                self.alert_lane()
            except errors.StoreUnavailable as exc:
                self._store_down("cannot lease alerts", exc)
            return
        if not self.alert_command and self.alert_command_for is None:
            return
        try:
            # a backend that cannot (over the API) runs none: the host worker has its lane
            self.backend.run_alert_commands(
                self.queue, self.owner, self.alert_command, self.alert_command_for
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

    def _start_threads(self) -> None:
        """The worker's components, wired to each other by their public methods."""
        name = f"worker-{self.queue}"
        slots = self._slots
        supervisor = self._supervisor = Supervisor(
            name,
            self.owner,
            lease_seconds=self.lease_seconds,
            heartbeat_seconds=self.heartbeat_seconds,
            kill_grace_seconds=self.kill_grace_seconds,
            force=self._force,
            beat=lambda requests: recorder.beat(requests),
            hand_on=self._to_record,
            release=slots.released,
        )
        recorder = self._recorder = Recorder(
            self.backend,
            name,
            self.owner,
            concurrency=self.concurrency,
            lease_seconds=self.lease_seconds,
            force=self._force,
            beaten=supervisor.beaten,
            recorded=slots.recorded,
        )
        self._spawners = Spawners(
            name,
            self.owner,
            min(self.concurrency, SPAWN_THREADS),
            launch=self._launcher.launch,
            watch=supervisor.watch,
            record=self._to_record,
            release=slots.released,
        )

    def _start(self, leases: Sequence[Lease]) -> None:
        self._slots.take(len(leases))
        assert self._spawners is not None
        for lease in leases:
            self._spawners.submit(lease)

    def wake(self) -> None:
        """Runs may be ready (an in-process claim queued them): lease now, not after the
        poll interval."""
        self._slots.wake()

    def _to_record(self, endings: list[Ending]) -> None:
        """The outcomes of runs whose commands are over go to the recorder: their slots are
        free now, and they count against the record backlog until recorded."""
        self._slots.ended(len(endings))
        assert self._recorder is not None
        self._recorder.settle(endings)
        self._slots.wake()

    def _drain(self) -> None:
        """Wait for the runs in flight (the supervisor watches `force` itself), then end the
        worker's threads."""
        while not self._slots.empty():
            self._slots.wait(TICK_SECONDS)
            self._slots.clear()
        for part in (self._listener, self._spawners, self._supervisor, self._recorder):
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
