"""Misfire policies: what a claim does with a run that is due late (after an outage)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from schedctl.scheduling.schedules import (
    OnceSchedule,
    Schedule,
    latest_occurrence,
    next_occurrence,
)

__all__ = ["ClaimPlan", "MisfirePolicy", "is_misfired", "plan_claim"]

_TICK = timedelta(microseconds=1)


class MisfirePolicy(enum.StrEnum):
    run_once = "run_once"  # one catch-up run for the latest missed time, the rest skipped
    skip = "skip"  # record every missed time as skipped; wait for the next one
    run_all = "run_all"  # dispatch every missed time (the dispatcher paces them)


@dataclass(frozen=True)
class ClaimPlan:
    dispatch: tuple[datetime, ...]  # nominal times to dispatch now (at most 1)
    skipped: tuple[datetime, ...]  # nominal times to record as skipped (at most skip_cap)
    next_run_at: datetime | None  # next nominal time to wait for; None: the job is completed


def is_misfired(
    nominal: datetime, now: datetime, grace_seconds: float, window_seconds: int = 0
) -> bool:
    """Late beyond the tolerance window plus the grace period."""
    return now > nominal + timedelta(seconds=max(window_seconds, 0) + grace_seconds)


def plan_claim(
    schedule: Schedule,
    nominal: datetime,
    now: datetime,
    policy: MisfirePolicy,
    grace_seconds: float,
    window_seconds: int = 0,
    end: datetime | None = None,
    skip_cap: int = 1000,
) -> ClaimPlan:
    """What to do with a job whose current nominal time is due at `now`.

    Every walk over occurrences stops after `skip_cap` of them and jumps the rest in
    O(log) steps, so an outage of any length costs a bounded claim.
    """
    cap = max(skip_cap, 0)
    if end is not None and nominal > end:
        return ClaimPlan((), (), None)
    if (
        not is_misfired(nominal, now, grace_seconds, window_seconds)
        or policy is MisfirePolicy.run_all
    ):
        return ClaimPlan((nominal,), (), next_occurrence(schedule, nominal, end=end))
    if isinstance(schedule, OnceSchedule):
        if policy is MisfirePolicy.skip:
            return ClaimPlan((), (nominal,), None)
        return ClaimPlan((nominal,), (), None)
    if policy is MisfirePolicy.run_once:
        return _coalesce(schedule, nominal, now, end, cap)
    return _skip(schedule, nominal, now, grace_seconds, window_seconds, end, cap)


def _coalesce(
    schedule: Schedule, nominal: datetime, now: datetime, end: datetime | None, cap: int
) -> ClaimPlan:
    skipped: list[datetime] = []
    latest = nominal
    for _ in range(cap + 1):
        following = next_occurrence(schedule, latest, end=end)
        if following is None or following > now:
            break
        if len(skipped) >= cap:
            # Too many to record: find the latest due occurrence directly.
            latest = latest_occurrence(schedule, now, not_before=following, end=end) or following
            break
        skipped.append(latest)
        latest = following
    return ClaimPlan((latest,), tuple(skipped), next_occurrence(schedule, latest, end=end))


def _skip(
    schedule: Schedule,
    nominal: datetime,
    now: datetime,
    grace_seconds: float,
    window_seconds: int,
    end: datetime | None,
    cap: int,
) -> ClaimPlan:
    skipped: list[datetime] = []
    current: datetime | None = nominal
    for _ in range(cap + 1):
        if current is None or not is_misfired(current, now, grace_seconds, window_seconds):
            return ClaimPlan((), tuple(skipped), current)
        if len(skipped) >= cap:
            break
        skipped.append(current)
        current = next_occurrence(schedule, current, end=end)
    # Past the cap: the first occurrence that is not misfired is the first one at or
    # after the misfire cutoff.
    cutoff = now - timedelta(seconds=max(window_seconds, 0) + grace_seconds)
    assert current is not None
    resume = next_occurrence(schedule, max(cutoff - _TICK, current - _TICK), end=end)
    return ClaimPlan((), tuple(skipped), resume)
