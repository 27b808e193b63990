"""Owns the pure arithmetic of shortened job ids: common prefixes, and the shortest unique
prefixes (at least MIN_SHOWN characters) of a set of ids. The database side (prefixes
among all of a tenant's jobs, resolving a prefix) is schedctl/storage/jobs/job_lookup.py."""

from __future__ import annotations

from collections.abc import Iterable

# tables show at least this many characters of an id
MIN_SHOWN = 8


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shortest_among(job_ids: Iterable[str]) -> dict[str, str]:
    """Each id's shortest prefix (at least MIN_SHOWN characters) no other id of the set
    shares: sorted, an id only needs to differ from its two neighbours."""
    ordered = sorted(set(job_ids))
    out: dict[str, str] = {}
    for i, job_id in enumerate(ordered):
        shared = 0
        if i > 0:
            shared = common_prefix(job_id, ordered[i - 1])
        if i + 1 < len(ordered):
            shared = max(shared, common_prefix(job_id, ordered[i + 1]))
        out[job_id] = job_id[: max(MIN_SHOWN, shared + 1)]
    return out
