"""Owns the tests of job names and id prefixes (issue 10 item 3): names unique per tenant
among jobs not deleted (create, the rename check, concurrent creates, the migration that
renames old duplicates), lookup by id, name or prefix through the library, the CLI (direct
and --api) and the REST API's by-name route, and the shortest unique prefixes tables show."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from typing import Any

import pytest
import requests
from sqlalchemy import select, update
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app
from schedctl.core import errors
from schedctl.domain.job_refs import shortest_among
from schedctl.storage.db import schema
from schedctl.storage.db.engine import make_engine
from schedctl.storage.db.migrate import head_revision, upgrade
from schedctl.storage.jobs import job_create
from scheduled_d.api.server import ApiServer
from tests.factories import insert_cron_job_row, insert_tenant_row
from tests.integration.api_support import job_body

ACTOR = "test"
runner = CliRunner()


def body(**overrides: Any) -> dict[str, Any]:
    # on queue "q": default names are made from the target
    return job_body(**{"target": {"type": "queue", "name": "q"}, **overrides})


@pytest.fixture
def acme(sched: Scheduler) -> str:
    sched.create_tenant("acme", ACTOR)
    return "acme"


def set_id(sched: Scheduler, job_id: str, new_id: str) -> None:
    # ids are random after their time part: a test needing ids with a shared prefix sets them
    with sched.store.tx() as connection:
        connection.execute(
            update(schema.jobs).where(schema.jobs.c.job_id == job_id).values(job_id=new_id)
        )


def mark_deleted(sched: Scheduler, job_id: str) -> None:
    # JobStatus.deleted comes with the delete command (another branch): set it directly
    with sched.store.tx() as connection:
        connection.execute(
            update(schema.jobs).where(schema.jobs.c.job_id == job_id).values(status="deleted")
        )


# -- uniqueness ------------------------------------------------------------------------


def test_a_duplicate_name_is_refused_and_writes_nothing(sched: Scheduler, acme: str) -> None:
    first, _ = sched.create_job(acme, body(name="nightly-backup"), actor=ACTOR)
    with pytest.raises(errors.Conflict) as caught:
        sched.create_job(acme, body(name="nightly-backup", payload={"x": 1}), actor=ACTOR)
    assert caught.value.field == "name" and caught.value.exit_code == 4
    assert caught.value.http_status == 409 and first.job_id in str(caught.value)
    assert [j.job_id for j in sched.list_jobs(acme).items] == [first.job_id]


def test_names_are_per_tenant_and_a_deleted_jobs_name_is_free(sched: Scheduler, acme: str) -> None:
    sched.create_tenant("other", ACTOR)
    mine, _ = sched.create_job(acme, body(name="nightly"), actor=ACTOR)
    theirs, _ = sched.create_job("other", body(name="nightly"), actor=ACTOR)
    assert mine.job_id != theirs.job_id
    mark_deleted(sched, mine.job_id)
    again, _ = sched.create_job(acme, body(name="nightly"), actor=ACTOR)
    assert sched.resolve_job(acme, "nightly") == again.job_id
    # the deleted job's id still resolves (its history stays readable by id)
    assert sched.resolve_job(acme, mine.job_id) == mine.job_id


def test_the_rename_check(sched: Scheduler, acme: str) -> None:
    a, _ = sched.create_job(acme, body(name="a"), actor=ACTOR)
    sched.create_job(acme, body(name="b"), actor=ACTOR)
    sched.check_job_name_free(acme, "a", except_job_id=a.job_id)  # its own name
    sched.check_job_name_free(acme, "c", except_job_id=a.job_id)
    with pytest.raises(errors.Conflict) as caught:
        sched.check_job_name_free(acme, "b", except_job_id=a.job_id)
    assert caught.value.field == "name"


def test_the_database_refuses_a_duplicate_any_path_writes(sched: Scheduler, acme: str) -> None:
    sched.create_job(acme, body(name="a"), actor=ACTOR)
    b, _ = sched.create_job(acme, body(name="b"), actor=ACTOR)
    with pytest.raises(Exception, match=r"(?i)unique"):
        with sched.store.tx() as connection:
            connection.execute(
                update(schema.jobs).where(schema.jobs.c.job_id == b.job_id).values(name="a")
            )
    assert sched.get_job(b.job_id, acme).name == "b"


def test_default_names_never_collide(sched: Scheduler, acme: str) -> None:
    one, _ = sched.create_job(acme, body(), actor=ACTOR)
    two, _ = sched.create_job(acme, body(), actor=ACTOR)
    assert one.name == f"q-cron-{one.job_id[-6:]}" and two.name == f"q-cron-{two.job_id[-6:]}"
    # an idempotent replay answers with the same job and name
    key = body(idempotency_key="k1")
    first, created = sched.create_job(acme, key, actor=ACTOR)
    replay, again = sched.create_job(acme, key, actor=ACTOR)
    assert created and not again and replay.name == first.name


@pytest.mark.postgres
def test_concurrent_creates_with_one_name_one_wins(pg_url: str) -> None:
    with Scheduler.open(pg_url) as sched:
        sched.create_tenant("acme", ACTOR)
        results: list[str] = []
        lock = threading.Lock()
        barrier = threading.Barrier(6, timeout=60)

        def create(i: int) -> None:
            barrier.wait()
            try:
                sched.create_job("acme", body(name="race", payload={"i": i}), actor=ACTOR)
                outcome = "created"
            except errors.Conflict as exc:
                assert exc.field == "name", exc
                outcome = "conflict"
            with lock:
                results.append(outcome)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert sorted(results) == ["conflict"] * 5 + ["created"]
        assert len(sched.list_jobs("acme").items) == 1


def _race_names(
    sched: Scheduler, monkeypatch: pytest.MonkeyPatch, names: Any
) -> tuple[list[int], list[str]]:
    """After each read of keys and names by this thread's creates, another create commits
    a job named `names(batch, ids)` (the names this create is about to use) before this
    one inserts. Answers how many reads there were (one: no pass ran again) and what the
    other creates answered."""
    read = job_create._Batch._existing_keys_and_taken_names
    main = threading.current_thread()
    reads: list[int] = []
    others: list[str] = []

    def take(name: str) -> None:
        try:
            sched.create_job("acme", body(name=name), actor=ACTOR)
            others.append("created")
        except errors.Conflict as exc:
            others.append(f"conflict on {exc.field}")

    def racing_read(batch: Any, ids: Any) -> Any:
        found = read(batch, ids)
        if threading.current_thread() is main:
            reads.append(1)
            for name in names(batch, ids):
                other = threading.Thread(target=take, args=(name,), daemon=True)
                other.start()
                other.join(timeout=30)
        return found

    monkeypatch.setattr(job_create._Batch, "_existing_keys_and_taken_names", racing_read)
    return reads, others


@pytest.mark.postgres
def test_a_default_name_taken_meanwhile_becomes_the_long_form(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another create commits the exact default name a create read as free, before that
    create's insert: the job is written under the long default name (the whole id) in the
    same pass. Before, the insert failed, the whole transaction ran again, and a batch that
    lost three passes was refused with a name conflict it never asked for."""
    with Scheduler.open(pg_url) as sched:
        sched.create_tenant("acme", ACTOR)
        reads, others = _race_names(
            sched,
            monkeypatch,
            lambda batch, ids: [job_create._auto_name(batch.items[0].spec.name, ids[0])],
        )
        job, created = sched.create_job("acme", body(), actor=ACTOR)
        monkeypatch.undo()
        assert created and others == ["created"] and reads == [1]
        assert job.name == f"q-cron-{job.job_id}"
        jobs = sched.list_jobs("acme").items
        assert len(jobs) == 2 and len({j.name for j in jobs}) == 2
        # what was written is what the answer said, audit entry and all
        assert sched.get_job(job.job_id, "acme").name == job.name


@pytest.mark.postgres
def test_a_given_name_taken_meanwhile_refuses_that_job_alone(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Scheduler.open(pg_url) as sched:
        sched.create_tenant("acme", ACTOR)
        reads, others = _race_names(sched, monkeypatch, lambda batch, ids: ["wanted"])
        outcomes = sched.create_many(
            "acme", [body(name="wanted"), body(name="free"), body()], actor=ACTOR
        )
        monkeypatch.undo()
        assert others == ["created"] and reads == [1]
        refused, free, default = outcomes
        assert refused.error is not None and refused.error.field == "name", refused
        assert free.job is not None and free.job.name == "free" and free.created
        assert default.job is not None and default.created
        names = sorted(j.name for j in sched.list_jobs("acme").items)
        assert names == sorted(["wanted", "free", default.job.name])


# -- lookup ----------------------------------------------------------------------------


def test_resolution_order_and_prefixes(sched: Scheduler, acme: str) -> None:
    a, _ = sched.create_job(acme, body(name="alpha"), actor=ACTOR)
    b, _ = sched.create_job(acme, body(name="beta"), actor=ACTOR)
    set_id(sched, a.job_id, "0123456789ab" + "0" * 20)
    set_id(sched, b.job_id, "0123456789ab" + "1" * 20)
    a_id, b_id = "0123456789ab" + "0" * 20, "0123456789ab" + "1" * 20
    assert sched.resolve_job(acme, a_id) == a_id
    assert sched.resolve_job(acme, "beta") == b_id
    assert sched.resolve_job(acme, "0123456789ab1") == b_id
    assert sched.get_job("0123456789ab0", acme).name == "alpha"
    with pytest.raises(errors.ValidationError) as caught:
        sched.resolve_job(acme, "0123456789")
    assert caught.value.field == "job" and a_id in str(caught.value) and b_id in str(caught.value)
    # too short a prefix, another tenant's name, nothing: NotFound
    sched.create_tenant("other", ACTOR)
    for ref in ("01234", "nope"):
        with pytest.raises(errors.NotFound):
            sched.resolve_job(acme, ref)
    with pytest.raises(errors.NotFound):
        sched.get_job("alpha", "other")
    # an exact name wins over a prefix: a job named like another's id prefix
    c, _ = sched.create_job(acme, body(name="0123456789ab1"), actor=ACTOR)
    assert sched.resolve_job(acme, "0123456789ab1") == c.job_id
    # every job command takes a reference
    assert sched.pause_job("alpha", acme, actor=ACTOR).status.value == "paused"
    assert sched.resume_job("alpha", acme, actor=ACTOR).status.value == "active"
    assert sched.runs("alpha", acme).items == ()
    assert sched.audit(acme, job_id="alpha").items[0].job_id == a_id


def test_shortest_prefixes(sched: Scheduler, acme: str) -> None:
    ids = ["0123456789ab" + s for s in ("0" * 20, "01" + "0" * 18, "f" * 20)]
    for job_id in ids:
        job, _ = sched.create_job(acme, body(), actor=ACTOR)
        set_id(sched, job.job_id, job_id)
    short = sched.short_job_ids(acme, ids)
    assert short == {ids[0]: ids[0][:14], ids[1]: ids[1][:14], ids[2]: ids[2][:13]}
    # among the rows only (--api), a lone id needs 8 characters
    assert shortest_among([ids[2]]) == {ids[2]: ids[2][:8]}
    for job_id, prefix in short.items():
        assert sched.resolve_job(acme, prefix) == job_id


# -- CLI -------------------------------------------------------------------------------


def cli(db: str | None, *args: str) -> Any:
    argv = (["--db", db] if db else []) + list(args)
    result = runner.invoke(app, argv)
    assert "Traceback" not in result.output, result.output
    return result


def test_cli_by_name_prefix_and_errors(db_url: str) -> None:
    assert cli(db_url, "tenant", "create", "acme").exit_code == 0
    create = ["job", "create", "--tenant", "acme", "--cron", "@daily", "--queue", "q"]
    made = cli(db_url, *create, "--name", "nightly-backup", "--output", "json")
    assert made.exit_code == 0, made.output
    job_id = json.loads(made.stdout)["job_id"]
    dup = cli(db_url, *create, "--name", "nightly-backup")
    assert dup.exit_code == 4 and "name" in dup.output
    shown = cli(db_url, "job", "show", "nightly-backup", "--tenant", "acme", "--output", "json")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["job_id"] == job_id
    for command in (["job", "pause"], ["job", "resume"], ["job", "trigger"], ["runs"]):
        result = cli(db_url, *command, job_id[:14], "--tenant", "acme")
        assert result.exit_code == 0, (command, result.output)
    rescheduled = cli(
        db_url, "job", "reschedule", "nightly-backup", "--tenant", "acme", "--cron", "@hourly"
    )
    assert rescheduled.exit_code == 0, rescheduled.output
    assert cli(db_url, "job", "show", "missing", "--tenant", "acme").exit_code == 3
    listed = cli(db_url, "job", "list", "--tenant", "acme")
    assert listed.exit_code == 0 and job_id[:8] in listed.stdout
    assert job_id not in listed.stdout  # the shortest unique prefix, not the whole id
    # an ambiguous prefix: exit 2, naming the field and the candidates
    with Scheduler.open(db_url) as sched:
        other, _ = sched.create_job("acme", body(name="second"), actor=ACTOR)
        twin = job_id[:10] + "f" * 22
        set_id(sched, other.job_id, twin)
    result = cli(db_url, "job", "show", job_id[:10], "--tenant", "acme")
    assert result.exit_code == 2 and "job" in result.output and twin in result.output
    assert cli(db_url, "job", "cancel", "second", "--tenant", "acme").exit_code == 0
    audit = cli(db_url, "audit", "--tenant", "acme", "--job", "second", "--output", "json")
    assert audit.exit_code == 0 and twin in audit.stdout


# -- REST API --------------------------------------------------------------------------


def test_api_by_name_and_references(sched: Scheduler) -> None:
    _, token = sched.create_tenant("acme", ACTOR)
    _, other_token = sched.create_tenant("other", ACTOR)
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {token}"
        made = session.post(server.url + "/v1/jobs", json=body(name="nightly/backup"), timeout=30)
        assert made.status_code == 201, made.text
        job_id = made.json()["job_id"]
        dup = session.post(server.url + "/v1/jobs", json=body(name="nightly/backup"), timeout=30)
        assert dup.status_code == 409 and dup.json()["error"]["field"] == "name", dup.text
        got = session.get(server.url + "/v1/jobs/by-name/nightly%2Fbackup", timeout=30)
        assert got.status_code == 200 and got.json()["job_id"] == job_id
        assert session.get(server.url + "/v1/jobs/by-name/none", timeout=30).status_code == 404
        # the id routes take a prefix (and a name without a slash)
        assert session.get(server.url + f"/v1/jobs/{job_id[:12]}", timeout=30).status_code == 200
        theirs = requests.get(
            server.url + "/v1/jobs/by-name/nightly%2Fbackup",
            headers={"Authorization": f"Bearer {other_token}"},
            timeout=30,
        )
        assert theirs.status_code == 404
        # the CLI through the API: by name (with a slash) and by prefix
        api = ["--api", server.url, "--token", token]
        shown = cli(None, *api, "job", "show", "nightly/backup", "--output", "json")
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["job_id"] == job_id
        paused = cli(None, *api, "job", "pause", job_id[:12])
        assert paused.exit_code == 0, paused.output
        listed = cli(None, *api, "job", "list")
        assert listed.exit_code == 0 and job_id[:8] in listed.stdout
    finally:
        server.stop()


# -- migration -------------------------------------------------------------------------


def test_migration_renames_duplicate_names(empty_url_any: str) -> None:
    url = empty_url_any
    upgrade(url, "0007")
    engine = make_engine(url)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [
        ("j1", "t1", "nightly", "active"),
        ("j2", "t1", "nightly", "paused"),
        ("j3", "t1", "nightly", "cancelled"),
        ("j4", "t1", "nightly-2", "active"),  # the first free suffix is then -3
        ("j5", "t2", "nightly", "active"),
        ("j6", "t1", "old", "deleted"),
        ("j7", "t1", "old", "deleted"),
    ]
    try:
        with engine.begin() as connection:
            for tenant in ("t1", "t2"):
                insert_tenant_row(connection, tenant, f"name-{tenant}", created_at=now, quota=10)
            for job_id, tenant, name, status in rows:
                insert_cron_job_row(
                    connection, job_id, tenant, queue="q", at=now, name=name, status=status
                )
    finally:
        engine.dispose()
    assert upgrade(url)[1] == head_revision()
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            result = connection.execute(select(schema.jobs.c.job_id, schema.jobs.c.name))
            names = {job_id: name for job_id, name in result}
    finally:
        engine.dispose()
    assert names == {
        "j1": "nightly",
        "j2": "nightly-3",
        "j3": "nightly-4",
        "j4": "nightly-2",
        "j5": "nightly",
        "j6": "old",
        "j7": "old",
    }


@pytest.fixture(
    params=["empty_sqlite_url", pytest.param("empty_pg_url", marks=pytest.mark.postgres)]
)
def empty_url_any(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url
