"""Owns a job's run policy: the overlap policy and the per-run resource limits.

`overlap` says what happens when a run of a queue job comes due while an earlier run of the
same job is still running: `queue` waits for a slot under max_concurrency (the default, as
before), `allow` starts it anyway (max_concurrency is not applied), `skip` records the new
run skipped ("previous run still running"), `replace` stops the running one (as a cancel
does) and starts the new one. `skip` and `replace` mean one run at a time. A retry of a run
(attempt 2 and on) always waits as `queue` does: it is the same run, not a new one.

`memory_max` (bytes), `cpu_weight` (1-10000) and `tasks_max` (processes and threads) go to
each run's cgroup (memory.max, cpu.weight, pids.max) where the worker has those
controllers; null is no limit. Both are the same keys in the REST body, the job files and
the CLI flags; every refusal names its field.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from schedctl.core import errors, limits
from schedctl.core.limits import MAX_CPU_WEIGHT as MAX_CPU_WEIGHT
from schedctl.core.limits import MAX_TASKS as MAX_TASKS

MIN_MEMORY = 1 << 20  # below a MiB no command starts: a typo, not a limit
MAX_MEMORY = 1 << 50
RUN_KEYS = frozenset({"overlap", "memory_max", "cpu_weight", "tasks_max"})
_SIZE = re.compile(r"([0-9]{1,16})([KMGT]?)(i?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SKIPPED_OVERLAP = "previous run still running"


class Overlap(enum.StrEnum):
    # upper case: `replace` would shadow str.replace
    ALLOW = "allow"
    SKIP = "skip"
    QUEUE = "queue"
    REPLACE = "replace"


@dataclass(frozen=True)
class RunPolicy:
    overlap: Overlap = Overlap.QUEUE
    memory_max: int | None = None
    cpu_weight: int | None = None
    tasks_max: int | None = None

    def columns(self) -> dict[str, Any]:
        """The jobs columns it is stored in (one each, same names)."""
        return {
            "overlap": self.overlap.value,
            "memory_max": self.memory_max,
            "cpu_weight": self.cpu_weight,
            "tasks_max": self.tasks_max,
        }

    def to_dict(self) -> dict[str, Any]:
        """Its part of a job's REST view (and of a job file)."""
        return self.columns()


@dataclass(frozen=True)
class RunLimits:
    """What a worker applies to a run's cgroup (a lease carries it; None: no limits)."""

    memory_max: int | None = None
    cpu_weight: int | None = None
    tasks_max: int | None = None


def run_policy_from(data: Mapping[str, Any]) -> RunPolicy:
    """From stored columns or a job's REST view (absent keys: the defaults)."""
    return RunPolicy(
        overlap=Overlap(data.get("overlap") or Overlap.QUEUE.value),
        memory_max=data.get("memory_max"),
        cpu_weight=data.get("cpu_weight"),
        tasks_max=data.get("tasks_max"),
    )


def parse_run_policy(
    body: Mapping[str, Any], *, target_type: str, current: RunPolicy | None = None
) -> RunPolicy:
    """The run policy of a create body (current None) or an update's (keys absent from the
    body keep `current`). Overlap applies to queue targets: an http target's run is a
    request, not a process, and nothing else than `queue` can be kept for one."""
    base = current or RunPolicy()
    overlap = base.overlap
    if "overlap" in body:
        overlap = parse_overlap(body["overlap"])
    if target_type != "queue" and overlap is not Overlap.QUEUE:
        raise errors.ValidationError(
            f"overlap {overlap.value!r} applies only to queue targets (an http target's "
            "runs are requests: leave overlap out or give 'queue')",
            field="overlap",
        )
    memory = base.memory_max
    if "memory_max" in body:
        memory = parse_memory(body["memory_max"])
    cpu = base.cpu_weight
    if "cpu_weight" in body:
        cpu = _bounded(body["cpu_weight"], "cpu_weight", 1, MAX_CPU_WEIGHT)
    tasks = base.tasks_max
    if "tasks_max" in body:
        tasks = _bounded(body["tasks_max"], "tasks_max", 1, MAX_TASKS)
    if target_type != "queue" and (memory, cpu, tasks) != (None, None, None):
        field = next(k for k in ("memory_max", "cpu_weight", "tasks_max") if k in body)
        raise errors.ValidationError(
            "resource limits apply only to queue targets (a worker's command)", field=field
        )
    return RunPolicy(overlap, memory, cpu, tasks)


def parse_overlap(value: Any) -> Overlap:
    allowed = ", ".join(p.value for p in Overlap)
    if isinstance(value, str):
        try:
            return Overlap(value)
        except ValueError:
            pass
    raise errors.ValidationError(
        f"must be one of {allowed}, got {limits.describe(value)}", field="overlap"
    )


def parse_memory(value: Any) -> int | None:
    """Bytes: an integer, or a size like "512M", "2G", "1GiB" (powers of 1024); null: none."""
    if value is None:
        return None
    size: int | None = None
    if limits.is_int(value):
        size = int(value)
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value.strip())):
        size = int(match[1]) * _UNITS[match[2].upper()]
    if size is None or not MIN_MEMORY <= size <= MAX_MEMORY:
        raise errors.ValidationError(
            "must be a size from 1M to 1P: bytes, or a number with K, M, G or T "
            f"(like '512M'), or null; got {limits.describe(value)}",
            field="memory_max",
        )
    return size


def _bounded(value: Any, field: str, low: int, high: int) -> int | None:
    if value is None:
        return None
    if not limits.is_int(value) or not low <= value <= high:
        raise errors.ValidationError(
            f"must be an integer from {low} to {high}, or null; got {limits.describe(value)}",
            field=field,
        )
    return int(value)


DEFAULT_RUN_POLICY = RunPolicy()  # a job's without any of the keys (a dataclass default)
