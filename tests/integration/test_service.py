"""Owns the tests of the library API (schedctl.app.service.Scheduler) on real SQLite and Postgres:
tenants and tokens, job lifecycle, idempotency, paging, and "bad input changes nothing"."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from schedctl.app.service import Scheduler
from schedctl.core import errors
from schedctl.domain.models import JobStatus, RunStatus, RunTrigger
from schedctl.scheduling.schedules import CronSchedule, IntervalSchedule, OnceSchedule
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.create_statements import create_statements
from tests.integration.queue_support import table_snapshot

ACTOR = "test:service"
QUEUE = {"type": "queue", "name": "digest-jobs"}
SNAPSHOT_TABLES = (
    schema.tenants,
    schema.api_tokens,
    schema.jobs,
    schema.runs,
    schema.outbox,
    schema.audit_log,
)


@pytest.fixture
def tenant(sched: Scheduler) -> str:
    sched.create_tenant("acme", ACTOR)
    return "acme"


def job_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"schedule": {"cron": "0 8 * * MON"}, "target": dict(QUEUE)}
    body.update(overrides)
    return body


def iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def snapshot(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the tables a job request could touch, in a stable order."""
    return table_snapshot(store, SNAPSHOT_TABLES)


def job_row(store: Store, job_id: str) -> dict[str, Any]:
    with store.read() as connection:
        row = (
            connection.execute(select(schema.jobs).where(schema.jobs.c.job_id == job_id))
            .mappings()
            .one()
        )
    return dict(row)


# -- tenants ---------------------------------------------------------------------------


def test_tenant_token_is_returned_once_and_only_its_hash_is_stored(sched: Scheduler) -> None:
    created, token = sched.create_tenant("acme", ACTOR)
    assert token.startswith("st_")
    assert sched.tenants.authenticate(token) == (created.tenant_id, token.split("_")[1])
    with sched.store.read() as connection:
        rows = connection.execute(select(schema.api_tokens)).mappings().all()
        tenant_rows = connection.execute(select(schema.tenants)).mappings().all()
    assert len(rows) == 1
    assert rows[0]["token_hash"] == hashlib.sha256(token.encode()).hexdigest()
    stored = [str(v) for row in [*rows, *tenant_rows] for v in row.values()]
    assert not any(token in value for value in stored)
    # later reads never include it
    assert sched.get_tenant("acme") == created
    assert sched.get_tenant(created.tenant_id) == created
    assert "token" not in repr(sched.list_tenants())
    assert created.max_jobs == 10000 and created.allow_list == ()


def test_tenant_errors(sched: Scheduler) -> None:
    sched.create_tenant("acme", ACTOR)
    with pytest.raises(errors.Conflict) as conflict:
        sched.create_tenant("acme", ACTOR)
    assert conflict.value.field == "name"
    with pytest.raises(errors.ValidationError) as invalid:
        sched.create_tenant("no spaces please", ACTOR)
    assert invalid.value.field == "name"
    with pytest.raises(errors.NotFound) as missing:
        sched.get_tenant("nobody")
    assert missing.value.field == "tenant"
    assert [t.name for t in sched.list_tenants()] == ["acme"]


def test_tokens_authenticate_revoke_and_rotate(sched: Scheduler) -> None:
    created, token = sched.create_tenant("acme", ACTOR)
    tenant_id, token_id = sched.tenants.authenticate(token)
    second = sched.tenants.new_token("acme")
    sched.tenants.revoke_token(token_id)
    with pytest.raises(errors.Unauthorized):
        sched.tenants.authenticate(token)
    assert sched.tenants.authenticate(second)[0] == created.tenant_id == tenant_id
    for bad in ["", "st_nope", token[:-1] + ("A" if token[-1] != "A" else "B")]:
        with pytest.raises(errors.Unauthorized):
            sched.tenants.authenticate(bad)


def test_verified_tokens_are_cached_for_a_bounded_time(
    sched: Scheduler, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token verified once is served from the process's cache until its TTL passes; a
    revocation in this process drops it at once, one by another process (another store:
    its own cache is not this one) is seen when the entry expires. Fails when the cache
    outlives its TTL or maps a token to another tenant."""
    from schedctl.storage.tenants import token_cache

    now = [1000.0]
    cache = token_cache.TokenCache(ttl=5.0, clock=lambda: now[0])
    monkeypatch.setattr("schedctl.storage.tenants.tenants.VERIFIED_TOKENS", cache)
    acme, acme_token = sched.create_tenant("acme", ACTOR)
    other, other_token = sched.create_tenant("other", ACTOR)
    assert sched.tenants.cached_tenant(acme_token) is None
    assert sched.tenants.authenticate_tenant(acme_token)[0].tenant_id == acme.tenant_id
    assert sched.tenants.authenticate_tenant(other_token)[0].tenant_id == other.tenant_id
    cached = sched.tenants.cached_tenant(acme_token)
    assert cached is not None and cached[0].tenant_id == acme.tenant_id
    # revoked by "another process": the row changes without this cache knowing
    acme_id = sched.tenants.authenticate(acme_token)[1]
    with sched.store.tx() as connection:
        connection.execute(
            update(schema.api_tokens)
            .where(schema.api_tokens.c.token_id == acme_id)
            .values(revoked_at=datetime.now(UTC))
        )
    assert sched.tenants.authenticate_tenant(acme_token)[0].tenant_id == acme.tenant_id
    now[0] += 5.0  # the TTL is over: the database says revoked
    with pytest.raises(errors.Unauthorized):
        sched.tenants.authenticate_tenant(acme_token)
    with pytest.raises(errors.Unauthorized):  # and a refused token is never cached
        sched.tenants.authenticate_tenant(acme_token)
    # revoked in this process: refused at once, within the TTL
    sched.tenants.authenticate_tenant(other_token)
    assert sched.tenants.cached_tenant(other_token) is not None
    sched.revoke_token(other_token, actor=ACTOR)
    assert sched.tenants.cached_tenant(other_token) is None
    with pytest.raises(errors.Unauthorized):
        sched.tenants.authenticate_tenant(other_token)


def test_a_job_row_inserted_twice_is_an_integrity_error(sched: Scheduler, tenant: str) -> None:
    """The batch insert (an INSERT over arrays on Postgres, on the driver's cursor) raises
    SQLAlchemy's IntegrityError, which job_create retries when a concurrent create took a
    key or a name. Fails when the driver's own error escapes (a 500 for the race)."""
    from sqlalchemy.exc import IntegrityError

    from schedctl.storage.backend.dialect import dialect_of

    job, _ = sched.create_job(tenant, job_body(), actor=ACTOR)
    with sched.store.read() as connection:
        row = dict(
            connection.execute(select(schema.jobs).where(schema.jobs.c.job_id == job.job_id))
            .mappings()
            .one()
        )
    with pytest.raises(IntegrityError), sched.store.engine.begin() as connection:
        statements = create_statements(dialect_of(connection))
        statements.insert_jobs(connection, [{**row, "job_id": "f" * 32}])


# -- create ----------------------------------------------------------------------------


def test_create_run_at(sched: Scheduler, tenant: str) -> None:
    at = (sched.store.now() + timedelta(hours=2)).replace(microsecond=0)
    job, created = sched.create_job(
        tenant, job_body(schedule={"run_at": at.isoformat()}), actor=ACTOR
    )
    assert created and job.status is JobStatus.active and job.version == 1
    assert job.schedule == OnceSchedule(at)
    assert job.next_run_at == at == job.next_fire_at
    assert sched.get_job(job.job_id) == job


def test_create_delay(sched: Scheduler, tenant: str) -> None:
    before = sched.store.now()
    job, _ = sched.create_job(tenant, job_body(schedule={"delay": "PT10M"}), actor=ACTOR)
    after = sched.store.now()
    assert job.next_run_at is not None
    assert before + timedelta(minutes=10) <= job.next_run_at <= after + timedelta(minutes=10)


def test_create_cron(sched: Scheduler, tenant: str) -> None:
    job, _ = sched.create_job(
        tenant,
        job_body(schedule={"cron": "30 8 * * *", "timezone": "Asia/Kolkata"}, window="5m"),
        actor=ACTOR,
    )
    assert isinstance(job.schedule, CronSchedule)
    assert job.next_run_at is not None and job.next_fire_at is not None
    # 08:30 in Kolkata (+05:30) is 03:00 UTC
    assert (job.next_run_at.hour, job.next_run_at.minute) == (3, 0)
    assert job.next_run_at <= job.next_fire_at < job.next_run_at + timedelta(minutes=5)
    assert timedelta(0) < job.next_run_at - sched.store.now() <= timedelta(days=1)


def test_create_every(sched: Scheduler, tenant: str) -> None:
    anchor = datetime(2026, 1, 1, tzinfo=UTC)
    before = sched.store.now()
    job, _ = sched.create_job(
        tenant, job_body(schedule={"every": "45s", "anchor": iso(anchor)}), actor=ACTOR
    )
    after = sched.store.now()
    assert job.schedule == IntervalSchedule(45, anchor)
    assert job.next_run_at is not None
    assert (job.next_run_at - anchor).total_seconds() % 45 == 0
    # the next fire after the create's own clock, which lies between the two reads (a
    # single read after the create failed when a fire time fell between the two)
    assert before < job.next_run_at <= after + timedelta(seconds=45)


def test_create_http_target_and_all_options(sched: Scheduler, tenant: str) -> None:
    job, _ = sched.create_job(
        tenant,
        job_body(
            name="hook",
            target={"type": "http", "url": "https://hooks.example.com/x"},
            payload={"k": [1, "two"]},
            retry={"max_attempts": 5},
            misfire_policy="skip",
            max_concurrency=None,
            timeout="30m",
        ),
        actor=ACTOR,
    )
    assert job.name == "hook" and job.target.url == "https://hooks.example.com/x"
    assert job.payload == {"k": [1, "two"]} and job.retry.max_attempts == 5
    assert job.misfire_policy.value == "skip"
    assert job.max_concurrency == 0 and job.timeout_seconds == 1800


def test_idempotency(sched: Scheduler, tenant: str) -> None:
    body = job_body(idempotency_key="nightly-1", payload={"a": 1})
    first, created = sched.create_job(tenant, body, actor=ACTOR)
    assert created
    before = snapshot(sched.store)
    again, created_again = sched.create_job(tenant, dict(body), actor=ACTOR)
    assert (again, created_again) == (first, False)
    with pytest.raises(errors.Conflict) as conflict:
        sched.create_job(
            tenant, job_body(idempotency_key="nightly-1", payload={"a": 2}), actor=ACTOR
        )
    assert conflict.value.field == "idempotency_key"
    assert snapshot(sched.store) == before


def test_idempotency_keys_are_per_tenant(sched: Scheduler, tenant: str) -> None:
    sched.create_tenant("other", ACTOR)
    body = job_body(idempotency_key="k")
    mine, _ = sched.create_job(tenant, body, actor=ACTOR)
    theirs, created = sched.create_job("other", body, actor=ACTOR)
    assert created and theirs.job_id != mine.job_id


def test_quota_refuses_new_jobs_but_not_replays(sched: Scheduler, tenant: str) -> None:
    with sched.store.tx() as connection:
        connection.execute(update(schema.tenants).values(max_jobs=1))
    first, _ = sched.create_job(tenant, job_body(idempotency_key="only"), actor=ACTOR)
    assert sched.create_job(tenant, job_body(idempotency_key="only"), actor=ACTOR) == (first, False)
    with pytest.raises(errors.QuotaExceeded):
        sched.create_job(tenant, job_body(), actor=ACTOR)


# -- bad input changes nothing ---------------------------------------------------------

BAD_BODIES = {
    "unknown time zone": (
        job_body(schedule={"cron": "0 8 * * *", "timezone": "Nowhere/X"}),
        "timezone",
    ),
    "invalid cron": (job_body(schedule={"cron": "0 25 * * *"}), "cron"),
    "never-firing cron": (job_body(schedule={"cron": "0 0 30 2 *"}), "cron"),
    "run_at in the past": (job_body(schedule={"run_at": "2001-01-01T00:00:00Z"}), "run_at"),
    "run_at without offset": (job_body(schedule={"run_at": "2099-01-01T00:00:00"}), "run_at"),
    "oversized payload": (job_body(payload={"x": "y" * 70_000}), "payload"),
    "zero interval": (job_body(schedule={"every": "0s"}), "interval"),
    "negative interval": (job_body(schedule={"every": -5}), "interval"),
    "zero delay": (job_body(schedule={"delay": "0s"}), "delay"),
    "max_attempts 0": (job_body(retry={"max_attempts": 0}), "retry.max_attempts"),
    "unknown key": (job_body(colour="blue"), "colour"),
    "two schedule kinds": (job_body(schedule={"delay": "1m", "every": "1m"}), "schedule"),
    "bad misfire policy": (job_body(misfire_policy="maybe"), "misfire_policy"),
    "bad target type": (job_body(target={"type": "carrier-pigeon"}), "target.type"),
    "url without host": (job_body(target={"type": "http", "url": "http://"}), "target.url"),
    "end before the only run": (
        job_body(schedule={"run_at": "2099-01-01T00:00:00Z"}, end="2098-01-01T00:00:00Z"),
        "schedule",
    ),
}


@pytest.mark.parametrize(("body", "field"), BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_input_changes_nothing(
    sched: Scheduler, tenant: str, body: dict[str, Any], field: str
) -> None:
    existing, _ = sched.create_job(tenant, job_body(), actor=ACTOR)
    before = snapshot(sched.store)
    with pytest.raises(errors.ValidationError) as info:
        sched.create_job(tenant, body, actor=ACTOR)
    assert info.value.field == field
    assert field in str(info.value)
    assert snapshot(sched.store) == before
    assert [j.job_id for j in sched.list_jobs().items] == [existing.job_id]


def test_unknown_tenant_changes_nothing(sched: Scheduler, tenant: str) -> None:
    before = snapshot(sched.store)
    with pytest.raises(errors.NotFound) as info:
        sched.create_job("ghost", job_body(), actor=ACTOR)
    assert info.value.field == "tenant"
    assert snapshot(sched.store) == before


# -- listing ---------------------------------------------------------------------------


def test_list_pages_with_cursors(sched: Scheduler, tenant: str) -> None:
    created = {sched.create_job(tenant, job_body(), actor=ACTOR)[0].job_id for _ in range(25)}
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        page = sched.list_jobs(tenant, limit=10, cursor=cursor)
        seen.extend(j.job_id for j in page.items)
        pages += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
        # jobs created between pages must not shift or repeat the ones already listed
        sched.create_job(tenant, job_body(), actor=ACTOR)
    assert len(seen) == len(set(seen))
    assert created <= set(seen)
    assert seen == sorted(seen)
    assert pages >= 3


def test_list_filters_by_tenant_and_status(sched: Scheduler, tenant: str) -> None:
    sched.create_tenant("other", ACTOR)
    mine, _ = sched.create_job(tenant, job_body(), actor=ACTOR)
    paused, _ = sched.create_job(tenant, job_body(), actor=ACTOR)
    theirs, _ = sched.create_job("other", job_body(), actor=ACTOR)
    sched.pause_job(paused.job_id, actor=ACTOR)
    assert {j.job_id for j in sched.list_jobs(tenant).items} == {mine.job_id, paused.job_id}
    assert [j.job_id for j in sched.list_jobs(status="paused").items] == [paused.job_id]
    assert [j.job_id for j in sched.list_jobs("other").items] == [theirs.job_id]
    with pytest.raises(errors.ValidationError) as info:
        sched.list_jobs(status="sleeping")
    assert info.value.field == "status"
    with pytest.raises(errors.ValidationError) as bad_cursor:
        sched.list_jobs(cursor="!!!not-a-cursor")
    assert bad_cursor.value.field == "cursor"


# -- changes ---------------------------------------------------------------------------


def test_cancel_and_cancel_again(sched: Scheduler, tenant: str) -> None:
    job, _ = sched.create_job(tenant, job_body(), actor=ACTOR)
    cancelled = sched.cancel_job(job.job_id, tenant, actor=ACTOR)
    assert cancelled.status is JobStatus.cancelled
    assert cancelled.version == job.version + 1
    assert cancelled.next_run_at is None and cancelled.next_fire_at is None
    row = job_row(sched.store, job.job_id)
    before = snapshot(sched.store)
    with pytest.raises(errors.Conflict) as info:
        sched.cancel_job(job.job_id, actor=ACTOR)
    assert info.value.field == "status"
    assert job_row(sched.store, job.job_id) == row
    assert snapshot(sched.store) == before
    for change in (sched.pause_job, sched.resume_job, sched.trigger_job):
        with pytest.raises(errors.Conflict):
            change(job.job_id, actor=ACTOR)
    assert snapshot(sched.store) == before


def test_pause_and_resume_from_now(sched: Scheduler, tenant: str) -> None:
    anchor = sched.store.now() - timedelta(hours=10, minutes=30)
    job, _ = sched.create_job(
        tenant, job_body(schedule={"every": "1h", "anchor": iso(anchor)}), actor=ACTOR
    )
    paused = sched.pause_job(job.job_id, actor=ACTOR)
    assert paused.status is JobStatus.paused and paused.next_fire_at is None
    assert paused.version == job.version + 1
    with pytest.raises(errors.Conflict):
        sched.pause_job(job.job_id, actor=ACTOR)
    # as if the pause had lasted a day: the stored next run is long gone
    with sched.store.tx() as connection:
        connection.execute(
            update(schema.jobs).where(schema.jobs.c.job_id == job.job_id).values(next_run_at=anchor)
        )
    resumed = sched.resume_job(job.job_id, actor=ACTOR)
    now = sched.store.now()
    assert resumed.status is JobStatus.active and resumed.version == job.version + 2
    assert resumed.next_run_at is not None and resumed.next_fire_at is not None
    assert now < resumed.next_run_at <= now + timedelta(hours=1)
    assert (resumed.next_run_at - anchor).total_seconds() % 3600 == 0
    with pytest.raises(errors.Conflict):
        sched.resume_job(job.job_id, actor=ACTOR)


def test_reschedule(sched: Scheduler, tenant: str) -> None:
    job, _ = sched.create_job(tenant, job_body(), actor=ACTOR)
    at = (sched.store.now() + timedelta(days=3)).replace(microsecond=0)
    moved = sched.reschedule_job(job.job_id, {"run_at": iso(at)}, tenant, actor=ACTOR)
    assert moved.version == job.version + 1
    assert moved.schedule == OnceSchedule(at)
    assert moved.next_run_at == at == moved.next_fire_at
    again = sched.reschedule_job(
        job.job_id, {"cron": "15 6 * * *", "timezone": "Europe/London"}, actor=ACTOR
    )
    assert again.version == job.version + 2 and isinstance(again.schedule, CronSchedule)
    assert again.next_run_at is not None and again.next_run_at.minute == 15
    before = snapshot(sched.store)
    for bad, field in [
        ({"cron": "0 8 * * *", "timezone": "Atlantis/Capital"}, "timezone"),
        ({"run_at": "2000-01-01T00:00:00Z"}, "run_at"),
        ({"every": "0s"}, "interval"),
        ({"delay": "1m", "cron": "* * * * *"}, "schedule"),
    ]:
        with pytest.raises(errors.ValidationError) as info:
            sched.reschedule_job(job.job_id, bad, actor=ACTOR)
        assert info.value.field == field
    assert snapshot(sched.store) == before


def test_trigger_writes_a_manual_run_and_an_outbox_row(sched: Scheduler, tenant: str) -> None:
    job, _ = sched.create_job(tenant, job_body(), actor=ACTOR)
    run = sched.trigger_job(job.job_id, tenant, actor=ACTOR)
    assert run.job_id == job.job_id and run.trigger is RunTrigger.manual
    assert run.status is RunStatus.dispatched and run.attempt == 1
    with sched.store.read() as connection:
        outbox = connection.execute(select(schema.outbox)).mappings().all()
    assert [(o["job_id"], o["scheduled_at"]) for o in outbox] == [(job.job_id, run.scheduled_at)]
    assert outbox[0]["target"] == "digest-jobs"
    # a manual run does not move the schedule
    assert sched.get_job(job.job_id).next_run_at == job.next_run_at


def test_runs_page_newest_first(sched: Scheduler, tenant: str) -> None:
    job, _ = sched.create_job(tenant, job_body(), actor=ACTOR)
    assert sched.runs(job.job_id).items == ()
    triggered = [sched.trigger_job(job.job_id, actor=ACTOR).scheduled_at for _ in range(5)]
    seen: list[datetime] = []
    cursor: str | None = None
    while True:
        page = sched.runs(job.job_id, tenant, limit=2, cursor=cursor)
        seen.extend(r.scheduled_at for r in page.items)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == sorted(triggered, reverse=True)


def test_unknown_or_foreign_job_is_not_found(sched: Scheduler, tenant: str) -> None:
    sched.create_tenant("other", ACTOR)
    theirs, _ = sched.create_job("other", job_body(), actor=ACTOR)
    before = snapshot(sched.store)
    calls: dict[str, Callable[[str, str | None], object]] = {
        "get": lambda job_id, t: sched.get_job(job_id, t),
        "cancel": lambda job_id, t: sched.cancel_job(job_id, t, actor=ACTOR),
        "pause": lambda job_id, t: sched.pause_job(job_id, t, actor=ACTOR),
        "resume": lambda job_id, t: sched.resume_job(job_id, t, actor=ACTOR),
        "trigger": lambda job_id, t: sched.trigger_job(job_id, t, actor=ACTOR),
        "reschedule": lambda job_id, t: sched.reschedule_job(
            job_id, {"delay": "1m"}, t, actor=ACTOR
        ),
        "runs": lambda job_id, t: sched.runs(job_id, t),
    }
    for name, call in calls.items():
        for job_id, scope in [("0" * 32, None), (theirs.job_id, tenant)]:
            with pytest.raises(errors.NotFound) as info:
                call(job_id, scope)
            assert info.value.field == "job_id", name
    assert snapshot(sched.store) == before
