"""Owns `Batcher`, the worker's and the relay's way to a backend: a thread that hands one
call everything submitted together (the worker's outcomes and heartbeats, the relay's
outcomes), so that one transaction serves many runs and nobody waits for it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

# Items handed to the call in one batch at most.
MAX_BATCH = 500
# How long close() waits for the thread to finish what was submitted, by default.
CLOSE_SECONDS = 10.0

Item = TypeVar("Item")


class Batcher(Generic[Item]):
    """A thread that hands `call` everything submitted while its previous call ran (at
    most `max_batch` at a time): one backend call for what arrives together. Nobody waits
    for the call: its results go where `call` sends them, and an exception escaping it is
    logged (the items are the call's to keep or give up).

    With `gather` > 1, fewer than `gather` items wait up to `linger` seconds (from the
    first one's arrival) for more: a backend call costs about as much as thirty items
    in it, so a busy worker settles in fewer, fuller calls."""

    def __init__(
        self,
        call: Callable[[list[Item]], None],
        name: str,
        *,
        gather: int = 1,
        linger: float = 0.0,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._call = call
        self._pending: list[Item] = []
        self._wake = threading.Condition()
        self._closed = False
        self._gather = gather
        self._linger = linger
        self._max_batch = max_batch
        self._first_at = 0.0  # when the first of the pending items arrived
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[Item]) -> None:
        with self._wake:
            if not self._pending:
                self._first_at = time.monotonic()
            self._pending.extend(items)
            if len(self._pending) >= self._gather or self._closed:
                self._wake.notify()
            elif len(self._pending) == len(items):
                self._wake.notify()  # the first: the thread starts its linger

    def close(self, timeout: float | None = CLOSE_SECONDS) -> None:
        """Finish what was submitted (up to `timeout` seconds; None: however long it
        takes), then end the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                while 0 < len(self._pending) < self._gather and not self._closed:
                    left = self._first_at + self._linger - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if not self._pending:
                    return
                limit = self._max_batch
                batch, self._pending = self._pending[:limit], self._pending[limit:]
            try:
                self._call(batch)
            except Exception:
                log.exception("%s: failed", self._thread.name)
