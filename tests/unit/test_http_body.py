"""The request body and instant the HTTP client builds by hand are the bytes json.dumps and
format_instant give (the signature covers them byte for byte)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from schedctl.delivery.http import _instant, delivery_body, encode_payload
from schedctl.scheduling.timeparse import format_instant

INSTANTS = [
    datetime(2026, 12, 2, 0, 0, tzinfo=UTC),
    datetime(2026, 12, 2, 0, 0, 0, 1, tzinfo=UTC),
    datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(2026, 6, 1, 12, 30, tzinfo=timezone(timedelta(hours=5, minutes=30))),
    datetime(2026, 6, 1, 12, 30, tzinfo=timezone(timedelta(0))),
]
PAYLOADS = [None, {"bench": True}, {"é": ["\u2028", 1.5, '"quoted"']}, [], "text", 3]


@pytest.mark.parametrize("at", INSTANTS)
def test_the_instant_is_format_instants(at: datetime) -> None:
    assert _instant(at) == format_instant(at)


def test_a_naive_instant_is_refused_as_before() -> None:
    with pytest.raises(Exception, match="UTC offset"):
        _instant(datetime(2026, 1, 1))


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("job_id", ["j_0123", 'odd "id" ü'])
def test_the_body_of_an_encoded_payload_is_the_json_document(payload: object, job_id: str) -> None:
    at = INSTANTS[1]
    expected = json.dumps(
        {"job_id": job_id, "scheduled_at": format_instant(at), "attempt": 2, "payload": payload},
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    assert delivery_body(job_id, at, 2, payload) == expected
    assert delivery_body(job_id, at, 2, encode_payload(payload)) == expected
