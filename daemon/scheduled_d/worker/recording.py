"""Owns the worker's two threads to the backend: one records the outcomes of runs that
ended together in one call (`settle_many`, retried while the backend is away), the other
extends the leases due together in one call (`beat_many`); both are `Batcher`s."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from schedctl.core import errors, retrying
from schedctl.domain.leasing import Beat, LeaseBackend
from scheduled_d.batching import Batcher
from scheduled_d.worker.runs import BeatRequest, Ending, Run

log = logging.getLogger("scheduled_d.worker")

# The settling thread waits up to SETTLE_LINGER_SECONDS for concurrency /
# SETTLE_GATHER_DIVISOR outcomes to record together (fewer, fuller transactions).
SETTLE_GATHER_DIVISOR = 4
SETTLE_LINGER_SECONDS = 0.01


class Recorder:
    """Records outcomes (`settle`) and sends heartbeats (`beat`) for one worker's runs
    through `backend`, nobody waiting: each beat's result goes to `beaten`, and `recorded`
    is told how many outcomes were recorded (or given up: their leases expire and the
    reaper redelivers them). Setting `force` ends the retries."""

    def __init__(
        self,
        backend: LeaseBackend,
        name: str,
        owner: str,
        *,
        concurrency: int,
        lease_seconds: float,
        force: threading.Event,
        beaten: Callable[[list[tuple[Run, Beat | None]]], None],
        recorded: Callable[[int], None],
    ) -> None:
        self.backend = backend
        self.owner = owner
        self.lease_seconds = lease_seconds
        self._force = force
        self._beaten = beaten
        self._recorded_count = recorded
        self._settler: Batcher[Ending] = Batcher(
            self._record_endings,
            f"{name}-settle",
            gather=max(1, concurrency // SETTLE_GATHER_DIVISOR),
            linger=SETTLE_LINGER_SECONDS,
        )
        self._beater: Batcher[BeatRequest] = Batcher(self._beat_runs, f"{name}-beat")

    def settle(self, endings: Sequence[Ending]) -> None:
        """Record these outcomes (with what arrives together)."""
        self._settler.submit(endings)

    def beat(self, requests: Sequence[BeatRequest]) -> None:
        """Send these heartbeats (with what arrives together)."""
        self._beater.submit(requests)

    def close(self) -> None:
        """Finish what was submitted, then end both threads."""
        self._beater.close()
        self._settler.close()

    def _beat_runs(self, requests: list[BeatRequest]) -> None:
        """The heartbeats due together, in one backend call; the results go back to the
        supervisor."""
        try:
            beats: Sequence[Beat | errors.StoreUnavailable] = self.backend.beat_many(
                [(r.run.lease, r.output_tail) for r in requests], self.lease_seconds
            )
        except errors.StoreUnavailable as exc:
            beats = [exc] * len(requests)
        results: list[tuple[Run, Beat | None]] = []
        for request, beat in zip(requests, beats, strict=True):
            if isinstance(beat, errors.StoreUnavailable):
                # the backend could not say: the next heartbeat sends the output again
                log.warning("run %s: heartbeat failed: %s", request.run.lease.idempotency_key,
                            beat)  # fmt: skip
                results.append((request.run, None))
                continue
            request.run.output_sent = request.output_seen
            results.append((request.run, beat))
        self._beaten(results)

    def _record_endings(self, endings: list[Ending]) -> None:
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
                retry: list[Ending] = []
                for ending, result in zip(pending, results, strict=True):
                    if isinstance(result, errors.StoreUnavailable):
                        retry.append(ending)
                    else:
                        self._recorded(ending, result)
                if len(retry) < len(pending):
                    # one wake of the lease loop for the batch
                    self._recorded_count(len(pending) - len(retry))
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
                    self._recorded_count(len(retry))
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
            self._recorded_count(len(pending))  # their leases expire and the reaper redelivers them
            raise

    def _recorded(self, ending: Ending, recorded: bool) -> None:
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
