"""The body of an HTTP delivery is the same bytes whether the relay hands the payload over
decoded or already encoded (EncodedPayload, which it keeps per job): receivers verify the
signature over these bytes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from schedctl.delivery.http import delivery_body, encode_payload

PAYLOADS: list[Any] = [
    None,
    {},
    {"a": 1, "b": [1, 2.5, None, True], "nested": {"x": "y"}},
    {"text": 'quotes " and \\ backslashes, a line\nbreak, a tab\t and \u0001'},
    {"unicode": "faß, 東京, emoji \U0001f600"},
    [1, "two", {"three": 3}],
    "just a string",
    12345678901234567890,
    -0.5,
    {"order": "kept", "z": 1, "a": 2},
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_an_encoded_payload_gives_the_same_body(payload: Any) -> None:
    at = datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)
    for job_id in ("01JOBID", 'odd "id" \u00e9'):
        plain = delivery_body(job_id, at, 3, payload)
        assert delivery_body(job_id, at, 3, encode_payload(payload)) == plain
        assert json.loads(plain)["payload"] == payload


def test_the_encoded_payload_is_never_shown() -> None:
    assert "secret" not in repr(encode_payload({"token": "secret"}))
