"""Owns the tests of job request validation (schedctl.domain.jobspec): pure, no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from schedctl.core import errors
from schedctl.domain.jobspec import parse_job_request, parse_schedule
from schedctl.domain.models import TargetType
from schedctl.scheduling.cron import CronSchedule
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import IntervalSchedule, OnceSchedule

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
QUEUE = {"type": "queue", "name": "digest-jobs"}


def body(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"schedule": {"delay": "10m"}, "target": dict(QUEUE)}
    base.update(overrides)
    return base


def refused(request: dict[str, Any], **kwargs: Any) -> errors.ValidationError:
    with pytest.raises(errors.ValidationError) as info:
        parse_job_request(request, now=NOW, **kwargs)
    return info.value


# -- every schedule kind ---------------------------------------------------------------


def test_run_at_with_offset_becomes_utc_once() -> None:
    spec = parse_job_request(body(schedule={"run_at": "2026-10-12T08:00:00+05:30"}), now=NOW)
    assert spec.schedule == OnceSchedule(datetime(2026, 10, 12, 2, 30, tzinfo=UTC))


@pytest.mark.parametrize(
    ("delay", "seconds"), [("10m", 600), ("PT10M", 600), ("90", 90), ("1h30m", 5400), (45, 45)]
)
def test_delay_is_once_at_now_plus_delay(delay: Any, seconds: int) -> None:
    spec = parse_job_request(body(schedule={"delay": delay}), now=NOW)
    assert spec.schedule == OnceSchedule(NOW + timedelta(seconds=seconds))


def test_cron_with_time_zone() -> None:
    spec = parse_job_request(
        body(schedule={"cron": "0 8 * * MON", "timezone": "Asia/Kolkata"}), now=NOW
    )
    assert isinstance(spec.schedule, CronSchedule)
    assert (spec.schedule.expr, spec.schedule.timezone) == ("0 8 * * MON", "Asia/Kolkata")


def test_cron_time_zone_defaults_to_utc() -> None:
    spec = parse_job_request(body(schedule={"cron": "@hourly"}), now=NOW)
    assert isinstance(spec.schedule, CronSchedule)
    assert spec.schedule.timezone == "UTC"


def test_every_anchors_at_now_by_default() -> None:
    spec = parse_job_request(body(schedule={"every": "30s"}), now=NOW)
    assert spec.schedule == IntervalSchedule(30, NOW)


def test_every_with_anchor() -> None:
    spec = parse_job_request(
        body(schedule={"every": "PT1H", "anchor": "2026-01-01T00:15:00Z"}), now=NOW
    )
    assert spec.schedule == IntervalSchedule(3600, datetime(2026, 1, 1, 0, 15, tzinfo=UTC))


def test_parse_schedule_alone_for_reschedule() -> None:
    assert parse_schedule({"delay": "5m"}, NOW) == OnceSchedule(NOW + timedelta(minutes=5))


# -- defaults and full bodies ----------------------------------------------------------


def test_defaults() -> None:
    spec = parse_job_request(body(), now=NOW)
    assert spec.payload == {}
    assert spec.retry.max_attempts == 3
    assert spec.retry.base_delay_seconds == 1.0
    assert spec.retry.max_delay_seconds == 300.0
    assert spec.misfire_policy is MisfirePolicy.run_once
    assert (spec.grace_seconds, spec.window_seconds, spec.timeout_seconds) == (60, 0, 0)
    assert spec.max_concurrency == 1  # no overlapping runs unless asked
    assert spec.start_at is None and spec.end_at is None
    assert spec.idempotency_key is None
    assert spec.name == "digest-jobs-delay"


def test_full_body() -> None:
    spec = parse_job_request(
        {
            "name": "nightly report",
            "schedule": {"cron": "0 2 * * *", "timezone": "Europe/Berlin"},
            "target": {"type": "http", "url": "https://hooks.example.com/run?x=1"},
            "payload": {"report": "daily", "n": [1, 2]},
            "retry": {
                "max_attempts": 5,
                "backoff": "exponential",
                "base_delay": "2s",
                "max_delay": "10m",
            },
            "misfire_policy": "run_all",
            "grace": "5m",
            "window": "PT5M",
            "max_concurrency": None,
            "timeout": "30m",
            "start": "2026-04-01T00:00:00Z",
            "end": "2027-04-01T00:00:00+02:00",
            "idempotency_key": "report-1",
        },
        now=NOW,
    )
    assert spec.name == "nightly report"
    assert spec.target.type is TargetType.http
    assert spec.target.url == "https://hooks.example.com/run?x=1"
    assert (spec.retry.max_attempts, spec.retry.base_delay_seconds) == (5, 2.0)
    assert spec.retry.max_delay_seconds == 600.0
    assert spec.misfire_policy is MisfirePolicy.run_all
    assert (spec.grace_seconds, spec.window_seconds, spec.timeout_seconds) == (300, 300, 1800)
    assert spec.max_concurrency == 0  # null: no limit
    assert spec.start_at == datetime(2026, 4, 1, tzinfo=UTC)
    assert spec.end_at == datetime(2027, 3, 31, 22, tzinfo=UTC)
    assert spec.idempotency_key == "report-1"


def test_request_hash_ignores_key_order_and_idempotency_key() -> None:
    first = parse_job_request(body(payload={"a": 1, "b": 2}, idempotency_key="k1"), now=NOW)
    second = parse_job_request(
        {"payload": {"b": 2, "a": 1}, "target": dict(QUEUE), "schedule": {"delay": "10m"}},
        now=NOW,
    )
    third = parse_job_request(body(payload={"a": 1, "b": 3}), now=NOW)
    assert first.request_hash == second.request_hash
    assert first.request_hash != third.request_hash


def test_payload_at_the_limit_is_accepted() -> None:
    # {"x":"..."} is 8 bytes of syntax around the string
    spec = parse_job_request(body(payload={"x": "a" * (64 * 1024 - 8)}), now=NOW)
    assert len(spec.payload["x"]) == 64 * 1024 - 8


# -- one test per kind of bad input: each names its field -------------------------------


@pytest.mark.parametrize(
    ("request_body", "field", "words"),
    [
        pytest.param(
            body(schedule={"cron": "0 8 * * *", "timezone": "Mars/Olympus"}),
            "timezone",
            ["Mars/Olympus"],
            id="unknown_time_zone",
        ),
        pytest.param(body(schedule={"cron": "61 * * * *"}), "cron", [], id="invalid_cron"),
        pytest.param(
            body(schedule={"cron": "0 0 30 2 *"}), "cron", ["never"], id="cron_that_never_fires"
        ),
        pytest.param(
            body(schedule={"run_at": "2026-03-01T11:59:59Z"}),
            "run_at",
            ["past"],
            id="run_at_in_the_past",
        ),
        pytest.param(
            body(schedule={"run_at": "2026-10-12T08:00:00"}),
            "run_at",
            ["offset"],
            id="run_at_without_offset",
        ),
        pytest.param(
            body(payload={"x": "a" * (64 * 1024)}),
            "payload",
            [str(64 * 1024), str(64 * 1024 + 8)],
            id="payload_over_the_size_limit",
        ),
        pytest.param(
            body(retry={"max_attempts": 0}), "retry.max_attempts", [], id="max_attempts_zero"
        ),
        pytest.param(body(priority=5), "priority", [], id="unknown_key"),
        pytest.param(
            body(schedule={"cron": "0 8 * * *", "tz": "UTC"}),
            "schedule.tz",
            [],
            id="unknown_key_inside_schedule",
        ),
        pytest.param(
            body(schedule={"run_at": "2026-10-12T08:00:00Z", "cron": "0 8 * * *"}),
            "schedule",
            ["run_at", "cron"],
            id="two_schedule_kinds",
        ),
        pytest.param(body(schedule={}), "schedule", [], id="no_schedule_kind"),
        pytest.param(
            body(misfire_policy="sometimes"), "misfire_policy", [], id="bad_misfire_policy"
        ),
        pytest.param(
            body(target={"type": "smtp", "to": "ops@example.com"}),
            "target.type",
            [],
            id="bad_target_type",
        ),
        pytest.param(
            body(target={"type": "http", "url": "https:///path"}),
            "target.url",
            ["host"],
            id="http_url_without_host",
        ),
    ],
)
def test_a_bad_input_names_its_field_and_why(
    request_body: dict[str, Any], field: str, words: list[str]
) -> None:
    error = refused(request_body)
    assert error.field == field
    for word in [field, *words]:
        assert word in str(error)


def test_payload_limit_is_configurable() -> None:
    error = refused(body(payload="x" * 20), max_payload_bytes=10)
    assert error.field == "payload" and "limit of 10 bytes" in str(error)


@pytest.mark.parametrize("every", ["0s", 0, -30, "-30s", "PT0S"])
def test_zero_or_negative_interval(every: Any) -> None:
    error = refused(body(schedule={"every": every}))
    assert error.field == "interval" and "interval" in str(error)


@pytest.mark.parametrize("delay", ["0s", 0, "0", "PT0M", -5])
def test_zero_delay(delay: Any) -> None:
    error = refused(body(schedule={"delay": delay}))
    assert error.field == "delay" and "delay" in str(error)


@pytest.mark.parametrize(
    ("request_body", "field"),
    [
        (body(target={"type": "http", "url": "ftp://example.com/x"}), "target.url"),
        (body(target={"type": "queue"}), "target.name"),
        (body(target={"type": "queue", "name": "has space"}), "target.name"),
        (body(target="digest-jobs"), "target"),
        ({"schedule": {"delay": "1m"}}, "target"),
        ({"target": QUEUE}, "schedule"),
        (body(schedule="0 8 * * *"), "schedule"),
        (body(schedule={"run_at": "2026-10-12T08:00:00Z", "timezone": "UTC"}), "timezone"),
        (body(schedule={"delay": "10 minutes"}), "delay"),
        (body(retry={"max_attempts": "3"}), "retry.max_attempts"),
        (body(retry={"max_attempts": True}), "retry.max_attempts"),
        (body(retry={"backoff": "linear"}), "retry.backoff"),
        (body(retry={"jitter": True}), "retry.jitter"),
        (body(grace="-1s"), "grace"),
        (body(window=[5]), "window"),
        (body(max_concurrency=0), "max_concurrency"),
        (body(start="2026-05-01T00:00:00Z", end="2026-04-01T00:00:00Z"), "end"),
        (body(start="tomorrow"), "start"),
        (body(idempotency_key="k" * 201), "idempotency_key"),
        (body(idempotency_key=17), "idempotency_key"),
        (body(name=""), "name"),
        (body(payload=float("nan")), "payload"),
    ],
)
def test_other_bad_inputs_name_their_field(request_body: dict[str, Any], field: str) -> None:
    error = refused(request_body)
    assert error.field == field
    assert field in str(error)


def test_body_must_be_an_object() -> None:
    with pytest.raises(errors.ValidationError) as info:
        parse_job_request([1, 2], now=NOW)  # type: ignore[arg-type]
    assert info.value.field == "body"


@pytest.mark.parametrize("ref", ["a\x00b", "nl\nname", "del\x7f"])
def test_an_upstream_reference_with_a_control_character_is_refused_naming_after(ref: str) -> None:
    # found by fuzzing POST /v1/jobs:batch: a NUL reached Postgres (which refuses it in text)
    body = {"target": {"type": "queue", "name": "q"}, "after": ["good", ref]}
    with pytest.raises(errors.ValidationError) as caught:
        parse_job_request(body, now=datetime(2026, 1, 1, tzinfo=UTC))
    assert caught.value.field == "after"


# the characters jobspec's one control-character search refuses in names, idempotency keys
# and upstream references: C0, DEL, C1 (0x80-0x9f) and U+2028/U+2029 (a name reaches mail
# headers, where Python breaks lines on U+0085 and U+2028 too); the rest is text
CONTROL = [chr(c) for c in (*range(32), *range(127, 160), 0x2028, 0x2029)]
NOT_CONTROL = [" ", "~", "\xa0", "é", "\u2027", "\u202a", "\U0001f600"]


@pytest.mark.parametrize("field", ["name", "idempotency_key"])
def test_exactly_the_controls_and_line_separators_are_refused_in_names_and_keys(
    field: str,
) -> None:
    for char in CONTROL:
        with pytest.raises(errors.ValidationError) as info:
            parse_job_request(body(**{field: f"a{char}b"}), now=NOW)
        assert info.value.field == field, repr(char)
        assert ("NUL" if char == "\x00" else "control or line-separator") in info.value.message
    for char in NOT_CONTROL:
        spec = parse_job_request(body(**{field: f"a{char}b"}), now=NOW)
        assert getattr(spec, field) == f"a{char}b"


def test_exactly_the_controls_and_line_separators_are_refused_in_upstream_references() -> None:
    for char in CONTROL:
        with pytest.raises(errors.ValidationError) as info:
            parse_job_request({"after": [f"up{char}"], "target": body()["target"]}, now=NOW)
        assert info.value.field == "after", repr(char)
    for char in NOT_CONTROL:
        spec = parse_job_request({"after": [f"up{char}"], "target": body()["target"]}, now=NOW)
        assert spec.after == (f"up{char}",)


def test_an_unknown_key_is_refused_naming_the_first_in_order() -> None:
    with pytest.raises(errors.ValidationError) as info:
        parse_job_request(body(zeta=1, alpha=2), now=NOW)
    assert info.value.field == "alpha"
    with pytest.raises(errors.ValidationError) as info:
        parse_job_request(body(schedule={"cron": "0 8 * * *", "zone": "UTC"}), now=NOW)
    assert info.value.field == "schedule.zone"
