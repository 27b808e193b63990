"""SIGTERM/SIGINT handling: the first asks for a warm stop, the second forces it.

SIGHUP never stops the daemon (its default action would kill it and orphan the commands its
workers run): it calls the reload hook set by set_reload_hook() in a thread of its own (the
daemon's entry point re-reads the configuration's log level), or only logs it."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)

_reload_hook: Callable[[], None] | None = None
# also called on SIGHUP, after the hook: components that reload on their own (the host
# worker's job files)
_listeners: list[Callable[[], None]] = []


def set_reload_hook(hook: Callable[[], None] | None) -> None:
    """What SIGHUP does (None: log that it was received, nothing else)."""
    global _reload_hook
    _reload_hook = hook


def add_reload_listener(listener: Callable[[], None]) -> Callable[[], None]:
    """Call `listener` on each SIGHUP (after the reload hook); returns its remover."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def _reload() -> None:
    hook = _reload_hook
    if hook is None and not _listeners:
        log.info("received SIGHUP: nothing to reload")
        return
    for each in [hook, *_listeners]:
        if each is None:
            continue
        try:
            each()
        except Exception:  # a failed reload keeps the daemon running on its current settings
            log.exception("reload on SIGHUP failed; the current settings stay")


def handle_sighup(_signum: int = signal.SIGHUP, _frame: FrameType | None = None) -> None:
    # the work happens in a thread: logging from inside a signal handler can interrupt a
    # write to the same stream in the main thread
    threading.Thread(target=_reload, name="sighup-reload", daemon=True).start()


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
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, handle_sighup)
    try:
        yield stop, force
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
