"""Time semantics: cron and other schedules, DST rules, misfire policies, jitter windows."""

from __future__ import annotations

from schedctl.scheduling.cron import CronFire, CronSchedule, FireKind
from schedctl.scheduling.misfire import ClaimPlan, MisfirePolicy, plan_claim
from schedctl.scheduling.schedules import (
    IntervalSchedule,
    OnceSchedule,
    Schedule,
    first_occurrence,
    latest_occurrence,
    next_occurrence,
    schedule_from_dict,
    schedule_to_dict,
)
from schedctl.scheduling.timeparse import format_instant, parse_duration, parse_instant
from schedctl.scheduling.windows import fire_time, jitter_seconds

__all__ = [
    "ClaimPlan",
    "CronFire",
    "CronSchedule",
    "FireKind",
    "IntervalSchedule",
    "MisfirePolicy",
    "OnceSchedule",
    "Schedule",
    "fire_time",
    "first_occurrence",
    "format_instant",
    "jitter_seconds",
    "latest_occurrence",
    "next_occurrence",
    "parse_duration",
    "parse_instant",
    "plan_claim",
    "schedule_from_dict",
    "schedule_to_dict",
]
