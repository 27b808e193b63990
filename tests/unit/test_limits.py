"""Owns the unit tests of schedctl.core.limits: ASCII-only bounded integers, ids and cursors,
JSON that json.loads cannot convert (5,000-digit integers, nesting past the recursion
limit), and the payload value check (depth, int64, finite floats)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedctl.core import errors, limits
from schedctl.domain.config import load_config
from schedctl.scheduling.cron import CronSchedule
from schedctl.scheduling.timeparse import parse_duration, parse_instant


@pytest.mark.parametrize(
    "text",
    [
        "\u0663",
        "1\u0662",
        "\uff11",
        "1e3",
        "1.0",
        "0x10",
        "1_000",
        "",
        " ",
        "+",
        "9" * 5000,
        "\u0968\u0966",
    ],
)
def test_parse_int_takes_ascii_digits_only(text: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        limits.parse_int(text, "count", 0, 10**6)
    assert caught.value.field == "count"


def test_parse_int_bounds() -> None:
    assert limits.parse_int(" 42 ", "n", 1, 100) == 42
    assert limits.parse_int("0007", "n", 1, 100) == 7
    for text in ("0", "101", "-1", "1" + "0" * 30):
        with pytest.raises(errors.ValidationError, match="from 1 to 100"):
            limits.parse_int(text, "n", 1, 100)


@settings(max_examples=50)
@given(st.integers(min_value=limits.MAX_ID + 1) | st.integers(max_value=0))
def test_ids_outside_bigint_are_invalid(value: int) -> None:
    for given_as in (value, str(value)):
        with pytest.raises(errors.ValidationError) as caught:
            limits.parse_id(given_as, "id")
        assert caught.value.field == "id"
    assert limits.parse_id(str(limits.MAX_ID)) == limits.MAX_ID


def test_cursors() -> None:
    assert limits.check_cursor("abc") == "abc"
    for bad in ("A" * (limits.MAX_CURSOR_LENGTH + 1), "\u0663\u0663"):
        with pytest.raises(errors.ValidationError, match="not a cursor"):
            limits.check_cursor(bad)
    for bad in ("1234567890123456789012345", "\u0663", "-1", "0", "1.5"):
        with pytest.raises(errors.ValidationError, match="not a cursor") as caught:
            limits.cursor_id(bad)
        assert caught.value.field == "cursor"


def test_parse_json_huge_integers_become_markers_and_are_refused() -> None:
    value = limits.parse_json('{"n": ' + "9" * 5000 + "}", "payload")
    assert isinstance(value["n"], limits.OversizedInt)
    with pytest.raises(errors.ValidationError, match="5000 digits") as caught:
        limits.check_json_value(value, "payload")
    assert caught.value.field == "payload"
    # 19 or 20 digits still convert, and are judged by value
    assert limits.parse_json(str(limits.INT64_MAX), "x") == limits.INT64_MAX
    with pytest.raises(errors.ValidationError, match="2\\^63"):
        limits.check_json_value([limits.INT64_MAX + 1], "payload")
    with pytest.raises(errors.ValidationError, match="2\\^63"):
        limits.check_json_value({"a": [limits.INT64_MIN - 1]}, "payload")
    limits.check_json_value([limits.INT64_MIN, limits.INT64_MAX, 1e308, -0.0], "payload")


@pytest.mark.parametrize("text", ["[NaN]", '{"x": Infinity}', "-Infinity", "1e999", "[-1e400]"])
def test_non_finite_numbers_are_refused(text: str) -> None:
    with pytest.raises(errors.ValidationError, match="finite") as caught:
        limits.check_json_value(limits.parse_json(text, "payload"), "payload")
    assert caught.value.field == "payload"


def test_nesting_past_the_recursion_limit_names_the_key() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    with pytest.raises(errors.ValidationError, match="nested deeper") as caught:
        limits.parse_json(deep, "payload")
    assert caught.value.field == "payload"
    body = '{"schedule": {"delay": "PT1M"}, "payload": ' + deep + "}"
    with pytest.raises(errors.ValidationError) as caught:
        limits.parse_json(body.encode(), "body")
    assert caught.value.field == "payload"
    # a key inside a string is no key; nesting under no single key is the body's
    tricky = '{"a": "\\"payload\\": [[[", "b": ' + deep + "}"
    with pytest.raises(errors.ValidationError) as caught:
        limits.parse_json(tricky, "body")
    assert caught.value.field == "b"


def test_nesting_within_the_parser_but_past_the_limit_is_refused_by_the_check() -> None:
    value = json.loads("[" * 65 + "]" * 65)
    with pytest.raises(errors.ValidationError, match="64 levels"):
        limits.check_json_value(value, "payload")
    limits.check_json_value(json.loads("[" * 64 + "]" * 64), "payload")


def test_malformed_json_is_the_given_class_and_quotes_nothing() -> None:
    class Malformed(errors.ValidationError):
        pass

    with pytest.raises(Malformed) as caught:
        limits.parse_json('{"secret": "hunter2"', "body", malformed=Malformed)
    assert "hunter2" not in caught.value.message
    with pytest.raises(Malformed, match="UTF-8"):
        limits.parse_json(b'{"a": "\xff"}', "body", malformed=Malformed)


def test_describe_is_short_and_never_recurses() -> None:
    deep = json.loads("[" * 900 + "]" * 900)
    assert limits.describe(deep) == "a list"
    assert limits.describe({"a": deep}) == "an object"
    assert len(limits.describe("x" * 10_000)) < 50
    assert limits.describe(10**5000) == "an integer of about 5001 digits"


# -- durations, instants and cron: ASCII digits, bounded lengths -------------------------


@pytest.mark.parametrize(
    "text",
    [
        "\u0663m",
        "PT\u0663M",
        "\u0661h",
        "3\u0660s",
        "\u0663",
        "P\u0661D",
        "\uff11m",
        "9" * 5000 + "s",
        "PT" + "9" * 5000 + "M",
    ],
)
def test_durations_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        parse_duration(text, "delay")
    assert caught.value.field == "delay"


def test_ascii_durations_still_parse() -> None:
    assert parse_duration("3m", "d") == timedelta(minutes=3)
    assert parse_duration("PT10M", "d") == timedelta(minutes=10)
    assert parse_duration("1h30m", "d") == timedelta(hours=1, minutes=30)
    assert parse_duration("90", "d") == timedelta(seconds=90)


@pytest.mark.parametrize(
    "text", ["\u0662\u0660\u0662\u0666-01-01T00:00:00Z", "2026-01-01T0\u0663:00:00Z", "2" * 5000]
)
def test_instants_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(errors.ValidationError):
        parse_instant(text, "run_at")


@pytest.mark.parametrize("expr", ["*/" + "9" * 5000 + " * * * *", "9" * 5000 + " * * * *"])
def test_cron_values_of_thousands_of_digits_are_out_of_range(expr: str) -> None:
    with pytest.raises(errors.ValidationError, match="out of range"):
        CronSchedule.parse(expr, "UTC")


# -- configuration numbers ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SCHEDULED_PARTITION_COUNT", "\u0663"),
        ("SCHEDULED_PARTITION_COUNT", "9" * 5000),
        ("SCHEDULED_SESSION_TIMEOUT_SECONDS", "nan"),
        ("SCHEDULED_SESSION_TIMEOUT_SECONDS", "inf"),
        ("SCHEDULED_RETENTION_DAYS", "1e3"),
    ],
)
def test_configuration_numbers_are_ascii_and_finite(variable: str, value: str) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        load_config(environ={variable: value})
    assert caught.value.field == variable.removeprefix("SCHEDULED_").lower()


@pytest.mark.parametrize(
    "worker",
    [
        {"concurrency": limits.MAX_WORKER_CONCURRENCY + 1},
        {"concurrency": 10**30},
        {"lease_seconds": limits.MAX_LEASE_SECONDS + 1},
        {"lease_seconds": float("inf")},
        {"lease_seconds": float("nan")},
    ],
)
def test_worker_settings_are_bounded(tmp_path: Path, worker: dict[str, Any]) -> None:
    settings_lines = "\n".join(f"{k} = {_toml(v)}" for k, v in worker.items())
    path = tmp_path / "scheduled.toml"
    path.write_text(f'[[worker]]\nqueue = "q"\ncommand = ["true"]\n{settings_lines}\n')
    with pytest.raises(errors.ConfigError) as caught:
        load_config(path, environ={})
    assert caught.value.field in ("worker.concurrency", "worker.lease_seconds")


def _toml(value: Any) -> str:
    if isinstance(value, float) and value != value:
        return "nan"
    if value == float("inf"):
        return "inf"
    return str(value)
