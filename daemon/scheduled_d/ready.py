"""Owns `ReadyListener`, the thread that turns a ReadyFeed's word (Postgres LISTEN: new
ready messages for a worker's queue, new outbox rows for a relay) into a wake() of the
waiting loop, so that work readied by a claim starts moments after it, not at the next
poll. The loops still poll: the word is a hint."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from schedctl.domain.leasing import ReadyFeed

log = logging.getLogger(__name__)

# the longest a listener waits between looks at its stop flag
WAIT_SECONDS = 0.25


class ReadyListener:
    def __init__(self, feed: ReadyFeed, wake: Callable[[], None], name: str) -> None:
        self._feed = feed
        self._wake = wake
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_SECONDS * 40)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._feed.wait(WAIT_SECONDS):
                    self._wake()
        except Exception:
            # a hint only: the loop still finds its work by polling
            log.exception("%s: listening for ready work failed", self._thread.name)
        finally:
            self._feed.close()
