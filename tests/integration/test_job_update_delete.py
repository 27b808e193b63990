"""Owns the tests of job update and delete (issue 10 items 1-2) on SQLite and Postgres,
through the library, the CLI (local and --api) and the REST API: every field, If-Match /
--if-version, bad input writing nothing, an update racing a claim, and a deleted job
stopping like a cancelled one, leaving lists and lookups but not its run history."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import requests
from sqlalchemy import select
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app as cli_app
from schedctl.core import errors
from schedctl.domain.leasing import Beat
from schedctl.domain.models import JobStatus, Lane, RunStatus, TargetType
from schedctl.scheduling.cron import CronSchedule
from schedctl.scheduling.schedules import IntervalSchedule
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.payloads import decode_payload
from schedctl.storage.pipeline.claim import Claimer, ClaimResult, DueJob
from schedctl.storage.pipeline.outbox import OutboxRepo
from schedctl.storage.pipeline.queue import QueueRepo
from scheduled_d.api.server import ApiServer
from tests.integration.test_claim import ALL, own_all

ACTOR = "test:update"
QUEUE = {"type": "queue", "name": "q"}
runner = CliRunner()


@pytest.fixture
def sched(sched: Scheduler) -> Scheduler:
    sched.create_tenant("acme", ACTOR)
    return sched


def new_job(sched: Scheduler, **overrides: Any) -> str:
    body: dict[str, Any] = {
        "schedule": {"cron": "0 8 * * MON"},
        "target": dict(QUEUE),
        "payload": {"v": 1},
    }
    body.update(overrides)
    job, _ = sched.create_job("acme", body, actor=ACTOR)
    return job.job_id


def job_row(store: Store, job_id: str) -> dict[str, Any]:
    with store.read() as connection:
        row = connection.execute(select(schema.jobs).where(schema.jobs.c.job_id == job_id))
        return dict(row.mappings().one())


def audit_rows(store: Store) -> list[tuple[Any, ...]]:
    with store.read() as connection:
        return [tuple(r) for r in connection.execute(select(schema.audit_log)).all()]


# -- update: every field, through the library ------------------------------------------

FIELD_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "name": ({"name": "nightly"}, lambda j: j.name == "nightly"),
    "schedule": (
        {"schedule": {"every": "10m"}},
        lambda j: isinstance(j.schedule, IntervalSchedule) and j.schedule.every_seconds == 600,
    ),
    "timezone": (
        {"schedule": {"timezone": "Europe/Paris"}},
        lambda j: (
            isinstance(j.schedule, CronSchedule)
            and (j.schedule.expr, j.schedule.timezone) == ("0 8 * * MON", "Europe/Paris")
        ),
    ),
    "target_queue": (
        {"target": {"type": "queue", "name": "other"}},
        lambda j: j.target.address == "other",
    ),
    "target_url": (
        {"target": {"type": "http", "url": "https://hooks.invalid/run"}},
        lambda j: j.target.url == "https://hooks.invalid/run",
    ),
    "payload": (
        {"payload": {"v": 2, "list": [1, 2]}},
        lambda j: j.payload == {"v": 2, "list": [1, 2]},
    ),
    "retry": (
        {"retry": {"max_attempts": 7, "base_delay": "2s"}},
        lambda j: (
            (j.retry.max_attempts, j.retry.base_delay_seconds, j.retry.max_delay_seconds)
            == (7, 2.0, 300.0)
        ),
    ),
    "misfire_policy": ({"misfire_policy": "skip"}, lambda j: j.misfire_policy.value == "skip"),
    "grace": ({"grace": "5m"}, lambda j: j.grace_seconds == 300),
    "window": ({"window": "1m"}, lambda j: j.window_seconds == 60),
    "max_concurrency": ({"max_concurrency": None}, lambda j: j.max_concurrency == 0),
    "timeout": ({"timeout": "90s"}, lambda j: j.timeout_seconds == 90),
}


@pytest.mark.parametrize("case", sorted(FIELD_CASES))
def test_update_changes_one_field_and_bumps_the_version(sched: Scheduler, case: str) -> None:
    job_id = new_job(sched)
    before = sched.get_job(job_id)
    body, check = FIELD_CASES[case]
    after = sched.update_job(job_id, body, "acme", actor=ACTOR)
    assert check(after), after
    assert after.version == before.version + 1
    # what the body does not name keeps its value
    for attr in ("name", "payload", "target", "retry", "misfire_policy", "grace_seconds"):
        if not attr.startswith(case.split("_")[0]):
            assert getattr(after, attr) == getattr(before, attr), attr
    entry = sched.audit("acme", job_id=job_id).items[0]
    assert entry.action == ("reschedule" if case in {"schedule", "timezone"} else "update")
    # the changed field names, never the payload
    assert entry.detail is not None and entry.detail["fields"] == sorted(body)
    assert "list" not in json.dumps(entry.detail)


def test_a_new_schedule_recomputes_the_next_run(sched: Scheduler) -> None:
    job_id = new_job(sched)
    before = sched.get_job(job_id)
    after = sched.update_job(
        job_id, {"schedule": {"every": "10m"}, "window": "0s"}, "acme", actor=ACTOR
    )
    assert after.next_run_at is not None and after.next_run_at != before.next_run_at
    assert after.next_fire_at == after.next_run_at
    # reschedule keeps working, and is audited as before
    again = sched.reschedule_job(job_id, {"cron": "0 9 * * *"}, "acme", actor=ACTOR)
    assert again.version == after.version + 1
    assert sched.audit("acme", job_id=job_id).items[0].action == "reschedule"


BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({}, "body"),
    ({"bogus": 1}, "bogus"),
    ({"idempotency_key": "k"}, "idempotency_key"),
    ({"name": ""}, "name"),
    ({"name": None}, "name"),
    ({"schedule": {"cron": "99 * * * *"}}, "cron"),
    ({"schedule": {"run_at": "2001-01-01T00:00:00Z"}}, "run_at"),
    ({"target": {"type": "queue", "name": "bad name"}}, "target.name"),
    ({"target": {"type": "http", "url": "http://127.0.0.1:9/x"}}, "target.url"),
    ({"target": {"type": "http", "url": "ftp://example.com/"}}, "target.url"),
    ({"payload": "x" * 70_000}, "payload"),
    ({"retry": {"max_attempts": 0}}, "retry.max_attempts"),
    ({"retry": {"base_delay": "10m", "max_delay": "1s"}}, "retry.max_delay"),
    ({"misfire_policy": "sometimes"}, "misfire_policy"),
    ({"grace": "-5s"}, "grace"),
    ({"window": "forever"}, "window"),
    ({"max_concurrency": 0}, "max_concurrency"),
    ({"timeout": [1]}, "timeout"),
    # a valid field next to a bad one: nothing of either is written
    ({"name": "fine", "timeout": "nope"}, "timeout"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES, ids=[f for _, f in BAD_BODIES])
def test_bad_input_names_the_field_and_writes_nothing(
    sched: Scheduler, body: dict[str, Any], field: str
) -> None:
    job_id = new_job(sched)
    row = job_row(sched.store, job_id)
    audit = audit_rows(sched.store)
    with pytest.raises(errors.SchedError) as caught:
        sched.update_job(job_id, body, "acme", actor=ACTOR)
    assert caught.value.field == field
    assert job_row(sched.store, job_id) == row
    assert audit_rows(sched.store) == audit


def test_timezone_alone_needs_a_cron_job(sched: Scheduler) -> None:
    job_id = new_job(sched, schedule={"every": "1h"})
    with pytest.raises(errors.ValidationError) as caught:
        sched.update_job(job_id, {"schedule": {"timezone": "UTC"}}, "acme", actor=ACTOR)
    assert caught.value.field == "timezone"


def test_a_stale_version_is_refused_and_writes_nothing(sched: Scheduler) -> None:
    job_id = new_job(sched)
    version = sched.get_job(job_id).version
    sched.update_job(job_id, {"name": "a"}, "acme", if_version=version, actor=ACTOR)
    row = job_row(sched.store, job_id)
    with pytest.raises(errors.Conflict) as caught:
        sched.update_job(job_id, {"name": "b"}, "acme", if_version=version, actor=ACTOR)
    assert caught.value.field == "version"
    with pytest.raises(errors.Conflict):
        sched.delete_job(job_id, "acme", if_version=version, actor=ACTOR)
    assert job_row(sched.store, job_id) == row


def test_another_tenants_job_is_not_found(sched: Scheduler) -> None:
    sched.create_tenant("other", ACTOR)
    job_id = new_job(sched)
    with pytest.raises(errors.NotFound):
        sched.update_job(job_id, {"name": "x"}, "other", actor=ACTOR)
    with pytest.raises(errors.NotFound):
        sched.delete_job(job_id, "other", actor=ACTOR)


# -- update racing a claim -------------------------------------------------------------


def _due_job(sched: Scheduler) -> str:
    """A job due now (its next run moved into the past, as a dispatcher would find it)."""
    # no concurrency limit: a run still leased does not hold up the next one
    job_id = new_job(sched, schedule={"every": "1h"}, max_concurrency=None)
    past = datetime(2020, 1, 1, tzinfo=UTC)
    with sched.store.tx() as connection:
        connection.execute(
            schema.jobs.update()
            .where(schema.jobs.c.job_id == job_id)
            .values(next_run_at=past, next_fire_at=past, grace_seconds=10**9)
        )
    return job_id


@dataclass
class _Dispatcher:
    """Dispatcher d1 owning every partition, reading and claiming as of one instant: a read
    kept across a change shows what a claim from a stale read does."""

    claimer: Claimer
    epochs: dict[int, int]
    now: datetime

    @classmethod
    def owning_all(cls, sched: Scheduler) -> _Dispatcher:
        return cls(Claimer(sched.store, "d1"), own_all(sched.store), datetime.now(UTC))

    def due(self, job_id: str) -> list[DueJob]:
        return [d for d in self.claimer.load_due(ALL, self.now) if d.job_id == job_id]

    def claim(self, due: list[DueJob]) -> ClaimResult:
        return self.claimer.claim(due, self.epochs, self.now)


def test_a_claim_from_a_read_before_the_update_claims_nothing(sched: Scheduler) -> None:
    job_id = _due_job(sched)
    dispatcher = _Dispatcher.owning_all(sched)
    stale = dispatcher.due(job_id)
    assert stale
    sched.update_job(job_id, {"target": {"type": "queue", "name": "new"}}, "acme", actor=ACTOR)
    result = dispatcher.claim(stale)
    assert result.dispatched == [] and result.stale == 1
    # a fresh read claims with the new definition
    assert dispatcher.claim(dispatcher.due(job_id)).dispatched
    with sched.store.read() as connection:
        targets = connection.execute(
            select(schema.queue_messages.c.queue).where(schema.queue_messages.c.job_id == job_id)
        ).all()
    assert [t[0] for t in targets] == ["new"]


def test_a_run_claimed_before_the_update_keeps_the_old_definition(sched: Scheduler) -> None:
    job_id = _due_job(sched)
    dispatcher = _Dispatcher.owning_all(sched)
    assert dispatcher.claim(dispatcher.due(job_id)).dispatched
    # the update commits after the claim, before delivery
    sched.update_job(
        job_id,
        {"target": {"type": "queue", "name": "new"}, "payload": {"v": 2}},
        "acme",
        actor=ACTOR,
    )
    sched.update_job(job_id, {"payload": {"v": 3}}, "acme", actor=ACTOR)
    repo = QueueRepo(sched.store)
    assert repo.move_outbox() == 0  # the claim queued the run itself
    tenant_id = sched.get_tenant("acme").tenant_id
    assert repo.lease("new", "w", 30, tenant_id=tenant_id) == []
    (old,) = repo.lease("q", "w", 30, tenant_id=tenant_id)
    assert old.payload == {"v": 1}
    # a run claimed after the update has the new target and the newest payload
    sched.trigger_job(job_id, "acme", actor=ACTOR)
    assert repo.move_outbox() == 1
    (new,) = repo.lease("new", "w", 30, tenant_id=tenant_id)
    assert new.payload == {"v": 3}


def test_an_http_run_claimed_before_the_update_is_sent_with_the_old_payload(
    sched: Scheduler,
) -> None:
    job_id = new_job(sched, target={"type": "http", "url": "https://hooks.invalid/run"})
    sched.trigger_job(job_id, "acme", actor=ACTOR)
    sched.update_job(
        job_id,
        {"payload": {"v": 2}, "target": {"type": "http", "url": "https://other.invalid/"}},
        "acme",
        actor=ACTOR,
    )
    lane = Lane(sched.get_tenant("acme").tenant_id, TargetType.http)
    (delivery,) = OutboxRepo(sched.store).claim({lane: 10}, "relay", 30).deliveries
    assert delivery.target == "https://hooks.invalid/run"
    assert decode_payload(delivery.stored_payload) == {"v": 1}


# -- delete ----------------------------------------------------------------------------


def test_delete_stops_the_job_and_hides_it_but_keeps_its_history(sched: Scheduler) -> None:
    job_id = _due_job(sched)
    keep = new_job(sched)
    run = sched.trigger_job(job_id, "acme", actor=ACTOR)
    dispatcher = _Dispatcher.owning_all(sched)
    stale = dispatcher.due(job_id)
    deleted = sched.delete_job(job_id, "acme", actor=ACTOR)
    assert deleted.status is JobStatus.deleted and deleted.next_run_at is None
    # no run claimed after it commits, not even from a read made before
    assert dispatcher.claim(stale).dispatched == []
    assert dispatcher.due(job_id) == []
    # the run waiting in the outbox is skipped as for a cancel
    assert QueueRepo(sched.store).move_outbox() == 0
    history = sched.runs(job_id, "acme").items
    assert [(r.scheduled_at, r.status) for r in history] == [(run.scheduled_at, RunStatus.skipped)]
    # gone from lookups and lists; status=deleted still lists it
    with pytest.raises(errors.NotFound):
        sched.get_job(job_id, "acme")
    assert [j.job_id for j in sched.list_jobs("acme").items] == [keep]
    assert [j.job_id for j in sched.list_jobs("acme", "deleted").items] == [job_id]
    for change in (
        lambda: sched.delete_job(job_id, "acme", actor=ACTOR),
        lambda: sched.cancel_job(job_id, "acme", actor=ACTOR),
        lambda: sched.pause_job(job_id, "acme", actor=ACTOR),
        lambda: sched.trigger_job(job_id, "acme", actor=ACTOR),
        lambda: sched.update_job(job_id, {"name": "x"}, "acme", actor=ACTOR),
        lambda: sched.reschedule_job(job_id, {"every": "1h"}, "acme", actor=ACTOR),
    ):
        with pytest.raises(errors.NotFound):
            change()
    assert sched.audit("acme", job_id=job_id).items[0].action == "delete"


def test_a_deleted_jobs_idempotency_key_creates_nothing(sched: Scheduler) -> None:
    body = {"schedule": {"every": "1h"}, "target": dict(QUEUE), "idempotency_key": "once"}
    job, created = sched.create_job("acme", body, actor=ACTOR)
    assert created
    sched.delete_job(job.job_id, "acme", actor=ACTOR)
    for again in (body, {**body, "name": "other"}):
        with pytest.raises(errors.Conflict) as caught:
            sched.create_job("acme", again, actor=ACTOR)
        assert caught.value.field == "idempotency_key" and job.job_id in caught.value.message
    assert sched.list_jobs("acme").items == ()


def test_a_deleted_jobs_queued_message_is_skipped_and_its_worker_stopped(
    sched: Scheduler,
) -> None:
    job_id = new_job(sched, max_concurrency=None)
    tenant_id = sched.get_tenant("acme").tenant_id
    repo = QueueRepo(sched.store)
    first = sched.trigger_job(job_id, "acme", actor=ACTOR)
    second = sched.trigger_job(job_id, "acme", actor=ACTOR)
    assert repo.move_outbox() == 2
    (lease,) = repo.lease("q", "w", 30, tenant_id=tenant_id)
    assert lease.scheduled_at == first.scheduled_at
    sched.delete_job(job_id, "acme", actor=ACTOR)
    # the running command is told to stop; the queued run is skipped, never leased
    assert repo.beat(lease, 30) is Beat.cancelled
    assert repo.lease("q", "w", 30, tenant_id=tenant_id) == []
    statuses = {r.scheduled_at: r.status for r in sched.runs(job_id, "acme").items}
    assert statuses[second.scheduled_at] is RunStatus.skipped


# -- CLI (local database and --api) and REST API ---------------------------------------


def cli(db_url: str, *args: str) -> Any:
    result = runner.invoke(cli_app, ["--db", db_url, *args])
    assert "Traceback" not in result.output, result.output
    return result


def test_cli_update_and_delete(sched: Scheduler, db_url: str) -> None:
    job_id = new_job(sched)
    result = cli(
        db_url,
        *f"job update {job_id} --tenant acme -o json --name n2 --max-attempts 5".split(),
        *"--timeout 1m --grace 2m --window 30s --misfire skip --max-concurrency 0".split(),
        *'--queue q2 --payload {"v":9} --tz Asia/Tokyo --base-delay 3s --max-delay 1h'.split(),
    )
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    assert job["name"] == "n2" and job["payload"] == {"v": 9}
    assert job["retry"]["max_attempts"] == 5 and job["retry"]["base_delay_seconds"] == 3
    assert job["target"] == {"type": "queue", "name": "q2"}
    assert job["schedule"] == {"kind": "cron", "cron": "0 8 * * MON", "timezone": "Asia/Tokyo"}
    stale = cli(db_url, "job", "update", job_id, "--name", "x", "--if-version", "1")
    assert stale.exit_code == 4, stale.output
    bad = cli(db_url, "job", "update", job_id, "--timeout", "soon")
    assert bad.exit_code == 2 and "timeout" in bad.output
    assert sched.get_job(job_id).name == "n2"
    sched.trigger_job(job_id, "acme", actor=ACTOR)
    deleted = cli(db_url, "job", "delete", job_id, "--if-version", str(job["version"]))
    assert deleted.exit_code == 0, deleted.output
    assert cli(db_url, "job", "show", job_id).exit_code == 3
    listed = cli(db_url, "job", "list", "--tenant", "acme", "-o", "json")
    assert json.loads(listed.stdout)["items"] == []
    runs = cli(db_url, "runs", job_id, "-o", "json")
    assert runs.exit_code == 0 and len(json.loads(runs.stdout)["items"]) == 1
    assert cli(db_url, "job", "delete", job_id).exit_code == 3


@pytest.fixture
def api(sched: Scheduler) -> Iterator[tuple[str, str]]:
    _, token = sched.create_tenant("remote", ACTOR)
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        yield server.url, token
    finally:
        server.stop()


def test_api_update_delete_and_the_cli_through_it(sched: Scheduler, api: tuple[str, str]) -> None:
    url, token = api
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    body = {"schedule": {"every": "1h"}, "target": dict(QUEUE), "idempotency_key": "k1"}
    job = session.post(url + "/v1/jobs", json=body, timeout=30).json()
    path = f"{url}/v1/jobs/{job['job_id']}"
    changed = session.patch(
        path,
        json={"payload": {"v": 2}, "retry": {"max_attempts": 4}, "window": "10s"},
        headers={"If-Match": str(job["version"])},
        timeout=30,
    )
    assert changed.status_code == 200, changed.text
    assert changed.json()["payload"] == {"v": 2} and changed.json()["retry"]["max_attempts"] == 4
    stale = session.patch(
        path, json={"name": "x"}, headers={"If-Match": f'"{job["version"]}"'}, timeout=30
    )
    assert stale.status_code == 409 and stale.json()["error"]["field"] == "version"
    bad = session.patch(path, json={"grace": "-1s"}, timeout=30)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "grace"
    assert (
        session.patch(path, json={"name": "x"}, headers={"If-Match": "v"}, timeout=30).status_code
        == 422
    )
    assert session.get(path, timeout=30).json() == changed.json()
    # the CLI with --api goes through the same routes
    base = ["--api", url, "--token", token]
    result = runner.invoke(
        cli_app, [*base, "job", "update", job["job_id"], "--name", "r2", "-ojson"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["name"] == "r2"
    refused = runner.invoke(
        cli_app, [*base, "job", "update", job["job_id"], "--name", "r3", "--if-version", "1"]
    )
    assert refused.exit_code == 4, refused.output
    session.post(path + "/trigger", timeout=30)
    result = runner.invoke(cli_app, [*base, "job", "delete", job["job_id"]])
    assert result.exit_code == 0, result.output
    assert session.get(path, timeout=30).status_code == 404
    assert session.delete(path, timeout=30).status_code == 404
    assert session.get(url + "/v1/jobs", timeout=30).json()["items"] == []
    runs = session.get(path + "/runs", timeout=30)
    assert runs.status_code == 200 and len(runs.json()["items"]) == 1
    again = session.post(url + "/v1/jobs", json=body, timeout=30)
    assert again.status_code == 409 and again.json()["error"]["field"] == "idempotency_key"
    # DELETE is 204 with no body
    other = session.post(url + "/v1/jobs", json={**body, "idempotency_key": "k2"}, timeout=30)
    gone = session.delete(f"{url}/v1/jobs/{other.json()['job_id']}", timeout=30)
    assert gone.status_code == 204 and gone.content == b""


def test_a_read_sends_the_version_as_etag_and_if_match_takes_it_or_a_star(
    sched: Scheduler, api: tuple[str, str]
) -> None:
    url, token = api
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    body = {"name": "tagged", "schedule": {"every": "1h"}, "target": dict(QUEUE)}
    job = session.post(url + "/v1/jobs", json=body, timeout=30).json()
    path = f"{url}/v1/jobs/{job['job_id']}"
    got = session.get(path, timeout=30)
    assert got.headers["ETag"] == f'"{job["version"]}"'
    assert (
        session.get(url + "/v1/jobs/by-name/tagged", timeout=30).headers["ETag"]
        == (got.headers["ETag"])
    )
    # the tag read, as a client sends it back
    changed = session.patch(
        path, json={"timeout": "5m"}, headers={"If-Match": got.headers["ETag"]}, timeout=30
    )
    assert changed.status_code == 200, changed.text
    assert changed.headers["ETag"] == f'"{changed.json()["version"]}"' != got.headers["ETag"]
    # the tag read before that change is stale: 409 and nothing changes
    stale = session.patch(
        path, json={"timeout": "9m"}, headers={"If-Match": got.headers["ETag"]}, timeout=30
    )
    assert stale.status_code == 409 and stale.json()["error"]["field"] == "version"
    # * matches whatever version the job has
    star = session.patch(path, json={"timeout": "7m"}, headers={"If-Match": "*"}, timeout=30)
    assert star.status_code == 200, star.text
    assert star.json()["timeout_seconds"] == 420
    assert star.headers["ETag"] == session.get(path, timeout=30).headers["ETag"]
    # but not a job that does not exist
    missing = f"{url}/v1/jobs/{'0' * len(job['job_id'])}"
    assert (
        session.patch(missing, json={"timeout": "7m"}, headers={"If-Match": "*"}, timeout=30)
    ).status_code == 404
    # a malformed tag is still a 422 naming the header
    bad = session.patch(path, json={"timeout": "7m"}, headers={"If-Match": "**"}, timeout=30)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "If-Match"
    assert session.get(path, timeout=30).json()["timeout_seconds"] == 420
    gone = session.delete(path, headers={"If-Match": "*"}, timeout=30)
    assert gone.status_code == 204
    assert session.get(path, timeout=30).status_code == 404


def test_update_and_delete_take_a_name_or_prefix_and_renames_stay_unique(
    sched: Scheduler,
) -> None:
    first = new_job(sched, name="nightly")
    second = new_job(sched, name="weekly")
    # by name, and by an id prefix
    assert sched.update_job("nightly", {"timeout": "5m"}, "acme", actor=ACTOR).job_id == first
    assert sched.update_job(second[:12], {"timeout": "5m"}, "acme", actor=ACTOR).job_id == second
    before = sched.get_job(second, "acme")
    with pytest.raises(errors.Conflict) as caught:
        sched.update_job(second, {"name": "nightly"}, "acme", actor=ACTOR)
    assert caught.value.field == "name"
    assert sched.get_job(second, "acme") == before  # nothing written
    # renaming a job to its own name is no conflict
    sched.update_job(second, {"name": "weekly"}, "acme", actor=ACTOR)
    sched.delete_job("nightly", "acme", actor=ACTOR)
    with pytest.raises(errors.NotFound):
        sched.get_job("nightly", "acme")
    # a deleted job's name is free again
    assert sched.update_job(second, {"name": "nightly"}, "acme", actor=ACTOR).name == "nightly"
