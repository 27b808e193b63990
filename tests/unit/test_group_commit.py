"""Group commit: each caller gets its own item's result; a failed call fails its whole batch."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from schedctl.group_commit import GroupCommit


def test_each_caller_gets_its_own_result_and_calls_carry_many_items() -> None:
    calls: list[int] = []
    gate = threading.Event()

    def call(items: Sequence[int]) -> list[int]:
        calls.append(len(items))
        gate.wait(10)  # the first call holds until the others have queued behind it
        return [i * 10 for i in items]

    group: GroupCommit[int, int] = GroupCommit(call)
    results: dict[int, int] = {}

    def submit(i: int) -> None:
        results[i] = group.submit(i)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(20)]
    threads[0].start()
    for _ in range(1000):  # bounded: until the first call is under way
        if calls:
            break
        threading.Event().wait(0.01)
    for t in threads[1:]:
        t.start()
    gate.set()
    for t in threads:
        t.join(30)
    assert results == {i: i * 10 for i in range(20)}
    assert sum(calls) == 20
    assert len(calls) < 20  # the 19 that waited behind the first call went together


def test_an_error_reaches_every_caller_of_the_batch() -> None:
    def call(items: Sequence[int]) -> list[int]:
        raise RuntimeError("database away")

    group: GroupCommit[int, int] = GroupCommit(call)
    with pytest.raises(RuntimeError, match="database away"):
        group.submit(1)


def test_a_call_returning_the_wrong_count_is_an_error_not_a_wrong_answer() -> None:
    bad: GroupCommit[int, int] = GroupCommit(lambda items: [])
    with pytest.raises(RuntimeError, match="0 results for 1 items"):
        bad.submit(1)
