"""The delivery signature scheme: v2's canonical string, sign/verify round trip, what v2
covers (timestamp, method, path, Idempotency-Key, body), replays, rotation lists, v1 during
its deprecation period, malformed timestamps, header spellings, and clear errors."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from schedctl.core import errors
from schedctl.core.signing import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    parse_timestamp,
    sign,
    sign_v2,
    signed_headers,
    verify,
    verify_signature,
)

SECRET = "s3cret-key"
OLD_SECRET = "old-s3cret"
BODY = b'{"job_id":"j1","scheduled_at":"2026-01-01T00:00:00Z","attempt":1,"payload":{}}'
NOW = 1_767_225_600
KEY = "j1:2026-01-01T00:00:00Z"
PATH = "/hooks/run?source=sched"


def headers_for(secrets: str | list[str] = SECRET, **kwargs: object) -> dict[str, str]:
    options: dict[str, object] = {"method": "POST", "path": PATH, "now": NOW}
    options.update(kwargs)
    return signed_headers(secrets, BODY, KEY, **options)  # type: ignore[arg-type]


def check(secret: str, headers: dict[str, str], body: bytes = BODY, **kwargs: object) -> None:
    options: dict[str, object] = {"method": "POST", "path": PATH, "now": NOW}
    options.update(kwargs)
    verify(secret, headers, body, **options)  # type: ignore[arg-type]


def test_v2_is_hmac_sha256_over_the_documented_canonical_string() -> None:
    canonical = f"v2:{NOW}\nPOST\n{PATH}\n{KEY}\n".encode() + BODY
    expected = hmac.new(SECRET.encode(), canonical, hashlib.sha256).hexdigest()
    got = sign_v2(SECRET, NOW, method="post", path=PATH, idempotency_key=KEY, body=BODY)
    assert got == f"v2={expected}"
    headers = headers_for()
    assert headers[TIMESTAMP_HEADER] == str(NOW)
    assert headers[IDEMPOTENCY_HEADER] == KEY
    # v2 first; v1 follows during its deprecation period
    assert headers[SIGNATURE_HEADER] == f"v2={expected}, {sign(SECRET, NOW, BODY)}"


def test_v1_is_still_hmac_sha256_over_timestamp_dot_body() -> None:
    expected = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert sign(SECRET, NOW, BODY) == f"v1={expected}"


def test_round_trip_with_any_header_spelling() -> None:
    headers = headers_for()
    check(SECRET, headers)
    check(SECRET, {k.lower(): v for k, v in headers.items()}, now=NOW + 299)
    # a whole URL is reduced to its path and query; the method's case does not matter
    check(SECRET, headers, method="post", path=f"https://hooks.example.com{PATH}")


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"headers": {IDEMPOTENCY_HEADER: "j1:2026-01-01T00:01:00Z"}}, "Idempotency-Key"),
        ({"method": "PUT"}, "method"),
        ({"path": "/hooks/run?source=other"}, "query"),
        ({"path": "/hooks/other?source=sched"}, "path"),
        ({"body": BODY.replace(b'"attempt":1', b'"attempt":2')}, "body"),
        ({"headers": {TIMESTAMP_HEADER: str(NOW + 1)}}, "timestamp"),
    ],
)
def test_every_covered_part_breaks_the_signature(change: dict[str, object], what: str) -> None:
    headers = {**headers_for(), **change.get("headers", {})}  # type: ignore[dict-item]
    options = {k: v for k, v in change.items() if k in ("method", "path")}
    body = change.get("body", BODY)
    assert isinstance(body, bytes)
    with pytest.raises(errors.SignatureError, match="does not match"):
        check(SECRET, headers, body, **options)


def test_v1_alone_does_not_protect_the_idempotency_key_which_is_why_v2_exists() -> None:
    headers = headers_for()
    headers[IDEMPOTENCY_HEADER] = "another:key"
    with pytest.warns(DeprecationWarning):
        verify(SECRET, headers, BODY, now=NOW)  # the old call form: v1 only
    with pytest.raises(errors.SignatureError, match="does not match"):
        check(SECRET, headers)


def test_wrong_secret_is_refused() -> None:
    with pytest.raises(errors.SignatureError, match="does not match"):
        check("another", headers_for())


def test_replay_older_than_five_minutes_is_refused() -> None:
    headers = headers_for()
    check(SECRET, headers, now=NOW + 300)
    with pytest.raises(errors.SignatureError, match="replay"):
        check(SECRET, headers, now=NOW + 301)
    with pytest.raises(errors.SignatureError, match="future"):
        check(SECRET, headers, now=NOW - 301)


def test_the_window_runs_from_the_whole_second_in_the_header() -> None:
    """A delivery signed 0.999 s into a second carries that second (rounded down), and a
    receiver's five minutes run from the header's value: 299.5 s after the signing instant
    is 300.499 s after the header, a replay. A test that checked "arrival + 299 s" failed
    whenever the delivery crossed a second; a check at the edge starts from the header."""
    signed = NOW + 0.999
    headers = headers_for(now=signed)
    assert headers[TIMESTAMP_HEADER] == str(NOW)
    check(SECRET, headers, now=NOW + 300)  # the edge itself is inside
    check(SECRET, headers, now=NOW - 300)
    for late in (signed + 299.5, NOW + 300.001):
        with pytest.raises(errors.SignatureError, match="replay"):
            check(SECRET, headers, now=late)
    with pytest.raises(errors.SignatureError, match="future"):
        check(SECRET, headers, now=NOW - 300.001)


def test_rotation_two_signatures_and_a_receiver_with_either_secret_verifies() -> None:
    headers = headers_for([SECRET, OLD_SECRET])
    values = [v.strip() for v in headers[SIGNATURE_HEADER].split(",")]
    assert [v[:3] for v in values] == ["v2=", "v2=", "v1=", "v1="]
    check(SECRET, headers)
    check(OLD_SECRET, headers)
    with pytest.warns(DeprecationWarning):
        verify(OLD_SECRET, headers, BODY, now=NOW)
    with pytest.raises(errors.SignatureError, match="does not match"):
        check("a third secret", headers)


def test_v1_during_its_deprecation_period() -> None:
    v1_only = {
        TIMESTAMP_HEADER: str(NOW),
        SIGNATURE_HEADER: sign(SECRET, NOW, BODY),
        IDEMPOTENCY_HEADER: KEY,
    }
    # receivers not updated yet: the old call form still verifies, with a warning
    with pytest.warns(DeprecationWarning, match="method= and path="):
        verify(SECRET, v1_only, BODY, now=NOW)
    verify_signature(SECRET, str(NOW), v1_only[SIGNATURE_HEADER], BODY, now=NOW)
    # updated receivers facing a relay that only sends v1 opt in
    check(SECRET, v1_only, accept_v1=True)
    # otherwise v1 is refused, so stripping the v2 values is no downgrade
    with pytest.raises(errors.SignatureError, match="accept_v1"):
        check(SECRET, v1_only)
    # a sender may stop sending v1: then only the v2 call form works
    v2_only = headers_for(include_v1=False)
    check(SECRET, v2_only)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(errors.SignatureError, match="no v1= signature"),
    ):
        verify(SECRET, v2_only, BODY, now=NOW)


BAD_TIMESTAMPS = [
    pytest.param("9" * 5000, id="5000-digits"),
    pytest.param("1" + "0" * 20, id="21-digits"),
    pytest.param("-1767225600", id="negative"),
    # Python's str.isdigit() and int() accept these; a timestamp header must not
    pytest.param("\u0661\u0667\u0666\u0667\u0662\u0662\u0665\u0666\u0660\u0660", id="arabic-indic"),
    pytest.param("".join(chr(0xFF10 + int(d)) for d in "1767225600"), id="fullwidth-digits"),
    pytest.param("", id="empty"),
    pytest.param("   ", id="blank"),
    pytest.param("+1767225600", id="plus"),
    pytest.param("1767225600.5", id="fraction"),
    pytest.param("1e9", id="exponent"),
    pytest.param("soon", id="word"),
]


@pytest.mark.parametrize("timestamp", BAD_TIMESTAMPS)
def test_malformed_timestamps_raise_the_signature_error(timestamp: str) -> None:
    headers = {**headers_for(), TIMESTAMP_HEADER: timestamp}
    with pytest.raises(errors.SignatureError, match="not Unix seconds") as caught:
        check(SECRET, headers)
    assert caught.value.http_status == 401
    assert len(str(caught.value)) < 200  # a 5,000-digit value is not echoed back
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(errors.SignatureError, match="not Unix seconds"),
    ):
        verify(SECRET, headers, BODY, now=NOW)
    with pytest.raises(errors.SignatureError, match="not Unix seconds"):
        parse_timestamp(timestamp)


def test_negative_int_timestamp_is_refused_when_signing_too() -> None:
    with pytest.raises(errors.SignatureError, match="not Unix seconds"):
        sign_v2(SECRET, -5, method="POST", path="/", idempotency_key=KEY, body=BODY)
    with pytest.raises(errors.SignatureError, match="not Unix seconds"):
        sign(SECRET, 10**5000, BODY)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({SIGNATURE_HEADER: "v2=ab", IDEMPOTENCY_HEADER: KEY}, "missing the X-Sched-Timestamp"),
        ({TIMESTAMP_HEADER: str(NOW), IDEMPOTENCY_HEADER: KEY}, "missing the X-Sched-Signature"),
        ({TIMESTAMP_HEADER: str(NOW), SIGNATURE_HEADER: "v2=ab"}, "missing the Idempotency-Key"),
        (
            {TIMESTAMP_HEADER: str(NOW), SIGNATURE_HEADER: "v0=ab", IDEMPOTENCY_HEADER: KEY},
            "no v2= signature",
        ),
        (
            {
                TIMESTAMP_HEADER: str(NOW),
                SIGNATURE_HEADER: ", ".join(["v2=ab"] * 17),
                IDEMPOTENCY_HEADER: KEY,
            },
            "more than 16",
        ),
        (
            {TIMESTAMP_HEADER: str(NOW), SIGNATURE_HEADER: "v2=ab", IDEMPOTENCY_HEADER: "a\nb"},
            "line break",
        ),
    ],
)
def test_malformed_headers_say_what_is_wrong(headers: dict[str, str], message: str) -> None:
    with pytest.raises(errors.SignatureError, match=message) as caught:
        check(SECRET, headers)
    assert caught.value.http_status == 401


def test_method_and_path_go_together() -> None:
    with pytest.raises(errors.SignatureError, match="both"):
        verify(SECRET, headers_for(), BODY, method="POST", now=NOW)


def test_decoded_text_body_is_refused() -> None:
    with pytest.raises(errors.SignatureError, match="raw request body"):
        check(SECRET, headers_for(), BODY.decode())  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, 31, 63, 64, 65, 200])
def test_prepared_key_states_sign_as_hmac_does_for_any_key_length(size: int) -> None:
    """Keys longer than SHA-256's block are hashed first (RFC 2104), shorter ones padded:
    the prepared states give hmac's value, for str and bytes secrets alike."""
    secret = ("k" * size).encode()
    canonical = f"v2:{NOW}\nPOST\n{PATH}\n{KEY}\n".encode() + BODY
    v2 = hmac.new(secret, canonical, hashlib.sha256).hexdigest()
    v1 = hmac.new(secret, f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    for given in (secret, secret.decode(), [secret.decode(), SECRET]):
        header = headers_for(given)[SIGNATURE_HEADER]  # type: ignore[arg-type]
        assert header.split(", ")[0] == f"v2={v2}"
        assert f"v1={v1}" in header.split(", ")
        check(secret.decode(), headers_for(given))  # type: ignore[arg-type]


def test_a_secret_is_prepared_once_not_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """hashlib.sha256 runs when a secret is first used; later signatures only copy its
    prepared states (hmac.digest set the key up again on every call)."""
    secret = "prepared-once-secret"
    headers_for(secret)
    made: list[bytes] = []
    real = hashlib.sha256

    def counted(data: bytes = b"") -> object:
        made.append(data)
        return real(data)

    monkeypatch.setattr(hashlib, "sha256", counted)
    monkeypatch.setattr(hmac, "digest", lambda *_: pytest.fail("hmac.digest set the key up again"))
    first = headers_for(secret)
    second = headers_for(secret, now=NOW + 1)
    assert made == []
    assert first[SIGNATURE_HEADER] != second[SIGNATURE_HEADER]
    monkeypatch.undo()
    check(secret, second, now=NOW + 1)
