"""Owns a tenant's quota use inside a job create's transaction: its quotas (the row locked
until commit), its creates in the rate window, and its jobs holding a max_jobs slot. What is
over a quota is the service's decision; this only counts.

Counting costs a read of up to create_rate_per_minute recent jobs and up to max_jobs
slot-holding ones, under the lock that serializes the tenant's creates: at 5,000 active
jobs it halved the creates per second. So the tenant's row keeps upper bounds of both,
raised by every create (and by whatever brings a job back to holding a slot): while the
bounds leave room under both quotas, a create counts nothing. A bound only ever
overstates (jobs ending or leaving the window lower the truth, not the bound), so the
quotas still hold exactly; once a bound reaches its quota the next create counts, and the
counts become the bounds again."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, Select, bindparam, func, select, tuple_, update
from sqlalchemy.engine import Connection

from schedctl.core import errors
from schedctl.domain.models import JobStatus
from schedctl.storage.backend.dialect import Dialect, dialect_of
from schedctl.storage.db import schema
from schedctl.storage.db.types import UTCDateTime
from schedctl.storage.jobs.job_create import Admission, Admit


@dataclass
class QuotaUse:
    """One tenant's quotas and upper bounds of what counts against them, read under its row
    lock, with the bounds already raised by the `adding` jobs this transaction may create."""

    tenant_id: str
    max_jobs: int
    create_rate_per_minute: int
    now: datetime  # the database's clock, read under the lock
    adding: int
    slots_bound: int | None  # including `adding`; None: not known
    rate_since: datetime | None
    rate_bound: int | None  # jobs created after rate_since, including `adding`
    _connection: Connection
    _counted: tuple[datetime, int, int] | None = None

    def counts(self, window: timedelta, skew: timedelta) -> tuple[int, datetime | None, int]:
        """The jobs created in the last `window` and the oldest one's created_at, and the
        jobs holding a max_jobs slot, this transaction's not included. Upper bounds (and
        no oldest) when the stored bounds leave room for `adding` more under both quotas:
        then no statement runs. Else counted, in one statement (see _counts).

        Job ids start with their creator's clock in milliseconds: only ids from `window`
        plus `skew` (for API servers whose clocks run behind) are read for the rate, a
        short range of the (tenant_id, job_id) index. Slots are counted up to max_jobs:
        past that the answer is the same (full)."""
        if self._bounds_fit(window):
            assert self.rate_bound is not None and self.slots_bound is not None
            return self.rate_bound - self.adding, None, self.slots_bound - self.adding
        floor = max(0, int((time.time() - (window + skew).total_seconds()) * 1000))
        since = self.now - window
        created, oldest, active = self._connection.execute(
            _counts(dialect_of(self._connection)),
            {
                "tenant_id": self.tenant_id,
                "floor": f"{floor:012x}",
                "since": since,
                "rate_limit": self.create_rate_per_minute,
                "slots_limit": self.max_jobs,
            },
        ).one()
        # a count cut off at its quota (a raised quota would find it understated) refuses
        # every item: no count is kept without a create
        self._counted = (since, int(created), int(active))
        return int(created), oldest, int(active)

    def record(self, created: int) -> None:
        """After the transaction's inserts, told how many jobs it created: the stored
        bounds become the counts plus those (when it counted and created some), or the
        bounds it found plus those (the take raised them by `adding`). Nothing is
        written when the take's raise was exact; a create that created nothing leaves
        the row as it found it."""
        since: datetime | None
        slots: int | None
        rate: int | None
        if self._counted is not None and created > 0:
            since, recent, holding = self._counted
            slots, rate = holding + created, recent + created
        elif created == self.adding:
            return
        else:
            since = self.rate_since
            slots = None if self.slots_bound is None else self.slots_bound - self.adding + created
            rate = None if self.rate_bound is None else self.rate_bound - self.adding + created
        self._connection.execute(
            _RECORD,
            {"b_tenant_id": self.tenant_id, "b_slots": slots, "b_since": since, "b_rate": rate},
        )

    def _bounds_fit(self, window: timedelta) -> bool:
        return (
            self.slots_bound is not None
            and self.rate_bound is not None
            and self.rate_since is not None
            # the bound counts from rate_since: it covers the window only from there on
            and self.rate_since <= self.now - window
            and self.slots_bound <= self.max_jobs
            and self.rate_bound <= self.create_rate_per_minute
        )


_COUNTS: dict[type, Select[Any]] = {}


def _counts(dialect: Dialect) -> Select[Any]:
    """QuotaUse.counts's statement for the backend, built once (a create would otherwise
    build and hash it again): the oldest `rate_limit` ids from `floor` created after
    `since` (ids sort by creation: past that the answer is the same, over), and up to
    `slots_limit` jobs holding a slot."""
    built = _COUNTS.get(type(dialect))
    if built is not None:
        return built
    jobs = schema.jobs
    tenant = jobs.c.tenant_id == bindparam("tenant_id")
    recent = (
        select(jobs.c.created_at)
        .where(
            tenant,
            # (tenant_id, job_id) as a row: only the tenant's index can answer it. As
            # job_id >= floor alone, Postgres's generic plan (a prepared statement after
            # five runs) walked the primary key over every tenant's jobs of the window
            tuple_(jobs.c.tenant_id, jobs.c.job_id)
            >= tuple_(bindparam("tenant_id"), bindparam("floor")),
            jobs.c.created_at > bindparam("since", type_=UTCDateTime),
        )
        .order_by(jobs.c.job_id)
        .limit(bindparam("rate_limit", type_=Integer))
        .subquery()
    )
    holding = _HOLDING_IDS.subquery()
    counts: Select[Any] = select(
        select(func.count()).select_from(recent).scalar_subquery(),
        select(func.min(recent.c.created_at)).scalar_subquery(),
        select(func.count()).select_from(holding).scalar_subquery(),
    )
    _COUNTS[type(dialect)] = counts
    return counts


# The Retry-After of a full max_jobs quota: nothing frees a slot on a schedule (a job ends
# when its owner cancels it or its last run passes), so this is a polite interval.
MAX_JOBS_RETRY_AFTER_SECONDS = 60

# the statuses of jobs that count against max_jobs
SLOT_HOLDERS = (JobStatus.active.value, JobStatus.paused.value)

_tenants = schema.tenants
_this_tenant = _tenants.c.tenant_id == bindparam("b_tenant_id")
_RECORD = (
    update(_tenants)
    .where(_this_tenant)
    .values(
        quota_slots_bound=bindparam("b_slots", type_=Integer),
        quota_rate_since=bindparam("b_since", type_=UTCDateTime),
        quota_rate_bound=bindparam("b_rate", type_=Integer),
    )
)
_SLOT_TAKEN = (
    update(_tenants)
    .where(_this_tenant)
    .values(quota_slots_bound=_tenants.c.quota_slots_bound + 1)
    .returning(_tenants.c.max_jobs, _tenants.c.quota_slots_bound)
)
_SET_SLOTS = (
    update(_tenants)
    .where(_this_tenant)
    .values(quota_slots_bound=bindparam("b_slots", type_=Integer))
)
# up to `slots_limit` of the tenant's jobs holding a slot (counted by _counts and take_slot)
_HOLDING_IDS = (
    select(schema.jobs.c.job_id)
    .where(
        schema.jobs.c.tenant_id == bindparam("tenant_id"),
        schema.jobs.c.status.in_(SLOT_HOLDERS),
    )
    .limit(bindparam("slots_limit", type_=Integer))
)
_HOLDING = select(func.count()).select_from(_HOLDING_IDS.subquery())
_FORGET = (
    update(_tenants)
    .where(_this_tenant)
    .values(quota_slots_bound=None, quota_rate_since=None, quota_rate_bound=None)
)
_TAKES: dict[type, Any] = {}


def _take(dialect: Dialect) -> Any:
    """take_quota_use's statement for the backend, built once: the bounds raised by
    `adding` (NULL stays NULL), the row locked by the UPDATE, the quotas and the raised
    bounds returned, and the clock read after the lock."""
    built = _TAKES.get(type(dialect))
    if built is not None:
        return built
    adding = bindparam("b_adding", type_=Integer)
    clock = dialect.locked_clock()
    built = _TAKES[type(dialect)] = (
        update(_tenants)
        .where(_this_tenant)
        .values(
            quota_slots_bound=_tenants.c.quota_slots_bound + adding,
            quota_rate_bound=_tenants.c.quota_rate_bound + adding,
        )
        .returning(
            _tenants.c.max_jobs,
            _tenants.c.create_rate_per_minute,
            _tenants.c.quota_slots_bound,
            _tenants.c.quota_rate_since,
            _tenants.c.quota_rate_bound,
            clock,
        )
    )
    return built


def take_quota_use(connection: Connection, tenant_id: str, adding: int) -> QuotaUse:
    """The tenant's quotas and use bounds, raised by the `adding` jobs this transaction may
    create, in one statement; the tenant's row is locked until commit (as FOR NO KEY
    UPDATE: it serializes creates of this tenant but not the foreign-key checks of other
    writers, which take KEY SHARE)."""
    row = connection.execute(
        _take(dialect_of(connection)), {"b_tenant_id": tenant_id, "b_adding": adding}
    ).first()
    if row is None:
        raise errors.NotFound(f"no tenant {tenant_id!r}", field="tenant")
    now = row[5].astimezone(UTC)
    return QuotaUse(
        tenant_id=tenant_id,
        max_jobs=int(row.max_jobs),
        create_rate_per_minute=int(row.create_rate_per_minute),
        now=now,
        adding=adding,
        slots_bound=row.quota_slots_bound,
        rate_since=row.quota_rate_since,
        rate_bound=row.quota_rate_bound,
        _connection=connection,
    )


def take_slot(connection: Connection, tenant_id: str) -> None:
    """A job of the tenant came back to holding a slot (a completed or cancelled job
    rescheduled, its new status written in this transaction already): QuotaExceeded
    (field max_jobs) when that puts the tenant over max_jobs, else its slots bound grows
    with it. Counts only when the bound reaches the quota; locks the tenant's row until
    commit."""
    row = connection.execute(_SLOT_TAKEN, {"b_tenant_id": tenant_id}).first()
    if row is None:
        raise errors.NotFound(f"no tenant {tenant_id!r}", field="tenant")
    max_jobs, bound = int(row[0]), row[1]
    if bound is not None and bound <= max_jobs:
        return
    holding = int(
        connection.execute(
            _HOLDING, {"tenant_id": tenant_id, "slots_limit": max_jobs + 1}
        ).scalar_one()
    )
    if holding > max_jobs:
        # the rollback undoes the status too: nothing changes
        raise errors.QuotaExceeded(
            f"the tenant has reached its limit of {max_jobs} active jobs, so this job "
            "cannot hold a slot again (cancel others, or ask an operator to raise max_jobs)",
            field="max_jobs",
            retry_after=MAX_JOBS_RETRY_AFTER_SECONDS,
        )
    connection.execute(_SET_SLOTS, {"b_tenant_id": tenant_id, "b_slots": holding})


def forget_quota_use(connection: Connection, tenant_id: str) -> None:
    """Jobs were written without a create (bulk loads): the next create counts."""
    connection.execute(_FORGET, {"b_tenant_id": tenant_id})


def quota_admission(
    tenant_id: str, check: Callable[[QuotaUse], Callable[[int], errors.SchedError | None]]
) -> Admit:
    """A create_jobs `admit`: `check` sees the tenant's quota use in the create's own
    transaction and answers for each position of a job to create, so what it allows is
    atomic with the insert."""

    def admit(connection: Connection, adding: int) -> Admission:
        use = take_quota_use(connection, tenant_id, adding)
        return Admission(now=use.now, refuse=check(use), record=use.record)

    return admit
