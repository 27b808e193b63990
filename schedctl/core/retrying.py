"""Owns the retry policies of the daemon's reconnect and retry loops: exponential backoff
with jitter (tenacity's wait strategies), always waited out on an event a stop sets.

One policy per kind of outage, all here: the database away (dispatcher, relay, worker),
a coordination round against ZooKeeper that failed or is not settled yet, and a broker
connection found dead. The jitter keeps a fleet of daemons that lost the same server at
the same moment from coming back in lock step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

T = TypeVar("T")

# attempt numbers past this add nothing: every policy reaches its cap long before
_MAX_EXPONENT = 64


@dataclass(frozen=True)
class BackoffPolicy:
    """Waits of `first_seconds`, then times `multiplier` per failure up to `max_seconds`,
    each plus a random jitter of up to `jitter_seconds`."""

    first_seconds: float
    max_seconds: float
    jitter_seconds: float
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.first_seconds <= self.max_seconds:
            raise ValueError("a backoff needs 0 < first_seconds <= max_seconds")
        if self.jitter_seconds < 0 or self.multiplier < 1:
            raise ValueError("a backoff needs jitter_seconds >= 0 and multiplier >= 1")

    def wait_strategy(self) -> tenacity.wait.wait_base:
        """The policy as a tenacity wait strategy (for `tenacity.Retrying`)."""
        exponential = tenacity.wait_exponential(
            multiplier=self.first_seconds, max=self.max_seconds, exp_base=self.multiplier
        )
        return exponential + tenacity.wait_random(0, self.jitter_seconds)

    def delay(self, failures: int) -> float:
        """The wait after `failures` failures in a row (1 is the first)."""
        retrying = tenacity.Retrying(wait=self.wait_strategy())
        state = tenacity.RetryCallState(retrying, fn=None, args=(), kwargs={})
        state.attempt_number = min(max(failures, 1), _MAX_EXPONENT)
        return float(retrying.wait(state))


# The database is away: short at first, never long enough to matter once it is back.
STORE_UNAVAILABLE = BackoffPolicy(first_seconds=0.5, max_seconds=5.0, jitter_seconds=0.5)
# A ZooKeeper coordination round that failed (connection trouble) or left a partition to
# take once its old owner lets go; the owner node's watch usually wakes the round sooner.
ZOOKEEPER_ROUND = BackoffPolicy(first_seconds=0.2, max_seconds=1.0, jitter_seconds=0.1)
# A pooled broker connection found dead: reconnect almost at once, a broker restart is
# the usual cause and the delivery is waiting.
BROKER_RECONNECT = BackoffPolicy(first_seconds=0.05, max_seconds=1.0, jitter_seconds=0.05)


class Backoff:
    """The failures in a row of one long-running loop and the wait each one earns.

    `wait(event)` returns early when the event is set, so a stop never waits out a long
    backoff; `reset()` after a success starts the next outage from the first wait.
    """

    def __init__(self, policy: BackoffPolicy) -> None:
        self.policy = policy
        self.failures = 0

    def next_delay(self) -> float:
        """Count one more failure; the wait it earns."""
        self.failures += 1
        return self.policy.delay(self.failures)

    def wait(self, event: threading.Event) -> bool:
        """Count one more failure and wait for it unless `event` is set first; True if
        the event is set."""
        return event.wait(self.next_delay())

    def reset(self) -> None:
        self.failures = 0


def call_with_retries(
    action: Callable[[], T],
    *,
    policy: BackoffPolicy,
    retry_on: type[BaseException] | Callable[[BaseException], bool],
    attempts: int | None = None,
    give_up_after: float | None = None,
    stop: threading.Event | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """`action()`, tried again after a backoff while it raises what `retry_on` names (an
    exception class, or a test of the error), until it succeeds, `attempts` tries are
    made, `give_up_after` seconds have passed, or `stop` is set; then the last error is
    raised. `on_retry` sees each error that is retried (for the log)."""
    conditions: list[tenacity.stop.stop_base] = []
    if attempts is not None:
        conditions.append(tenacity.stop_after_attempt(attempts))
    if give_up_after is not None:
        conditions.append(tenacity.stop_after_delay(give_up_after))
    if stop is not None:
        conditions.append(tenacity.stop_when_event_set(stop))
    if not conditions:
        raise ValueError("a retry needs a bound: attempts, give_up_after or stop")

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        if error is not None and on_retry is not None:
            on_retry(error)

    def sleep(seconds: float) -> None:
        if stop is None:
            time.sleep(seconds)
        else:
            stop.wait(seconds)  # a stop ends the wait; the stop condition then gives up

    retry = (
        tenacity.retry_if_exception_type(retry_on)
        if isinstance(retry_on, type)
        else tenacity.retry_if_exception(retry_on)
    )
    retrying = tenacity.Retrying(
        retry=retry,
        stop=tenacity.stop_any(*conditions),
        wait=policy.wait_strategy(),
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(action)
