"""Durations and instants as users type them, and the canonical RFC 3339 output."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

import pytest

from schedctl.core.errors import ValidationError
from schedctl.scheduling.timeparse import format_instant, parse_duration, parse_instant


def _refused(
    parse: Callable[[str, str], object], text: str, field: str, match: str | None = None
) -> str:
    """The message of the ValidationError that `parse(text, field)` raises naming `field`
    (matching `match` when given)."""
    with pytest.raises(ValidationError, match=match) as info:
        parse(text, field)
    assert info.value.field == field
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90", timedelta(seconds=90)),
        ("0", timedelta(0)),
        ("1.5", timedelta(seconds=1.5)),
        ("30s", timedelta(seconds=30)),
        ("10m", timedelta(minutes=10)),
        ("2h", timedelta(hours=2)),
        ("1d", timedelta(days=1)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1d2h3m4s", timedelta(days=1, hours=2, minutes=3, seconds=4)),
        (" 5m ", timedelta(minutes=5)),
        ("PT10M", timedelta(minutes=10)),
        ("PT1H30M", timedelta(hours=1, minutes=30)),
        ("P1D", timedelta(days=1)),
        ("P1DT2H", timedelta(days=1, hours=2)),
        ("PT0.5S", timedelta(seconds=0.5)),
        ("PT0,5S", timedelta(seconds=0.5)),
        ("P2W", timedelta(weeks=2)),
        ("pt10m", timedelta(minutes=10)),
        ("PT0S", timedelta(0)),
    ],
)
def test_valid_durations(text: str, expected: timedelta) -> None:
    assert parse_duration(text, "window") == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "  ",
        "-5",
        "-5m",
        "5 m",
        "1h 30m",
        "1.5h",
        "m",
        "10x",
        "1m1h",
        "P",
        "PT",
        "P1DT",
        "PT-1M",
        "1e3",
        "abc",
        "P1H",
        "T10M",
        "10mins",
    ],
)
def test_invalid_durations_name_the_field_and_forms(text: str) -> None:
    message = _refused(parse_duration, text, "window")
    assert message.startswith("window: ")
    assert "PT10M" in message and "1h30m" in message


@pytest.mark.parametrize("text", ["P1M", "P1Y", "P1Y2M3D", "P1MT5M"])
def test_calendar_durations_refused_with_reason(text: str) -> None:
    _refused(parse_duration, text, "delay", match="years and months")


def test_huge_duration_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="too large"):
        parse_duration("99999999999d", "delay")


def test_non_string_duration() -> None:
    with pytest.raises(ValidationError):
        parse_duration(90, "delay")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-10-12T08:00:00+05:30", datetime(2026, 10, 12, 2, 30, tzinfo=UTC)),
        ("2026-10-12T02:30:00Z", datetime(2026, 10, 12, 2, 30, tzinfo=UTC)),
        ("2026-10-12T02:30:00.250Z", datetime(2026, 10, 12, 2, 30, 0, 250000, tzinfo=UTC)),
        ("2026-10-12 02:30:00-04:00", datetime(2026, 10, 12, 6, 30, tzinfo=UTC)),
        ("2026-10-12T02:30Z", datetime(2026, 10, 12, 2, 30, tzinfo=UTC)),
    ],
)
def test_valid_instants(text: str, expected: datetime) -> None:
    parsed = parse_instant(text, "run_at")
    assert parsed == expected
    assert parsed.tzinfo is UTC


@pytest.mark.parametrize("text", ["2026-10-12T08:00:00", "2026-10-12 08:00"])
def test_naive_instant_needs_offset(text: str) -> None:
    message = _refused(parse_instant, text, "run_at", match=r"needs a UTC offset, e\.g\.")
    assert message.startswith("run_at: ")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "tomorrow",
        "2026-10-12",
        "2026-13-01T00:00:00Z",
        "2026-10-12T25:00:00Z",
        "12/10/2026 08:00",
        "2026-10-12T08:00:00+25:00",
    ],
)
def test_invalid_instants(text: str) -> None:
    assert "2026-10-12T08:00:00Z" in _refused(parse_instant, text, "at")


def test_out_of_range_instant() -> None:
    with pytest.raises(ValidationError, match="out of range"):
        parse_instant("0001-01-01T00:00:00+01:00", "at")


def test_format_instant() -> None:
    assert format_instant(datetime(2026, 10, 12, 2, 30, tzinfo=UTC)) == "2026-10-12T02:30:00Z"
    assert (
        format_instant(datetime(2026, 10, 12, 8, 0, 0, 5, tzinfo=timezone(timedelta(hours=5))))
        == "2026-10-12T03:00:00.000005Z"
    )
    with pytest.raises(ValidationError):
        format_instant(datetime(2026, 1, 1))


def test_round_trip() -> None:
    value = datetime(2026, 3, 29, 1, 0, 0, 123456, tzinfo=UTC)
    assert parse_instant(format_instant(value), "t") == value
