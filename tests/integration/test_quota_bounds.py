"""The quota bounds on SQLite and a real Postgres: creates far from a tenant's quotas count
nothing and raise the stored bounds, a bound at its quota makes the next create count, and
max_jobs and the create rate still hold exactly whatever ends, comes back, is bulk loaded
or has its quota changed (checked against the jobs themselves over a random sequence)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

from schedctl.app.service import Scheduler
from schedctl.core import errors
from schedctl.domain.models import JobStatus
from schedctl.storage.db import schema
from schedctl_bench.storage.bulk import insert_once_jobs

ACTOR = "test:quota-bounds"


@pytest.fixture
def tenant(sched: Scheduler) -> str:
    sched.create_tenant("acme", ACTOR)
    return "acme"


def body(**overrides: Any) -> dict[str, Any]:
    made: dict[str, Any] = {
        "schedule": {"cron": "0 8 * * MON"},
        "target": {"type": "queue", "name": "q"},
    }
    made.update(overrides)
    return made


def bounds(sched: Scheduler) -> tuple[int | None, int | None]:
    """The stored (slots bound, rate bound) of the only tenant."""
    t = schema.tenants
    with sched.store.read() as connection:
        row = connection.execute(select(t.c.quota_slots_bound, t.c.quota_rate_bound)).one()
    return row[0], row[1]


def set_bounds(sched: Scheduler, slots: int, rate: int) -> None:
    with sched.store.tx() as connection:
        connection.execute(
            update(schema.tenants).values(quota_slots_bound=slots, quota_rate_bound=rate)
        )


def holding(sched: Scheduler) -> int:
    """The jobs holding a max_jobs slot, counted."""
    j = schema.jobs
    with sched.store.read() as connection:
        return int(
            connection.execute(
                select(func.count()).where(
                    j.c.status.in_([JobStatus.active.value, JobStatus.paused.value])
                )
            ).scalar_one()
        )


def complete(sched: Scheduler, job_id: str) -> None:
    """The job's last run passed: what a claim writes."""
    with sched.store.tx() as connection:
        connection.execute(
            update(schema.jobs)
            .where(schema.jobs.c.job_id == job_id)
            .values(status=JobStatus.completed.value, next_run_at=None, next_fire_at=None)
        )


def created(sched: Scheduler, tenant: str, **overrides: Any) -> bool:
    """Whether a create was admitted (False: refused by a quota)."""
    try:
        sched.create_job(tenant, body(**overrides), actor=ACTOR)
    except errors.QuotaExceeded:
        return False
    return True


def test_creates_far_from_the_quotas_raise_the_bounds_and_count_nothing(
    sched: Scheduler, tenant: str
) -> None:
    first, _ = sched.create_job(tenant, body(), actor=ACTOR)  # unknown bounds: counted
    assert bounds(sched) == (1, 1)
    sched.create_job(tenant, body(), actor=ACTOR)
    assert bounds(sched) == (2, 2)
    # a job that ends lowers the truth, not the bound
    sched.cancel_job(first.job_id, tenant, actor=ACTOR)
    assert bounds(sched) == (2, 2)
    # bounds far from the quotas (10,000 jobs, 600 a minute) are used, not counted: a
    # count would have made them 2 and 3
    set_bounds(sched, 40, 50)
    sched.create_job(tenant, body(), actor=ACTOR)
    assert bounds(sched) == (41, 51)
    # a batch raises them by what it created; a replay creates nothing
    outcomes = sched.create_many(
        tenant, [body(idempotency_key="k"), body(idempotency_key="k"), body()], actor=ACTOR
    )
    assert [o.created for o in outcomes] == [True, False, True]
    assert bounds(sched) == (43, 53)
    sched.create_job(tenant, body(idempotency_key="k"), actor=ACTOR)
    assert bounds(sched) == (43, 53)


def test_a_bound_at_its_quota_makes_the_next_create_count(sched: Scheduler, tenant: str) -> None:
    sched.set_quotas(tenant, max_jobs=5, actor=ACTOR)
    jobs = [sched.create_job(tenant, body(), actor=ACTOR)[0] for _ in range(5)]
    assert bounds(sched)[0] == 5
    assert not created(sched, tenant)
    assert bounds(sched)[0] == 5  # a refused create leaves the row as it was
    sched.delete_job(jobs[0].job_id, tenant, actor=ACTOR)
    assert created(sched, tenant)  # counted: 4 hold a slot
    assert bounds(sched)[0] == 5
    assert not created(sched, tenant)
    assert holding(sched) == 5


def test_a_job_brought_back_raises_the_slots_bound(sched: Scheduler, tenant: str) -> None:
    sched.set_quotas(tenant, max_jobs=3, actor=ACTOR)
    once = {"run_at": (datetime.now(UTC) + timedelta(days=1)).isoformat()}
    a = sched.create_job(tenant, body(schedule=once), actor=ACTOR)[0]
    b = sched.create_job(tenant, body(schedule=once), actor=ACTOR)[0]
    complete(sched, a.job_id)
    complete(sched, b.job_id)
    assert created(sched, tenant)  # the bound (3) fits: not counted
    assert created(sched, tenant)  # 4 > 3: counted, 1 held, the bound becomes 2
    assert bounds(sched)[0] == 2 and holding(sched) == 2
    sched.reschedule_job(a.job_id, once, tenant, actor=ACTOR)  # completed -> active
    assert bounds(sched)[0] == 3 and holding(sched) == 3
    # without its raise the bound (2) would have let a fourth job in
    assert not created(sched, tenant)
    assert holding(sched) == 3


def test_a_job_brought_back_over_max_jobs_is_refused_and_nothing_changes(
    sched: Scheduler, tenant: str
) -> None:
    sched.set_quotas(tenant, max_jobs=2, actor=ACTOR)
    once = {"run_at": (datetime.now(UTC) + timedelta(days=1)).isoformat()}
    a = sched.create_job(tenant, body(schedule=once), actor=ACTOR)[0]
    complete(sched, a.job_id)
    sched.create_job(tenant, body(), actor=ACTOR)
    sched.create_job(tenant, body(), actor=ACTOR)  # counted: 1 held, now 2 of 2
    before = sched.get_job(a.job_id, tenant)
    for bring_back in (
        lambda: sched.reschedule_job(a.job_id, once, tenant, actor=ACTOR),
        lambda: sched.update_job(a.job_id, {"schedule": once}, tenant, actor=ACTOR),
    ):
        with pytest.raises(errors.QuotaExceeded) as refused:
            bring_back()
        assert refused.value.field == "max_jobs"
        assert refused.value.retry_after > 0
        after = sched.get_job(a.job_id, tenant)
        assert (after.status, after.version) == (JobStatus.completed, before.version)
        assert holding(sched) == 2 and bounds(sched)[0] == 2
    # a bound that overstates is counted, not trusted: with a slot free it comes back
    sched.cancel_job(sched.list_jobs(tenant, status="active").items[0].job_id, tenant, actor=ACTOR)
    assert bounds(sched)[0] == 2
    sched.reschedule_job(a.job_id, once, tenant, actor=ACTOR)
    assert sched.get_job(a.job_id, tenant).status is JobStatus.active
    assert holding(sched) == 2 and bounds(sched)[0] == 2


def test_a_quota_raised_after_a_count_cut_off_at_it_still_holds(
    sched: Scheduler, tenant: str
) -> None:
    for _ in range(5):
        sched.create_job(tenant, body(), actor=ACTOR)
    sched.set_quotas(tenant, create_rate_per_minute=3, actor=ACTOR)
    assert not created(sched, tenant)  # the count stops at 3: at least 3, over
    sched.set_quotas(tenant, create_rate_per_minute=7, actor=ACTOR)
    assert created(sched, tenant)  # 5 made in the minute: room for 2 (counted again)
    assert created(sched, tenant)
    assert not created(sched, tenant)


def test_a_bulk_load_forgets_the_bounds(sched: Scheduler, tenant: str) -> None:
    sched.set_quotas(tenant, max_jobs=4, actor=ACTOR)
    sched.create_job(tenant, body(), actor=ACTOR)
    assert bounds(sched)[0] == 1
    tenant_id = sched.tenants.get(tenant).tenant_id
    insert_once_jobs(sched.store, tenant_id, [datetime.now(UTC) + timedelta(days=1)] * 3)
    assert bounds(sched) == (None, None)
    assert not created(sched, tenant)  # counted: 4 hold a slot
    assert holding(sched) == 4


def test_max_jobs_holds_over_a_random_sequence(sched: Scheduler, tenant: str) -> None:
    """Creates (single and batches), cancels, deletes, pauses, resumes, completions, jobs
    brought back and quota changes in a seeded random order: every create is admitted
    exactly when the jobs holding a slot leave room, and the stored bound never
    understates them."""
    rng = random.Random(12)
    max_jobs = 6
    sched.set_quotas(tenant, max_jobs=max_jobs, actor=ACTOR)
    once = {"run_at": (datetime.now(UTC) + timedelta(days=1)).isoformat()}
    for step in range(120):
        jobs = sched.list_jobs(tenant, limit=200).items
        by_status: dict[JobStatus, list[str]] = {}
        for job in jobs:
            by_status.setdefault(job.status, []).append(job.job_id)
        action = rng.choice(
            ["create", "create", "create", "batch", "cancel", "delete", "pause", "resume",
             "complete", "bring back", "quota"]
        )  # fmt: skip
        held = holding(sched)
        active, paused = by_status.get(JobStatus.active, []), by_status.get(JobStatus.paused, [])
        done = by_status.get(JobStatus.completed, [])
        if action == "create":
            assert created(sched, tenant, schedule=once) == (held < max_jobs), step
        elif action == "batch":
            size = rng.randint(1, 4)
            outcomes = sched.create_many(tenant, [body(schedule=once)] * size, actor=ACTOR)
            made = sum(1 for o in outcomes if o.created)
            assert made == min(size, max(0, max_jobs - held)), step
        elif action == "cancel" and active:
            sched.cancel_job(rng.choice(active), tenant, actor=ACTOR)
        elif action == "delete" and active + paused:
            sched.delete_job(rng.choice(active + paused), tenant, actor=ACTOR)
        elif action == "pause" and active:
            sched.pause_job(rng.choice(active), tenant, actor=ACTOR)
        elif action == "resume" and paused:
            sched.resume_job(rng.choice(paused), tenant, actor=ACTOR)
        elif action == "complete" and active:
            complete(sched, rng.choice(active))
        elif action == "bring back" and done:
            try:
                sched.reschedule_job(rng.choice(done), once, tenant, actor=ACTOR)
                admitted = True
            except errors.QuotaExceeded:
                admitted = False
            assert admitted == (held < max_jobs), step
        elif action == "quota":
            max_jobs = rng.randint(3, 9)
            sched.set_quotas(tenant, max_jobs=max_jobs, actor=ACTOR)
        slots, _ = bounds(sched)
        assert slots is None or slots >= holding(sched), step
        # a quota lowered below what is held is the only way over it
        assert holding(sched) <= max(max_jobs, held), step
