"""Cron expressions in an IANA time zone: parsing, validation and next fire times across DST.

The DST rule (DESIGN.md, "Scheduling semantics"):

* specific-time jobs (the hour field does not match all 24 hours): a matching wall time
  inside a gap fires at the transition instant; a wall time that happens twice fires once,
  at its first occurrence;
* every-hour jobs: fire at each matching wall time that really happens, both occurrences
  of a repeated hour included, nothing inside a gap;
* fire times strictly increase, so wall times that land on the same instant fire once.

Each field is validated here (so an error names the field and the value), then croniter
expands the validated fields to integer sets. croniter is deliberately not used for
iteration: it fires `30 2 * * *` twice on a fall-back night; the walk over local wall times
is our own.
"""

from __future__ import annotations

import enum
import functools
import re
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from schedctl.core.errors import ValidationError

__all__ = ["CronFire", "CronSchedule", "FireKind", "load_zone"]

_EPOCH = datetime(1970, 1, 1)
_SECOND = timedelta(seconds=1)

# The longest wait between two fires that the static check admits is a 29 February on
# one weekday under the AND rule (e.g. `0 0 29 2 */7`): 28 years, 40 across a
# non-leap century year. 50 years bounds every search with room to spare.
_MAX_SEARCH_DAYS = 366 * 50

_MONTH_NAMES = {
    name: number
    for number, name in enumerate(
        ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"),
        start=1,
    )
}
_DAY_NAMES = {
    name: number for number, name in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"))
}
_MONTH_DAYS = (0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)  # 29 Feb exists in leap years

_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

# no cron field value has more digits (and int() refuses thousands of them)
_MAX_VALUE_DIGITS = 10
_ELEMENT = re.compile(r"^(?:(\*)|([0-9A-Za-z]+)(?:-([0-9A-Za-z]+))?)(?:/([0-9]+))?$")
_EXTENSION = re.compile(r"[#?]|^(?:[0-9]*L|[0-9]+W|LW|L-[0-9]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    low: int
    high: int
    names: dict[str, int] | None = None


_FIELDS = (
    _FieldSpec("minute", 0, 59),
    _FieldSpec("hour", 0, 23),
    _FieldSpec("day-of-month", 1, 31),
    _FieldSpec("month", 1, 12, _MONTH_NAMES),
    _FieldSpec("day-of-week", 0, 7, _DAY_NAMES),
)


class FireKind(enum.StrEnum):
    exact = "exact"  # the wall time happened and this is its (first) occurrence
    shifted = "shifted"  # the wall time fell in a DST gap; fired at the transition instant
    repeated = "repeated"  # second occurrence of a repeated wall time (every-hour jobs only)


@dataclass(frozen=True)
class CronFire:
    """One fire: its instant (aware UTC) and the nominal local wall time it stands for."""

    instant: datetime
    wall: datetime  # naive local wall time; the earliest one when several merge
    kind: FireKind


def load_zone(name: str, field_name: str = "timezone") -> ZoneInfo:
    """An IANA zone by name; never the server's own zone."""
    # "localtime" is a link to whatever the host is configured with: not a stable zone.
    if not name or name.strip() != name or name.lower() == "localtime":
        raise ValidationError(f"unknown time zone '{name}'", field=field_name)
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValidationError(f"unknown time zone '{name}'", field=field_name) from None


def _as_utc(value: datetime, field_name: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValidationError("must be timezone-aware (UTC)", field=field_name)
    return value.astimezone(UTC)


def _fail(message: str) -> ValidationError:
    return ValidationError(message, field="cron")


def _value(token: str, spec: _FieldSpec) -> int:
    if token.isascii() and token.isdigit():
        if len(token) > _MAX_VALUE_DIGITS:
            raise _fail(f"{spec.name}: value '{token[:10]}...' out of range {spec.low}-{spec.high}")
        number = int(token)
    elif spec.names is not None and token.upper() in spec.names:
        number = spec.names[token.upper()]
    else:
        raise _fail(f"{spec.name}: invalid value '{token}'")
    if not spec.low <= number <= spec.high:
        raise _fail(f"{spec.name}: value {number} out of range {spec.low}-{spec.high}")
    return number


def _validate(text: str, spec: _FieldSpec) -> tuple[str, bool]:
    """The field checked and rewritten in plain numbers (`low-high/step`, names resolved),
    and whether it starts with `*` (which Vixie cron treats as unrestricted when choosing
    between the AND and OR day rules)."""
    elements: list[str] = []
    span = spec.high - spec.low + (0 if spec.name == "day-of-week" else 1)
    for element in text.split(","):
        if _EXTENSION.search(element):
            raise _fail(
                f"{spec.name}: '{element}' uses a non-standard extension (L, W, #, ?), "
                "which is not supported"
            )
        match = _ELEMENT.match(element)
        if match is None:
            raise _fail(f"{spec.name}: invalid element '{element}' in '{text}'")
        star, first, last, step_text = match.groups()
        step = 1
        if step_text is not None:
            if len(step_text) > _MAX_VALUE_DIGITS:
                raise _fail(f"{spec.name}: step '{step_text[:10]}...' out of range 1-{span}")
            step = int(step_text)
            if not 1 <= step <= span:
                raise _fail(f"{spec.name}: step {step} out of range 1-{span}")
        if star:
            elements.append(f"*/{step}")
            continue
        low = _value(first, spec)
        if last is not None:
            high = _value(last, spec)
            # MON-SUN reads naturally; SUN is 0, so let it close the week as 7.
            if spec.name == "day-of-week" and high == 0 and last.upper() == "SUN":
                high = 7
            if high < low:
                raise _fail(f"{spec.name}: range '{element}' runs backwards")
        elif step_text is not None:
            high = spec.high  # `5/15` = from 5 to the end, every 15
        else:
            high = low
        # croniter reads `5-5` as the whole cycle round from 5 back to 5: one value is one
        elements.append(str(low) if low == high else f"{low}-{high}/{step}")
    return ",".join(elements), text.startswith("*")


@functools.lru_cache(maxsize=4096)
def _expand(fields: tuple[str, ...]) -> tuple[frozenset[int], ...]:
    """croniter's expansion of validated fields to the values each one matches (cached:
    the claim path parses the schedule of every due job, and expanding costs more than the
    rest of the parse)."""
    expanded, _ = croniter.expand(" ".join(fields))
    sets: list[frozenset[int]] = []
    for values, spec in zip(expanded, _FIELDS, strict=True):
        if "*" in values:
            numbers = set(range(spec.low, spec.high + 1))
        else:
            numbers = {int(value) for value in values}
        if spec.name == "day-of-week":
            numbers = {number % 7 for number in numbers}  # Sunday is 0, whether 0 or 7
        sets.append(frozenset(numbers))
    return tuple(sets)


@dataclass(frozen=True)
class CronSchedule:
    """A validated 5-field cron expression evaluated in an IANA time zone."""

    expr: str
    timezone: str
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)
    _minutes: frozenset[int] = field(init=False, repr=False, compare=False)
    _hours: frozenset[int] = field(init=False, repr=False, compare=False)
    _doms: frozenset[int] = field(init=False, repr=False, compare=False)
    _months: frozenset[int] = field(init=False, repr=False, compare=False)
    _dows: frozenset[int] = field(init=False, repr=False, compare=False)
    _day_or: bool = field(init=False, repr=False, compare=False)
    _slots: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _slot_keys: tuple[int, ...] = field(init=False, repr=False, compare=False)

    @classmethod
    def parse(cls, expr: str, timezone: str) -> CronSchedule:
        return cls(expr, timezone)

    def __post_init__(self) -> None:
        if not isinstance(self.expr, str) or not self.expr.strip():
            raise _fail("empty expression")
        if not isinstance(self.timezone, str):
            raise ValidationError("must be a string", field="timezone")
        text = " ".join(self.expr.split())
        if text.startswith("@"):
            macro = text.lower()
            if macro not in _MACROS:
                raise _fail(
                    f"'{text}' is not supported; use 5 fields or one of " + ", ".join(_MACROS)
                )
            text, body = macro, _MACROS[macro]
        else:
            body = text
        parts = body.split(" ")
        if len(parts) != 5:
            raise _fail(
                f"expected 5 fields (minute hour day-of-month month day-of-week), "
                f"got {len(parts)} in '{text}'"
            )
        checked = [_validate(part, spec) for part, spec in zip(parts, _FIELDS, strict=True)]
        minutes, hours, doms, months, dows = _expand(tuple(field for field, _ in checked))
        dom_star, dow_star = checked[2][1], checked[4][1]
        day_or = not dom_star and not dow_star
        if not dom_star and dow_star:
            # AND rule with a restricted day of month: some listed day must exist in some
            # listed month. Every other combination fires within a few years at most.
            if not any(day <= _MONTH_DAYS[month] for day in doms for month in months):
                month_names = ", ".join(
                    name for name, number in _MONTH_NAMES.items() if number in months
                )
                days = ",".join(str(day) for day in sorted(doms))
                raise _fail(f"can never fire: day-of-month {days} never occurs in {month_names}")
        zone = load_zone(self.timezone)
        slots = tuple((hour, minute) for hour in sorted(hours) for minute in sorted(minutes))
        assign = object.__setattr__
        assign(self, "expr", text)
        assign(self, "_zone", zone)
        assign(self, "_minutes", minutes)
        assign(self, "_hours", hours)
        assign(self, "_doms", doms)
        assign(self, "_months", months)
        assign(self, "_dows", dows)
        assign(self, "_day_or", day_or)
        assign(self, "_slots", slots)
        assign(self, "_slot_keys", tuple(hour * 60 + minute for hour, minute in slots))

    @property
    def zone(self) -> ZoneInfo:
        return self._zone

    @property
    def every_hour(self) -> bool:
        """True when the hour field matches all 24 hours (the every-hour DST rule applies)."""
        return len(self._hours) == 24

    def matches_local(self, wall: datetime) -> bool:
        """Whether a naive local wall time matches the expression (ignoring DST)."""
        if wall.second or wall.microsecond:
            return False
        return (
            wall.minute in self._minutes
            and wall.hour in self._hours
            and wall.month in self._months
            and self._day_matches(wall.date())
        )

    def next_after(self, after: datetime) -> datetime:
        """The first fire instant strictly after `after` (aware UTC in and out)."""
        return self.next_fire(after).instant

    def iter_after(self, after: datetime) -> Iterator[datetime]:
        for fire in self.fires_after(after):
            yield fire.instant

    def fires_after(self, after: datetime) -> Iterator[CronFire]:
        """The fires strictly after `after`, in order, with what each one stands for."""
        current = after
        while True:
            fire = self.next_fire(current)
            yield fire
            current = fire.instant

    def next_fire(self, after: datetime) -> CronFire:
        after_utc = _as_utc(after, "after")
        limit = after_utc.replace(tzinfo=None)
        try:
            local = after_utc.astimezone(self._zone)
        except OverflowError:
            raise ValidationError("out of range", field="after") from None
        start = local.replace(tzinfo=None, fold=0)
        if self.every_hour and local.fold == 0:
            # If `after` is the first pass through a wall time that is about to repeat,
            # the second passes of the walls just before it are still ahead of us.
            before, later = self._offsets(start)
            if before > later:
                start -= before - later
        best: tuple[datetime, datetime, FireKind] | None = None
        for wall in self._walls_from(start):
            resolved = self._resolve(wall)
            if not resolved:
                continue
            # Walls map to instants in order except for second passes, which all come
            # before any wall past the repeated range: once a wall's earliest instant is
            # not earlier than the best found, nothing later can beat it.
            if best is not None and resolved[0][0] >= best[0]:
                break
            for instant, kind in resolved:
                if instant > limit and (best is None or instant < best[0]):
                    best = (instant, wall, kind)
        if best is None:
            raise ValidationError(
                f"'{self.expr}' has no fire time within {_MAX_SEARCH_DAYS // 366} years "
                f"after {after_utc.isoformat()}",
                field="cron",
            )
        instant, wall, kind = best
        return CronFire(instant.replace(tzinfo=UTC), wall, kind)

    def _day_matches(self, day: date) -> bool:
        dom_ok = day.day in self._doms
        dow_ok = day.isoweekday() % 7 in self._dows
        return (dom_ok or dow_ok) if self._day_or else (dom_ok and dow_ok)

    def _walls_from(self, start: datetime) -> Iterator[datetime]:
        """Matching naive wall times at or after `start`'s minute, in order (bounded)."""
        day = start.date()
        first = bisect_left(self._slot_keys, start.hour * 60 + start.minute)
        slots = self._slots
        try:
            for _ in range(_MAX_SEARCH_DAYS):
                if day.month not in self._months:
                    day = date(day.year + day.month // 12, day.month % 12 + 1, 1)
                    first = 0
                    continue
                if self._day_matches(day):
                    year, month, dom = day.year, day.month, day.day
                    for hour, minute in slots[first:]:
                        yield datetime(year, month, dom, hour, minute)
                first = 0
                day += timedelta(days=1)
        except (OverflowError, ValueError):
            return  # ran off the end of the calendar (year 9999)

    def _offsets(self, wall: datetime) -> tuple[timedelta, timedelta]:
        """UTC offsets of a wall time before and after a transition (equal when none)."""
        before = wall.replace(tzinfo=self._zone).utcoffset()
        after = wall.replace(tzinfo=self._zone, fold=1).utcoffset()
        assert before is not None and after is not None
        return before, after

    def _resolve(self, wall: datetime) -> list[tuple[datetime, FireKind]]:
        """The naive-UTC instants at which this wall time fires, earliest first."""
        before, after = self._offsets(wall)
        if before == after:
            return [(wall - before, FireKind.exact)]
        if before > after:  # clocks went back: the wall time happens twice
            first = (wall - before, FireKind.exact)
            if self.every_hour:
                return [first, (wall - after, FireKind.repeated)]
            return [first]
        if self.every_hour:  # inside a gap: does not happen
            return []
        return [(self._transition(wall - after, wall - before), FireKind.shifted)]

    def _transition(self, low: datetime, high: datetime) -> datetime:
        """The exact second the offset changes, between naive-UTC `low` (old offset) and
        `high` (new offset). Shifts are not assumed to be one hour."""
        low_s = (low - _EPOCH) // _SECOND
        high_s = -((_EPOCH - high) // _SECOND)
        old = self._offset_at(low_s)
        for _ in range(64):  # binary search over seconds; 64 halvings cover any range
            if high_s - low_s <= 1:
                break
            middle = (low_s + high_s) // 2
            if self._offset_at(middle) == old:
                low_s = middle
            else:
                high_s = middle
        return _EPOCH + timedelta(seconds=high_s)

    def _offset_at(self, seconds: int) -> timedelta | None:
        instant = (_EPOCH + timedelta(seconds=seconds)).replace(tzinfo=UTC)
        return instant.astimezone(self._zone).utcoffset()
