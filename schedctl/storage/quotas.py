"""Owns reading a tenant's quota use inside a job create's transaction: its quotas (the row
locked until commit), its creates in the rate window, and its active jobs. What is over a
quota is the service's decision; this only counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, Interval, Select, bindparam, func, select, tuple_
from sqlalchemy.engine import Connection

from schedctl import errors
from schedctl.models import JobStatus
from schedctl.storage import schema
from schedctl.storage.clock import db_now
from schedctl.storage.dialect import Dialect, Lock, dialect_of
from schedctl.storage.job_create import Admission, Admit


@dataclass
class QuotaUse:
    """One tenant's quotas and what counts against them, read under its row lock."""

    tenant_id: str
    max_jobs: int
    create_rate_per_minute: int
    _connection: Connection
    _now: datetime | None = None

    @property
    def now(self) -> datetime:
        """The database's clock, read under the lock: by `counts` in its statement where
        the dialect can, else here."""
        if self._now is None:
            self._now = db_now(self._connection)
        return self._now

    def counts(self, window: timedelta, skew: timedelta) -> tuple[int, datetime | None, int]:
        """In one statement: the jobs created in the last `window` and the oldest one's
        created_at, and the jobs holding a max_jobs slot (active or paused); where the
        dialect has a statement clock, the same statement reads the database's clock
        (`now`: one round trip less per create transaction, still after the lock).

        Job ids start with their creator's clock in milliseconds: only ids from `window`
        plus `skew` (for API servers whose clocks run behind) are read for the rate, a
        short range of the (tenant_id, job_id) index, not a scan of every job the tenant
        ever had, and at most create_rate_per_minute of them. Slots are counted up to
        max_jobs: past that the answer is the same (full), and a tenant with millions of
        jobs must not cost a count of millions per create."""
        floor = max(0, int((time.time() - (window + skew).total_seconds()) * 1000))
        params: dict[str, Any] = {
            "tenant_id": self.tenant_id,
            "floor": f"{floor:012x}",
            "rate_limit": self.create_rate_per_minute,
            "slots_limit": self.max_jobs,
        }
        with_clock, plain = _counts(dialect_of(self._connection))
        if self._now is None and with_clock is not None:
            params["window"] = window
            now, created, oldest, active = self._connection.execute(with_clock, params).one()
            assert isinstance(now, datetime)
            self._now = now.astimezone(UTC)
        else:  # the clock costs no statement here (or was read already)
            params["since"] = self.now - window
            created, oldest, active = self._connection.execute(plain, params).one()
        return int(created), oldest, int(active)


_COUNTS: dict[type, tuple[Select[Any] | None, Select[Any]]] = {}


def _counts(dialect: Dialect) -> tuple[Select[Any] | None, Select[Any]]:
    """QuotaUse.counts's statements for the backend, built once (a create would otherwise
    build and hash them again): with the database's clock read in it (None where the
    dialect has no statement clock), and without."""
    built = _COUNTS.get(type(dialect))
    if built is None:
        clock = dialect.statement_clock()
        with_clock = None if clock is None else _counts_statement(clock)
        built = _COUNTS[type(dialect)] = (with_clock, _counts_statement(None))
    return built


def _counts_statement(clock: Any | None) -> Select[Any]:
    """The oldest `rate_limit` ids from `floor` created after `since` (ids sort by
    creation: past that the answer is the same, over), and up to `slots_limit` jobs
    holding a slot. With a `clock` (an SQL expression): that clock first, and `since` is
    it minus `window`."""
    jobs = schema.jobs
    tenant = jobs.c.tenant_id == bindparam("tenant_id")
    since = bindparam("since") if clock is None else clock - bindparam("window", type_=Interval)
    recent = (
        select(jobs.c.created_at)
        .where(
            tenant,
            # (tenant_id, job_id) as a row: only the tenant's index can answer it. As
            # job_id >= floor alone, Postgres's generic plan (a prepared statement after
            # five runs) walked the primary key over every tenant's jobs of the window
            tuple_(jobs.c.tenant_id, jobs.c.job_id)
            >= tuple_(bindparam("tenant_id"), bindparam("floor")),
            jobs.c.created_at > since,
        )
        .order_by(jobs.c.job_id)
        .limit(bindparam("rate_limit", type_=Integer))
        .subquery()
    )
    holding = (
        select(jobs.c.job_id)
        .where(tenant, jobs.c.status.in_([JobStatus.active.value, JobStatus.paused.value]))
        .limit(bindparam("slots_limit", type_=Integer))
        .subquery()
    )
    return select(
        *([] if clock is None else [clock]),
        select(func.count()).select_from(recent).scalar_subquery(),
        select(func.min(recent.c.created_at)).scalar_subquery(),
        select(func.count()).select_from(holding).scalar_subquery(),
    )


def lock_quota_use(connection: Connection, tenant_id: str) -> QuotaUse:
    """The tenant's current quotas, its row locked until commit. FOR NO KEY UPDATE: it
    serializes creates of this tenant but not the foreign-key checks of other writers
    (those take KEY SHARE)."""
    tenants = schema.tenants
    query = select(tenants.c.max_jobs, tenants.c.create_rate_per_minute).where(
        tenants.c.tenant_id == tenant_id
    )
    row = connection.execute(dialect_of(connection).lock(query, Lock.no_key_update)).first()
    if row is None:
        raise errors.NotFound(f"no tenant {tenant_id!r}", field="tenant")
    return QuotaUse(
        tenant_id=tenant_id,
        max_jobs=int(row.max_jobs),
        create_rate_per_minute=int(row.create_rate_per_minute),
        _connection=connection,
    )


def quota_admission(
    tenant_id: str, check: Callable[[QuotaUse], Callable[[int], errors.SchedError | None]]
) -> Admit:
    """A create_jobs `admit`: `check` sees the tenant's quota use in the create's own
    transaction and answers for each position of a job to create, so what it allows is
    atomic with the insert."""

    def admit(connection: Connection) -> Admission:
        use = lock_quota_use(connection, tenant_id)
        refuse = check(use)  # first: its count reads the clock too
        return Admission(now=use.now, refuse=refuse)

    return admit
