"""Rendezvous-hash partition assignment: deterministic, complete, balanced, minimal movement."""

from __future__ import annotations

from collections import Counter

import pytest

from schedctl.coordination.assignment import assign, assignment, partitions_for, score

P = 1024
THREE = ["dispatcher-a", "dispatcher-b", "dispatcher-c"]


def test_assignment_is_deterministic_and_ignores_member_order() -> None:
    first = assignment(THREE, P)
    assert assignment(list(reversed(THREE)), P) == first
    assert assignment([*THREE, "dispatcher-a"], P) == first  # duplicates change nothing
    assert all(assign(p, THREE) == first[p] for p in range(P))
    # a stable hash, not Python's per-process hash(): every process and version agrees
    assert score("dispatcher-a", 0) == 6550479299720001487
    assert score("dispatcher-a", 1) == 12671308322518042701


def test_every_partition_is_owned_by_exactly_one_member() -> None:
    owned = [partitions_for(m, THREE, P) for m in THREE]
    assert set().union(*owned) == set(range(P))
    assert sum(len(s) for s in owned) == P  # pairwise disjoint
    assert partitions_for("not-a-member", THREE, P) == set()
    assert partitions_for("solo", ["solo"], P) == set(range(P))
    assert assignment([], P) == {}
    with pytest.raises(ValueError):
        assign(0, [])


def test_three_members_are_balanced_within_reason() -> None:
    counts = Counter(assignment(THREE, P).values())
    print(f"\n3 members over {P} partitions: {dict(sorted(counts.items()))}")
    fair = P / 3
    assert all(0.8 * fair <= n <= 1.2 * fair for n in counts.values()), counts


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_a_joining_member_takes_about_one_nth_and_nothing_else_moves(size: int) -> None:
    members = [f"node-{i}" for i in range(size)]
    before = assignment(members, P)
    after = assignment([*members, "newcomer"], P)
    moved = {p for p in range(P) if before[p] != after[p]}
    # minimal movement: every partition that moved went to the newcomer
    assert moved == {p for p, m in after.items() if m == "newcomer"}
    share = len(moved) / P
    expected = 1 / (size + 1)
    print(f"\n{size} -> {size + 1} members: {len(moved)} of {P} partitions moved")
    assert 0.75 * expected <= share <= 1.25 * expected


def test_a_leaving_member_gives_up_only_its_own_partitions() -> None:
    members = ["n1", "n2", "n3", "n4"]
    before = assignment(members, P)
    after = assignment(["n1", "n2", "n4"], P)
    moved = {p for p in range(P) if before[p] != after[p]}
    assert moved == {p for p, m in before.items() if m == "n3"}
