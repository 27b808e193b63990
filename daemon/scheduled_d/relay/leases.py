"""Owns the relay's hold on what it claimed: the leases of the runs it holds (waiting for a
slot, in flight, or delivered and not recorded yet) and the heartbeat thread that extends
them all, every heartbeat_seconds, in one statement per EXTEND_BATCH."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from schedctl.core import errors
from schedctl.storage.pipeline.outbox import Delivery, OutboxRepo

log = logging.getLogger("scheduled_d.relay")

# leases extended per statement
EXTEND_BATCH = 5000


class HeldLeases:
    """The leases `owner` holds in the outbox, extended by `lease_seconds` every
    `heartbeat_seconds` once started. A relay that dies stops extending, and another
    relay delivers its runs again about one lease later."""

    def __init__(
        self, outbox: OutboxRepo, owner: str, lease_seconds: float, heartbeat_seconds: float
    ) -> None:
        self.outbox = outbox
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        # leases claimed and not settled yet: (outbox id, lease token) -> outbox id
        self._held: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.extended = 0  # leases extended by the heartbeat
        self.errors = 0  # heartbeats that failed

    def hold(self, deliveries: Sequence[Delivery]) -> None:
        with self._lock:
            for d in deliveries:
                self._held[(d.outbox_id, d.lease)] = d.outbox_id

    def let_go(self, deliveries: Sequence[Delivery]) -> None:
        with self._lock:
            for d in deliveries:
                self._held.pop((d.outbox_id, d.lease), None)

    def count(self) -> int:
        """Leases claimed and not settled yet (what the heartbeat extends)."""
        with self._lock:
            return len(self._held)

    def start(self) -> None:
        """Start the heartbeat thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="relay-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _serve(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            self.extend()

    def extend(self) -> int:
        """Extend the leases of every run held; returns how many were extended. A failure
        is logged: the next beat tries again, and the lease has two more beats of slack."""
        with self._lock:
            ids = sorted(set(self._held.values()))
        extended = 0
        try:
            for start in range(0, len(ids), EXTEND_BATCH):
                extended += self.outbox.extend(
                    ids[start : start + EXTEND_BATCH], self.owner, self.lease_seconds
                )
        except errors.StoreUnavailable as exc:
            self.errors += 1
            log.warning("relay: cannot extend %d lease(s): %s", len(ids), exc)
        except Exception:
            self.errors += 1
            log.exception("relay: extending %d lease(s) failed", len(ids))
        self.extended += extended
        return extended
