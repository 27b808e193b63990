"""Retry backoff: exponential growth, full jitter within bounds, the cap, determinism."""

from __future__ import annotations

import random

import pytest

from schedctl.core.backoff import backoff_ceiling, backoff_delay


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (7, 60.0), (10_000, 60.0)],
)
def test_ceiling_doubles_up_to_the_cap(attempt: int, expected: float) -> None:
    assert backoff_ceiling(attempt, 1.0, 60.0) == expected


@pytest.mark.parametrize("attempt", [1, 2, 3, 5, 8, 50, 100_000])
def test_delay_is_within_zero_and_the_ceiling(attempt: int) -> None:
    rng = random.Random(attempt)
    ceiling = backoff_ceiling(attempt, 0.5, 30.0)
    for _ in range(500):
        delay = backoff_delay(attempt, 0.5, 30.0, rng)
        assert 0.0 <= delay <= ceiling


def test_full_jitter_spreads_over_the_whole_range() -> None:
    rng = random.Random(7)
    delays = [backoff_delay(4, 1.0, 100.0, rng) for _ in range(2000)]
    # full jitter, not "ceiling plus a little": both halves of [0, 8] are used
    assert min(delays) < 1.0
    assert max(delays) > 7.0


def test_cap_bounds_every_delay() -> None:
    rng = random.Random(3)
    assert max(backoff_delay(40, 2.0, 5.0, rng) for _ in range(1000)) <= 5.0


def test_seeded_rng_is_deterministic() -> None:
    first = [backoff_delay(a, 1.0, 60.0, random.Random(42)) for a in range(1, 10)]
    second = [backoff_delay(a, 1.0, 60.0, random.Random(42)) for a in range(1, 10)]
    assert first == second


def test_zero_base_means_no_delay() -> None:
    assert backoff_delay(3, 0.0, 10.0) == 0.0


def test_attempt_is_one_based() -> None:
    with pytest.raises(ValueError):
        backoff_delay(0, 1.0, 10.0)
    with pytest.raises(ValueError):
        backoff_delay(1, -1.0, 10.0)
