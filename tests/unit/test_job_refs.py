"""Owns the tests of the shortest-unique-prefix arithmetic (schedctl/domain/job_refs.py)."""

from __future__ import annotations

from schedctl.domain.job_refs import common_prefix, shortest_among


def test_common_prefix() -> None:
    assert common_prefix("abcd", "abxy") == 2
    assert common_prefix("abc", "abc") == 3
    assert common_prefix("", "a") == 0


def test_shortest_among_is_unique_and_at_least_eight() -> None:
    ids = ["0" * 32, "0" * 20 + "1" * 12, "1" * 32, "0123456789abcdef" * 2]
    short = shortest_among(ids)
    assert short["1" * 32] == "1" * 8
    assert short["0" * 32] == "0" * 21 and short["0" * 20 + "1" * 12] == "0" * 20 + "1"
    assert short["0123456789abcdef" * 2] == "01234567"
    for job_id, prefix in short.items():
        assert len(prefix) >= 8 and job_id.startswith(prefix)
        assert [other for other in ids if other.startswith(prefix)] == [job_id]
    assert shortest_among([]) == {}
