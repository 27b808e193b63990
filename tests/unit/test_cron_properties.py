"""Property tests: cron fire times in every zone with DST history against a brute-force oracle.

The oracle walks every UTC minute, converts it to local time and applies the DST rule as
stated in DESIGN.md; expressions are generated together with their field sets, so the
oracle does not share the parser with the code under test.
"""

from __future__ import annotations

import functools
import itertools
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedctl.scheduling.cron import CronSchedule

MINUTE = timedelta(minutes=1)
RANGE_START = datetime(2000, 1, 1, tzinfo=UTC)
RANGE_END = datetime(2040, 1, 1, tzinfo=UTC)
HORIZON = timedelta(days=3)
MAX_FIRES = 8

PROPERTY_SETTINGS = settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass(frozen=True)
class Transition:
    at: datetime  # the first instant with the new offset
    before: timedelta
    after: timedelta


def _offset(zone: ZoneInfo, instant: datetime) -> timedelta:
    offset = instant.astimezone(zone).utcoffset()
    assert offset is not None
    return offset


@functools.cache
def transitions() -> dict[str, tuple[Transition, ...]]:
    """Every zone's offset transitions in 2000..2040, exact to the second.

    Weekly sampling finds every offset period longer than a week (the shortest real ones,
    Morocco's Ramadan suspensions, last about a month); bisection pins each to the second.
    """
    found: dict[str, tuple[Transition, ...]] = {}
    step = timedelta(days=7)
    for key in sorted(zoneinfo.available_timezones() - {"localtime"}):
        zone = ZoneInfo(key)
        items: list[Transition] = []
        current, previous = RANGE_START, _offset(zone, RANGE_START)
        while current < RANGE_END:
            following = current + step
            offset = _offset(zone, following)
            if offset != previous:
                low, high = int(current.timestamp()), int(following.timestamp())
                while high - low > 1:
                    middle = (low + high) // 2
                    if _offset(zone, datetime.fromtimestamp(middle, UTC)) == previous:
                        low = middle
                    else:
                        high = middle
                items.append(Transition(datetime.fromtimestamp(high, UTC), previous, offset))
                previous = offset
            current = following
        if items:
            found[key] = tuple(items)
    return found


ZONES = sorted(transitions())


@dataclass(frozen=True)
class Spec:
    """A cron expression and the sets it stands for, built independently of the parser."""

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    doms: frozenset[int]
    months: frozenset[int]
    dows: frozenset[int]  # 0 = Sunday
    dom_star: bool
    dow_star: bool

    @property
    def every_hour(self) -> bool:
        return len(self.hours) == 24

    def day_matches(self, day: date) -> bool:
        dom_ok = day.day in self.doms
        dow_ok = day.isoweekday() % 7 in self.dows
        if not self.dom_star and not self.dow_star:
            return dom_ok or dow_ok
        return dom_ok and dow_ok

    def matches(self, wall: datetime) -> bool:
        return (
            wall.second == 0
            and wall.minute in self.minutes
            and wall.hour in self.hours
            and wall.month in self.months
            and self.day_matches(wall.date())
        )


def _listed(draw: st.DrawFn, low: int, high: int, size: int) -> tuple[str, frozenset[int]]:
    values = draw(st.sets(st.integers(low, high), min_size=1, max_size=size))
    return ",".join(str(v) for v in sorted(values)), frozenset(values)


@st.composite
def minute_fields(draw: st.DrawFn) -> tuple[str, frozenset[int]]:
    kind = draw(st.sampled_from(["star", "step", "list", "range", "range_step"]))
    if kind == "star":
        return "*", frozenset(range(60))
    if kind == "step":
        k = draw(st.sampled_from([5, 7, 10, 15, 20, 30]))
        return f"*/{k}", frozenset(range(0, 60, k))
    if kind == "list":
        return _listed(draw, 0, 59, 4)
    low = draw(st.integers(0, 58))
    high = draw(st.integers(low + 1, 59))
    if kind == "range":
        return f"{low}-{high}", frozenset(range(low, high + 1))
    k = draw(st.integers(2, 20))
    return f"{low}-{high}/{k}", frozenset(range(low, high + 1, k))


@st.composite
def hour_fields(draw: st.DrawFn, focus: tuple[int, ...] = ()) -> tuple[str, frozenset[int]]:
    kind = draw(st.sampled_from(["star", "star1", "full_range", "list", "list", "range", "step"]))
    if kind == "star":
        return "*", frozenset(range(24))
    if kind == "star1":
        return "*/1", frozenset(range(24))
    if kind == "full_range":
        return "0-23", frozenset(range(24))
    if kind == "list":
        extra = draw(st.sets(st.integers(0, 23), max_size=5))
        values = (extra | set(focus)) or {draw(st.integers(0, 23))}
        if len(values) == 24:
            values.discard(min(values))
        return ",".join(str(v) for v in sorted(values)), frozenset(values)
    if kind == "range":
        low = draw(st.integers(0, 22))
        high = draw(st.integers(low, 22))
        return f"{low}-{high}", frozenset(range(low, high + 1))
    k = draw(st.integers(2, 12))
    return f"*/{k}", frozenset(range(0, 24, k))


DOM_CHOICES = [
    ("*", frozenset(range(1, 32)), True),
    ("*", frozenset(range(1, 32)), True),
    ("*", frozenset(range(1, 32)), True),
    ("1-20", frozenset(range(1, 21)), False),
    ("*/2", frozenset(range(1, 32, 2)), True),
    ("2,4,6,8,10,12,14,16,18,20,22,24,26,28,30", frozenset(range(2, 31, 2)), False),
]
MONTH_CHOICES = [
    ("*", frozenset(range(1, 13))),
    ("*", frozenset(range(1, 13))),
    ("*", frozenset(range(1, 13))),
    ("JAN-JUN", frozenset(range(1, 7))),
    ("mar,apr,sep,oct,nov", frozenset({3, 4, 9, 10, 11})),
    ("2-12/2", frozenset({2, 4, 6, 8, 10, 12})),
]
DOW_CHOICES = [
    ("*", frozenset(range(7)), True),
    ("*", frozenset(range(7)), True),
    ("*", frozenset(range(7)), True),
    ("MON-FRI", frozenset(range(1, 6)), False),
    ("0,6", frozenset({0, 6}), False),
    ("SAT,7", frozenset({6, 0}), False),
    ("*/2", frozenset({0, 2, 4, 6}), True),
    ("1-7", frozenset(range(7)), False),
]


@st.composite
def specs(draw: st.DrawFn, focus: tuple[int, ...] = ()) -> Spec:
    minute_text, minutes = draw(minute_fields())
    hour_text, hours = draw(hour_fields(focus))
    dom_text, doms, dom_star = draw(st.sampled_from(DOM_CHOICES))
    month_text, months = draw(st.sampled_from(MONTH_CHOICES))
    dow_text, dows, dow_star = draw(st.sampled_from(DOW_CHOICES))
    text = f"{minute_text} {hour_text} {dom_text} {month_text} {dow_text}"
    return Spec(text, minutes, hours, doms, months, dows, dom_star, dow_star)


def oracle(spec: Spec, zone: ZoneInfo, start: datetime, horizon: datetime) -> list[datetime]:
    """Every fire in (start, horizon] by walking each UTC minute (all transitions in range
    fall on whole minutes)."""
    result: list[datetime] = []
    instant = start.replace(second=0, microsecond=0) + MINUTE
    previous = _offset(zone, instant - MINUTE)
    while instant <= horizon:
        local = instant.astimezone(zone)
        offset = local.utcoffset()
        assert offset is not None
        wall = local.replace(tzinfo=None)
        if spec.every_hour:
            fire = spec.matches(wall)
        else:
            fire = spec.matches(wall) and local.fold == 0
            if offset > previous:  # clocks went forward at this instant
                skipped = instant.replace(tzinfo=None) + previous
                while not fire and skipped < wall:
                    fire = spec.matches(skipped)
                    skipped += MINUTE
        if fire:
            result.append(instant)
        previous = offset
        instant += MINUTE
    return result


def implementation(spec: Spec, zone: str, start: datetime) -> tuple[list[datetime], datetime]:
    """Fires from the code under test and the horizon they are complete up to."""
    schedule = CronSchedule.parse(spec.text, zone)
    horizon = start + HORIZON
    got: list[datetime] = []
    for instant in schedule.iter_after(start):
        if instant > horizon:
            break
        got.append(instant)
        if len(got) == MAX_FIRES:
            horizon = instant
            break
    return got, horizon


def check(spec: Spec, zone_key: str, start: datetime) -> None:
    zone = ZoneInfo(zone_key)
    got, horizon = implementation(spec, zone_key, start)
    assert all(a < b for a, b in itertools.pairwise(got)), "not strictly increasing"
    assert all(t > start and t.tzinfo is UTC for t in got)
    for instant in got:
        local = instant.astimezone(zone)
        wall = local.replace(tzinfo=None)
        if spec.matches(wall):
            continue
        # Otherwise it must be a gap shift of a specific-time job: a transition instant
        # whose skipped wall times include a match.
        assert not spec.every_hour, f"{instant} does not match {spec.text} in local time"
        before = _offset(zone, instant - timedelta(seconds=1))
        after = _offset(zone, instant)
        assert after > before, f"{instant} is neither a match nor a transition"
        skipped = [wall - (after - before) + k * MINUTE for k in range((after - before) // MINUTE)]
        assert any(spec.matches(w) for w in skipped)
    assert got == oracle(spec, zone, start, horizon), spec.text


@PROPERTY_SETTINGS
@given(
    spec=specs(),
    zone_key=st.sampled_from(ZONES),
    start=st.datetimes(
        min_value=datetime(2000, 1, 1),
        max_value=datetime(2039, 12, 1),
        timezones=st.just(UTC),
    ),
)
def test_random_starts_match_oracle(spec: Spec, zone_key: str, start: datetime) -> None:
    check(spec, zone_key, start)


@st.composite
def near_transitions(draw: st.DrawFn) -> tuple[Spec, str, datetime]:
    zone_key = draw(st.sampled_from(ZONES))
    transition = draw(st.sampled_from(transitions()[zone_key]))
    # Aim specific-hour expressions at the wall hours around the transition.
    walls = {
        (transition.at + transition.before - timedelta(minutes=m)).hour for m in (0, 30, 60)
    } | {(transition.at + transition.after + timedelta(minutes=m)).hour for m in (0, 30)}
    spec = draw(specs(focus=tuple(sorted(walls))))
    lead = draw(st.integers(min_value=0, max_value=4 * 3600))
    start = transition.at - timedelta(seconds=lead, microseconds=draw(st.integers(0, 999_999)))
    return spec, zone_key, start


@PROPERTY_SETTINGS
@given(case=near_transitions())
def test_starts_near_transitions_match_oracle(case: tuple[Spec, str, datetime]) -> None:
    check(*case)


FIXED_SPECS = [
    Spec(
        "*/30 * * * *",
        frozenset({0, 30}),
        frozenset(range(24)),
        frozenset(range(1, 32)),
        frozenset(range(1, 13)),
        frozenset(range(7)),
        True,
        True,
    ),
]


def _wall_spec(wall: datetime) -> Spec:
    return Spec(
        f"{wall.minute} {wall.hour} * * *",
        frozenset({wall.minute}),
        frozenset({wall.hour}),
        frozenset(range(1, 32)),
        frozenset(range(1, 13)),
        frozenset(range(7)),
        True,
        True,
    )


def _first_transition_after_2025() -> list[tuple[str, Transition]]:
    cases = []
    for key in ZONES:
        later = [t for t in transitions()[key] if t.at.year >= 2026]
        if later:
            cases.append((key, later[0]))
    return cases


@pytest.mark.parametrize(
    ("zone_key", "transition"),
    _first_transition_after_2025(),
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_every_zone_next_transition(zone_key: str, transition: Transition) -> None:
    """Specific-time jobs at the first and at a middle affected wall time, and a half-hourly
    job, across each zone's next real transition."""
    shift = abs(transition.after - transition.before)
    start = transition.at - shift - timedelta(hours=1)
    first_affected = (transition.at + min(transition.before, transition.after)).replace(tzinfo=None)
    middle_affected = first_affected + (shift // 2 // MINUTE) * MINUTE
    walls = [first_affected, middle_affected]
    for spec in [*(_wall_spec(w) for w in walls), *FIXED_SPECS]:
        check(spec, zone_key, start)
    for wall in walls:
        schedule = CronSchedule.parse(_wall_spec(wall).text, zone_key)
        if transition.after > transition.before:  # gap: fires at the transition instant
            expected = transition.at
        else:  # repeat: fires once, at the first occurrence
            expected = (wall - transition.before).replace(tzinfo=UTC)
        assert schedule.next_after(start) == expected
        assert schedule.next_after(expected) > transition.at + shift
