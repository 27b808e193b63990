"""Claim plans for late runs under each misfire policy, with caps, end bounds and once jobs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedctl.scheduling.misfire import ClaimPlan, MisfirePolicy, is_misfired, plan_claim
from schedctl.scheduling.schedules import (
    CronSchedule,
    IntervalSchedule,
    OnceSchedule,
    Schedule,
    next_occurrence,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
EVERY_MINUTE = IntervalSchedule(60, T0)


def m(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def test_policy_values() -> None:
    assert [p.value for p in MisfirePolicy] == ["run_once", "skip", "run_all"]
    assert MisfirePolicy("skip") is MisfirePolicy.skip
    assert isinstance(MisfirePolicy.run_once, str)


@pytest.mark.parametrize("policy", list(MisfirePolicy))
def test_on_time_dispatches_nominal(policy: MisfirePolicy) -> None:
    plan = plan_claim(EVERY_MINUTE, m(5), m(5) + timedelta(seconds=4), policy, grace_seconds=5)
    assert plan == ClaimPlan((m(5),), (), m(6))


@pytest.mark.parametrize("policy", list(MisfirePolicy))
def test_window_extends_the_grace(policy: MisfirePolicy) -> None:
    now = m(5) + timedelta(seconds=65)  # 60 s window + 5 s grace: exactly on the edge
    plan = plan_claim(EVERY_MINUTE, m(5), now, policy, grace_seconds=5, window_seconds=60)
    assert plan.dispatch == (m(5),)
    assert not is_misfired(m(5), now, 5, 60)
    assert is_misfired(m(5), now + timedelta(microseconds=1), 5, 60)


def test_run_all_dispatches_each_in_turn() -> None:
    now = m(10.5)
    plan = plan_claim(EVERY_MINUTE, m(0), now, MisfirePolicy.run_all, grace_seconds=5)
    assert plan == ClaimPlan((m(0),), (), m(1))
    plan = plan_claim(EVERY_MINUTE, m(1), now, MisfirePolicy.run_all, grace_seconds=5)
    assert plan == ClaimPlan((m(1),), (), m(2))


def test_run_once_coalesces_to_latest() -> None:
    plan = plan_claim(EVERY_MINUTE, m(0), m(10.5), MisfirePolicy.run_once, grace_seconds=5)
    assert plan.dispatch == (m(10),)
    assert plan.skipped == tuple(m(i) for i in range(10))
    assert plan.next_run_at == m(11)


def test_run_once_single_late_run_is_just_dispatched() -> None:
    plan = plan_claim(EVERY_MINUTE, m(0), m(0.5), MisfirePolicy.run_once, grace_seconds=5)
    assert plan == ClaimPlan((m(0),), (), m(1))


@pytest.mark.parametrize("cap", [0, 1, 3])
def test_run_once_cap_jumps_to_latest(cap: int) -> None:
    plan = plan_claim(
        EVERY_MINUTE, m(0), m(10.5), MisfirePolicy.run_once, grace_seconds=5, skip_cap=cap
    )
    assert plan.skipped == tuple(m(i) for i in range(cap))
    assert plan.dispatch == (m(10),)
    assert plan.next_run_at == m(11)


def test_run_once_cron_long_outage_is_bounded() -> None:
    cron = CronSchedule.parse("* * * * *", "Europe/Berlin")
    now = datetime(2031, 7, 4, 12, 34, 56, tzinfo=UTC)
    plan = plan_claim(cron, T0, now, MisfirePolicy.run_once, grace_seconds=5, skip_cap=100)
    assert len(plan.skipped) == 100
    assert plan.skipped[:2] == (T0, m(1))
    assert plan.dispatch == (datetime(2031, 7, 4, 12, 34, tzinfo=UTC),)
    assert plan.next_run_at == datetime(2031, 7, 4, 12, 35, tzinfo=UTC)


def test_run_once_cron_across_dst_gap() -> None:
    cron = CronSchedule.parse("30 2 * * *", "Europe/Berlin")
    nominal = datetime(2026, 3, 27, 1, 30, tzinfo=UTC)
    now = datetime(2026, 3, 29, 1, 0, 1, tzinfo=UTC)  # just after the shifted 02:30 run
    plan = plan_claim(cron, nominal, now, MisfirePolicy.run_once, grace_seconds=0)
    assert plan.skipped == (nominal, datetime(2026, 3, 28, 1, 30, tzinfo=UTC))
    assert plan.dispatch == (datetime(2026, 3, 29, 1, 0, tzinfo=UTC),)
    assert plan.next_run_at == datetime(2026, 3, 30, 0, 30, tzinfo=UTC)


def test_skip_records_misfired_and_waits() -> None:
    plan = plan_claim(EVERY_MINUTE, m(0), m(10.5), MisfirePolicy.skip, grace_seconds=5)
    assert plan.dispatch == ()
    assert plan.skipped == tuple(m(i) for i in range(11))
    assert plan.next_run_at == m(11)


def test_skip_next_may_be_due_but_not_misfired() -> None:
    plan = plan_claim(EVERY_MINUTE, m(0), m(10.5), MisfirePolicy.skip, grace_seconds=60)
    assert plan.skipped == tuple(m(i) for i in range(10))
    assert plan.next_run_at == m(10)  # <= now, claimed normally next time


@pytest.mark.parametrize("cap", [0, 2])
def test_skip_cap_jumps(cap: int) -> None:
    plan = plan_claim(
        EVERY_MINUTE, m(0), m(10.5), MisfirePolicy.skip, grace_seconds=5, skip_cap=cap
    )
    assert plan.skipped == tuple(m(i) for i in range(cap))
    assert plan.next_run_at == m(11)
    assert plan.dispatch == ()


def test_skip_cron_long_outage_is_bounded() -> None:
    cron = CronSchedule.parse("*/5 * * * *", "America/New_York")
    now = datetime(2036, 1, 1, 0, 7, tzinfo=UTC)
    plan = plan_claim(cron, T0, now, MisfirePolicy.skip, grace_seconds=60, skip_cap=10)
    assert len(plan.skipped) == 10
    assert plan.next_run_at == datetime(2036, 1, 1, 0, 10, tzinfo=UTC)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (MisfirePolicy.skip, ClaimPlan((), (m(0),), None)),
        (MisfirePolicy.run_once, ClaimPlan((m(0),), (), None)),
        (MisfirePolicy.run_all, ClaimPlan((m(0),), (), None)),
    ],
)
def test_once_misfired(policy: MisfirePolicy, expected: ClaimPlan) -> None:
    assert plan_claim(OnceSchedule(m(0)), m(0), m(60), policy, grace_seconds=5) == expected


def test_once_on_time_completes() -> None:
    plan = plan_claim(OnceSchedule(m(0)), m(0), m(0), MisfirePolicy.skip, grace_seconds=5)
    assert plan == ClaimPlan((m(0),), (), None)


def test_end_bounds_run_once() -> None:
    plan = plan_claim(
        EVERY_MINUTE, m(0), m(10.5), MisfirePolicy.run_once, grace_seconds=5, end=m(4)
    )
    assert plan == ClaimPlan((m(4),), tuple(m(i) for i in range(4)), None)


def test_end_bounds_run_once_after_cap() -> None:
    plan = plan_claim(
        EVERY_MINUTE,
        m(0),
        m(10.5),
        MisfirePolicy.run_once,
        grace_seconds=5,
        end=m(4),
        skip_cap=1,
    )
    assert plan == ClaimPlan((m(4),), (m(0),), None)


def test_end_bounds_skip() -> None:
    plan = plan_claim(EVERY_MINUTE, m(0), m(10.5), MisfirePolicy.skip, grace_seconds=5, end=m(3))
    assert plan == ClaimPlan((), tuple(m(i) for i in range(4)), None)
    capped = plan_claim(
        EVERY_MINUTE, m(0), m(10.5), MisfirePolicy.skip, grace_seconds=5, end=m(3), skip_cap=1
    )
    assert capped == ClaimPlan((), (m(0),), None)


def test_end_bounds_on_time_and_run_all() -> None:
    assert plan_claim(EVERY_MINUTE, m(3), m(3), MisfirePolicy.run_all, 5, end=m(3)) == ClaimPlan(
        (m(3),), (), None
    )
    assert plan_claim(EVERY_MINUTE, m(4), m(4), MisfirePolicy.run_all, 5, end=m(3)) == ClaimPlan(
        (), (), None
    )


def _reference(
    schedule: Schedule,
    nominal: datetime,
    now: datetime,
    policy: MisfirePolicy,
    grace: float,
    window: int,
    end: datetime | None,
) -> ClaimPlan:
    """Unbounded walk over every occurrence: the plan with no cap."""
    occurrences = [nominal]
    while True:
        following = next_occurrence(schedule, occurrences[-1], end=end)
        if following is None or following > now + timedelta(hours=1):
            break
        occurrences.append(following)

    def late(t: datetime) -> bool:
        return now > t + timedelta(seconds=window + grace)

    def after(t: datetime) -> datetime | None:
        return next_occurrence(schedule, t, end=end)

    if not late(nominal) or policy is MisfirePolicy.run_all:
        return ClaimPlan((nominal,), (), after(nominal))
    if policy is MisfirePolicy.run_once:
        due = [t for t in occurrences if t <= now]
        return ClaimPlan((due[-1],), tuple(due[:-1]), after(due[-1]))
    missed = tuple(t for t in occurrences if late(t))
    return ClaimPlan((), missed, after(missed[-1]))


@settings(max_examples=300, deadline=None, database=None)
@given(
    every=st.integers(1, 600),
    start_k=st.integers(0, 50),
    late_s=st.integers(0, 20_000),
    policy=st.sampled_from(list(MisfirePolicy)),
    grace=st.integers(0, 120),
    window=st.integers(0, 120),
    cap=st.integers(0, 30),
    end_k=st.none() | st.integers(0, 200),
)
def test_interval_plans_match_unbounded_reference(
    every: int,
    start_k: int,
    late_s: int,
    policy: MisfirePolicy,
    grace: int,
    window: int,
    cap: int,
    end_k: int | None,
) -> None:
    schedule = IntervalSchedule(every, T0)
    nominal = T0 + timedelta(seconds=every * start_k)
    end = None if end_k is None else T0 + timedelta(seconds=every * (start_k + end_k))
    now = nominal + timedelta(seconds=late_s)
    plan = plan_claim(schedule, nominal, now, policy, grace, window, end, skip_cap=cap)
    reference = _reference(schedule, nominal, now, policy, grace, window, end)
    assert plan.dispatch == reference.dispatch
    assert plan.skipped == reference.skipped[:cap]
    assert plan.next_run_at == reference.next_run_at


CRONS = [
    CronSchedule.parse("*/7 * * * *", "Europe/Berlin"),
    CronSchedule.parse("0,30 2 * * *", "Europe/Berlin"),
    CronSchedule.parse("15 * * * *", "Australia/Lord_Howe"),
]


@settings(max_examples=150, deadline=None, database=None)
@given(
    schedule=st.sampled_from(CRONS),
    start=st.datetimes(datetime(2026, 3, 27), datetime(2026, 4, 6), timezones=st.just(UTC)),
    late_s=st.integers(0, 3 * 86400),
    policy=st.sampled_from(list(MisfirePolicy)),
    grace=st.integers(0, 600),
    cap=st.integers(0, 10),
)
def test_cron_plans_match_unbounded_reference(
    schedule: CronSchedule,
    start: datetime,
    late_s: int,
    policy: MisfirePolicy,
    grace: int,
    cap: int,
) -> None:
    nominal = schedule.next_after(start)
    now = nominal + timedelta(seconds=late_s)
    plan = plan_claim(schedule, nominal, now, policy, grace, 0, None, skip_cap=cap)
    reference = _reference(schedule, nominal, now, policy, grace, 0, None)
    assert plan.dispatch == reference.dispatch
    assert plan.skipped == reference.skipped[:cap]
    assert plan.next_run_at == reference.next_run_at
