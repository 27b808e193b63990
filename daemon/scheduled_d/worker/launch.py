"""Owns starting the worker's runs: each run's environment (built, not inherited), its
command (the worker's own or its RunSpec's) in a cgroup of its own when there is one
(`Launcher`), and the threads that start them side by side (`Spawners`)."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from queue import SimpleQueue

from schedctl.core import errors
from schedctl.domain.leasing import LeasedRun as Lease
from schedctl.scheduling.timeparse import format_instant
from scheduled_d.cgroups import containment
from scheduled_d.spawn import spawn
from scheduled_d.worker.runs import Ending, Run, RunSpec, failed

log = logging.getLogger("scheduled_d.worker")

# The only variables of the worker's own environment that reach a command (when set): the
# rest -- SCHEDULED_DATABASE_URL, SCHEDULED_PAYLOAD_KEYS, SCHEDULED_API_TOKEN... -- never do.
INHERITED_VARIABLES = ("PATH", "LANG", "TZ", "HOME")
# Threads starting commands side by side (at most; no more than concurrency).
SPAWN_THREADS = 16
# How long close() waits for each spawning thread.
JOIN_SECONDS = 10.0


class Launcher:
    """Starts one run's command: `command` with the lease's payload on stdin, or what
    `resolve` decides for the lease (a RunSpec); `env` over the inherited base;
    `tail_bytes` and `heartbeat_seconds` for the Run it makes."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        resolve: Callable[[Lease], RunSpec] | None,
        tail_bytes: int,
        heartbeat_seconds: float,
    ) -> None:
        self.command = list(command)
        self.resolve = resolve
        self.tail_bytes = tail_bytes
        self.heartbeat_seconds = heartbeat_seconds
        # the base of every command's environment, read once
        self._base_env = {
            name: os.environ[name] for name in INHERITED_VARIABLES if name in os.environ
        }
        self._base_env.update(env)
        # each run in a cgroup of its own, or the process group only (said once, at start)
        self._containment = containment()

    def environment(self, lease: Lease, extra: Mapping[str, str] | None = None) -> dict[str, str]:
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

    def launch(self, lease: Lease) -> Run | Ending:
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
                return failed(lease, str(exc), started_at)
        else:
            spec = RunSpec(self.command, json.dumps(lease.payload).encode())
        cgroup = self._containment.new_run(getattr(lease, "run_limits", None))
        try:
            child = spawn(
                spec.argv,
                self.environment(lease, spec.env),
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
            return failed(lease, f"cannot start the command: {exc}", started_at)
        run = Run(
            lease,
            child,
            spec.stdin,
            started_at,
            spec,
            tail_bytes=self.tail_bytes,
            heartbeat_seconds=self.heartbeat_seconds,
            keep_output=spec.keep_output,
        )
        run.feed_stdin()  # a payload that fits the pipe is written now, without a select
        return run


class Spawners:
    """The threads that start commands: Popen waits for each child to exec (without the
    interpreter lock), and on a busy machine that wait is most of a start, so several
    start side by side. Each run started goes to `watch`, each attempt that could not
    start to `record`; after an unexpected error the slot is given back (`release`)."""

    def __init__(
        self,
        name: str,
        owner: str,
        count: int,
        *,
        launch: Callable[[Lease], Run | Ending],
        watch: Callable[[Run], None],
        record: Callable[[list[Ending]], None],
        release: Callable[[int], None],
    ) -> None:
        self.owner = owner
        self._launch = launch
        self._watch = watch
        self._record = record
        self._release = release
        self._leases: SimpleQueue[Lease | None] = SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-spawn-{i}", daemon=True)
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
            thread.join(JOIN_SECONDS)

    def _serve(self) -> None:
        while (lease := self._leases.get()) is not None:
            try:
                started = self._launch(lease)
            except Exception:
                # the lease expires and the reaper redelivers the run: nothing is lost
                log.exception(
                    "worker %s: run of job %s failed unexpectedly", self.owner, lease.job_id
                )
                self._release(1)
                continue
            if isinstance(started, Ending):
                self._record([started])
            else:
                self._watch(started)
