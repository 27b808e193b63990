"""Owns job request validation: a REST-shaped job body -> a validated models.JobSpec.

The same parser serves the CLI (which builds the REST body from its flags) and the REST
API, so both refuse the same inputs with the same messages. Every refusal is a
ValidationError naming the offending field; nothing here touches the database.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import orjson

from schedctl.core import errors, limits
from schedctl.core.limits import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_CONCURRENCY,
    MAX_DURATION,
    MAX_PAYLOAD_DEPTH,
    describe,
)
from schedctl.domain.alerts.model import parse_alerts
from schedctl.domain.models import JobSpec, RetryPolicy, Target, TargetType
from schedctl.domain.runpolicy import RUN_KEYS, parse_run_policy
from schedctl.scheduling.cron import CronSchedule
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.scheduling.schedules import (
    AfterSchedule,
    BootSchedule,
    IntervalSchedule,
    OnceSchedule,
    Schedule,
)
from schedctl.scheduling.timeparse import parse_duration, parse_instant

MAX_NAME_LENGTH = 200
MAX_IDEMPOTENCY_KEY_LENGTH = 200
MAX_URL_LENGTH = 2048
MAX_CRON_LENGTH = 200
MAX_TIMEZONE_LENGTH = 100
# the numeric bounds live in schedctl.core.limits (one table for the CLI, the API and the docs)
MAX_ATTEMPTS_LIMIT = limits.MAX_ATTEMPTS
MAX_INSTANT = datetime(9000, 1, 1, tzinfo=UTC)

TOP_LEVEL_KEYS = frozenset(
    {
        "name",
        "schedule",
        "target",
        "payload",
        "retry",
        "misfire_policy",
        "grace",
        "window",
        "max_concurrency",
        "timeout",
        "start",
        "end",
        "idempotency_key",
        "alerts",
        "after",
        "metrics",
        *RUN_KEYS,
    }
)
SCHEDULE_KINDS = ("run_at", "delay", "cron", "every", "boot")
SCHEDULE_KEYS = frozenset({*SCHEDULE_KINDS, "timezone", "anchor"})
RETRY_KEYS = frozenset({"max_attempts", "backoff", "base_delay", "max_delay"})
# queue names end up in URLs, log lines and worker flags: keep them plain
QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}")
# the characters no name, key or upstream reference may hold (limits.CONTROL_CHARS): one
# search, not a Python loop over the characters (a hot spot of a body's validation)
_CONTROL = limits.CONTROL_CHARS


def parse_job_request(
    body: Mapping[str, Any],
    *,
    now: datetime,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> JobSpec:
    """Validate a job body (the REST shape of DESIGN.md) at `now` (the database clock)."""
    if not isinstance(body, Mapping):
        raise errors.ValidationError("the job must be a JSON object", field="body")
    _reject_unknown(body, TOP_LEVEL_KEYS, prefix="")
    after = parse_after(body["after"]) if "after" in body else ()
    if after and "schedule" in body:
        raise errors.ValidationError(
            "a dependent job has no schedule of its own: give schedule or after, not both",
            field="after",
        )
    if "schedule" not in body and not after:
        raise errors.ValidationError(
            "is required: one of run_at, delay, cron, every (or after: upstream jobs)",
            field="schedule",
        )
    if "target" not in body:
        raise errors.ValidationError("is required: a queue or http target", field="target")
    schedule: Schedule = AfterSchedule() if after else parse_schedule(body["schedule"], now)
    target = parse_target(body["target"])
    payload = body.get("payload", {})
    _check_payload(payload, max_payload_bytes)
    retry = _parse_retry(body.get("retry"))
    misfire = _parse_misfire(body.get("misfire_policy"))
    grace = _seconds(body, "grace", default=60, allow_zero=True)
    window = _seconds(body, "window", default=0, allow_zero=True)
    timeout = _seconds(body, "timeout", default=0, allow_zero=True)
    max_concurrency = _parse_max_concurrency(body)
    start_at = _optional_instant(body, "start")
    end_at = _optional_instant(body, "end")
    if start_at is not None and end_at is not None and end_at <= start_at:
        raise errors.ValidationError("end must be after start", field="end")
    if end_at is not None and end_at <= now:
        raise errors.ValidationError("end is in the past", field="end")
    idempotency_key = _parse_idempotency_key(body.get("idempotency_key"))
    name = _parse_name(
        body.get("name"),
        schedule_kind="after" if after else _kind_of(body["schedule"]),
        target=target,
    )
    return JobSpec(
        name=name,
        schedule=schedule,
        target=target,
        payload=payload,
        retry=retry,
        misfire_policy=misfire,
        grace_seconds=grace,
        window_seconds=window,
        max_concurrency=max_concurrency,
        timeout_seconds=timeout,
        start_at=start_at,
        end_at=end_at,
        idempotency_key=idempotency_key,
        request_hash=request_hash(body),
        alerts=parse_alerts(body["alerts"]) if body.get("alerts") is not None else None,
        after=after,
        metrics=parse_metrics(body.get("metrics", False)),
        run=parse_run_policy(body, target_type=target.type.value),
    )


def parse_metrics(value: Any) -> bool:
    """`metrics`: true asks for the job's run counts and durations on /metrics."""
    if not isinstance(value, bool):
        raise errors.ValidationError(f"must be true or false, got {value!r}", field="metrics")
    return value


def request_hash(body: Mapping[str, Any]) -> str:
    """What "the same request" means for idempotency: the canonical body minus its key."""
    canonical = {k: v for k, v in body.items() if k != "idempotency_key"}
    try:
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise errors.ValidationError(f"the job is not JSON: {exc}", field="body") from exc
    return hashlib.sha256(text.encode()).hexdigest()


# -- schedule ------------------------------------------------------------------------


def parse_schedule(obj: Any, now: datetime) -> Schedule:
    """One schedule object: {"run_at"} | {"delay"} | {"cron", "timezone"} | {"every", "anchor"}."""
    if not isinstance(obj, Mapping):
        raise errors.ValidationError(
            "must be an object with one of run_at, delay, cron, every", field="schedule"
        )
    _reject_unknown(obj, SCHEDULE_KEYS, prefix="schedule.")
    kind = _kind_of(obj)
    if "timezone" in obj and kind != "cron":
        raise errors.ValidationError(
            "timezone applies only to cron schedules (run_at carries its own offset)",
            field="timezone",
        )
    if "anchor" in obj and kind != "every":
        raise errors.ValidationError("anchor applies only to every schedules", field="anchor")
    if kind == "boot":
        # an @reboot job of a job file: its host's worker runs it once per boot
        if obj["boot"] is not True:
            raise errors.ValidationError("must be true (an @reboot job)", field="boot")
        return BootSchedule()
    if kind == "run_at":
        run_at = _instant(obj["run_at"], "run_at")
        if run_at <= now:
            raise errors.ValidationError(
                f"run_at {obj['run_at']} is in the past (now is {_iso(now)})", field="run_at"
            )
        return OnceSchedule(run_at)
    if kind == "delay":
        delay = _duration(obj["delay"], "delay")
        if delay <= timedelta(0):
            raise errors.ValidationError(
                f"delay must be positive, got {obj['delay']!r}", field="delay"
            )
        return OnceSchedule(now + delay)
    if kind == "cron":
        expr = _string(obj["cron"], "cron")
        timezone = _string(obj.get("timezone", "UTC"), "timezone")
        # bounded before the cron parser sees them (it chokes on absurd numbers)
        if len(expr) > MAX_CRON_LENGTH:
            raise errors.ValidationError(
                f"is longer than {MAX_CRON_LENGTH} characters", field="cron"
            )
        if len(timezone) > MAX_TIMEZONE_LENGTH:
            raise errors.ValidationError(
                f"is longer than {MAX_TIMEZONE_LENGTH} characters", field="timezone"
            )
        return CronSchedule.parse(expr, timezone)
    every = _duration(obj["every"], "interval")
    if every <= timedelta(0):
        raise errors.ValidationError(
            f"interval (schedule.every) must be positive, got {obj['every']!r}", field="interval"
        )
    if every.total_seconds() != int(every.total_seconds()):
        raise errors.ValidationError(
            f"interval (schedule.every) must be whole seconds, got {obj['every']!r}",
            field="interval",
        )
    anchor = _instant(obj["anchor"], "anchor") if obj.get("anchor") is not None else now
    return IntervalSchedule(int(every.total_seconds()), anchor)


def _kind_of(obj: Any) -> str:
    if not isinstance(obj, Mapping):
        raise errors.ValidationError("must be an object", field="schedule")
    kinds = [k for k in SCHEDULE_KINDS if k in obj]
    if not kinds:
        raise errors.ValidationError("needs one of run_at, delay, cron, every", field="schedule")
    if len(kinds) > 1:
        raise errors.ValidationError(
            f"has more than one kind ({', '.join(kinds)}): give exactly one", field="schedule"
        )
    return kinds[0]


# -- target --------------------------------------------------------------------------


def parse_target(obj: Any) -> Target:
    if not isinstance(obj, Mapping):
        raise errors.ValidationError(
            'must be an object: {"type": "queue", "name": ...} or {"type": "http", "url": ...}',
            field="target",
        )
    kind = obj.get("type")
    if kind == TargetType.queue.value:
        _reject_unknown(obj, frozenset({"type", "name"}), prefix="target.")
        name = _string(obj.get("name"), "target.name")
        if not QUEUE_NAME.fullmatch(name):
            raise errors.ValidationError(
                f"queue name {name!r} must be 1-200 characters of letters, digits and ._:/- "
                "starting with a letter or digit",
                field="target.name",
            )
        return Target(TargetType.queue, name=name)
    if kind == TargetType.http.value:
        _reject_unknown(obj, frozenset({"type", "url"}), prefix="target.")
        url = _string(obj.get("url"), "target.url")
        check_url(url)
        return Target(TargetType.http, url=url)
    raise errors.ValidationError(
        f"type must be 'queue' or 'http', got {describe(kind)}", field="target.type"
    )


def check_url(url: str, field: str = "target.url") -> None:
    """An http(s) URL a tenant gives (a target, an alert webhook), syntax only; which
    destinations a tenant may call is the SSRF guard's business. The URL is never repeated
    in an error: its path, query or user part may hold a secret."""
    if len(url) > MAX_URL_LENGTH:
        raise errors.ValidationError(f"is longer than {MAX_URL_LENGTH} characters", field=field)
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise errors.ValidationError("must not contain spaces or control characters", field=field)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise errors.ValidationError(f"is not a valid URL: {exc}", field=field) from exc
    if parts.scheme not in ("http", "https"):
        raise errors.ValidationError(
            f"must use http or https, not {parts.scheme[:20] or 'no scheme'!r}", field=field
        )
    if not parts.hostname:
        raise errors.ValidationError("has no host", field=field)
    if port == 0:
        raise errors.ValidationError("has port 0", field=field)
    if parts.username is not None or parts.password is not None:
        # credentials in a URL end up in logs and the run history
        raise errors.ValidationError("must not contain credentials (user:password@)", field=field)


# -- the rest ------------------------------------------------------------------------


_ORJSON_STRICT = (
    orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


def _check_payload(payload: Any, limit: int) -> None:
    # nesting, 64-bit integers and finite floats first: what follows serializes it
    limits.check_json_value(payload, "payload", max_depth=MAX_PAYLOAD_DEPTH)
    try:
        # orjson (C) first, much cheaper than json.dumps: its compact UTF-8 is the
        # size below but for floats, which it may spell a character or two shorter
        # (1e16, not 1e+16) and never more than a quarter shorter; well under the limit
        # that cannot matter, near it the size is measured as before
        # (passthrough: what json cannot write, orjson must refuse too)
        if 2 * len(orjson.dumps(payload, option=_ORJSON_STRICT)) <= limit:
            return
    except orjson.JSONEncodeError:
        pass  # not JSON text (an unpaired surrogate, a non-text key): as before, named
    try:
        encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise errors.ValidationError(f"is not a JSON value: {exc}", field="payload") from exc
    try:
        size = len(encoded.encode())
    except UnicodeEncodeError:
        # JSON can spell one ("\ud800"), but no UTF-8 consumer can read it back
        raise errors.ValidationError(
            "contains an unpaired surrogate (\\ud800-\\udfff): not valid Unicode text",
            field="payload",
        ) from None
    if size > limit:
        # its own class: the REST API answers 413 for it, the CLI still exits 2
        raise errors.PayloadTooLarge(
            f"payload is {size} bytes, over the limit of {limit} bytes", field="payload"
        )


def _parse_retry(obj: Any) -> RetryPolicy:
    if obj is None:
        return RetryPolicy()
    if not isinstance(obj, Mapping):
        raise errors.ValidationError("must be an object", field="retry")
    _reject_unknown(obj, RETRY_KEYS, prefix="retry.")
    max_attempts = obj.get("max_attempts", RetryPolicy.max_attempts)
    if not _is_int(max_attempts) or not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
        raise errors.ValidationError(
            f"must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}, got {describe(max_attempts)}",
            field="retry.max_attempts",
        )
    backoff = obj.get("backoff", "exponential")
    if backoff != "exponential":
        raise errors.ValidationError(
            f"only 'exponential' is supported, got {describe(backoff)}", field="retry.backoff"
        )
    base = _positive_seconds(obj, "base_delay", RetryPolicy.base_delay_seconds, "retry.base_delay")
    cap = _positive_seconds(obj, "max_delay", RetryPolicy.max_delay_seconds, "retry.max_delay")
    if cap < base:
        raise errors.ValidationError(
            "max_delay must not be shorter than base_delay", field="retry.max_delay"
        )
    return RetryPolicy(max_attempts=max_attempts, base_delay_seconds=base, max_delay_seconds=cap)


def _positive_seconds(obj: Mapping[str, Any], key: str, default: float, field: str) -> float:
    if obj.get(key) is None:
        return default
    value = _duration(obj[key], field)
    if value <= timedelta(0):
        raise errors.ValidationError(f"must be positive, got {describe(obj[key])}", field=field)
    return value.total_seconds()


def _parse_misfire(value: Any) -> MisfirePolicy:
    if value is None:
        return MisfirePolicy.run_once
    allowed = ", ".join(p.value for p in MisfirePolicy)
    if not isinstance(value, str):
        raise errors.ValidationError(f"must be one of {allowed}", field="misfire_policy")
    try:
        return MisfirePolicy(value)
    except ValueError:
        raise errors.ValidationError(
            f"must be one of {allowed}, got {describe(value)}", field="misfire_policy"
        ) from None


def _parse_max_concurrency(body: Mapping[str, Any]) -> int:
    """1 unless asked: overlapping runs of one job surprise people. null (0 in the model)
    means no limit."""
    if "max_concurrency" not in body:
        return 1
    value = body["max_concurrency"]
    if value is None:
        return 0
    if not _is_int(value) or not 1 <= value <= MAX_CONCURRENCY:
        raise errors.ValidationError(
            f"must be an integer from 1 to {MAX_CONCURRENCY}, or null for no limit; "
            f"got {describe(value)}",
            field="max_concurrency",
        )
    return int(value)


def _seconds(body: Mapping[str, Any], key: str, *, default: int, allow_zero: bool) -> int:
    if body.get(key) is None:
        return default
    value = _duration(body[key], key)
    if value < timedelta(0) or (value == timedelta(0) and not allow_zero):
        raise errors.ValidationError(f"must not be negative, got {describe(body[key])}", field=key)
    # whole seconds are all the schema keeps; round up so "0.5s" is not silently 0
    return math.ceil(value.total_seconds())


def _optional_instant(body: Mapping[str, Any], key: str) -> datetime | None:
    if body.get(key) is None:
        return None
    return _instant(body[key], key)


def _instant(value: Any, field: str) -> datetime:
    instant = parse_instant(_string(value, field), field)
    if instant >= MAX_INSTANT:
        # the scheduler adds windows and intervals to it: keep clear of datetime's year 9999
        raise errors.ValidationError(f"must be before {_iso(MAX_INSTANT)}", field=field)
    return instant


def _parse_idempotency_key(value: Any) -> str | None:
    if value is None:
        return None
    key = _string(value, "idempotency_key")
    if len(key) > MAX_IDEMPOTENCY_KEY_LENGTH:
        raise errors.ValidationError(
            f"is {len(key)} characters, the limit is {MAX_IDEMPOTENCY_KEY_LENGTH}",
            field="idempotency_key",
        )
    if _CONTROL.search(key):
        # it also travels as an HTTP header, where control characters cannot
        raise errors.ValidationError(
            "must not contain control or line-separator characters",
            field="idempotency_key",
        )
    return key


def _parse_name(value: Any, *, schedule_kind: str, target: Target) -> str:
    if value is None:
        # a readable default for listings: where it goes and how often
        host = urlsplit(target.address).hostname if target.type is TargetType.http else None
        return f"{host or target.address}-{schedule_kind}"[:MAX_NAME_LENGTH]
    name = _string(value, "name")
    if len(name) > MAX_NAME_LENGTH:
        raise errors.ValidationError(
            f"is {len(name)} characters, the limit is {MAX_NAME_LENGTH}", field="name"
        )
    if _CONTROL.search(name):
        raise errors.ValidationError(
            "must not contain control or line-separator characters", field="name"
        )
    return name


def _duration(value: Any, field: str) -> timedelta:
    """A duration string ("30s", "1h30m", "PT10M", "90") or a JSON number of seconds."""
    if _is_int(value) or (isinstance(value, float) and math.isfinite(value)):
        if abs(value) > MAX_DURATION.total_seconds():
            # checked before timedelta(), which overflows on huge numbers
            raise errors.ValidationError(
                f"must be at most {MAX_DURATION.days} days, got {describe(value)}", field=field
            )
        result = timedelta(seconds=value)
    elif isinstance(value, str):
        result = parse_duration(value, field)
    else:
        raise errors.ValidationError(
            f"must be a duration like '30s', '10m' or 'PT10M', got {describe(value)}",
            field=field,
        )
    if abs(result) > MAX_DURATION:
        raise errors.ValidationError(
            f"must be at most {MAX_DURATION.days} days, got {describe(value)}", field=field
        )
    return result


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise errors.ValidationError(
            f"must be a non-empty string, got {describe(value)}", field=field
        )
    _check_text(value, field)
    return value


def _check_text(value: str, field: str) -> None:
    """Strings stored as they are (names, keys, URLs) must be storable text: Postgres refuses
    NUL characters and no database encodes an unpaired surrogate (JSON can carry both)."""
    if "\x00" in value:
        raise errors.ValidationError("must not contain NUL characters", field=field)
    try:
        value.encode()
    except UnicodeEncodeError:
        raise errors.ValidationError(
            "must be valid Unicode text (it contains an unpaired surrogate)", field=field
        ) from None


def _is_int(value: Any) -> bool:
    # JSON true/false are ints to Python; they are never a count here
    return limits.is_int(value)


def _reject_unknown(obj: Mapping[str, Any], allowed: frozenset[str], *, prefix: str) -> None:
    if obj.keys() <= allowed:  # the usual case, without building the sorted list
        return
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        field = prefix + unknown[0]
        raise errors.ValidationError(
            f"unknown key (allowed here: {', '.join(sorted(allowed))})", field=field
        )


def _iso(value: datetime) -> str:
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


MAX_AFTER = 32  # upstream jobs of one dependent job


def parse_after(value: Any) -> tuple[str, ...]:
    """`after`: a non-empty list of upstream jobs (ids or names), without repeats."""
    if not isinstance(value, list) or not value:
        raise errors.ValidationError("must be a non-empty list of jobs", field="after")
    if len(value) > MAX_AFTER:
        raise errors.ValidationError(f"at most {MAX_AFTER} upstream jobs", field="after")
    found: list[str] = []
    for item in value:
        if not isinstance(item, str) or not item or len(item) > MAX_NAME_LENGTH:
            raise errors.ValidationError(
                f"each upstream job is a job id or name, got {item!r}", field="after"
            )
        if _CONTROL.search(item):
            # no name holds a control character (nor can a Postgres text hold NUL)
            raise errors.ValidationError(
                f"an upstream job name has no control characters, got {item!r}", field="after"
            )
        if item not in found:
            found.append(item)
    return tuple(found)
