"""Owns the tests of job request validation (schedctl.jobspec): pure, no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from schedctl import errors
from schedctl.jobspec import parse_job_request, parse_schedule
from schedctl.models import TargetType
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


def test_unknown_time_zone() -> None:
    error = refused(body(schedule={"cron": "0 8 * * *", "timezone": "Mars/Olympus"}))
    assert error.field == "timezone"
    assert "timezone" in str(error) and "Mars/Olympus" in str(error)


def test_invalid_cron() -> None:
    error = refused(body(schedule={"cron": "61 * * * *"}))
    assert error.field == "cron" and "cron" in str(error)


def test_cron_that_never_fires() -> None:
    error = refused(body(schedule={"cron": "0 0 30 2 *"}))
    assert error.field == "cron" and "cron" in str(error) and "never" in str(error)


def test_run_at_in_the_past() -> None:
    error = refused(body(schedule={"run_at": "2026-03-01T11:59:59Z"}))
    assert error.field == "run_at" and "run_at" in str(error) and "past" in str(error)


def test_run_at_without_offset() -> None:
    error = refused(body(schedule={"run_at": "2026-10-12T08:00:00"}))
    assert error.field == "run_at" and "run_at" in str(error) and "offset" in str(error)


def test_payload_over_the_size_limit() -> None:
    error = refused(body(payload={"x": "a" * (64 * 1024)}))
    assert error.field == "payload" and "payload" in str(error)
    assert str(64 * 1024) in str(error) and str(64 * 1024 + 8) in str(error)


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


def test_max_attempts_zero() -> None:
    error = refused(body(retry={"max_attempts": 0}))
    assert error.field == "retry.max_attempts" and "retry.max_attempts" in str(error)


def test_unknown_key() -> None:
    error = refused(body(priority=5))
    assert error.field == "priority" and "priority" in str(error)


def test_unknown_key_inside_schedule() -> None:
    error = refused(body(schedule={"cron": "0 8 * * *", "tz": "UTC"}))
    assert error.field == "schedule.tz" and "schedule.tz" in str(error)


def test_two_schedule_kinds() -> None:
    error = refused(body(schedule={"run_at": "2026-10-12T08:00:00Z", "cron": "0 8 * * *"}))
    assert error.field == "schedule" and "schedule" in str(error)
    assert "run_at" in str(error) and "cron" in str(error)


def test_no_schedule_kind() -> None:
    error = refused(body(schedule={}))
    assert error.field == "schedule" and "schedule" in str(error)


def test_bad_misfire_policy() -> None:
    error = refused(body(misfire_policy="sometimes"))
    assert error.field == "misfire_policy" and "misfire_policy" in str(error)


def test_bad_target_type() -> None:
    error = refused(body(target={"type": "smtp", "to": "ops@example.com"}))
    assert error.field == "target.type" and "target.type" in str(error)


def test_http_url_without_host() -> None:
    error = refused(body(target={"type": "http", "url": "https:///path"}))
    assert error.field == "target.url" and "target.url" in str(error) and "host" in str(error)


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
