"""Once / interval / cron occurrences, start and end bounds, and the stored JSON form."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedctl.core.errors import ValidationError
from schedctl.scheduling.schedules import (
    CronSchedule,
    IntervalSchedule,
    OnceSchedule,
    Schedule,
    first_occurrence,
    latest_occurrence,
    next_occurrence,
    schedule_from_dict,
    schedule_to_dict,
)
from schedctl.scheduling.windows import fire_time, jitter_seconds

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# --- once ----------------------------------------------------------------------


def test_once_next() -> None:
    once = OnceSchedule(at(100))
    assert next_occurrence(once, at(0)) == at(100)
    assert next_occurrence(once, at(99.999)) == at(100)
    assert next_occurrence(once, at(100)) is None
    assert next_occurrence(once, at(0), end=at(50)) is None
    assert next_occurrence(once, at(0), end=at(100)) == at(100)


def test_once_first_returns_run_at_even_in_the_past() -> None:
    once = OnceSchedule(at(100))
    assert first_occurrence(once, at(500)) == at(100)
    assert first_occurrence(once, at(0), end=at(10)) is None


def test_once_normalizes_to_utc_and_refuses_naive() -> None:
    plus5 = timezone(timedelta(hours=5))
    assert OnceSchedule(datetime(2026, 1, 1, 5, tzinfo=plus5)).run_at == T0
    assert OnceSchedule(datetime(2026, 1, 1, 5, tzinfo=plus5)).run_at.tzinfo is UTC
    with pytest.raises(ValidationError, match="run_at"):
        OnceSchedule(datetime(2026, 1, 1))


# --- interval ------------------------------------------------------------------


def test_interval_next() -> None:
    every = IntervalSchedule(30, at(0))
    assert next_occurrence(every, at(-1000)) == at(0)
    assert next_occurrence(every, at(-0.5)) == at(0)
    assert next_occurrence(every, at(0)) == at(30)
    assert next_occurrence(every, at(29.999999)) == at(30)
    assert next_occurrence(every, at(30)) == at(60)
    assert next_occurrence(every, at(10**9)) == at(10**9 + 20)
    assert next_occurrence(every, at(0), end=at(29)) is None
    assert next_occurrence(every, at(0), end=at(30)) == at(30)
    assert next_occurrence(every, at(100), end=at(100)) is None


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "30"])
def test_interval_must_be_positive_int(bad: object) -> None:
    with pytest.raises(ValidationError) as info:
        IntervalSchedule(bad, T0)  # type: ignore[arg-type]
    assert info.value.field == "interval"
    assert str(info.value).startswith("interval: ")


def test_interval_anchor_must_be_aware() -> None:
    with pytest.raises(ValidationError, match="anchor"):
        IntervalSchedule(10, datetime(2026, 1, 1))


@settings(max_examples=200, deadline=None, database=None)
@given(
    every=st.integers(1, 10**6),
    offset_us=st.integers(-(10**12), 10**13),
)
def test_interval_next_is_exact(every: int, offset_us: int) -> None:
    schedule = IntervalSchedule(every, T0)
    after = T0 + timedelta(microseconds=offset_us)
    result = next_occurrence(schedule, after)
    assert result is not None and result > after
    steps, remainder = divmod(result - T0, timedelta(seconds=every))
    assert remainder == timedelta(0) and steps >= 0
    assert result - timedelta(seconds=every) <= after or steps == 0


# --- cron ----------------------------------------------------------------------


def test_cron_next_and_end() -> None:
    cron = CronSchedule.parse("0 9 * * *", "Asia/Kolkata")
    assert next_occurrence(cron, T0) == datetime(2026, 1, 1, 3, 30, tzinfo=UTC)
    assert next_occurrence(cron, T0, end=datetime(2026, 1, 1, 3, 29, tzinfo=UTC)) is None


def test_first_occurrence_respects_start_and_now() -> None:
    hourly = CronSchedule.parse("0 * * * *", "UTC")
    start = datetime(2026, 2, 1, 5, tzinfo=UTC)
    # start is itself an occurrence: at or after start.
    assert first_occurrence(hourly, T0, start=start) == start
    # now is later than start: strictly after now.
    assert first_occurrence(hourly, start + timedelta(minutes=1), start=start) == start.replace(
        hour=6
    )
    assert first_occurrence(hourly, start, start=start) == start.replace(hour=6)
    assert first_occurrence(hourly, T0, start=start, end=start - timedelta(seconds=1)) is None
    every = IntervalSchedule(60, T0)
    assert first_occurrence(every, T0) == at(60)
    assert first_occurrence(every, T0, start=at(120)) == at(120)
    assert first_occurrence(every, T0, start=at(121)) == at(180)


# --- latest --------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [
        CronSchedule.parse("*/7 * * * *", "Europe/Berlin"),
        CronSchedule.parse("30 2 * * *", "Europe/Berlin"),
        CronSchedule.parse("0 0 29 2 *", "UTC"),
        IntervalSchedule(45, T0),
    ],
    ids=["cron_minutes", "cron_daily_dst", "cron_leap", "interval"],
)
def test_latest_occurrence_matches_a_walk(schedule: Schedule) -> None:
    lower = datetime(2026, 3, 28, 12, tzinfo=UTC)
    for upper in [lower + timedelta(hours=h, seconds=13) for h in (0, 1, 13, 25, 60)]:
        walked: datetime | None = None
        current = next_occurrence(schedule, lower - timedelta(microseconds=1))
        while current is not None and current <= upper:
            walked = current
            current = next_occurrence(schedule, current)
        assert latest_occurrence(schedule, upper, not_before=lower) == walked


def test_latest_occurrence_long_range_and_end() -> None:
    cron = CronSchedule.parse("*/5 * * * *", "America/New_York")
    upper = datetime(2030, 6, 1, 12, 3, 7, tzinfo=UTC)
    assert latest_occurrence(cron, upper, not_before=T0) == datetime(2030, 6, 1, 12, 0, tzinfo=UTC)
    end = datetime(2028, 1, 1, 0, 2, tzinfo=UTC)
    assert latest_occurrence(cron, upper, not_before=T0, end=end) == datetime(
        2028, 1, 1, 0, 0, tzinfo=UTC
    )
    assert latest_occurrence(cron, T0 + timedelta(minutes=4), not_before=T0 + timedelta(1)) is None
    once = OnceSchedule(at(10))
    assert latest_occurrence(once, at(20), not_before=at(0)) == at(10)
    assert latest_occurrence(once, at(9), not_before=at(0)) is None


# --- stored form ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "stored"),
    [
        (
            OnceSchedule(datetime(2026, 10, 12, 2, 30, tzinfo=UTC)),
            {"kind": "once", "run_at": "2026-10-12T02:30:00Z"},
        ),
        (
            CronSchedule.parse("0 8 * * MON", "Asia/Kolkata"),
            {"kind": "cron", "cron": "0 8 * * MON", "timezone": "Asia/Kolkata"},
        ),
        (
            IntervalSchedule(30, datetime(2026, 1, 1, 0, 0, 0, 500, tzinfo=UTC)),
            {"kind": "interval", "every_seconds": 30, "anchor": "2026-01-01T00:00:00.000500Z"},
        ),
    ],
)
def test_round_trip(schedule: Schedule, stored: dict[str, object]) -> None:
    assert schedule_to_dict(schedule) == stored
    assert schedule_from_dict(json.loads(json.dumps(stored))) == schedule


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({}, "schedule"),
        ({"kind": "weekly"}, "schedule"),
        ({"kind": "once"}, "schedule"),
        ({"kind": "once", "run_at": "2026-01-01T00:00:00"}, "run_at"),
        ({"kind": "cron", "cron": "0 0 * *", "timezone": "UTC"}, "cron"),
        ({"kind": "cron", "cron": "0 0 * * *", "timezone": "Nowhere/Zone"}, "timezone"),
        ({"kind": "cron", "cron": 5, "timezone": "UTC"}, "schedule"),
        ({"kind": "interval", "every_seconds": "30", "anchor": "2026-01-01T00:00:00Z"}, "interval"),
        ({"kind": "interval", "every_seconds": 0, "anchor": "2026-01-01T00:00:00Z"}, "interval"),
        ({"kind": "interval", "every_seconds": 30}, "schedule"),
    ],
)
def test_from_dict_rejects(data: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        schedule_from_dict(data)
    assert info.value.field == field


def test_naive_inputs_rejected() -> None:
    with pytest.raises(ValidationError, match="after"):
        next_occurrence(IntervalSchedule(5, T0), datetime(2026, 1, 1))


# --- tolerance windows ---------------------------------------------------------


def test_jitter_is_deterministic_and_in_range() -> None:
    nominal = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
    offsets = {jitter_seconds(f"job-{i}", nominal, 300) for i in range(200)}
    assert all(0 <= o < 300 for o in offsets)
    assert len(offsets) > 150  # spread, not clumped
    assert all(abs(o * 1000 - round(o * 1000)) < 1e-6 for o in offsets)  # whole ms
    assert jitter_seconds("job-1", nominal, 300) == jitter_seconds(
        "job-1", nominal.astimezone(timezone(timedelta(hours=3))), 300
    )
    assert jitter_seconds("job-1", nominal, 300) != jitter_seconds(
        "job-1", nominal + timedelta(hours=1), 300
    )
    # The same on every machine, forever: sha256 of "job-1|2026-01-01T00:00:00Z".
    digest = hashlib.sha256(b"job-1|2026-01-01T00:00:00Z").digest()
    expected_ms = int.from_bytes(digest[:8], "big") % 300_000
    assert jitter_seconds("job-1", nominal, 300) == expected_ms / 1000
    assert fire_time("job-1", nominal, 300) - nominal == timedelta(
        milliseconds=round(jitter_seconds("job-1", nominal, 300) * 1000)
    )


@pytest.mark.parametrize("window", [0, -10])
def test_no_window_no_jitter(window: int) -> None:
    assert jitter_seconds("job", T0, window) == 0.0
    assert fire_time("job", T0, window) == T0
