"""Owns the benchmarks' measurements: a percentile of samples (nearest rank), seconds as
milliseconds, and a live process's peak resident set and CPU time (Linux /proc; None
elsewhere). Standard library only: `schedctl --help` loads cli/bench.py, which uses it."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path


def percentile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank `q`th percentile (0 < q <= 100) of `values`; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def peak_rss_bytes(pid: int) -> int | None:
    """A live process's peak resident set (VmHWM), in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def cpu_seconds(pid: int, *, children: bool = False) -> float | None:
    """User + system CPU seconds of a live process so far; with `children`, those of its
    children that have exited and been waited for instead (a worker's commands)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # after the command's ")": state is field 3, utime 14, stime 15, cutime 16 and cstime 17
    # (1-based)
    first = 13 if children else 11
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")
