"""Schedule kinds (once, cron, interval), their occurrences, and their stored JSON form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeAlias

from schedctl.core.errors import ValidationError
from schedctl.scheduling.cron import CronSchedule
from schedctl.scheduling.timeparse import format_instant, parse_instant

__all__ = [
    "AfterSchedule",
    "BootSchedule",
    "CronSchedule",
    "IntervalSchedule",
    "OnceSchedule",
    "Schedule",
    "first_occurrence",
    "latest_occurrence",
    "next_occurrence",
    "schedule_from_dict",
    "schedule_to_dict",
]

_TICK = timedelta(microseconds=1)
_SECOND = timedelta(seconds=1)


def _as_utc(value: datetime, field_name: str) -> datetime:
    if type(value) is datetime and value.tzinfo is UTC:
        return value  # already UTC (every stored time): a claim asks this once per run
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValidationError("must be a timezone-aware time (UTC)", field=field_name)
    return value.astimezone(UTC)


@dataclass(frozen=True)
class OnceSchedule:
    """A single run at `run_at`."""

    run_at: datetime

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_at", _as_utc(self.run_at, "run_at"))


@dataclass(frozen=True)
class IntervalSchedule:
    """Every `every_seconds` seconds from `anchor`: anchor + k * every_seconds, k >= 0."""

    every_seconds: int
    anchor: datetime

    def __post_init__(self) -> None:
        every = self.every_seconds
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValidationError(
                f"must be a positive whole number of seconds, got {every!r}", field="interval"
            )
        object.__setattr__(self, "anchor", _as_utc(self.anchor, "anchor"))

    @property
    def step(self) -> timedelta:
        return timedelta(seconds=self.every_seconds)


@dataclass(frozen=True)
class AfterSchedule:
    """No time of its own: a dependent job (`after`) runs when its upstream jobs succeed."""


@dataclass(frozen=True)
class BootSchedule(AfterSchedule):
    """No time of its own either: an @reboot job of a job file, run by its host's worker
    once per boot and recorded as a boot run (the dispatcher never fires it; as an
    AfterSchedule, every place that leaves dependent jobs alone leaves it alone)."""


Schedule: TypeAlias = OnceSchedule | CronSchedule | IntervalSchedule | AfterSchedule


def next_occurrence(
    schedule: Schedule, after: datetime, *, end: datetime | None = None
) -> datetime | None:
    """The first occurrence strictly after `after` and not after `end`, or None."""
    if isinstance(schedule, AfterSchedule):
        return None
    after = _as_utc(after, "after")
    if end is not None:
        end = _as_utc(end, "end")
        if after >= end:
            return None
    result: datetime | None
    if isinstance(schedule, OnceSchedule):
        result = schedule.run_at if schedule.run_at > after else None
    elif isinstance(schedule, IntervalSchedule):
        if after < schedule.anchor:
            result = schedule.anchor
        else:
            steps = (after - schedule.anchor) // schedule.step + 1
            try:
                result = schedule.anchor + steps * schedule.step
            except OverflowError:
                result = None
    else:
        result = schedule.next_after(after)
    if result is not None and end is not None and result > end:
        return None
    return result


def first_occurrence(
    schedule: Schedule,
    now: datetime,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
) -> datetime | None:
    """When a new or resumed job first runs: at or after `start`, strictly after `now`.

    A one-time job returns its run_at as is; rejecting a run_at in the past is the
    caller's decision.
    """
    if isinstance(schedule, AfterSchedule):
        return None
    if isinstance(schedule, OnceSchedule):
        if end is not None and schedule.run_at > _as_utc(end, "end"):
            return None
        return schedule.run_at
    bound = _as_utc(now, "now")
    if start is not None:
        bound = max(bound, _as_utc(start, "start") - _TICK)
    return next_occurrence(schedule, bound, end=end)


def latest_occurrence(
    schedule: Schedule,
    at_or_before: datetime,
    *,
    not_before: datetime,
    end: datetime | None = None,
) -> datetime | None:
    """The latest occurrence in [not_before, min(at_or_before, end)], or None.

    Costs O(log(range)) next-time computations for cron, O(1) otherwise.
    """
    if isinstance(schedule, AfterSchedule):
        return None
    upper = _as_utc(at_or_before, "at_or_before")
    lower = _as_utc(not_before, "not_before")
    if end is not None:
        upper = min(upper, _as_utc(end, "end"))
    if upper < lower:
        return None
    if isinstance(schedule, OnceSchedule):
        return schedule.run_at if lower <= schedule.run_at <= upper else None
    if isinstance(schedule, IntervalSchedule):
        if upper < schedule.anchor:
            return None
        latest = schedule.anchor + ((upper - schedule.anchor) // schedule.step) * schedule.step
        return latest if latest >= lower else None
    return _latest_cron(schedule, upper, lower - _TICK)


def _latest_cron(schedule: CronSchedule, upper: datetime, floor: datetime) -> datetime | None:
    """Latest cron fire in (floor, upper]: widen a window back from `upper` until it holds
    a fire, then halve it down to a second, then step forward over the few fires left."""
    if schedule.next_after(floor) > upper:
        return None
    newer, older, span = upper, floor, _SECOND  # invariant: no fire in (newer, upper]
    for _ in range(80):
        older = floor if span >= upper - floor else upper - span
        if schedule.next_after(older) <= upper:
            break
        newer, span = older, span * 2
    for _ in range(80):  # invariant: a fire in (older, upper], none in (newer, upper]
        if newer - older <= _SECOND:
            break
        middle = older + (newer - older) / 2
        if schedule.next_after(middle) <= upper:
            older = middle
        else:
            newer = middle
    # Fires are at least a second apart, so only one or two remain in (older, upper].
    latest = schedule.next_after(older)
    for _ in range(1000):
        following = schedule.next_after(latest)
        if following > upper:
            break
        latest = following
    return latest


def schedule_to_dict(schedule: Schedule) -> dict[str, object]:
    """The JSON-safe stored form of a schedule."""
    if isinstance(schedule, OnceSchedule):
        return {"kind": "once", "run_at": format_instant(schedule.run_at)}
    if isinstance(schedule, BootSchedule):
        return {"kind": "boot"}
    if isinstance(schedule, AfterSchedule):
        return {"kind": "after"}
    if isinstance(schedule, IntervalSchedule):
        return {
            "kind": "interval",
            "every_seconds": schedule.every_seconds,
            "anchor": format_instant(schedule.anchor),
        }
    return {"kind": "cron", "cron": schedule.expr, "timezone": schedule.timezone}


def _text(data: Mapping[str, object], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise ValidationError(f"'{key}' must be a string", field="schedule")
    return value


def schedule_from_dict(data: Mapping[str, object]) -> Schedule:
    """The inverse of schedule_to_dict; anything malformed is a ValidationError."""
    if not isinstance(data, Mapping):
        raise ValidationError("must be an object", field="schedule")
    kind = data.get("kind")
    if kind == "after":
        return AfterSchedule()
    if kind == "boot":
        return BootSchedule()
    if kind == "once":
        return OnceSchedule(parse_instant(_text(data, "run_at"), "run_at"))
    if kind == "cron":
        return CronSchedule.parse(_text(data, "cron"), _text(data, "timezone"))
    if kind == "interval":
        every = data.get("every_seconds")
        if isinstance(every, bool) or not isinstance(every, int):
            raise ValidationError("'every_seconds' must be an integer", field="interval")
        return IntervalSchedule(every, parse_instant(_text(data, "anchor"), "anchor"))
    raise ValidationError(
        f"unknown kind {kind!r}; expected 'once', 'cron' or 'interval'", field="schedule"
    )
