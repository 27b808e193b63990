"""Cron parsing, validation and the DST rule on named, hand-checked cases."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import islice

import pytest

from schedctl.core.errors import ValidationError
from schedctl.scheduling.cron import CronSchedule, FireKind


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def fires(expr: str, zone: str, start: str, count: int) -> list[str]:
    schedule = CronSchedule.parse(expr, zone)
    return [
        t.isoformat().replace("+00:00", "Z") for t in islice(schedule.iter_after(utc(start)), count)
    ]


DST_CASES = [
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2026-03-28T12:00:00Z",
        ["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"],
        id="spring_gap",
    ),
    pytest.param(
        "0,30 2 * * *",
        "Europe/Berlin",
        "2026-03-28T12:00:00Z",
        ["2026-03-29T01:00:00Z", "2026-03-30T00:00:00Z", "2026-03-30T00:30:00Z"],
        id="spring_gap_two_walls_fire_once",
    ),
    pytest.param(
        "0 2,3 * * *",
        "Europe/Berlin",
        "2026-03-28T12:00:00Z",
        ["2026-03-29T01:00:00Z", "2026-03-30T00:00:00Z", "2026-03-30T01:00:00Z"],
        id="spring_gap_shift_lands_on_a_match",
    ),
    pytest.param(
        "30 * * * *",
        "Europe/Berlin",
        "2026-03-28T23:00:00Z",
        ["2026-03-28T23:30:00Z", "2026-03-29T00:30:00Z", "2026-03-29T01:30:00Z"],
        id="spring_gap_every_hour_skips",
    ),
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2026-10-24T12:00:00Z",
        ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"],
        id="fall_repeat",
    ),
    pytest.param(
        "30 * * * *",
        "Europe/Berlin",
        "2026-10-24T23:00:00Z",
        [
            "2026-10-24T23:30:00Z",
            "2026-10-25T00:30:00Z",
            "2026-10-25T01:30:00Z",
            "2026-10-25T02:30:00Z",
        ],
        id="fall_repeat_every_hour",
    ),
    pytest.param(
        "0 * * * *",
        "Europe/Berlin",
        "2026-10-25T00:10:00Z",
        ["2026-10-25T01:00:00Z", "2026-10-25T02:00:00Z"],
        id="fall_repeat_every_hour_second_pass_from_inside",
    ),
    pytest.param(
        "15 2 * * *",
        "Australia/Lord_Howe",
        "2026-10-02T12:00:00Z",
        ["2026-10-02T15:45:00Z", "2026-10-03T15:30:00Z", "2026-10-04T15:15:00Z"],
        id="lord_howe_30min_gap",
    ),
    pytest.param(
        "*/15 1,2 * * *",
        "Australia/Lord_Howe",
        "2026-04-04T13:00:00Z",
        [
            "2026-04-04T14:00:00Z",
            "2026-04-04T14:15:00Z",
            "2026-04-04T14:30:00Z",
            "2026-04-04T14:45:00Z",
            "2026-04-04T15:30:00Z",
        ],
        id="lord_howe_30min_repeat",
    ),
    pytest.param(
        "*/15 * * * *",
        "Australia/Lord_Howe",
        "2026-04-04T14:40:00Z",
        [
            "2026-04-04T14:45:00Z",
            "2026-04-04T15:00:00Z",
            "2026-04-04T15:15:00Z",
            "2026-04-04T15:30:00Z",
        ],
        id="lord_howe_30min_repeat_every_hour",
    ),
    pytest.param(
        "0 0 * * *",
        "America/Havana",
        "2026-03-07T00:00:00Z",
        ["2026-03-07T05:00:00Z", "2026-03-08T05:00:00Z", "2026-03-09T04:00:00Z"],
        id="havana_midnight_gap",
    ),
    pytest.param(
        "30 0 * * *",
        "America/Havana",
        "2026-10-31T12:00:00Z",
        ["2026-11-01T04:30:00Z", "2026-11-02T05:30:00Z"],
        id="havana_midnight_repeat",
    ),
    pytest.param(
        "0 0 * * *",
        "America/Santiago",
        "2026-09-05T00:00:00Z",
        ["2026-09-05T04:00:00Z", "2026-09-06T04:00:00Z", "2026-09-07T03:00:00Z"],
        id="santiago_midnight_gap",
    ),
    pytest.param(
        "30 23 * * *",
        "America/Santiago",
        "2026-04-03T12:00:00Z",
        ["2026-04-04T02:30:00Z", "2026-04-05T02:30:00Z", "2026-04-06T03:30:00Z"],
        id="santiago_repeat",
    ),
    pytest.param(
        "30 * * * *",
        "America/Santiago",
        "2026-04-05T01:00:00Z",
        [
            "2026-04-05T01:30:00Z",
            "2026-04-05T02:30:00Z",
            "2026-04-05T03:30:00Z",
            "2026-04-05T04:30:00Z",
        ],
        id="santiago_repeat_every_hour",
    ),
    pytest.param(
        "0 12 * * *",
        "Pacific/Apia",
        "2011-12-29T00:00:00Z",
        ["2011-12-29T22:00:00Z", "2011-12-30T10:00:00Z", "2011-12-30T22:00:00Z"],
        id="apia_skipped_day",
    ),
    pytest.param(
        "0 0 * * *",
        "Pacific/Apia",
        "2011-12-29T00:00:00Z",
        ["2011-12-29T10:00:00Z", "2011-12-30T10:00:00Z", "2011-12-31T10:00:00Z"],
        id="apia_skipped_day_merges_with_next_midnight",
    ),
    pytest.param(
        "0 * * * *",
        "Pacific/Apia",
        "2011-12-30T08:00:00Z",
        ["2011-12-30T09:00:00Z", "2011-12-30T10:00:00Z", "2011-12-30T11:00:00Z"],
        id="apia_skipped_day_every_hour",
    ),
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2026-10-24T10:00:00Z",  # 12:00 local
        ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"],
        id="berlin_croniter_regression",
    ),
]


@pytest.mark.parametrize(("expr", "zone", "start", "expected"), DST_CASES)
def test_dst_cases(expr: str, zone: str, start: str, expected: list[str]) -> None:
    assert fires(expr, zone, start, len(expected)) == expected


def test_berlin_regression_local_times() -> None:
    schedule = CronSchedule.parse("30 2 * * *", "Europe/Berlin")
    start = datetime(2026, 10, 24, 12, 0, tzinfo=schedule.zone)
    local = [t.astimezone(schedule.zone).isoformat() for t in islice(schedule.iter_after(start), 2)]
    assert local == ["2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]


def test_fire_kinds() -> None:
    gap = CronSchedule.parse("30 2 * * *", "Europe/Berlin").next_fire(utc("2026-03-28T12:00:00Z"))
    assert gap.kind is FireKind.shifted
    assert gap.wall == datetime(2026, 3, 29, 2, 30)
    hourly = CronSchedule.parse("30 * * * *", "Europe/Berlin")
    second = hourly.next_fire(utc("2026-10-25T00:30:00Z"))
    assert (second.instant, second.kind) == (utc("2026-10-25T01:30:00Z"), FireKind.repeated)
    assert hourly.next_fire(utc("2026-10-25T00:00:00Z")).kind is FireKind.exact


def test_result_is_aware_utc_and_input_zone_is_irrelevant() -> None:
    schedule = CronSchedule.parse("0 9 * * *", "Asia/Kolkata")
    a = schedule.next_after(utc("2026-01-01T00:00:00Z"))
    b = schedule.next_after(utc("2026-01-01T00:00:00Z").astimezone(schedule.zone))
    assert a == b == utc("2026-01-01T03:30:00Z")
    assert a.tzinfo is UTC


def test_strictly_after() -> None:
    schedule = CronSchedule.parse("0 * * * *", "UTC")
    assert schedule.next_after(utc("2026-01-01T10:00:00Z")) == utc("2026-01-01T11:00:00Z")
    assert schedule.next_after(utc("2026-01-01T09:59:59.999999Z")) == utc("2026-01-01T10:00:00Z")


def test_naive_after_rejected() -> None:
    with pytest.raises(ValidationError, match="after"):
        CronSchedule.parse("0 * * * *", "UTC").next_after(datetime(2026, 1, 1))


# --- parsing -----------------------------------------------------------------


def test_names_case_insensitive() -> None:
    a = CronSchedule.parse("0 9 * jan-mar Mon-fri", "UTC")
    b = CronSchedule.parse("0 9 * 1-3 1-5", "UTC")
    start = utc("2026-01-01T00:00:00Z")
    assert list(islice(a.iter_after(start), 30)) == list(islice(b.iter_after(start), 30))


def test_sunday_is_0_and_7_and_mon_sun_is_the_week() -> None:
    start = utc("2026-01-01T00:00:00Z")
    seven = list(islice(CronSchedule.parse("0 0 * * 7", "UTC").iter_after(start), 5))
    zero = list(islice(CronSchedule.parse("0 0 * * SUN", "UTC").iter_after(start), 5))
    assert seven == zero
    assert all(t.isoweekday() == 7 for t in seven)
    week = CronSchedule.parse("0 0 * * MON-SUN", "UTC")
    assert week.next_after(utc("2026-01-03T12:00:00Z")) == utc("2026-01-04T00:00:00Z")


@pytest.mark.parametrize(
    ("macro", "expanded"),
    [
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        ("@monthly", "0 0 1 * *"),
        ("@weekly", "0 0 * * 0"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        ("@HOURLY", "0 * * * *"),
    ],
)
def test_macros(macro: str, expanded: str) -> None:
    start = utc("2026-05-17T13:14:15Z")
    a = CronSchedule.parse(macro, "America/New_York")
    b = CronSchedule.parse(expanded, "America/New_York")
    assert list(islice(a.iter_after(start), 3)) == list(islice(b.iter_after(start), 3))


def test_vixie_or_rule_when_both_day_fields_restricted() -> None:
    # Friday the 13th style: the 13th OR any Friday.
    schedule = CronSchedule.parse("0 0 13 * FRI", "UTC")
    got = list(islice(schedule.iter_after(utc("2026-02-01T00:00:00Z")), 4))
    assert got == [
        utc("2026-02-06T00:00:00Z"),  # Friday
        utc("2026-02-13T00:00:00Z"),  # 13th (also a Friday)
        utc("2026-02-20T00:00:00Z"),
        utc("2026-02-27T00:00:00Z"),
    ]
    march = list(islice(schedule.iter_after(utc("2026-03-10T00:00:00Z")), 2))
    assert march == [utc("2026-03-13T00:00:00Z"), utc("2026-03-20T00:00:00Z")]


def test_and_rule_when_a_day_field_is_star() -> None:
    # dom `*`: only the day of week restricts; dom starting with `*` counts as `*` (Vixie).
    mondays = CronSchedule.parse("0 0 * * MON", "UTC")
    assert all(t.isoweekday() == 1 for t in islice(mondays.iter_after(utc("2026-01-01T00:00Z")), 8))
    odd_mondays = CronSchedule.parse("0 0 */2 * MON", "UTC")
    got = list(islice(odd_mondays.iter_after(utc("2026-01-01T00:00:00Z")), 4))
    assert all(t.isoweekday() == 1 and t.day % 2 == 1 for t in got)
    assert got[0] == utc("2026-01-05T00:00:00Z")


def test_steps_ranges_lists() -> None:
    schedule = CronSchedule.parse("5-20/5,45 */6 * * *", "UTC")
    got = list(islice(schedule.iter_after(utc("2026-01-01T00:00:00Z")), 6))
    assert [t.strftime("%H:%M") for t in got] == [
        "00:05",
        "00:10",
        "00:15",
        "00:20",
        "00:45",
        "06:05",
    ]
    assert CronSchedule.parse("10/20 * * * *", "UTC").next_after(
        utc("2026-01-01T00:31:00Z")
    ) == utc("2026-01-01T00:50:00Z")


def test_every_hour_classification() -> None:
    assert CronSchedule.parse("0 * * * *", "UTC").every_hour
    assert CronSchedule.parse("0 */1 * * *", "UTC").every_hour
    assert CronSchedule.parse("0 0-23 * * *", "UTC").every_hour
    assert not CronSchedule.parse("0 */2 * * *", "UTC").every_hour
    assert not CronSchedule.parse("0 0-22 * * *", "UTC").every_hour


def test_normalized_and_comparable() -> None:
    a = CronSchedule.parse("  0   9 * *  MON ", "Asia/Kolkata")
    assert a.expr == "0 9 * * MON"
    assert a == CronSchedule("0 9 * * MON", "Asia/Kolkata")
    assert hash(a) == hash(CronSchedule("0 9 * * MON", "Asia/Kolkata"))
    assert CronSchedule.parse("@Daily", "UTC").expr == "@daily"


def test_matches_local() -> None:
    schedule = CronSchedule.parse("30 2 * * *", "Europe/Berlin")
    assert schedule.matches_local(datetime(2026, 3, 29, 2, 30))
    assert not schedule.matches_local(datetime(2026, 3, 29, 2, 31))
    assert not schedule.matches_local(datetime(2026, 3, 29, 2, 30, 1))


INVALID_CRONS = [
    ("", "empty"),
    ("   ", "empty"),
    ("* * * *", "expected 5 fields"),
    ("0 0 * * * *", "got 6"),
    ("0 0 0 * * * 2026", "got 7"),
    ("@reboot", "'@reboot' is not supported"),
    ("@every 5m", "not supported"),
    ("60 * * * *", "minute: value 60 out of range 0-59"),
    ("* 24 * * *", "hour: value 24 out of range 0-23"),
    ("* * 0 * *", "day-of-month: value 0 out of range 1-31"),
    ("* * 32 * *", "day-of-month: value 32 out of range 1-31"),
    ("* * * 13 *", "month: value 13 out of range 1-12"),
    ("* * * * 8", "day-of-week: value 8 out of range 0-7"),
    ("0 0 L * *", "non-standard extension"),
    ("0 0 15W * *", "non-standard extension"),
    ("0 0 LW * *", "non-standard extension"),
    ("0 0 * * 5L", "non-standard extension"),
    ("0 0 * * 5#3", "non-standard extension"),
    ("0 0 ? * MON", "non-standard extension"),
    ("*/0 * * * *", "step 0 out of range"),
    ("*/61 * * * *", "step 61 out of range"),
    ("10-5 * * * *", "runs backwards"),
    ("1,,2 * * * *", "invalid element"),
    ("a * * * *", "minute: invalid value 'a'"),
    ("* * * FOO *", "month: invalid value 'FOO'"),
    ("* * MON * *", "day-of-month: invalid value 'MON'"),
    ("* * * * JAN", "day-of-week: invalid value 'JAN'"),
    ("-1 * * * *", "invalid element"),
    ("1-2-3 * * * *", "invalid element"),
    ("0 0 30 2 *", "can never fire"),
    ("0 0 31 2,4 *", "can never fire"),
    ("0 0 31 4,6 *", "can never fire"),
    ("0 0 30,31 FEB *", "can never fire"),
]


@pytest.mark.parametrize(("expr", "fragment"), INVALID_CRONS)
def test_invalid_cron(expr: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        CronSchedule.parse(expr, "UTC")
    assert info.value.field == "cron"
    assert str(info.value).startswith("cron: ")
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "zone",
    [
        "Mars/Olympus",
        "",
        "America",
        "../etc/passwd",
        "localtime",
        "/etc/localtime",
        " UTC",
        "Europe/Berlin\x00",
    ],
)
def test_unknown_zone(zone: str) -> None:
    with pytest.raises(ValidationError) as info:
        CronSchedule.parse("0 0 * * *", zone)
    assert info.value.field == "timezone"
    assert str(info.value).startswith("timezone: unknown time zone")


def test_leap_day_accepted_and_fires_on_leap_years() -> None:
    schedule = CronSchedule.parse("0 0 29 2 *", "UTC")
    got = list(islice(schedule.iter_after(utc("2026-01-01T00:00:00Z")), 2))
    assert got == [utc("2028-02-29T00:00:00Z"), utc("2032-02-29T00:00:00Z")]
    # 2100 is not a leap year: the wait spans eight years.
    assert schedule.next_after(utc("2096-03-01T00:00:00Z")) == utc("2104-02-29T00:00:00Z")


def test_rare_and_rule_found_within_bounds() -> None:
    # 29 February AND a Sunday (dow starts with `*`, so both must match).
    schedule = CronSchedule.parse("0 0 29 2 */7", "UTC")
    assert schedule.next_after(utc("2033-01-01T00:00:00Z")) == utc("2060-02-29T00:00:00Z")


def test_day_31_only_in_long_months() -> None:
    schedule = CronSchedule.parse("0 0 31 * *", "UTC")
    got = list(islice(schedule.iter_after(utc("2026-01-31T12:00:00Z")), 3))
    assert got == [
        utc("2026-03-31T00:00:00Z"),
        utc("2026-05-31T00:00:00Z"),
        utc("2026-07-31T00:00:00Z"),
    ]


def test_end_of_calendar_is_an_error_not_a_hang() -> None:
    schedule = CronSchedule.parse("0 0 29 2 *", "UTC")
    with pytest.raises(ValidationError, match="no fire time"):
        schedule.next_after(utc("9996-03-01T00:00:00Z"))


@pytest.mark.parametrize(
    ("expr", "field", "expected"),
    [
        # croniter alone reads a one-value range as the whole cycle round back to it
        ("5-5 * * * *", "_minutes", {5}),
        ("5-5/7 * * * *", "_minutes", {5}),
        ("0 3-3 * * *", "_hours", {3}),
        ("0 0 9-9/2 * *", "_doms", {9}),
        ("0 0 * NOV-11/7 *", "_months", {11}),
        ("0 0 * * WED-3", "_dows", {3}),
        # `N/step` runs to the end of the field: Sunday as 7 is in the week
        ("0 0 * * 1/1", "_dows", {0, 1, 2, 3, 4, 5, 6}),
        ("0 0 * * 1/3", "_dows", {0, 1, 4}),
        ("0 0 * * SAT-SUN", "_dows", {0, 6}),
        ("0 0 * * */7", "_dows", {0}),
        ("*/25,7 * * * *", "_minutes", {0, 7, 25, 50}),
    ],
)
def test_field_expansion_edge_cases(expr: str, field: str, expected: set[int]) -> None:
    assert getattr(CronSchedule.parse(expr, "UTC"), field) == expected
