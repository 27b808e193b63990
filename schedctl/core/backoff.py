"""Retry delays: exponential backoff with full jitter, shared by every delivery path (settling
uses it to schedule the next attempt)."""

from __future__ import annotations

import random

# One module-level generator: jitter needs no cryptographic quality, only spread.
_RNG = random.Random()


def backoff_ceiling(attempt: int, base: float, cap: float) -> float:
    """The upper bound of the delay after failed attempt `attempt` (1-based)."""
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    if base < 0 or cap < 0:
        raise ValueError("base and cap must not be negative")
    # cap the exponent first: 2 ** 1000 would overflow a float long before it mattered
    exponent = min(attempt - 1, 62)
    return float(min(cap, base * 2.0**exponent))


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retrying after failed attempt `attempt` (1-based):
    uniform(0, min(cap, base * 2 ** (attempt - 1))). Full jitter spreads the retries of
    many runs that failed together (an endpoint outage) instead of retrying in lockstep."""
    ceiling = backoff_ceiling(attempt, base, cap)
    return (rng or _RNG).uniform(0.0, ceiling)
