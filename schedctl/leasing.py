"""Owns the seam between the queue worker and where its runs come from: `LeaseBackend` (lease,
beat, ack, fail, stop_cancelled, reap) and `LeasedRun`, what the worker needs of a held run.

Two backends implement it: the direct one over the database (scheduled_d.worker.DirectBackend,
over schedctl.storage.queue.QueueRepo) and the tenant one over the REST API
(schedctl.queue_client.ApiLeaseBackend), so the worker's supervision (heartbeats, timeouts,
cancellation, output tails) is one piece of code for both.

Nothing here imports the database layer: a worker with `--api` holds no database credentials
and loads no database code.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class LeaseBackend(Protocol):
    """Where a worker leases runs and records their outcomes. Every method raises
    schedctl.errors.StoreUnavailable when the backend cannot be reached (the worker retries);
    ack, fail and stop_cancelled return False when the lease is no longer the worker's."""

    def lease(
        self, queue: str, owner: str, lease_seconds: float, limit: int
    ) -> Sequence[LeasedRun]:
        """Up to `limit` ready runs of `queue`, held for `lease_seconds`."""
        ...

    def beat(self, lease: LeasedRun, lease_seconds: float, output_tail: str | None = None) -> Beat:
        """Extend the lease; whether it is still held and whether the job was cancelled.
        `output_tail`, when given, is the run's output so far (shown by `schedctl logs`)."""
        ...

    def ack(
        self,
        lease: LeasedRun,
        *,
        exit_code: int | None,
        output_tail: str | None,
        started_at: datetime,
        finished_at: datetime,
    ) -> bool:
        """The run succeeded."""
        ...

    def fail(
        self,
        lease: LeasedRun,
        *,
        error: str,
        exit_code: int | None,
        output_tail: str | None,
        started_at: datetime,
        finished_at: datetime,
    ) -> bool:
        """The attempt failed: retried per the job's policy, or dead-lettered."""
        ...

    def stop_cancelled(
        self,
        lease: LeasedRun,
        *,
        exit_code: int | None,
        output_tail: str | None,
        started_at: datetime,
        finished_at: datetime,
        error: str,
    ) -> bool:
        """The job was cancelled and the command stopped: recorded, never retried."""
        ...

    def reap(self) -> int:
        """Settle expired leases of any queue (their worker died); how many. A backend
        whose server reaps by itself returns 0."""
        ...
