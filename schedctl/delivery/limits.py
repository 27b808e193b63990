"""Owns per-tenant delivery limits: a token bucket per tenant (its dispatch_rate_per_second)
and a concurrency budget per lane (one tenant's HTTP deliveries, or its RabbitMQ publishes).

The relay asks `capacity` before it claims outbox rows, so it only ever takes what its
slots can start now or right after: a tenant whose endpoint hangs fills its own lane and
nothing else, and its backlog stays in the outbox (leased by nobody) instead of queueing
in front of others.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from schedctl.domain.models import Lane

Clock = Callable[[], float]


class TokenBucket:
    """`rate` tokens a second, holding at most `burst` (default: one second's worth); the
    dispatcher paces a tenant's catch-up with one too."""

    def __init__(self, rate: float, burst: float | None = None, *, clock: Clock = time.monotonic):
        self._clock = clock
        self.rate = max(float(rate), 0.0)
        self.burst = max(float(burst if burst is not None else rate), 1.0)
        self._tokens = self.burst
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def set_rate(self, rate: float, burst: float | None = None) -> None:
        self._refill()
        self.rate = max(float(rate), 0.0)
        self.burst = max(float(burst if burst is not None else rate), 1.0)
        self._tokens = min(self._tokens, self.burst)

    def available(self) -> int:
        self._refill()
        return int(self._tokens)

    def take(self, count: int) -> int:
        """Take up to `count` whole tokens; returns how many were taken."""
        self._refill()
        granted = max(0, min(count, int(self._tokens)))
        self._tokens -= granted
        return granted


class DeliveryLimits:
    """Per-tenant rate, per-lane concurrency and a process-wide cap; thread-safe.

    - max_in_flight: deliveries running at once in this relay, all lanes together.
    - default_concurrency / default_rate: for tenants not configured (yet).
    """

    def __init__(
        self,
        *,
        max_in_flight: int = 512,
        default_concurrency: int = 16,
        default_rate: float = 1000.0,
        clock: Clock = time.monotonic,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self.default_concurrency = default_concurrency
        self.default_rate = default_rate
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, TokenBucket] = {}
        self._concurrency: dict[str, int] = {}
        self._busy: dict[Lane, int] = {}
        self._total = 0

    def configure(self, tenant_id: str, *, rate_per_second: float, concurrency: int) -> None:
        """Set (or change) a tenant's limits; in-flight work is not affected."""
        with self._lock:
            bucket = self._buckets.get(tenant_id)
            if bucket is None:
                self._buckets[tenant_id] = TokenBucket(rate_per_second, clock=self._clock)
            elif bucket.rate != rate_per_second:
                bucket.set_rate(rate_per_second)
            self._concurrency[tenant_id] = max(1, concurrency)

    def _bucket(self, tenant_id: str) -> TokenBucket:
        bucket = self._buckets.get(tenant_id)
        if bucket is None:
            bucket = self._buckets[tenant_id] = TokenBucket(self.default_rate, clock=self._clock)
        return bucket

    def concurrency(self, lane: Lane) -> int:
        with self._lock:
            return self._concurrency.get(lane.tenant_id, self.default_concurrency)

    def _free_slots(self, lane: Lane) -> int:
        limit = self._concurrency.get(lane.tenant_id, self.default_concurrency)
        return max(0, min(limit - self._busy.get(lane, 0), self.max_in_flight - self._total))

    def capacity(self, lane: Lane, *, per_slot: int = 1, queued: int = 0) -> int:
        """How many rows this lane may claim now: enough for every slot to be busy and to
        have one more batch waiting (`queued` batches wait already), no more than the
        tenant's tokens allow. The waiting batch is what keeps a fast lane busy while the
        next claim is on its way; a slow lane's backlog still stays in the outbox."""
        with self._lock:
            limit = self._concurrency.get(lane.tenant_id, self.default_concurrency)
            busy = self._busy.get(lane, 0)
            batches = 2 * limit - busy - queued
            if self._total >= self.max_in_flight:
                # the relay is full: only this lane's own running slots will take more
                batches = min(batches, busy - queued)
            if batches <= 0:
                return 0
            return min(batches * per_slot, self._bucket(lane.tenant_id).available())

    def take_tokens(self, tenant_id: str, count: int) -> None:
        """Spend `count` tokens (for rows claimed within `capacity`)."""
        with self._lock:
            self._bucket(tenant_id).take(count)

    def try_acquire(self, lane: Lane) -> bool:
        """Occupy one slot of the lane (and of the relay) if one is free."""
        with self._lock:
            if self._free_slots(lane) <= 0:
                return False
            self._busy[lane] = self._busy.get(lane, 0) + 1
            self._total += 1
            return True

    def release(self, lane: Lane) -> None:
        with self._lock:
            left = self._busy.get(lane, 0) - 1
            if left > 0:
                self._busy[lane] = left
            else:
                self._busy.pop(lane, None)
            self._total = max(0, self._total - 1)

    def busy(self, lane: Lane) -> int:
        with self._lock:
            return self._busy.get(lane, 0)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._total
