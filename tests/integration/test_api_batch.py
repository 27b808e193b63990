"""Owns the tests of POST /v1/jobs:batch over SQLite and Postgres (a real uvicorn on 127.0.0.1):
one result per job in the order sent, refused jobs write nothing, idempotent replay per job
(also inside one batch), the envelope's own 422s, quotas within a batch, and tenant
isolation."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import requests
from sqlalchemy import func, select

from schedctl.app.service import Scheduler
from schedctl.storage.db import schema
from tests.integration.api_support import Api, job_body, snapshot

BATCH = "/v1/jobs:batch"


def batch(api: Api, jobs: list[Any]) -> list[dict[str, Any]]:
    response = api.request("POST", BATCH, json={"jobs": jobs})
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    assert [r["index"] for r in results] == list(range(len(jobs)))
    return results


def count(sched: Scheduler, table: Any, tenant: str | None = None) -> int:
    query = select(func.count()).select_from(table)
    if tenant is not None:
        query = query.where(table.c.tenant_id == sched.get_tenant(tenant).tenant_id)
    with sched.store.read() as connection:
        return int(connection.execute(query).scalar_one())


def test_mixed_batch_one_result_each_and_refused_jobs_write_nothing(
    sched: Scheduler, acme: Api
) -> None:
    jobs = [
        job_body(name="first"),
        job_body(schedule={"run_at": "2001-01-01T00:00:00Z"}),  # in the past
        job_body(target={"type": "queue", "name": "bad name"}),
        "not an object",
        job_body(name="first"),  # the name is taken by the first job of this batch
        job_body(schedule={"cron": "0 8 * * MON", "timezone": "Mars/Olympus"}),
        job_body(name="last", idempotency_key="k-last"),
    ]
    results = batch(acme, jobs)
    assert [r["status"] for r in results] == [201, 422, 422, 422, 409, 422, 201]
    fields = [r["error"]["field"] if "error" in r else None for r in results]
    assert fields == [None, "run_at", "target.name", "body", "name", "timezone", None]
    for result in results[1:6]:
        assert set(result["error"]) == {"code", "message", "field"}
        assert "job" not in result
    assert results[0]["job"]["name"] == "first"
    assert results[6]["job"]["idempotency_key"] == "k-last"
    # exactly the two created jobs, each with its create audit entry
    assert count(sched, schema.jobs) == 2
    with sched.store.read() as connection:
        audited = connection.execute(
            select(schema.audit_log.c.job_id).where(schema.audit_log.c.job_id.is_not(None))
        ).scalars()
        assert sorted(audited) == sorted(results[i]["job"]["job_id"] for i in (0, 6))
    for created in (results[0], results[6]):
        shown = acme.request("GET", f"/v1/jobs/{created['job']['job_id']}").json()
        assert shown == created["job"]


def test_idempotent_replay_per_job(sched: Scheduler, acme: Api) -> None:
    jobs = [job_body(idempotency_key=f"k{i}", payload={"i": i}) for i in range(3)]
    first = batch(acme, jobs)
    assert [r["status"] for r in first] == [201, 201, 201]
    # the same batch again: every job replayed, nothing new
    again = batch(acme, jobs)
    assert [r["status"] for r in again] == [200, 200, 200]
    assert [r["job"]["job_id"] for r in again] == [r["job"]["job_id"] for r in first]
    # a key with another body is 409 for that job only; a new key is created
    changed = [jobs[0], {**jobs[1], "payload": {"i": "other"}}, job_body(idempotency_key="k9")]
    results = batch(acme, changed)
    assert [r["status"] for r in results] == [200, 409, 201]
    assert results[1]["error"]["field"] == "idempotency_key"
    # one key twice in one batch: created once, then replayed; another body is 409
    dup = [
        job_body(idempotency_key="dup"),
        job_body(idempotency_key="dup"),
        job_body(idempotency_key="dup", payload={"x": 1}),
    ]
    results = batch(acme, dup)
    assert [r["status"] for r in results] == [201, 200, 409]
    assert results[0]["job"]["job_id"] == results[1]["job"]["job_id"]
    # a single POST with a key a batch used replays that job
    single = acme.create(job_body(idempotency_key="k2", payload={"i": 2}))
    assert single.status_code == 200
    assert single.json()["job_id"] == first[2]["job"]["job_id"]
    assert count(sched, schema.jobs) == 5


@pytest.mark.parametrize(
    ("prefer", "minimal"),
    [
        ("return=minimal", True),
        ('respond-async, RETURN="minimal"; x=y', True),
        ("return=representation", False),
        (None, False),
        ("return", False),
        (",,;=", False),
    ],
)
def test_prefer_return_minimal_answers_ids_and_names(
    acme: Api, prefer: str | None, minimal: bool
) -> None:
    """RFC 7240: with return=minimal a created or replayed job's result is its id and name,
    an error's is unchanged, and Preference-Applied says so; any other Prefer gets whole
    jobs. Fails when the preference is ignored, misread, or a result loses its status."""
    jobs = [
        job_body(name="m1", idempotency_key="m1"),
        job_body(target={"type": "queue", "name": "bad name"}),
    ]
    headers = {} if prefer is None else {"Prefer": prefer}
    for expected in (201, 200):  # created, then replayed
        response = acme.request("POST", BATCH, json={"jobs": jobs}, headers=headers)
        assert response.status_code == 200, response.text
        ok, refused = response.json()["results"]
        assert refused["status"] == 422 and refused["error"]["field"] == "target.name"
        assert ok["status"] == expected
        job_id = acme.request("GET", "/v1/jobs/m1").json()["job_id"]
        if minimal:
            assert response.headers["Preference-Applied"] == "return=minimal"
            assert ok == {"index": 0, "status": expected, "job_id": job_id, "name": "m1"}
        else:
            assert "Preference-Applied" not in response.headers
            assert (ok["job"]["job_id"], ok["job"]["name"]) == (job_id, "m1")
            assert "job_id" not in ok


@pytest.mark.parametrize(
    ("envelope", "field"),
    [
        ({"jobs": [job_body()] * 1001}, "jobs"),
        ({"jobs": []}, "jobs"),
        ({"jobs": job_body()}, "jobs"),
        ({}, "jobs"),
        ([job_body()], "body"),
        ({"jobs": [job_body()], "extra": 1}, "extra"),
    ],
    ids=["over-1000", "empty", "not-a-list", "missing", "not-an-object", "unknown-key"],
)
def test_a_bad_envelope_is_422_naming_the_field_and_writes_nothing(
    sched: Scheduler, acme: Api, envelope: Any, field: str
) -> None:
    before = snapshot(sched.store)
    response = acme.request("POST", BATCH, json=envelope)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert error["field"] == field
    assert snapshot(sched.store) == before


def test_malformed_json_is_400(acme: Api) -> None:
    response = acme.request(
        "POST", BATCH, data="{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "body"


def test_max_jobs_quota_holds_within_a_batch(sched: Scheduler, acme: Api) -> None:
    sched.set_quotas("acme", max_jobs=3, actor="test")
    acme.new_job()
    results = batch(acme, [job_body(payload={"i": i}) for i in range(4)])
    assert [r["status"] for r in results] == [201, 201, 429, 429]
    assert {r["error"]["field"] for r in results[2:]} == {"max_jobs"}
    assert all(r["retry_after"] >= 1 for r in results[2:])
    assert count(sched, schema.jobs) == 3
    # a replay is no new job: allowed while full
    results = batch(acme, [job_body(payload={"i": 0})])
    assert [r["status"] for r in results] == [429]


def test_create_rate_quota_holds_within_a_batch(sched: Scheduler, acme: Api) -> None:
    sched.set_quotas("acme", create_rate_per_minute=2, actor="test")
    jobs = [job_body(idempotency_key=f"r{i}") for i in range(3)]
    results = batch(acme, jobs)
    assert [r["status"] for r in results] == [201, 201, 429]
    assert results[2]["error"]["field"] == "create_rate_per_minute"
    assert count(sched, schema.jobs) == 2
    # the created ones replay even over the rate
    assert [r["status"] for r in batch(acme, jobs[:2])] == [200, 200]


def test_a_token_creates_only_in_its_own_tenant(sched: Scheduler, acme: Api, other: Api) -> None:
    results = batch(other, [job_body(idempotency_key="same"), job_body(name="mine")])
    assert [r["status"] for r in results] == [201, 201]
    other_id = sched.get_tenant("other").tenant_id
    assert {r["job"]["tenant_id"] for r in results} == {other_id}
    for result in results:
        response = acme.request("GET", f"/v1/jobs/{result['job']['job_id']}")
        assert response.status_code == 404
    # keys and names are per tenant: acme's own are free
    mine = batch(acme, [job_body(idempotency_key="same"), job_body(name="mine")])
    assert [r["status"] for r in mine] == [201, 201]
    assert count(sched, schema.jobs, "acme") == 2
    assert count(sched, schema.jobs, "other") == 2
    # no token, no batch
    anonymous = requests.post(f"{acme.base_url}{BATCH}", json={"jobs": [job_body()]}, timeout=30)
    assert anonymous.status_code == 401


def test_dependent_jobs_in_a_batch(sched: Scheduler, acme: Api) -> None:
    jobs = [
        job_body(name="up"),
        {"after": ["up"], "target": job_body()["target"], "name": "down"},
        {"after": ["nowhere"], "target": job_body()["target"], "name": "orphan"},
        job_body(name="orphan"),  # the refused job's name stays free
    ]
    results = batch(acme, jobs)
    assert [r["status"] for r in results] == [201, 201, 404, 201]
    assert results[2]["error"]["field"] == "after"
    graph = acme.request("GET", f"/v1/jobs/{results[1]['job']['job_id']}/dependencies").json()
    assert [n["name"] for n in graph["upstream"]] == ["up"]
    assert count(sched, schema.jobs) == 3


def test_concurrent_single_creates_are_each_answered_as_if_in_turn(sched: Scheduler) -> None:
    """Concurrent creates of one tenant share transactions (schedctl/app/create_combiner.py):
    each still gets its own job, its own refusal, and its own audit actor."""
    tenant, _ = sched.create_tenant("busy", "test")
    sched.set_quotas("busy", max_jobs=30, actor="test")
    results: dict[int, Any] = {}

    def create(i: int) -> None:
        # 40 distinct jobs and 8 that reuse key k0 with its body: 30 slots in all
        key = "k0" if i >= 40 else f"k{i}"
        body = job_body(idempotency_key=key, payload={"i": 0 if i >= 40 else i})
        try:
            results[i] = sched.create_job(tenant, body, actor=f"token:t{i}")
        except Exception as exc:  # a refusal is this thread's answer
            results[i] = exc

    threads = [threading.Thread(target=create, args=(i,)) for i in range(48)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 48
    created = {i: r[0] for i, r in results.items() if isinstance(r, tuple) and r[1]}
    refused = [r for r in results.values() if isinstance(r, Exception)]
    assert len(created) == 30
    assert {getattr(r, "field", None) for r in refused} == {"max_jobs"}
    # k0 made one job at most, and every create of it that was answered got that job
    k0 = {
        r[0].job_id for i, r in results.items() if isinstance(r, tuple) and i in {0, *range(40, 48)}
    }
    assert len(k0) <= 1
    assert count(sched, schema.jobs, "busy") == 30
    with sched.store.read() as connection:
        actors = dict(
            connection.execute(
                select(schema.audit_log.c.job_id, schema.audit_log.c.actor).where(
                    schema.audit_log.c.job_id.is_not(None)
                )
            ).all()
        )
    assert {actors[job.job_id] for job in created.values()} == {f"token:t{i}" for i in created}
