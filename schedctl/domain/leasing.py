"""Owns the seam between the queue worker and where its runs come from: `LeaseBackend` (lease,
beat, ack, fail, stop_cancelled, reap), `LeasedRun`, what the worker needs of a held run, and
`Settles`, the one place ack, fail and stop_cancelled turn into a `Settlement`.

Two backends implement it: the direct one over the database
(scheduled_d.direct_backend.DirectBackend, over schedctl.storage.pipeline.queue.QueueRepo, which
settles through `Settles` too) and the tenant one over the REST API
(schedctl.clients.queue_client.ApiLeaseBackend), so the worker's supervision (heartbeats, timeouts,
cancellation, output tails) is one piece of code for both.

Nothing here imports the database layer: a worker with `--api` holds no database credentials
and loads no database code.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

from schedctl.core import errors

# The error recorded for an attempt whose command a cancel stopped.
CANCELLED_RUNNING_ERROR = "job cancelled while the command ran: stopped"


class Beat(enum.StrEnum):
    """What a heartbeat found."""

    extended = "extended"  # the lease is ours for another lease period
    lost = "lost"  # expired and reaped, or taken: the run is someone else's now
    cancelled = "cancelled"  # extended, but the job was cancelled: stop the command


class LeasedRun(Protocol):
    """A run a worker holds: what it needs to run the command and to record the outcome.
    The backend that leased it is the one that settles it."""

    @property
    def job_id(self) -> str: ...

    @property
    def scheduled_at(self) -> datetime: ...

    @property
    def attempt(self) -> int: ...

    @property
    def timeout_seconds(self) -> int:
        """0: no timeout."""
        ...

    @property
    def payload(self) -> Any: ...

    @property
    def idempotency_key(self) -> str:
        """`JOB_ID:SCHEDULED_AT`, the same for every attempt."""
        ...


# what a backend settles: any LeasedRun (a worker's backend), or its own lease type (QueueRepo)
L = TypeVar("L")


class Finish(enum.StrEnum):
    """How a worker's attempt ended, as it reports it."""

    succeeded = "succeeded"  # ack: the run is done
    failed = "failed"  # fail: retried per the job's policy, or dead-lettered
    cancelled = "cancelled"  # stop_cancelled: the job was cancelled; never retried


@dataclass(frozen=True)
class Settlement:
    """One report of how an attempt ended: what ack, fail and stop_cancelled hand on."""

    finish: Finish
    error: str | None  # None for a success
    exit_code: int | None
    output_tail: str | None
    started_at: datetime
    finished_at: datetime


class Settles(abc.ABC, Generic[L]):
    """ack, fail and stop_cancelled, written once: each makes one Settlement and hands it to
    `settle`, which a subclass implements. They return False (and change nothing) when the
    lease is no longer the caller's."""

    @abc.abstractmethod
    def settle(self, lease: L, settlement: Settlement) -> bool:
        """Record the settlement if the lease is still held; False (nothing changed) if not."""

    def ack(
        self,
        lease: L,
        *,
        exit_code: int | None,
        output_tail: str | None,
        started_at: datetime,
        finished_at: datetime,
    ) -> bool:
        """The run succeeded."""
        return self.settle(
            lease,
            Settlement(Finish.succeeded, None, exit_code, output_tail, started_at, finished_at),
        )

    def fail(
        self,
        lease: L,
        *,
        error: str,
        exit_code: int | None,
        output_tail: str | None,
        started_at: datetime,
        finished_at: datetime,
    ) -> bool:
        """The attempt failed: retried per the job's policy, or dead-lettered."""
        return self.settle(
            lease, Settlement(Finish.failed, error, exit_code, output_tail, started_at, finished_at)
        )

    def stop_cancelled(
        self,
        lease: L,
        *,
        error: str = CANCELLED_RUNNING_ERROR,
        exit_code: int | None,
        output_tail: str | None,
        started_at: datetime,
        finished_at: datetime,
    ) -> bool:
        """The job was cancelled and the command stopped: recorded as failed, never retried
        nor dead-lettered."""
        return self.settle(
            lease,
            Settlement(Finish.cancelled, error, exit_code, output_tail, started_at, finished_at),
        )


class ReadyFeed(Protocol):
    """Word that work is ready (a queue's new runs for a worker, new outbox rows for a
    relay), so an idle loop starts at once instead of at its next poll. A hint only: the
    loop still polls, and a lost word costs one poll."""

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True when work may have become ready meanwhile."""
        ...

    def close(self) -> None: ...


class LeaseBackend(Settles[LeasedRun]):
    """Where a worker leases runs and records their outcomes (ack, fail, stop_cancelled:
    Settles; many at once: settle_many). Every method raises
    schedctl.core.errors.StoreUnavailable when the backend cannot be reached (the worker
    retries)."""

    def ready_feed(self, queue: str) -> ReadyFeed | None:
        """A feed of `queue`'s new ready runs for one worker (its own connection), or None
        where this backend has none (the worker then finds them by polling)."""
        return None

    def run_alert_commands(
        self,
        queue: str,
        owner: str,
        command: Sequence[str],
        command_for: Callable[[Any], Any] | None,
    ) -> bool:
        """Run the host's alert command (`command`, or `command_for(alert)`) for each due
        command alert of `queue`'s jobs; whether this backend can (False, running nothing:
        over the API, where the host worker has an alert lane of its own instead)."""
        return False

    @abc.abstractmethod
    def lease(
        self, queue: str, owner: str, lease_seconds: float, limit: int
    ) -> Sequence[LeasedRun]:
        """Up to `limit` ready runs of `queue`, held for `lease_seconds`."""

    @abc.abstractmethod
    def beat(self, lease: LeasedRun, lease_seconds: float, output_tail: str | None = None) -> Beat:
        """Extend the lease; whether it is still held and whether the job was cancelled.
        `output_tail`, when given, is the run's output so far (shown by `schedctl logs`)."""

    def settle_many(
        self, items: Sequence[tuple[LeasedRun, Settlement]]
    ) -> list[bool | errors.StoreUnavailable]:
        """Settle each (lease, settlement): per item, whether it was recorded (as `settle`),
        or the StoreUnavailable that kept it from being (the caller tries it again). A
        backend that records many in one call overrides this; it may then raise
        StoreUnavailable for the whole batch, nothing of which was recorded."""
        results: list[bool | errors.StoreUnavailable] = []
        for lease, settlement in items:
            try:
                results.append(self.settle(lease, settlement))
            except errors.StoreUnavailable as exc:
                results.append(exc)
        return results

    def beat_many(
        self, items: Sequence[tuple[LeasedRun, str | None]], lease_seconds: float
    ) -> list[Beat | errors.StoreUnavailable]:
        """`beat` for each (lease, output_tail): per item, what it found, or the
        StoreUnavailable that kept it from saying. A backend that extends many leases in
        one call overrides this; it may then raise StoreUnavailable for the whole batch."""
        results: list[Beat | errors.StoreUnavailable] = []
        for lease, output_tail in items:
            try:
                results.append(self.beat(lease, lease_seconds, output_tail))
            except errors.StoreUnavailable as exc:
                results.append(exc)
        return results

    @abc.abstractmethod
    def reap(self) -> int:
        """Settle expired leases of any queue (their worker died); how many. A backend
        whose server reaps by itself returns 0."""
