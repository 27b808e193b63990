"""Fakes that tests hand to the code in place of what it reads from the machine: a clock the
test moves by hand (no sleeping, no timing)."""

from __future__ import annotations


class ManualClock:
    """A monotonic clock (a callable giving seconds) that moves only when a test sets `now`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
