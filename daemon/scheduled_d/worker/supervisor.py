"""Owns the worker's supervising thread: one selector over the pipes and exits of every
command the worker runs, and each run's timers (timeout, heartbeat, SIGKILL after the
grace, the output drain); nothing in it waits for the backend."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

from schedctl.domain.leasing import Beat
from scheduled_d.worker.runs import BeatRequest, Ending, Run, ending_of

log = logging.getLogger("scheduled_d.worker")

READ_CHUNK = 65536
# After the command exits, how long to keep reading output that a background child of it
# may still be writing before the worker stops listening.
DRAIN_SECONDS = 2.0
# The longest the supervisor sleeps between looks at `force` (and at a group awaiting its
# SIGKILL whose leader is gone).
TICK_SECONDS = 0.25
# Without pidfds (an old kernel), how often a running command is asked whether it exited.
POLL_EXIT_SECONDS = 0.01
# How long close() waits for the thread.
JOIN_SECONDS = TICK_SECONDS * 40


class Supervisor:
    """The thread that supervises every command of a worker: one selector over all their
    pipes (stdin fed, stdout and stderr read into their tails) and exits (pidfds), and
    each run's timers (timeout, heartbeat, SIGKILL after the grace, the output drain).

    What it needs goes in as callables: `beat` sends heartbeats (their results come back
    through `beaten`), `hand_on` takes the outcomes of runs that ended together, `release`
    frees the slots of runs that ended with nothing to record; `force` set kills every
    command."""

    def __init__(
        self,
        name: str,
        owner: str,
        *,
        lease_seconds: float,
        heartbeat_seconds: float,
        kill_grace_seconds: float,
        force: threading.Event,
        beat: Callable[[list[BeatRequest]], None],
        hand_on: Callable[[list[Ending]], None],
        release: Callable[[int], None],
    ) -> None:
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.kill_grace_seconds = kill_grace_seconds
        self._force = force
        self._beat = beat
        self._hand_on_to = hand_on
        self._release = release
        self._inbox: SimpleQueue[tuple[str, Any]] = SimpleQueue()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._runs: set[Run] = set()
        self._endings: list[Ending] = []  # runs over in this turn, not yet handed on
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name=f"{name}-runs", daemon=True)
        self._thread.start()

    # -- from other threads --------------------------------------------------------------

    def watch(self, run: Run) -> None:
        self._post("run", run)

    def beaten(self, results: list[tuple[Run, Beat | None]]) -> None:
        self._post("beats", results)

    def close(self) -> None:
        self._post("close", None)
        self._thread.join(JOIN_SECONDS)

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
                    log.exception("worker %s: the supervisor failed", self.owner)
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
        if self._force.is_set():
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
        touched: list[Run] = []
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
            self._hand_on_to(self._endings)
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

    def _watch(self, run: Run) -> None:
        child = run.child
        self._runs.add(run)
        for fd in run.sinks:
            self._selector.register(fd, selectors.EVENT_READ, (run, "out"))
        if child.exit_fd is not None:
            self._selector.register(child.exit_fd, selectors.EVENT_READ, (run, "exit"))
        if child.stdin is not None:  # the payload did not fit the pipe at once
            self._selector.register(child.stdin, selectors.EVENT_WRITE, (run, "in"))

    def _event(self, run: Run, fd: int, what: str) -> None:
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
                "worker %s: run of job %s failed unexpectedly", self.owner, run.lease.job_id
            )
            self._abandon(run)

    def _read(self, run: Run, fd: int) -> None:
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

    def _write(self, run: Run, fd: int) -> None:
        if not run.feed_stdin():
            self._selector.unregister(fd)

    def _check(self, run: Run, now: float) -> None:
        """Look at one run: its timers, its exit; hands its outcome on once it is over."""
        try:
            if self._over(run, now):
                self._finish(run)
        except Exception:
            log.exception(
                "worker %s: run of job %s failed unexpectedly", self.owner, run.lease.job_id
            )
            self._abandon(run)

    def _over(self, run: Run, now: float) -> bool:
        """Enforce the run's timers; whether it is over (exited and its output drained, or
        its group SIGKILLed); else sets when to look at it next."""
        child, outcome = run.child, run.outcome
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
            now >= run.kill_at or self._force.is_set() or (not running and not child.group_alive())
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
        if not outcome.lease_lost and now - run.last_confirmed >= self.lease_seconds:
            outcome.lease_lost = True
            self._terminate(run, now)
        # also while draining the output of an exited command: the outcome is not recorded
        # yet, and the lease must still be ours when it is
        if now >= run.next_heartbeat and not outcome.lease_lost and not run.beating:
            run.beating = True
            output_seen = (run.stdout.total, run.stderr.total)
            tail = run.tail() if output_seen != run.output_sent and not run.keep_output else None
            self._beat([BeatRequest(run, tail, output_seen)])
        # only the events still ahead: a passed deadline must not make this spin
        wake: list[float] = []
        if not outcome.lease_lost and not run.beating:
            wake.append(run.next_heartbeat)
        if not outcome.lease_lost:
            wake.append(run.last_confirmed + self.lease_seconds)
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

    def _terminate(self, run: Run, now: float) -> None:
        # SIGTERM to the whole group now, SIGKILL to it after the grace period (an earlier
        # pending SIGKILL is not postponed)
        run.child.signal_group(signal.SIGTERM)
        grace_end = now + self.kill_grace_seconds
        run.kill_at = grace_end if run.kill_at is None else min(run.kill_at, grace_end)

    def _apply_beats(self, results: list[tuple[Run, Beat | None]]) -> None:
        now = time.monotonic()
        for run, beat in results:
            run.beating = False
            if run not in self._runs:
                continue  # over meanwhile: its settle tells whether the lease was still ours
            outcome = run.outcome
            run.next_heartbeat = now + self.heartbeat_seconds
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

    def _close_pipes(self, run: Run) -> None:
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

    def _finish(self, run: Run) -> None:
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
        ending = ending_of(run)
        if ending is None:
            self._release(1)
        else:
            self._endings.append(ending)

    def _abandon(self, run: Run) -> None:
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
        self._release(1)
