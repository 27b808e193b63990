"""The sd_notify protocol, by hand: datagrams of "KEY=VALUE" lines to the AF_UNIX socket
named by $NOTIFY_SOCKET (a path, or "@name" for the abstract namespace).

Without $NOTIFY_SOCKET (not started by systemd with Type=notify) every call does nothing.
The hooks the daemon's modes call: ready(status), watchdog(), stopping(), status(text), and
start_watchdog(healthy, stop), which sends WATCHDOG=1 at half of $WATCHDOG_USEC for as long
as healthy() is true (a component that died stops the pings, and systemd restarts the unit).

The variables are removed from os.environ when first read, so the commands that workers run
never inherit them (they could otherwise send READY=1 or STOPPING=1 on the daemon's behalf).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_ENV_NAMES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """One connection-less sender to a notify socket (None: a no-op notifier)."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address or None
        self.watchdog_usec = watchdog_usec
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None, *, unset: bool = True) -> Notifier:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        usec: int | None = None
        raw_usec, raw_pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is for: a child that inherited the
        # variables must not ping on its parent's behalf
        for_us = not raw_pid or raw_pid == str(os.getpid())
        if raw_usec.isdigit() and int(raw_usec) > 0 and for_us:
            usec = int(raw_usec)
        if unset and environ is None:
            for name in _ENV_NAMES:
                os.environ.pop(name, None)
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between pings: half the watchdog timeout, as sd_watchdog_enabled(3) says."""
        return self.watchdog_usec / 2_000_000 if self.watchdog_usec else None

    def _target(self) -> str | bytes:
        assert self.address is not None
        if self.address.startswith("@"):
            return b"\0" + self.address[1:].encode()  # the abstract namespace
        return self.address

    def notify(self, *lines: str) -> bool:
        """Send the lines as one datagram; False (logged at DEBUG) when nobody listens."""
        if self.address is None:
            return False
        message = "\n".join(line.replace("\n", " ") for line in lines).encode()
        with self._lock:
            try:
                if self._sock is None:
                    kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    self._sock = socket.socket(socket.AF_UNIX, kind)
                self._sock.sendto(message, self._target())
            except OSError as exc:
                log.debug("sd_notify to %s failed: %s", self.address, exc)
                return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def start_watchdog(
        self, healthy: Callable[[], bool], stop: threading.Event
    ) -> threading.Thread | None:
        """A thread that sends WATCHDOG=1 every watchdog_interval while healthy() holds, until
        `stop`; None when the unit has no WatchdogSec= (or there is no notify socket)."""
        interval = self.watchdog_interval
        if interval is None or not self.enabled:
            return None

        def run() -> None:
            reported = False
            while True:
                try:
                    ok = healthy()
                except Exception:  # a broken check is an unhealthy process
                    log.exception("liveness check failed")
                    ok = False
                if ok:
                    self.watchdog()
                elif not reported:
                    reported = True
                    log.error("a component is not running: no more watchdog pings")
                    self.status("unhealthy: a component is not running")
                if stop.wait(interval):
                    return

        thread = threading.Thread(target=run, name="sd-watchdog", daemon=True)
        thread.start()
        return thread


_default: Notifier | None = None
_default_lock = threading.Lock()


def notifier() -> Notifier:
    """The process's notifier, read from (and removed from) the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Notifier.from_environ()
        return _default


def init() -> Notifier:
    """Read the environment now (before any thread or command starts)."""
    return notifier()


def ready(status: str | None = None) -> bool:
    return notifier().ready(status)


def watchdog() -> bool:
    return notifier().watchdog()


def stopping(status: str | None = None) -> bool:
    return notifier().stopping(status)


def status(text: str) -> bool:
    return notifier().status(text)


def start_watchdog(healthy: Callable[[], bool], stop: threading.Event) -> threading.Thread | None:
    return notifier().start_watchdog(healthy, stop)


def stopping_when(stop: threading.Event) -> threading.Thread | None:
    """STOPPING=1 as soon as `stop` is set (the first SIGTERM), from a thread of its own."""
    if not notifier().enabled:
        return None

    def run() -> None:
        stop.wait()
        stopping("stopping: finishing in-flight work")

    thread = threading.Thread(target=run, name="sd-stopping", daemon=True)
    thread.start()
    return thread


def announce(status: str, healthy: Callable[[], bool], stop: threading.Event) -> None:
    """What a mode calls once every component runs: READY=1 with a STATUS= line, WATCHDOG=1
    while healthy() until `stop`, and STOPPING=1 when `stop` is set."""
    ready(status)
    start_watchdog(healthy, stop)
    stopping_when(stop)
