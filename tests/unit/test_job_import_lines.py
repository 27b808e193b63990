"""Owns the tests of how `job import --api` checks a line before sending it as written:
JSON that json reads goes as it is, anything else is that line's own error naming `line`."""

from __future__ import annotations

import pytest

from schedctl.cli.job_import import _api_text
from schedctl.core import errors


@pytest.mark.parametrize(
    "line",
    [
        '  {"a": 1, "b": "café"}\n',
        '{"big": 123456789012345678901234567890}',  # orjson would make it a float: sent as is
        '{"x": NaN}',  # orjson refuses, json reads: the server judges it
        '{"s": "\\ud800"}',  # an escaped lone surrogate: JSON text, judged by the server
    ],
)
def test_json_goes_as_written(line: str) -> None:
    assert _api_text(line) == line.strip()


@pytest.mark.parametrize(
    "line",
    [
        "{not json",
        '{"s": "\udcff"}',  # an undecodable byte from stdin (surrogateescape): not UTF-8
        '{"p": ' + "[" * 100 + "]" * 100 + "}",  # deeper than the batch envelope allows
    ],
    ids=["not-json", "undecodable", "too-deep"],
)
def test_anything_else_is_the_lines_error(line: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        _api_text(line)
    assert caught.value.field == "line"
