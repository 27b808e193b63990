"""Owns the worker's admission: how many runs it holds (commands running or starting, and
outcomes not recorded yet) against its concurrency and record backlog, and the event the
lease loop waits on until a slot frees."""

from __future__ import annotations

import threading

# The lease loop leases once concurrency / LEASE_BATCH_DIVISOR slots are free, or
# LEASE_LINGER_SECONDS after the first one freed: one lease statement serves several runs.
LEASE_BATCH_DIVISOR = 4
LEASE_LINGER_SECONDS = 0.02
# Outcomes waiting to be recorded beyond the running commands: concurrency / this (at least
# one). When recording falls behind (a slow or absent database), leasing waits for it.
RECORD_BACKLOG_DIVISOR = 2


class Slots:
    """The runs a worker holds, counted: each is in flight (leased, its command not over)
    until `ended` (its outcome on its way to the record) or `released` (nothing to
    record), then unrecorded until `recorded`. A release or a record wakes `wait`."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self._lock = threading.Lock()
        self._freed = threading.Event()
        # runs leased whose command has not ended (or not started yet): what `concurrency`
        # bounds. A slot frees when its command ends, not when the outcome is recorded: the
        # record waits for a batch and a transaction (about half of a slot's cycle running
        # /bin/true), and the command's slot need not.
        self._in_flight = 0
        # outcomes handed to the settler and not recorded yet: at most `record_backlog`, so
        # a worker killed -9 leaves at most concurrency + that many runs to be redelivered
        self._unrecorded = 0
        self.record_backlog = max(1, concurrency // RECORD_BACKLOG_DIVISOR)

    @property
    def batch(self) -> int:
        """How many free slots make a lease worth asking for at once."""
        return max(1, self.concurrency // LEASE_BATCH_DIVISOR)

    def free(self) -> tuple[int, int]:
        """(runs that may be leased now, runs in flight)."""
        with self._lock:
            active = self._in_flight
            unrecorded = self._unrecorded
        free = min(
            self.concurrency - active,
            self.concurrency + self.record_backlog - active - unrecorded,
        )
        return free, active

    def active(self) -> int:
        """Runs leased and not yet recorded (running, or their outcome on its way)."""
        with self._lock:
            return self._in_flight + self._unrecorded

    def take(self, count: int) -> None:
        """`count` runs were leased."""
        with self._lock:
            self._in_flight += count

    def released(self, count: int) -> None:
        """`count` runs ended with nothing to record (or given up): their slots are free."""
        with self._lock:
            self._in_flight -= count
        self._freed.set()

    def ended(self, count: int) -> None:
        """The commands of `count` runs are over and their outcomes go to be recorded: their
        slots are free now (`wake` once the outcomes are handed on), and they count against
        the record backlog until recorded."""
        with self._lock:
            self._in_flight -= count
            self._unrecorded += count

    def recorded(self, count: int) -> None:
        """`count` outcomes are recorded (or given up)."""
        with self._lock:
            self._unrecorded -= count
        self._freed.set()

    def wake(self) -> None:
        """Wake the lease loop (runs may be ready)."""
        self._freed.set()

    def clear(self) -> None:
        """Before a look: a change after it wakes the next `wait`."""
        self._freed.clear()

    def wait(self, timeout: float) -> bool:
        """Until a slot frees (or `wake`), at most `timeout` seconds."""
        return self._freed.wait(timeout)

    def empty(self) -> bool:
        """Nothing in flight, nothing unrecorded."""
        with self._lock:
            return self._in_flight == 0 and self._unrecorded == 0
