"""The retry policies: exponential backoff with jitter, bounded, and cut short by a stop."""

from __future__ import annotations

import threading

import pytest

from schedctl.core import errors, retrying
from schedctl.core.retrying import Backoff, BackoffPolicy, call_with_retries

POLICY = BackoffPolicy(first_seconds=0.5, max_seconds=5.0, jitter_seconds=0.25)
# no waiting at all, so tests that retry do not sleep
INSTANT = BackoffPolicy(first_seconds=1e-6, max_seconds=1e-6, jitter_seconds=0.0)


def test_delays_grow_exponentially_up_to_the_cap_plus_jitter() -> None:
    for failures, base in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 5.0), (500, 5.0)]:
        delays = [POLICY.delay(failures) for _ in range(50)]
        assert all(base <= d <= base + 0.25 for d in delays), (failures, delays)
    assert len({POLICY.delay(1) for _ in range(20)}) > 1, "no jitter"


@pytest.mark.parametrize(
    "policy",
    [retrying.STORE_UNAVAILABLE, retrying.ZOOKEEPER_ROUND, retrying.BROKER_RECONNECT],
)
def test_every_policy_is_bounded(policy: BackoffPolicy) -> None:
    assert policy.delay(10_000) <= policy.max_seconds + policy.jitter_seconds


@pytest.mark.parametrize(
    ("first", "most", "jitter"), [(0.0, 1.0, 0.0), (2.0, 1.0, 0.0), (1.0, 1.0, -1.0)]
)
def test_a_policy_that_makes_no_sense_is_refused(first: float, most: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        BackoffPolicy(first_seconds=first, max_seconds=most, jitter_seconds=jitter)


def test_backoff_counts_failures_and_resets() -> None:
    backoff = Backoff(POLICY)
    assert 0.5 <= backoff.next_delay() <= 0.75
    assert 1.0 <= backoff.next_delay() <= 1.25
    backoff.reset()
    assert 0.5 <= backoff.next_delay() <= 0.75


def test_a_set_stop_event_cuts_the_wait_short() -> None:
    stop = threading.Event()
    stop.set()
    long = Backoff(BackoffPolicy(first_seconds=3600, max_seconds=3600, jitter_seconds=0))
    assert long.wait(stop) is True


def test_retries_until_success_and_reports_each_retry() -> None:
    calls: list[int] = []
    seen: list[BaseException] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise errors.StoreUnavailable("down")
        return "done"

    result = call_with_retries(
        flaky,
        policy=INSTANT,
        retry_on=errors.StoreUnavailable,
        attempts=5,
        on_retry=seen.append,
    )
    assert result == "done" and len(calls) == 3 and len(seen) == 2


def test_gives_up_after_the_attempts_with_the_last_error() -> None:
    calls: list[int] = []

    def down() -> None:
        calls.append(1)
        raise errors.StoreUnavailable(f"down {len(calls)}")

    with pytest.raises(errors.StoreUnavailable, match="down 2"):
        call_with_retries(down, policy=INSTANT, retry_on=errors.StoreUnavailable, attempts=2)


def test_other_errors_are_not_retried() -> None:
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise ValueError("bug")

    with pytest.raises(ValueError, match="bug"):
        call_with_retries(broken, policy=INSTANT, retry_on=lambda e: False, attempts=5)
    assert len(calls) == 1


def test_a_stop_gives_up_instead_of_waiting_out_the_backoff() -> None:
    stop = threading.Event()
    calls: list[int] = []
    hour = BackoffPolicy(first_seconds=3600, max_seconds=3600, jitter_seconds=0)

    def down() -> None:
        calls.append(1)
        stop.set()  # asked to stop while the store is away
        raise errors.StoreUnavailable("down")

    with pytest.raises(errors.StoreUnavailable):
        call_with_retries(
            down, policy=hour, retry_on=errors.StoreUnavailable, give_up_after=7200, stop=stop
        )
    assert len(calls) == 1


def test_a_retry_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="bound"):
        call_with_retries(lambda: None, policy=INSTANT, retry_on=errors.StoreUnavailable)
