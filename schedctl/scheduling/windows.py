"""Tolerance windows: a deterministic jitter that spreads fire times within W seconds."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from schedctl.scheduling.timeparse import format_instant

__all__ = ["fire_time", "jitter_seconds"]


def _jitter_ms(job_id: str, nominal: datetime, window_seconds: int) -> int:
    if window_seconds <= 0:
        return 0
    # Hash the canonical UTC text, not the datetime, so every machine and every
    # restart agrees on the offset.
    digest = hashlib.sha256(f"{job_id}|{format_instant(nominal)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (int(window_seconds) * 1000)


def jitter_seconds(job_id: str, nominal: datetime, window_seconds: int) -> float:
    """Offset in [0, window_seconds) at millisecond resolution; 0.0 without a window."""
    return _jitter_ms(job_id, nominal, window_seconds) / 1000


def fire_time(job_id: str, nominal: datetime, window_seconds: int) -> datetime:
    """When the run of `nominal` is actually triggered (its identity stays `nominal`)."""
    if window_seconds <= 0:
        return nominal  # no window, no jitter: the claim asks this for every run it makes
    return nominal + timedelta(milliseconds=_jitter_ms(job_id, nominal, window_seconds))
