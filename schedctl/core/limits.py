"""Owns the bounds of every number schedctl and the REST API accept, and the safe parsing of
user-supplied numbers, ids and JSON.

One place, so the CLI, the API and the storage layer refuse the same values with the same
message (docs/jobs.md "Limits" and schedctl(1) document this table). Every refusal is a
ValidationError naming the field: an id of 25 digits, a payload integer of 5,000 digits, a
payload nested 20,000 deep or a duration written in Arabic-Indic digits never reaches
int(), the database or a recursive serializer as such.

Numbers typed by people are ASCII digits only: Python's int(), float() and str.isdigit()
also accept other scripts' digits ("٣" is 3 to int()), which nobody means in a schedule.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from schedctl.core import errors

# -- the bounds ------------------------------------------------------------------------

# signed 64-bit: the database's BIGINT, and what JSON consumers in other languages can hold
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# ids the database generates (dead letters, audit entries): BIGINT, from 1
MAX_ID = INT64_MAX
# a cursor is an opaque string this server issued: short base64
MAX_CURSOR_LENGTH = 512
# items per page of every listing (jobs, runs, dead letters, audit)
MAX_PAGE = 1000
# jobs per POST /v1/jobs:batch (and per request of `schedctl job import`)
MAX_BATCH_JOBS = 1000
# payload: JSON nested deeper than this is a mistake or an attack (serializers give up near
# 255, Python's json near 1,000); integers must fit in 64 bits; floats must be finite
MAX_PAYLOAD_DEPTH = 64
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024
# retry policy
MAX_ATTEMPTS = 100
# every duration (delay, interval, grace, window, timeout, backoff delays): a year and a day
# is a typo beyond that, and would overflow datetime arithmetic further on
MAX_DURATION = timedelta(days=366)
MAX_DURATION_SECONDS = int(MAX_DURATION.total_seconds())
# dlq purge --older-than: an age further back than this is a typo (and overflows datetime)
MAX_AGE = timedelta(days=36525)
# overlapping runs of one job (null / 0: no limit)
MAX_CONCURRENCY = 10_000
MAX_CPU_WEIGHT = 10_000  # cgroup v2's cpu.weight range is 1-10000
MAX_TASKS = 4_194_304  # the kernel's pid_max ceiling
# tenant quotas (schedctl tenant quota)
MAX_QUOTA = 1_000_000_000
# tenant delivery settings (schedctl tenant delivery, tenant allow)
MAX_ALLOW_LIST = 200
MAX_DELIVERY_CONCURRENCY = 1000
MAX_RATE_PER_SECOND = 1_000_000
# workers: visibility timeout of a lease, and commands run at once
MIN_LEASE_SECONDS = 1
MAX_LEASE_SECONDS = 12 * 3600
MAX_WORKER_CONCURRENCY = 1000
# a run's output kept in its run history ([[worker]] output_bytes): the end of stdout and
# of stderr, each; the run history column holds at most MAX_OUTPUT_BYTES characters
DEFAULT_OUTPUT_BYTES = 64 * 1024
MAX_OUTPUT_BYTES = 1024 * 1024
# cron next -n
MAX_CRON_COUNT = 1000
# scheduled-d worker --max-runs
MAX_RUNS = 1_000_000_000

# digits beyond which a number cannot be within any bound above (int64 has 19): refused
# before int() sees it, so Python's 4,300-digit conversion limit is never hit
MAX_NUMBER_DIGITS = 20
# the characters no name, key or text that can reach a header (mail, HTTP) or a log line may
# hold: C0, DEL, C1 and the Unicode line and paragraph separators. Python's e-mail package
# and str.splitlines() break lines on U+0085, U+2028 and U+2029 as on a newline
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

BOUNDS: tuple[tuple[str, str, str], ...] = (
    # (what, where, range) -- the documented table (docs/jobs.md "Limits", schedctl(1))
    ("ids (dead letters, audit entries)", "dlq show/replay/purge ID", f"1 to {MAX_ID} (2^63-1)"),
    (
        "job references",
        "job show/cancel/... JOB, /v1/jobs/{id}",
        "an id, a name (at most 200 characters, no control characters) or an id prefix "
        "(6+ hex digits); any other is not found (exit 3, 404)",
    ),
    ("cursors", "--cursor, ?cursor=", f"as issued; at most {MAX_CURSOR_LENGTH} characters"),
    ("page size", "--limit, ?limit=", f"1 to {MAX_PAGE}"),
    ("payload", "--payload, --payload-file, payload", "64 KiB (max_payload_bytes)"),
    ("payload nesting", "payload", f"at most {MAX_PAYLOAD_DEPTH} levels"),
    ("payload integers", "payload", "-2^63 to 2^63-1; floats finite (no NaN, Infinity)"),
    ("max attempts", "--max-attempts, retry.max_attempts", f"1 to {MAX_ATTEMPTS}"),
    (
        "durations",
        "--in, --every, --grace, --window, --timeout, delay, every, grace, window, timeout, "
        "retry.base_delay, retry.max_delay",
        f"0 to {MAX_DURATION.days} days (delay, every: above 0)",
    ),
    (
        "max concurrency",
        "--max-concurrency, max_concurrency",
        f"1 to {MAX_CONCURRENCY} (--max-concurrency 0, null: no limit)",
    ),
    ("tenant max jobs", "tenant quota --max-jobs", f"0 to {MAX_QUOTA}"),
    ("tenant creates per minute", "tenant quota --create-rate", f"0 to {MAX_QUOTA}"),
    ("delivery concurrency", "tenant delivery --concurrency", f"1 to {MAX_DELIVERY_CONCURRENCY}"),
    ("dispatch rate per second", "tenant delivery --rate", f"1 to {MAX_RATE_PER_SECOND}"),
    (
        "worker lease",
        "scheduled-d worker --lease-seconds, [[worker]] lease_seconds",
        f"{MIN_LEASE_SECONDS} to {MAX_LEASE_SECONDS} s",
    ),
    (
        "worker concurrency",
        "scheduled-d worker --concurrency, [[worker]] concurrency",
        f"1 to {MAX_WORKER_CONCURRENCY}",
    ),
    (
        "worker output kept per run",
        "[[worker]] output_bytes",
        f"0 to {MAX_OUTPUT_BYTES} bytes (1 MiB; default {DEFAULT_OUTPUT_BYTES})",
    ),
    ("dead letter age", "dlq purge --older-than", f"above 0, at most {MAX_AGE.days} days"),
    ("worker runs", "scheduled-d worker --max-runs", f"1 to {MAX_RUNS}"),
    ("cron preview", "cron next -n", f"1 to {MAX_CRON_COUNT}"),
)

_ASCII_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_ASCII_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?", re.ASCII)


# -- integers ----------------------------------------------------------------------------


def is_int(value: Any) -> bool:
    """A JSON integer (true/false are ints to Python, and never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, field: str, low: int, high: int, *, what: str = "an integer") -> int:
    """`value` as an int in [low, high], else a ValidationError naming `field`."""
    if not is_int(value) or not low <= value <= high:
        raise errors.ValidationError(
            f"must be {what} from {low} to {high}, got {describe(value)}", field=field
        )
    return int(value)


def parse_int(text: str, field: str, low: int, high: int) -> int:
    """An integer typed by a person: ASCII digits (an optional sign), within [low, high]."""
    value = text.strip() if isinstance(text, str) else text
    if not isinstance(value, str) or not _ASCII_INT.fullmatch(value):
        raise errors.ValidationError(
            f"must be an integer (ASCII digits) from {low} to {high}, got {describe(text)}",
            field=field,
        )
    if len(value.lstrip("+-").lstrip("0")) > MAX_NUMBER_DIGITS:
        raise errors.ValidationError(
            f"must be an integer from {low} to {high}, got {describe(text)}", field=field
        )
    return check_int(int(value), field, low, high)


def parse_number(text: Any, field: str, low: float, high: float) -> float:
    """A number of seconds typed by a person: ASCII digits with an optional fraction."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    elif (
        isinstance(text, str)
        and _ASCII_NUMBER.fullmatch(text.strip())
        and len(text.strip()) <= MAX_NUMBER_DIGITS
    ):
        value = float(text.strip())
    else:
        value = math.nan
    if not low <= value <= high:
        raise errors.ValidationError(
            f"must be a number (ASCII digits) from {low:g} to {high:g}, got {describe(text)}",
            field=field,
        )
    return value


def parse_id(value: Any, field: str = "id") -> int:
    """A database id (dead letter, audit entry) from the command line, a path or a cursor."""
    if is_int(value):
        return check_int(value, field, 1, MAX_ID, what="an id")
    return parse_int(value, field, 1, MAX_ID)


def check_page(limit: int) -> int:
    """The page size of a listing (jobs, runs, dead letters, audit): 1 to MAX_PAGE."""
    if not 1 <= limit <= MAX_PAGE:
        raise errors.ValidationError(f"must be between 1 and {MAX_PAGE}", field="limit")
    return limit


def check_cursor(cursor: str | None) -> str | None:
    """A cursor's outer shape (its content is checked by whoever decodes it)."""
    if cursor is None:
        return None
    if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR_LENGTH or not cursor.isascii():
        raise errors.ValidationError("not a cursor this server issued", field="cursor")
    return cursor


def cursor_id(before: str) -> int:
    """The id a decoded id cursor holds."""
    try:
        return parse_id(before, "cursor")
    except errors.ValidationError:
        raise errors.ValidationError("not a cursor this server issued", field="cursor") from None


def describe(value: Any) -> str:
    """A value for an error message: short, whatever the input."""
    if isinstance(value, OversizedInt):
        return str(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, Mapping):
        # never repr() a container: it may be nested deep enough for a RecursionError
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    if is_int(value) and abs(value) >= 10**MAX_NUMBER_DIGITS:
        # str() of an integer past 4,300 digits is itself a ValueError
        return (
            f"an integer of about {math.floor(abs(value).bit_length() * math.log10(2)) + 1} digits"
        )
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- JSON --------------------------------------------------------------------------------


class OversizedInt:
    """A JSON integer too long to convert (what parse_json puts in its place): refused by
    whichever validator meets it, with the field named."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"

    __str__ = __repr__


def _json_int(text: str) -> int | OversizedInt:
    digits = len(text.lstrip("-"))
    if digits > MAX_NUMBER_DIGITS:
        return OversizedInt(digits)
    return int(text)


def parse_json(
    text: str | bytes,
    field: str,
    *,
    malformed: type[errors.ValidationError] = errors.ValidationError,
) -> Any:
    """JSON from a person or a client, without the exceptions json.loads lets out:
    integers too long for int() become OversizedInt (refused by the validators, which name
    their field), and nesting deep enough for a RecursionError is a ValidationError naming
    the top-level key it is under (or `field`). Text that is not JSON is `malformed`
    (naming `field`); its message gives the position, never the text (it may hold a
    payload)."""
    try:
        return json.loads(text, parse_int=_json_int)
    except UnicodeDecodeError:
        raise malformed("is not UTF-8 text", field=field) from None
    except json.JSONDecodeError as exc:
        raise malformed(
            f"is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", field=field
        ) from None
    except RecursionError:
        raise errors.ValidationError(
            f"is nested deeper than {MAX_PAYLOAD_DEPTH} levels", field=deep_key(text) or field
        ) from None
    except ValueError:
        # a number json cannot convert: not expected with parse_int above, but never a 500
        raise malformed("is not valid JSON: a number is out of range", field=field) from None


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]', re.DOTALL)


def deep_key(text: str | bytes) -> str | None:
    """The top-level key of a JSON object under which the nesting exceeds MAX_PAYLOAD_DEPTH
    (None if the document is not an object, or the nesting is not under one key)."""
    deep, key = _too_deep(text)
    if not deep or key is None:
        return None
    try:
        name = json.loads(key)
    except ValueError:
        return None
    return name if isinstance(name, str) and len(name) <= 100 else None


def too_deep(text: str | bytes) -> bool:
    """Whether JSON text nests deeper than an object holding a MAX_PAYLOAD_DEPTH-deep
    value (a payload)."""
    return _too_deep(text)[0]


def _too_deep(text: str | bytes) -> tuple[bool, bytes | None]:
    """Whether the nesting exceeds MAX_PAYLOAD_DEPTH + 1, and the top-level key (as JSON
    text) it is under, if any."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    depth = 0
    last_string: bytes | None = None
    key: bytes | None = None
    for match in _TOKEN.finditer(raw):
        token = match.group()
        first = token[:1]
        if first == b'"':
            last_string = token
        elif first == b":":
            if depth == 1:
                key, last_string = last_string, None
        elif first in (b"[", b"{"):
            depth += 1
            if depth > MAX_PAYLOAD_DEPTH + 1:
                return True, key
        else:
            depth -= 1
            if depth == 1:
                key = None
    return False, None


def check_json_value(value: Any, field: str, *, max_depth: int = MAX_PAYLOAD_DEPTH) -> None:
    """A parsed JSON value that is safe to store and serialize anywhere: nested at most
    max_depth levels, integers within int64, floats finite. Iterative: a deep value is
    refused rather than a RecursionError."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        elif isinstance(item, OversizedInt):
            raise errors.ValidationError(
                f"holds {item}: integers must be from -2^63 to 2^63-1", field=field
            )
        elif is_int(item):
            if not INT64_MIN <= item <= INT64_MAX:
                raise errors.ValidationError(
                    f"holds {describe(item)}: integers must be from -2^63 to 2^63-1",
                    field=field,
                )
            continue
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise errors.ValidationError(
                    f"holds {item!r}: numbers must be finite (JSON has no NaN or Infinity)",
                    field=field,
                )
            continue
        else:
            continue
        if depth > max_depth:
            raise errors.ValidationError(f"is nested deeper than {max_depth} levels", field=field)
        stack.extend((child, depth + 1) for child in children)
