"""SIGTERM/SIGINT handling: the first asks for a warm stop, the second forces it."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)


@contextmanager
def stop_on_signals() -> Iterator[tuple[threading.Event, threading.Event]]:
    """Yields (stop, force); restores the previous handlers on exit."""
    stop, force = threading.Event(), threading.Event()
    first_at = [0.0]

    def handle(signum: int, _frame: FrameType | None) -> None:
        if not stop.is_set():
            first_at[0] = time.monotonic()
            log.info("received %s: finishing in-flight work", signal.Signals(signum).name)
            stop.set()
        elif time.monotonic() - first_at[0] > 1.0:  # a duplicate within 1 s is the same request
            log.warning("received %s again: stopping now", signal.Signals(signum).name)
            force.set()

    previous = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop, force
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
