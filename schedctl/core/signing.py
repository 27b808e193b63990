"""Owns the signature scheme of deliveries: `signed_headers` (the relay) and `verify` (tenants).

Every HTTP delivery is a POST whose body is the JSON object
``{"job_id", "scheduled_at", "attempt", "payload"}`` with these headers:

- ``Idempotency-Key: JOB_ID:SCHEDULED_AT`` -- the run's identity (RFC 3339, UTC, ``Z``);
  the same for every attempt of the run, so a receiver can drop duplicates;
- ``X-Sched-Timestamp: 1767225600`` -- when this attempt was signed, in Unix seconds;
- ``X-Sched-Signature: v2=<hex>, v1=<hex>`` -- HMAC-SHA256 signatures keyed with the
  tenant's signing secret (its UTF-8 bytes), comma separated.

Scheme v2 (current) signs these bytes, the canonical string::

    "v2:" TIMESTAMP "\\n" METHOD "\\n" PATH "\\n" IDEMPOTENCY_KEY "\\n" BODY

- TIMESTAMP: the ``X-Sched-Timestamp`` value (ASCII digits);
- METHOD: the request method in upper case (``POST``);
- PATH: the request target as sent on the wire: the percent-encoded path, plus ``?`` and the
  query when there is one (``/hooks/run?source=sched``), never the scheme or host;
- IDEMPOTENCY_KEY: the ``Idempotency-Key`` header's value;
- BODY: the raw request body, byte for byte.
None of the text fields can contain a line feed, and the body comes last, so the fields
cannot be shifted into each other. Changing the timestamp, method, path, Idempotency-Key or
body breaks the signature: a captured request cannot be replayed under another key or to
another endpoint of the receiver.

Scheme v1 (deprecated) signs ``TIMESTAMP "." BODY`` only: it does not cover the
Idempotency-Key, so a receiver that deduplicates on that header can be made to accept a
replay within the 5 minutes. Deprecation period: the relay sends ``v1=`` after the ``v2=``
values, and `verify` accepts v1 when called the old way (without method and path; it warns
with a DeprecationWarning), in every 0.x release and at least until V1_ACCEPTED_UNTIL
(2027-06-30); 1.0 removes v1. A caller that passes method and path gets v2 checked and v1
refused (else an attacker would strip the v2 values to downgrade), unless it passes
``accept_v1=True`` while relays from before v2 (which send v1 only) still run.

Rotation: while a tenant's previous secret is in its grace period the relay signs with both
secrets: ``v2=<new>, v2=<old>, v1=<new>, v1=<old>``. A receiver holding either secret
verifies: `verify` accepts when any value of its scheme matches.

Broker (RabbitMQ) messages carry the same headers; their METHOD is ``PUBLISH`` and their
PATH is the queue name.

A receiver verifies in three steps, which `verify` does in one call:

1. compute the HMAC over the canonical string and compare it in constant time with each
   ``v2=`` value of the signature header;
2. refuse a timestamp further than 5 minutes from its own clock (either way);
3. deduplicate on ``Idempotency-Key`` within those 5 minutes (retries are signed afresh,
   so a retry an hour later is still valid and still has the same key).

Use the raw body bytes (parsing and re-serialising the JSON changes them) and the raw
request target (a decoded PATH_INFO may differ from what was sent).

Example::

    from schedctl.signing import verify  # the public path
    verify(SECRET, request.headers, request.get_data(),
           method=request.method, path=request.environ["RAW_URI"])  # raises SignatureError
"""

from __future__ import annotations

import hashlib
import hmac
import time
import warnings
from collections.abc import Mapping, Sequence
from datetime import date
from typing import Any
from urllib.parse import urlsplit

from schedctl.core import errors

TIMESTAMP_HEADER = "X-Sched-Timestamp"
SIGNATURE_HEADER = "X-Sched-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
SCHEME = "v2"
V1 = "v1"
DEFAULT_TOLERANCE_SECONDS = 300
# the relay still sends v1 next to v2, for receivers that have not moved to v2 yet
SEND_V1 = True
V1_ACCEPTED_UNTIL = date(2027, 6, 30)
BROKER_METHOD = "PUBLISH"
# Unix seconds have 10 digits until the year 2286; more is not a timestamp
MAX_TIMESTAMP_DIGITS = 12
# more signature values than this in one header is not a rotation, it is an attack
MAX_SIGNATURES = 16

Secrets = str | bytes | Sequence[str | bytes]


def _key(secret: str | bytes) -> bytes:
    if not secret:
        raise errors.ConfigError("the signing secret is empty", field="signing_secret")
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _secrets(secrets: Secrets) -> list[str | bytes]:
    """The secrets given, one or several, each checked not empty (as _key_state takes them:
    str or bytes, so that they can key its cache)."""
    given = [secrets] if isinstance(secrets, str | bytes) else list(secrets)
    if not given:
        raise errors.ConfigError("no signing secret", field="signing_secret")
    keys: list[str | bytes] = []
    for secret in given:
        if not secret:
            raise errors.ConfigError("the signing secret is empty", field="signing_secret")
        keys.append(secret if isinstance(secret, str | bytes) else bytes(secret))
    return keys


# HMAC-SHA256 (RFC 2104) with the key's padded blocks hashed once per secret: a signature
# then costs copies of the two prepared hashes, far less than hmac.digest (which sets the
# key up again on every call). Bounded: secrets are few and rotate rarely.
_BLOCK_BYTES = 64  # SHA-256's block
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))
_KEY_STATES: dict[str | bytes, tuple[Any, Any]] = {}
MAX_KEY_STATES = 256


def _key_state(secret: str | bytes) -> tuple[Any, Any]:
    """The inner and outer SHA-256 states of `secret` after its padded key block."""
    state = _KEY_STATES.get(secret)
    if state is None:
        key = _key(secret)
        if len(key) > _BLOCK_BYTES:
            key = hashlib.sha256(key).digest()
        block = key.ljust(_BLOCK_BYTES, b"\0")
        state = (
            hashlib.sha256(block.translate(_IPAD)),
            hashlib.sha256(block.translate(_OPAD)),
        )
        if len(_KEY_STATES) >= MAX_KEY_STATES:
            _KEY_STATES.clear()  # a bound, not an eviction policy
        _KEY_STATES[secret] = state
    return state


def parse_timestamp(value: str | int) -> int:
    """Unix seconds from a timestamp header (1 to 12 ASCII digits); SignatureError otherwise.
    Negative, empty, non-ASCII-digit and oversized values are all refused the same way."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 10**MAX_TIMESTAMP_DIGITS:
            raise errors.SignatureError(
                f"{TIMESTAMP_HEADER} is not Unix seconds (1 to {MAX_TIMESTAMP_DIGITS} digits)"
            )
        return value
    if isinstance(value, str):
        text = value.strip()
    else:
        raise errors.SignatureError(f"{TIMESTAMP_HEADER} is not Unix seconds")
    if not (text.isascii() and text.isdigit() and len(text) <= MAX_TIMESTAMP_DIGITS):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise errors.SignatureError(
            f"{TIMESTAMP_HEADER} is not Unix seconds (1 to {MAX_TIMESTAMP_DIGITS} digits): "
            f"{shown!r}"
        )
    return int(text)


def request_path(path_or_url: str) -> str:
    """PATH of the canonical string: the path and query of a request target or whole URL."""
    text = path_or_url.strip()
    if "://" in text.split("?", 1)[0]:
        parts = urlsplit(text)
        text = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return text or "/"


def _field(name: str, value: str) -> bytes:
    if "\n" in value or "\r" in value:
        raise errors.SignatureError(f"the {name} contains a line break")
    return value.encode()


# the METHOD and PATH lines of the canonical string per request target: a relay sends to
# few targets, each many times
_TARGETS: dict[tuple[str, str], bytes] = {}
MAX_TARGETS = 4096


def _method_and_path(method: str, path: str) -> bytes:
    found = _TARGETS.get((method, path))
    if found is None:
        found = (
            _field("method", method.strip().upper()) + b"\n" + _field("path", request_path(path))
        )
        if len(_TARGETS) >= MAX_TARGETS:
            _TARGETS.clear()  # a bound, not an eviction policy
        _TARGETS[(method, path)] = found
    return found


def _canonical_v2(stamp: bytes, method: str, path: str, idempotency_key: str, body: bytes) -> bytes:
    return b"\n".join(
        (
            b"v2:" + stamp,
            _method_and_path(method, path),
            _field(IDEMPOTENCY_HEADER, idempotency_key.strip()),
            body,
        )
    )


def canonical_v2(
    timestamp: int | str, method: str, path: str, idempotency_key: str, body: bytes
) -> bytes:
    """The bytes a v2 signature covers (see the module documentation)."""
    stamp = str(parse_timestamp(timestamp)).encode()
    return _canonical_v2(stamp, method, path, idempotency_key, bytes(body))


def canonical_v1(timestamp: int | str, body: bytes) -> bytes:
    """The bytes a (deprecated) v1 signature covers: ``<timestamp>.<body>``."""
    return str(parse_timestamp(timestamp)).encode() + b"." + bytes(body)


def _hex(secret: str | bytes, message: bytes) -> str:
    """hmac.new(key, message, sha256).hexdigest(), from the secret's prepared states."""
    inner, outer = _key_state(secret)
    inner = inner.copy()
    inner.update(message)
    outer = outer.copy()
    outer.update(inner.digest())
    return str(outer.hexdigest())


def sign(secret: str | bytes, timestamp: int | str, body: bytes) -> str:
    """The deprecated ``v1=<hex>`` value for `body` signed at `timestamp` (Unix seconds)."""
    (key,) = _secrets(secret)
    return f"{V1}={_hex(key, canonical_v1(timestamp, body))}"


def sign_v2(
    secret: str | bytes,
    timestamp: int | str,
    *,
    method: str,
    path: str,
    idempotency_key: str,
    body: bytes,
) -> str:
    """The ``v2=<hex>`` value of one request."""
    (key,) = _secrets(secret)
    message = canonical_v2(timestamp, method, path, idempotency_key, body)
    return f"{SCHEME}={_hex(key, message)}"


def signature_header(
    secrets: Secrets,
    timestamp: int | str,
    *,
    method: str,
    path: str,
    idempotency_key: str,
    body: bytes,
    include_v1: bool = SEND_V1,
) -> str:
    """The ``X-Sched-Signature`` value: a v2 value per secret (current first, then the one in
    its grace period), then the v1 values while v1 is still sent."""
    keys = _secrets(secrets)
    stamp = str(parse_timestamp(timestamp)).encode()
    body = bytes(body)
    message = _canonical_v2(stamp, method, path, idempotency_key, body)
    values = [f"{SCHEME}={_hex(key, message)}" for key in keys]
    if include_v1:
        old = stamp + b"." + body
        values += [f"{V1}={_hex(key, old)}" for key in keys]
    return ", ".join(values)


def signed_headers(
    secrets: Secrets,
    body: bytes,
    idempotency_key: str,
    *,
    method: str,
    path: str,
    now: float | None = None,
    include_v1: bool = SEND_V1,
) -> dict[str, str]:
    """The three delivery headers for a request of `method` to `path` carrying `body`,
    signed now (or at `now`) with every secret in `secrets` (one, or two during a rotation's
    grace period)."""
    timestamp = int(time.time() if now is None else now)
    return {
        IDEMPOTENCY_HEADER: idempotency_key,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature_header(
            secrets,
            timestamp,
            method=method,
            path=path,
            idempotency_key=idempotency_key,
            body=body,
            include_v1=include_v1,
        ),
    }


def verify(
    secret: str | bytes,
    headers: Mapping[str, str],
    body: bytes,
    *,
    method: str | None = None,
    path: str | None = None,
    accept_v1: bool = False,
    tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> None:
    """Check a received delivery: `headers` as received (any capitalisation), `body` the raw
    request body, `method` and `path` the request's method and target (path and query, or the
    whole URL). Returns None when genuine and fresh; raises errors.SignatureError (an
    Unauthorized: answer 401) saying what is wrong otherwise.

    Without `method` and `path` only a (deprecated) v1 signature can be checked: that call
    form still works during v1's deprecation period and warns. With them, v2 is required,
    and v1 is also accepted only when `accept_v1` is true."""
    timestamp = _header(headers, TIMESTAMP_HEADER)
    signature = _header(headers, SIGNATURE_HEADER)
    if timestamp is None:
        raise errors.SignatureError(f"missing the {TIMESTAMP_HEADER} header")
    if signature is None:
        raise errors.SignatureError(f"missing the {SIGNATURE_HEADER} header")
    if (method is None) != (path is None):
        raise errors.SignatureError("give both the request's method and path, or neither")
    if method is None or path is None:
        warnings.warn(
            "verify() without method and path checks the deprecated v1 signature, which does "
            "not cover the Idempotency-Key: pass method= and path=",
            DeprecationWarning,
            stacklevel=2,
        )
        verify_signature(
            secret, timestamp, signature, body, tolerance_seconds=tolerance_seconds, now=now
        )
        return
    key = _header(headers, IDEMPOTENCY_HEADER)
    if key is None:
        raise errors.SignatureError(f"missing the {IDEMPOTENCY_HEADER} header")
    _check_body(body)
    signed_at = _fresh(timestamp, tolerance_seconds, now)
    values = _values(signature)
    expected: list[tuple[str, str]] = [
        (
            SCHEME,
            sign_v2(secret, signed_at, method=method, path=path, idempotency_key=key, body=body),
        )
    ]
    if accept_v1:
        expected.append((V1, sign(secret, signed_at, body)))
    schemes = {scheme for scheme, _ in expected}
    if not any(scheme in schemes for scheme, _ in values):
        hint = ""
        if not accept_v1 and any(scheme == V1 for scheme, _ in values):
            hint = (
                " (v1 is refused when method and path are given; pass accept_v1=True while "
                "relays that only send v1 remain)"
            )
        raise errors.SignatureError(f"{SIGNATURE_HEADER} has no {SCHEME}= signature{hint}")
    if not _any_match(values, expected):
        raise errors.SignatureError(
            "the signature does not match: wrong secret, or the method, path, "
            "Idempotency-Key or body was changed"
        )


def verify_signature(
    secret: str | bytes,
    timestamp: str,
    signature: str,
    body: bytes,
    *,
    tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> None:
    """The deprecated v1 check, for callers that have the two header values already."""
    _check_body(body)
    signed_at = _fresh(timestamp, tolerance_seconds, now)
    values = _values(signature)
    if not any(scheme == V1 for scheme, _ in values):
        raise errors.SignatureError(f"{SIGNATURE_HEADER} has no {V1}= signature")
    if not _any_match(values, [(V1, sign(secret, signed_at, body))]):
        raise errors.SignatureError(
            "the signature does not match: wrong secret, or the body was changed"
        )


def _check_body(body: object) -> None:
    if not isinstance(body, bytes | bytearray):
        # a str body was decoded (and maybe re-encoded): its bytes may no longer match
        raise errors.SignatureError("verify the raw request body (bytes), not decoded text")


def _fresh(timestamp: str, tolerance_seconds: float, now: float | None) -> int:
    signed_at = parse_timestamp(timestamp)
    current = time.time() if now is None else now
    age = current - signed_at
    if age > tolerance_seconds:
        raise errors.SignatureError(
            f"the delivery was signed {int(age)} s ago, more than {int(tolerance_seconds)} s: "
            "refused as a possible replay"
        )
    if -age > tolerance_seconds:
        raise errors.SignatureError(
            f"the delivery's timestamp is {int(-age)} s in the future: check both clocks"
        )
    return signed_at


def _values(signature: str) -> list[tuple[str, str]]:
    """(scheme, value) of every ``scheme=value`` entry of a signature header."""
    entries = [part.strip() for part in signature.split(",") if part.strip()]
    if len(entries) > MAX_SIGNATURES:
        raise errors.SignatureError(
            f"{SIGNATURE_HEADER} lists {len(entries)} signatures, more than {MAX_SIGNATURES}"
        )
    values = []
    for entry in entries:
        scheme, equals, value = entry.partition("=")
        if equals:
            values.append((scheme.strip(), value.strip()))
    return values


def _any_match(values: list[tuple[str, str]], expected: list[tuple[str, str]]) -> bool:
    # compare_digest against every candidate, without stopping early at a match
    matched = False
    for scheme, value in values:
        for want_scheme, want in expected:
            same = hmac.compare_digest(
                value.encode(errors="replace"), want[len(want_scheme) + 1 :].encode()
            )
            matched |= same and scheme == want_scheme
    return matched


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value
    wanted = name.lower()
    for key, found in headers.items():
        if key.lower() == wanted:
            return found
    return None
