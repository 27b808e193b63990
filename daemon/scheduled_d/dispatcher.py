"""The dispatcher: for the partitions it owns, claims each due run at its time, in batches."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from schedctl import errors
from schedctl.coordination.base import Coordinator
from schedctl.storage.claim import Claimer, ClaimResult
from schedctl.storage.store import Store

log = logging.getLogger(__name__)

CLOCK_RESYNC_SECONDS = 30.0


@dataclass
class DispatcherStats:
    claimed: int = 0
    skipped: int = 0
    stale: int = 0
    fenced_batches: int = 0
    aborted_batches: int = 0


class Dispatcher:
    """Claims due runs of owned partitions; "now" is the database clock (measured offset)."""

    def __init__(
        self,
        store: Store,
        coordinator: Coordinator,
        *,
        owner: str,
        batch_size: int = 1000,
        poll_seconds: float = 0.25,
        on_claimed: Callable[[ClaimResult], None] | None = None,
    ) -> None:
        self.store = store
        self.coordinator = coordinator
        self.claimer = Claimer(store, owner)
        self.batch_size = batch_size
        self.poll_seconds = poll_seconds
        self.on_claimed = on_claimed
        self.stats = DispatcherStats()
        self.wake_event = threading.Event()
        self._offset = 0.0
        self._offset_at = float("-inf")

    def wake(self) -> None:
        """A job was created or changed: look again now instead of at the next poll."""
        self.wake_event.set()

    def now(self) -> datetime:
        if time.monotonic() - self._offset_at > CLOCK_RESYNC_SECONDS:
            self._offset = self.store.clock_offset()
            self._offset_at = time.monotonic()
        return datetime.now(UTC) + timedelta(seconds=self._offset)

    def tick(self) -> int:
        """Claim one batch of due runs; returns how many jobs were claimed."""
        owned = self.coordinator.owned()
        if not owned:
            return 0
        now = self.now()
        due = self.claimer.load_due(owned.keys(), now, self.batch_size)
        if not due:
            return 0
        result = self.claimer.claim(due, owned, now)
        self.stats.claimed += len(result.dispatched)
        self.stats.skipped += result.skipped
        self.stats.stale += result.stale
        if result.fenced:
            self.stats.fenced_batches += 1
            log.warning(
                "fenced off partitions %s: another dispatcher owns them", sorted(result.fenced)
            )
        if result.aborted:
            self.stats.aborted_batches += 1
        if result.dispatched and self.on_claimed is not None:
            self.on_claimed(result)
        return len(due)

    def run(self, stop: threading.Event) -> None:
        log.info("dispatcher started")
        while not stop.is_set():
            try:
                claimed = self.tick()
            except errors.StoreUnavailable as exc:
                log.warning("database unavailable, retrying: %s", exc)
                stop.wait(1.0)
                continue
            if claimed >= self.batch_size:
                continue  # more is due: no sleep
            self.wake_event.wait(self.poll_seconds)
            self.wake_event.clear()
        log.info("dispatcher stopped (claimed %d runs)", self.stats.claimed)
