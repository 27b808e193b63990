"""Parsing user-supplied durations and instants, and formatting instants as RFC 3339 UTC."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from schedctl.core.errors import ValidationError

__all__ = ["format_instant", "parse_duration", "parse_instant"]

# ASCII digits only: \d and int() also take other scripts' digits ("٣m" is not 3 minutes)
_SECONDS = re.compile(r"([0-9]+(?:\.[0-9]+)?)", re.ASCII)
_SHORT = re.compile(
    r"(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+(?:\.[0-9]+)?)s)?", re.ASCII
)
_ISO = re.compile(
    r"P(?:([0-9]+)W)?(?:([0-9]+)D)?(?:T(?:([0-9]+)H)?(?:([0-9]+)M)?(?:([0-9]+(?:[.,][0-9]+)?)S)?)?",
    re.IGNORECASE | re.ASCII,
)
_ISO_CALENDAR = re.compile(r"P[^T]*[0-9][YM]", re.IGNORECASE | re.ASCII)
# a number part of more digits than this is beyond any duration accepted anywhere (and
# int() refuses strings of thousands of digits with a ValueError)
_MAX_DIGITS = 15
_DIGIT_RUN = re.compile("[0-9]{" + str(_MAX_DIGITS + 1) + ",}", re.ASCII)

_DURATION_FORMS = (
    "expected seconds (90), a short form like 30s, 10m, 2h, 1d or 1h30m, "
    "or an ISO 8601 duration like PT10M or P1DT2H"
)
_INSTANT_EXAMPLE = "e.g. 2026-10-12T08:00:00Z or 2026-10-12T08:00:00+05:30"


def parse_duration(text: str, field: str) -> timedelta:
    """A duration in seconds, short form (1h30m) or ISO 8601 (PT1H30M).

    Zero is returned as such; callers decide whether it is allowed.
    """
    if not isinstance(text, str):
        raise ValidationError(f"invalid duration: {_DURATION_FORMS}", field=field)
    value = text.strip()
    if _DIGIT_RUN.search(value):
        raise ValidationError(f"duration '{_clip(text)}' has too many digits", field=field)
    try:
        if match := _SECONDS.fullmatch(value):
            return timedelta(seconds=float(match.group(1)))
        if value and (match := _SHORT.fullmatch(value)):
            days, hours, minutes, seconds = match.groups()
            return timedelta(
                days=int(days or 0),
                hours=int(hours or 0),
                minutes=int(minutes or 0),
                seconds=float(seconds or 0),
            )
        match = _ISO.fullmatch(value)
        if match and not value.upper().endswith(("P", "T")):
            weeks, days, hours, minutes, seconds = match.groups()
            return timedelta(
                weeks=int(weeks or 0),
                days=int(days or 0),
                hours=int(hours or 0),
                minutes=int(minutes or 0),
                seconds=float((seconds or "0").replace(",", ".")),
            )
    except OverflowError:
        raise ValidationError(f"duration '{_clip(text)}' is too large", field=field) from None
    if _ISO_CALENDAR.match(value):
        raise ValidationError(
            f"invalid duration '{_clip(text)}': years and months have no fixed length; "
            "use days (P30D) instead",
            field=field,
        )
    if not value.isascii():
        raise ValidationError(
            f"invalid duration '{_clip(text)}': write it in ASCII (digits 0-9), {_DURATION_FORMS}",
            field=field,
        )
    raise ValidationError(f"invalid duration '{_clip(text)}': {_DURATION_FORMS}", field=field)


def parse_instant(text: str, field: str) -> datetime:
    """An ISO 8601 / RFC 3339 time with a UTC offset or Z, as an aware UTC datetime."""
    if not isinstance(text, str):
        raise ValidationError(f"invalid time: expected ISO 8601, {_INSTANT_EXAMPLE}", field=field)
    value = text.strip()
    # fromisoformat also reads bare dates and week dates; a time of day is required here.
    # ASCII only: fromisoformat reads other scripts' digits too
    if len(value) < 11 or len(value) > 64 or not value.isascii() or not value[:4].isdigit():
        raise ValidationError(
            f"invalid time '{_clip(text)}': expected ISO 8601 with a UTC offset, "
            f"{_INSTANT_EXAMPLE}",
            field=field,
        )
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValidationError(
            f"invalid time '{_clip(text)}': expected ISO 8601 with a UTC offset, "
            f"{_INSTANT_EXAMPLE}",
            field=field,
        ) from None
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ValidationError(
            f"time '{_clip(text)}' needs a UTC offset, {_INSTANT_EXAMPLE}", field=field
        )
    try:
        return parsed.astimezone(UTC)
    except OverflowError:
        raise ValidationError(f"time '{_clip(text)}' is out of range", field=field) from None


def _clip(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def format_instant(dt: datetime) -> str:
    """RFC 3339 in UTC with Z; microseconds only when non-zero."""
    if dt.tzinfo is UTC:  # what the database and the parsers give: no conversion to make
        return dt.replace(tzinfo=None).isoformat() + "Z"
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ValidationError("needs a UTC offset", field="time")
    return dt.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"
