"""Owns the signature scheme of HTTP deliveries: `sign` (the relay) and `verify` (tenants).

Every HTTP delivery is a POST whose body is the JSON object
``{"job_id", "scheduled_at", "attempt", "payload"}`` with these headers:

- ``Idempotency-Key: JOB_ID:SCHEDULED_AT`` -- the run's identity (RFC 3339, UTC, ``Z``);
  the same for every attempt of the run, so a receiver can drop duplicates;
- ``X-Sched-Timestamp: 1767225600`` -- when this attempt was signed, in Unix seconds;
- ``X-Sched-Signature: v1=<hex>`` -- HMAC-SHA256, keyed with the tenant's signing
  secret (UTF-8), over the bytes ``<timestamp>.<body>``: the timestamp header's
  value, one ``.``, then the request body exactly as received.

A receiver verifies in three steps, which `verify` does in one call:

1. compute the HMAC over ``timestamp + "." + raw body`` and compare it in constant time
   with each ``v1=`` value of the signature header (several may be listed, comma
   separated, while a secret is being rotated);
2. refuse a timestamp further than 5 minutes from its own clock (either way), so a
   captured request cannot be replayed later;
3. deduplicate on ``Idempotency-Key`` within those 5 minutes (retries are signed afresh,
   so a retry an hour later is still valid and still has the same key).

The signature covers the body, and the body carries job_id, scheduled_at and attempt, so
none of them can be changed without breaking it. Use the raw body bytes: parsing and
re-serialising the JSON changes them.

Example (any WSGI/ASGI framework works the same)::

    from schedctl.signing import verify
    verify(SECRET, request.headers, request.get_data())   # raises SignatureError
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

from schedctl import errors

TIMESTAMP_HEADER = "X-Sched-Timestamp"
SIGNATURE_HEADER = "X-Sched-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
SCHEME = "v1"
DEFAULT_TOLERANCE_SECONDS = 300


def _key(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def sign(secret: str | bytes, timestamp: int | str, body: bytes) -> str:
    """The ``X-Sched-Signature`` value for `body` signed at `timestamp` (Unix seconds)."""
    if not secret:
        raise errors.ConfigError("the signing secret is empty", field="signing_secret")
    message = str(int(timestamp)).encode() + b"." + body
    digest = hmac.new(_key(secret), message, hashlib.sha256).hexdigest()
    return f"{SCHEME}={digest}"


def signed_headers(
    secret: str | bytes, body: bytes, idempotency_key: str, *, now: float | None = None
) -> dict[str, str]:
    """The three delivery headers for `body`, signed now (or at `now`)."""
    timestamp = int(time.time() if now is None else now)
    return {
        IDEMPOTENCY_HEADER: idempotency_key,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret, timestamp, body),
    }


def verify(
    secret: str | bytes,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> None:
    """Check a received delivery: `headers` as received (any capitalisation), `body` the raw
    request body. Returns None when genuine and fresh; raises errors.SignatureError (an
    Unauthorized: answer 401) saying what is wrong otherwise."""
    timestamp = _header(headers, TIMESTAMP_HEADER)
    signature = _header(headers, SIGNATURE_HEADER)
    if timestamp is None:
        raise errors.SignatureError(f"missing the {TIMESTAMP_HEADER} header")
    if signature is None:
        raise errors.SignatureError(f"missing the {SIGNATURE_HEADER} header")
    verify_signature(
        secret, timestamp, signature, body, tolerance_seconds=tolerance_seconds, now=now
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
    """`verify` for callers that have the two header values already."""
    if not isinstance(body, bytes | bytearray):
        # a str body was decoded (and maybe re-encoded): its bytes may no longer match
        raise errors.SignatureError("verify the raw request body (bytes), not decoded text")
    value = timestamp.strip()
    if not value.isascii() or not value.isdigit():
        raise errors.SignatureError(f"{TIMESTAMP_HEADER} is not Unix seconds: {value[:40]!r}")
    signed_at = int(value)
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
    candidates = [
        part.strip()[len(SCHEME) + 1 :]
        for part in signature.split(",")
        if part.strip().startswith(SCHEME + "=")
    ]
    if not candidates:
        raise errors.SignatureError(f"{SIGNATURE_HEADER} has no {SCHEME}= signature")
    expected = sign(secret, signed_at, bytes(body))[len(SCHEME) + 1 :]
    # compare_digest against every candidate, without stopping early at a match
    matched = False
    for candidate in candidates:
        matched |= hmac.compare_digest(candidate.encode(), expected.encode())
    if not matched:
        raise errors.SignatureError(
            "the signature does not match: wrong secret, or the body was changed"
        )


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value
    wanted = name.lower()
    for key, found in headers.items():
        if key.lower() == wanted:
            return found
    return None
