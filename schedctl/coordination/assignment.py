"""Deterministic partition assignment: which member should own which partition (rendezvous hashing).

Every member computes the same answer from the same member list, with no coordination:
for each partition the member with the highest sha256(member|partition) score wins. When
a member joins it wins about 1/n of the partitions, each taken from whoever had it; when
one leaves only its partitions move. No other partition changes hands, so a rebalance
fences off as few in-flight claims as possible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def score(member: str, partition: int) -> int:
    """The member's weight for the partition: a stable 64-bit hash (never Python's hash(),
    which differs between processes)."""
    digest = hashlib.sha256(f"{member}|{partition}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def assign(partition: int, members: Iterable[str]) -> str:
    """The member that should own `partition`; ValueError when there are no members."""
    best: tuple[int, str] | None = None
    for member in members:
        # ties (astronomically unlikely) break on the name, so every member agrees
        candidate = (score(member, partition), member)
        if best is None or candidate > best:
            best = candidate
    if best is None:
        raise ValueError("cannot assign a partition to no members")
    return best[1]


def assignment(members: Iterable[str], partition_count: int) -> dict[int, str]:
    """Partition -> member for every partition (empty when there are no members)."""
    unique = sorted(set(members))
    if not unique:
        return {}
    return {p: assign(p, unique) for p in range(partition_count)}


def partitions_for(member: str, members: Iterable[str], partition_count: int) -> set[int]:
    """The partitions `member` should own among `members` (none if it is not one of them)."""
    unique = sorted(set(members))
    if member not in unique:
        return set()
    return {p for p in range(partition_count) if assign(p, unique) == member}
