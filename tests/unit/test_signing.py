"""The delivery signature scheme: sign/verify round trip, tampering, replays, rotation lists,
header spellings, and clear errors."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from schedctl import errors
from schedctl.signing import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    sign,
    signed_headers,
    verify,
)

SECRET = "s3cret-key"
BODY = b'{"job_id":"j1","scheduled_at":"2026-01-01T00:00:00Z","attempt":1,"payload":{}}'
NOW = 1_767_225_600


def test_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    expected = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert sign(SECRET, NOW, BODY) == f"v1={expected}"


def test_round_trip_with_any_header_spelling() -> None:
    headers = signed_headers(SECRET, BODY, "j1:2026-01-01T00:00:00Z", now=NOW)
    assert headers[IDEMPOTENCY_HEADER] == "j1:2026-01-01T00:00:00Z"
    verify(SECRET, headers, BODY, now=NOW)
    verify(SECRET, {k.lower(): v for k, v in headers.items()}, BODY, now=NOW + 299)


def test_tampered_body_is_refused() -> None:
    headers = signed_headers(SECRET, BODY, "k", now=NOW)
    with pytest.raises(errors.SignatureError, match="does not match"):
        verify(SECRET, headers, BODY.replace(b'"attempt":1', b'"attempt":2'), now=NOW)


def test_wrong_secret_is_refused() -> None:
    headers = signed_headers(SECRET, BODY, "k", now=NOW)
    with pytest.raises(errors.SignatureError):
        verify("another", headers, BODY, now=NOW)


def test_changed_timestamp_breaks_the_signature() -> None:
    headers = signed_headers(SECRET, BODY, "k", now=NOW)
    headers[TIMESTAMP_HEADER] = str(NOW + 1)
    with pytest.raises(errors.SignatureError, match="does not match"):
        verify(SECRET, headers, BODY, now=NOW)


def test_replay_older_than_five_minutes_is_refused() -> None:
    headers = signed_headers(SECRET, BODY, "k", now=NOW)
    verify(SECRET, headers, BODY, now=NOW + 300)
    with pytest.raises(errors.SignatureError, match="replay"):
        verify(SECRET, headers, BODY, now=NOW + 301)
    with pytest.raises(errors.SignatureError, match="future"):
        verify(SECRET, headers, BODY, now=NOW - 301)


def test_several_signatures_during_rotation() -> None:
    good = sign(SECRET, NOW, BODY)
    headers = {TIMESTAMP_HEADER: str(NOW), SIGNATURE_HEADER: f"v1={'0' * 64}, {good}"}
    verify(SECRET, headers, BODY, now=NOW)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({SIGNATURE_HEADER: "v1=ab"}, "missing the X-Sched-Timestamp"),
        ({TIMESTAMP_HEADER: str(NOW)}, "missing the X-Sched-Signature"),
        ({TIMESTAMP_HEADER: "soon", SIGNATURE_HEADER: "v1=ab"}, "not Unix seconds"),
        ({TIMESTAMP_HEADER: str(NOW), SIGNATURE_HEADER: "v0=ab"}, "no v1= signature"),
    ],
)
def test_malformed_headers_say_what_is_wrong(headers: dict[str, str], message: str) -> None:
    with pytest.raises(errors.SignatureError, match=message) as caught:
        verify(SECRET, headers, BODY, now=NOW)
    assert caught.value.http_status == 401


def test_decoded_text_body_is_refused() -> None:
    headers = signed_headers(SECRET, BODY, "k", now=NOW)
    with pytest.raises(errors.SignatureError, match="raw request body"):
        verify(SECRET, headers, BODY.decode(), now=NOW)  # type: ignore[arg-type]
