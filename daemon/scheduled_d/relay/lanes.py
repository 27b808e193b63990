"""Owns the relay's reading of the outbox: per lane (tenant and kind), what to claim so that
its slots can start now and right after, the batches claimed and waiting for a slot, and
the slots running (started by scheduled_d.relay.senders, which take batches from here)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from schedctl.delivery.limits import DeliveryLimits
from schedctl.domain.models import Lane, TargetType
from schedctl.storage.pipeline.outbox import Delivery, OutboxRepo, TenantSettings
from scheduled_d.relay.leases import HeldLeases
from scheduled_d.relay.stats import RelayStats

log = logging.getLogger("scheduled_d.relay")

# RabbitMQ publishes are quick: one slot publishes up to this many runs in a row.
RABBITMQ_PER_SLOT = 50
# A lane with batches still waiting is refilled once this fraction of its slots' worth can
# be claimed (at 1/4 and a waiting batch per slot, the lane never runs dry meanwhile).
REFILL_FRACTION = 4


def per_slot(lane: Lane) -> int:
    """Runs one slot of the lane delivers in a row."""
    return RABBITMQ_PER_SLOT if lane.kind == TargetType.rabbitmq else 1


class Lanes:
    """The relay's lanes: `pump` claims for them and says which slots to start; a slot
    takes its lane's batches (`next_batch`) until none is left, then leaves (`slot_left`,
    which calls `freed`). Claimed leases are held in `leases` (the heartbeat extends
    them)."""

    def __init__(
        self,
        outbox: OutboxRepo,
        limits: DeliveryLimits,
        leases: HeldLeases,
        stats: RelayStats,
        *,
        owner: str,
        lease_seconds: float,
        poll_seconds: float,
        freed: Callable[[], None],
    ) -> None:
        self.outbox = outbox
        self.limits = limits
        self.leases = leases
        self.stats = stats
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self._freed = freed
        self._rotation = 0
        self._closing = threading.Event()
        # batches claimed and waiting for a slot of their lane, and the slots running
        self._queued: dict[Lane, deque[list[Delivery]]] = {}
        self._running: dict[Lane, int] = {}
        self._lock = threading.Lock()
        self._drained: set[Lane] = set()  # lanes whose last claim found less than it asked
        self._last_active: dict[Lane, float] = {}  # when a slot of the lane last finished

    def lanes(self, tenants: Iterable[TenantSettings]) -> list[Lane]:
        lanes = []
        for tenant in tenants:
            lanes.append(Lane(tenant.tenant_id, TargetType.http))
            if tenant.broker_url:
                lanes.append(Lane(tenant.tenant_id, TargetType.rabbitmq))
        # a different lane goes first each pass: when the whole relay is at max_in_flight,
        # the slots that free up are shared round-robin, not always won by the first tenant
        if lanes:
            self._rotation = (self._rotation + 1) % len(lanes)
            lanes = lanes[self._rotation :] + lanes[: self._rotation]
        return lanes

    def pump(
        self, tenants: Iterable[TenantSettings], *, every_lane: bool = True
    ) -> tuple[int, list[Lane]]:
        """Claim what the lanes can start now or right after and queue it for their slots;
        returns the number of runs claimed and a lane per slot to start (their places
        taken already). With every_lane=False (a slot just freed) only lanes that had more
        than they could take last time, or delivered within the last poll interval, are
        asked again: idle tenants cost one probe per poll, not one per delivery."""
        caps: dict[Lane, int] = {}
        now = time.monotonic()
        for lane in self.lanes(tenants):
            if (
                not every_lane
                and lane in self._drained
                and now - self._last_active.get(lane, float("-inf")) > self.poll_seconds
            ):
                continue
            slot_rows = per_slot(lane)
            with self._lock:
                queued = len(self._queued.get(lane, ()))
            rows = self.limits.capacity(lane, per_slot=slot_rows, queued=queued)
            if not every_lane and queued and rows < self._refill_rows(lane, slot_rows):
                # the lane still has batches waiting: let a few more slots free up, so that
                # one claim transaction refills many of them (claims cost several
                # statements whatever their size)
                continue
            if rows > 0:
                caps[lane] = rows
        claimed = self.outbox.claim(caps, self.owner, self.lease_seconds) if caps else None
        by_lane: dict[Lane, list[Delivery]] = {}
        if claimed is not None:
            self.stats.skipped += claimed.cancelled
            self.stats.lost += claimed.lost
            if claimed.lost:
                log.warning(
                    "relay: %d delivery lease(s) of a stopped relay expired: lost attempts",
                    claimed.lost,
                )
            self.leases.hold(claimed.deliveries)
            for delivery in claimed.deliveries:
                by_lane.setdefault(delivery.lane, []).append(delivery)
            for lane, cap in caps.items():
                # fewer than asked: nothing more is due there until the next full pass
                if len(by_lane.get(lane, ())) + claimed.cancelled < cap:
                    self._drained.add(lane)
                else:
                    self._drained.discard(lane)
        slots: list[Lane] = []
        with self._lock:
            for lane, deliveries in by_lane.items():
                self.limits.take_tokens(lane.tenant_id, len(deliveries))
                waiting = self._queued.setdefault(lane, deque())
                slot_rows = per_slot(lane)
                for i in range(0, len(deliveries), slot_rows):
                    waiting.append(deliveries[i : i + slot_rows])
            # a slot per waiting batch, as far as the lane and the relay allow
            for lane, waiting in list(self._queued.items()):
                started = self._running.get(lane, 0)
                while len(waiting) > started and self.limits.try_acquire(lane):
                    slots.append(lane)
                    started += 1
                self._running[lane] = started
                if not waiting and not started:
                    del self._queued[lane]
                    self._running.pop(lane, None)
        return (len(claimed.deliveries) if claimed is not None else 0), slots

    def _refill_rows(self, lane: Lane, slot_rows: int) -> int:
        """The smallest claim worth making for a lane that still has batches waiting: a
        quarter of its slots' worth (its waiting batches cover half of them meanwhile)."""
        return max(1, self.limits.concurrency(lane) // REFILL_FRACTION) * slot_rows

    def next_batch(self, lane: Lane) -> list[Delivery] | None:
        """The lane's next waiting batch, or None when the slot leaves (counted out of the
        lane's running slots in the same lock as the look: pump() never counts on a slot
        that is already leaving)."""
        with self._lock:
            waiting = self._queued.get(lane)
            if self._closing.is_set() or not waiting:
                self._running[lane] = self._running.get(lane, 1) - 1
                return None
            return waiting.popleft()

    def slot_left(self, lane: Lane, counted: bool) -> None:
        """A slot of `lane` ended (`counted`: not through next_batch, which counts it out)."""
        with self._lock:
            if counted:
                self._running[lane] = self._running.get(lane, 1) - 1
            self._last_active[lane] = time.monotonic()
        self.limits.release(lane)
        self._freed()

    def close(self) -> list[Delivery]:
        """No batch starts any more: the ones waiting, to give back to the outbox."""
        self._closing.set()
        with self._lock:
            waiting = [d for batches in self._queued.values() for b in batches for d in b]
            self._queued.clear()
        return waiting

    def waiting(self) -> bool:
        """Whether batches wait for a slot."""
        with self._lock:
            return any(self._queued.values())
