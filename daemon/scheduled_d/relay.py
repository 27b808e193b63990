"""The outbox relay: moves claimed runs from the outbox to their targets (today the built-in
queue) and settles queue leases whose worker died."""

from __future__ import annotations

import logging
import threading
import time

from schedctl import errors
from schedctl.storage.queue import QueueRepo
from schedctl.storage.store import Store

log = logging.getLogger(__name__)

# Backoff while the database is away: short at first, never long enough to matter after.
STORE_RETRY_MIN_SECONDS = 0.5
STORE_RETRY_MAX_SECONDS = 5.0


class Relay:
    """Polls the outbox every `poll_seconds` (or at once after `wake()`), moving up to
    `batch_size` rows per transaction; reaps expired queue leases every `reap_seconds`.
    Several relays may run at once: the outbox is read with SKIP LOCKED on Postgres."""

    def __init__(
        self,
        store: Store,
        *,
        batch_size: int = 500,
        poll_seconds: float = 0.2,
        reap_seconds: float = 1.0,
    ) -> None:
        self.store = store
        self.repo = QueueRepo(store)
        self.batch_size = batch_size
        self.poll_seconds = poll_seconds
        self.reap_seconds = reap_seconds
        self.moved = 0
        self.reaped = 0
        self.store_errors = 0  # passes that found the database unavailable
        self._wake = threading.Event()
        self._next_reap = 0.0

    def wake(self) -> None:
        """New outbox rows were committed: relay them now instead of at the next poll."""
        self._wake.set()

    def run_once(self) -> int:
        """One pass: a batch of outbox rows, and the lease reaper when it is due. Returns
        the number of rows moved."""
        moved = self.repo.move_outbox(self.batch_size)
        self.moved += moved
        if time.monotonic() >= self._next_reap:
            reaped = self.repo.expire_leases(self.batch_size)
            self.reaped += reaped
            if reaped:
                log.info("relay: settled %d expired queue lease(s)", reaped)
            self._next_reap = time.monotonic() + self.reap_seconds
        return moved

    def run(self, stop: threading.Event) -> None:
        """Relay until `stop` is set; database outages are logged and waited out."""
        retry = STORE_RETRY_MIN_SECONDS
        unavailable = False
        while not stop.is_set():
            # cleared before the pass: a wake() during it makes the next wait return at once
            self._wake.clear()
            try:
                moved = self.run_once()
            except errors.StoreUnavailable as exc:
                self.store_errors += 1
                if not unavailable:
                    log.warning("relay: database unavailable: %s; retrying", exc)
                unavailable = True
                stop.wait(retry)
                retry = min(retry * 2, STORE_RETRY_MAX_SECONDS)
                continue
            if unavailable:
                log.info("relay: database reachable again")
                unavailable = False
                retry = STORE_RETRY_MIN_SECONDS
            if moved >= self.batch_size:
                continue  # a full batch: more are probably waiting
            self._wake.wait(self.poll_seconds)
