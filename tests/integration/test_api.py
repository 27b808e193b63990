"""Owns the tests of the tenant REST API (scheduled_d.api) served by a real uvicorn on 127.0.0.1
over SQLite and Postgres: the /v1 contract, tenant isolation on every endpoint, idempotency,
stable paging, quotas, size limits, tokens, the audit log, payloads kept out of logs and
encrypted at rest, and the error shape of every failure."""

from __future__ import annotations

import base64
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from prometheus_client import REGISTRY
from sqlalchemy import select, update
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app as cli_app
from schedctl.core.crypto import KEYS_ENV, PayloadCipher, is_encrypted
from schedctl.core.ssrf import normalize_entry
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.payloads import configure_payload_cipher, reset_payload_cipher
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.tenants.tenant_delivery import TenantDeliveryRepo
from scheduled_d.api.server import ApiServer
from tests.integration.api_support import MARKER, QUEUE, Api, job_body, serving, snapshot

runner = CliRunner()


def stored_payload(store: Store, job_id: str) -> str:
    with store.read() as connection:
        value = connection.execute(
            select(schema.jobs.c.payload).where(schema.jobs.c.job_id == job_id)
        ).scalar_one()
    assert isinstance(value, str)
    return value


def assert_error(response: requests.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "field"}
    assert body["error"]["code"] == code and body["error"]["message"]
    error: dict[str, Any] = body["error"]
    return error


# -- the contract ----------------------------------------------------------------------


def test_create_show_and_list(acme: Api) -> None:
    response = acme.create(
        job_body(
            schedule={"cron": "0 8 * * MON", "timezone": "Asia/Kolkata"},
            payload={"report": "weekly"},
            retry={"max_attempts": 5, "backoff": "exponential"},
            misfire_policy="skip",
            window="PT5M",
        )
    )
    assert response.status_code == 201, response.text
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['job_id']}"
    assert job["status"] == "active" and job["next_run_at"].endswith("Z")
    assert job["schedule"] == {"kind": "cron", "cron": "0 8 * * MON", "timezone": "Asia/Kolkata"}
    assert job["payload"] == {"report": "weekly"} and job["retry"]["max_attempts"] == 5
    assert job["window_seconds"] == 300 and job["misfire_policy"] == "skip"
    assert acme.request("GET", f"/v1/jobs/{job['job_id']}").json() == job
    listed = acme.request("GET", "/v1/jobs").json()
    assert listed == {"items": [job], "next_cursor": None}


def test_run_at_and_delay_schedules(acme: Api) -> None:
    at = acme.new_job(job_body(schedule={"run_at": "2099-10-12T08:00:00+05:30"}))
    assert at["next_run_at"] == "2099-10-12T02:30:00Z"
    later = acme.new_job(job_body(schedule={"delay": "PT10M"}))
    assert later["schedule"]["kind"] == "once"


def test_whoami_and_healthz(acme: Api, server: ApiServer) -> None:
    me = acme.request("GET", "/v1/tenant").json()
    assert me["name"] == "acme" and me["token_id"] == acme.token_id
    assert me["max_jobs"] > 0 and me["create_rate_per_minute"] > 0
    health = requests.get(server.url + "/healthz", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_pause_resume_trigger_and_runs_newest_first(acme: Api) -> None:
    job = acme.new_job(job_body(schedule={"every": "1h"}))
    path = f"/v1/jobs/{job['job_id']}"
    paused = acme.request("POST", path + "/pause")
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    assert_error(acme.request("POST", path + "/pause"), 409, "conflict")
    resumed = acme.request("POST", path + "/resume")
    assert resumed.status_code == 200 and resumed.json()["status"] == "active"
    assert resumed.json()["version"] == job["version"] + 2
    runs = []
    for _ in range(3):
        response = acme.request("POST", path + "/trigger")
        assert response.status_code == 202, response.text
        run = response.json()
        assert run["trigger"] == "manual" and run["status"] == "dispatched"
        assert run["idempotency_key"] == f"{job['job_id']}:{run['scheduled_at']}"
        runs.append(run)
    first = acme.request("GET", path + "/runs", params={"limit": 2}).json()
    assert [r["scheduled_at"] for r in first["items"]] == [
        runs[2]["scheduled_at"],
        runs[1]["scheduled_at"],
    ]
    rest = acme.request("GET", path + "/runs", params={"cursor": first["next_cursor"]}).json()
    assert [r["scheduled_at"] for r in rest["items"]] == [runs[0]["scheduled_at"]]
    assert rest["next_cursor"] is None


def test_reschedule(acme: Api) -> None:
    job = acme.new_job()
    path = f"/v1/jobs/{job['job_id']}"
    response = acme.request(
        "PATCH", path, json={"schedule": {"cron": "30 9 * * *", "timezone": "Europe/Paris"}}
    )
    assert response.status_code == 200, response.text
    changed = response.json()
    assert changed["schedule"] == {"kind": "cron", "cron": "30 9 * * *", "timezone": "Europe/Paris"}
    assert changed["version"] == job["version"] + 1
    assert changed["next_run_at"] != job["next_run_at"]
    assert_error(
        acme.request("PATCH", path, json={"schedule": {"cron": "99 * * * *"}}), 422, "invalid"
    )
    error = assert_error(acme.request("PATCH", path, json={"start": "x"}), 422, "invalid")
    assert error["field"] == "start"
    error = assert_error(acme.request("PATCH", path, json={}), 422, "invalid")
    assert error["field"] == "body"
    assert acme.request("GET", path).json() == changed


def test_cancel_keeps_the_job_listed(acme: Api) -> None:
    job = acme.new_job()
    path = f"/v1/jobs/{job['job_id']}"
    cancelled = acme.request("POST", path + "/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["next_run_at"] is None
    assert acme.request("GET", path).json() == cancelled
    assert_error(acme.request("POST", path + "/cancel"), 409, "conflict")
    assert_error(acme.request("POST", path + "/trigger"), 409, "conflict")
    assert_error(acme.request("POST", path + "/resume"), 409, "conflict")


# -- isolation: another tenant's job is 404 on every endpoint --------------------------

JOB_ENDPOINTS = {
    "get": ("GET", "", None),
    "reschedule": ("PATCH", "", {"schedule": {"delay": "1h"}}),
    "delete": ("DELETE", "", None),
    "cancel": ("POST", "/cancel", None),
    "pause": ("POST", "/pause", None),
    "resume": ("POST", "/resume", None),
    "trigger": ("POST", "/trigger", None),
    "runs": ("GET", "/runs", None),
}


@pytest.mark.parametrize("state", ["active", "paused"])
@pytest.mark.parametrize(
    ("method", "suffix", "body"), JOB_ENDPOINTS.values(), ids=JOB_ENDPOINTS.keys()
)
def test_another_tenants_job_is_404_on_every_endpoint(
    sched: Scheduler,
    acme: Api,
    other: Api,
    state: str,
    method: str,
    suffix: str,
    body: dict[str, Any] | None,
) -> None:
    job = acme.new_job()
    if state == "paused":
        assert acme.request("POST", f"/v1/jobs/{job['job_id']}/pause").status_code == 200
    before = snapshot(sched.store)
    theirs = other.request(method, f"/v1/jobs/{job['job_id']}{suffix}", json=body)
    error = assert_error(theirs, 404, "not_found")
    # exactly what an id that exists nowhere gets: the answer is no oracle
    missing_id = "0" * len(job["job_id"])
    missing = other.request(method, f"/v1/jobs/{missing_id}{suffix}", json=body)
    assert assert_error(missing, 404, "not_found") == {
        **error,
        "message": error["message"].replace(job["job_id"], missing_id),
    }
    assert snapshot(sched.store) == before
    # and the owner can do it (so the 404 was about the tenant, not the job's state)
    owner = acme.request(method, f"/v1/jobs/{job['job_id']}{suffix}", json=body)
    expected_ok = not (
        (suffix == "/pause" and state == "paused") or (suffix == "/resume" and state == "active")
    )
    assert (owner.status_code < 300) == expected_ok, owner.text


def test_listing_and_idempotency_keys_are_per_tenant(acme: Api, other: Api) -> None:
    mine = acme.create(job_body(), **{"Idempotency-Key": "shared-key"}).json()
    theirs = other.create(job_body(), **{"Idempotency-Key": "shared-key"})
    assert theirs.status_code == 201 and theirs.json()["job_id"] != mine["job_id"]
    assert [j["job_id"] for j in other.request("GET", "/v1/jobs").json()["items"]] == [
        theirs.json()["job_id"]
    ]
    assert [j["job_id"] for j in acme.request("GET", "/v1/jobs").json()["items"]] == [
        mine["job_id"]
    ]


# -- idempotency -----------------------------------------------------------------------


def test_idempotency_key_same_body_same_job_other_body_409(sched: Scheduler, acme: Api) -> None:
    body = job_body(payload={"a": 1})
    first = acme.create(body, **{"Idempotency-Key": "nightly-1"})
    assert first.status_code == 201
    before = snapshot(sched.store)
    again = acme.create(dict(body), **{"Idempotency-Key": "nightly-1"})
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["job_id"] == first.json()["job_id"]
    assert again.json() == first.json()
    conflict = acme.create(job_body(payload={"a": 2}), **{"Idempotency-Key": "nightly-1"})
    error = assert_error(conflict, 409, "conflict")
    assert error["field"] == "idempotency_key"
    assert snapshot(sched.store) == before
    # the key may also travel in the body; the two must agree when both are given
    in_body = acme.create(job_body(payload={"a": 1}, idempotency_key="nightly-1"))
    assert in_body.status_code == 200 and in_body.json()["job_id"] == first.json()["job_id"]
    mismatch = acme.create(job_body(idempotency_key="a"), **{"Idempotency-Key": "b"})
    assert assert_error(mismatch, 422, "invalid")["field"] == "idempotency_key"


def _clients_at_once(
    server: ApiServer, tenant: Api, count: int, work: Callable[[Api], None], timeout: float
) -> None:
    """`count` clients of the tenant, one thread each, run work(client) released together by
    a barrier (each client made before it); returns once every thread has ended."""
    barrier = threading.Barrier(count)

    def run() -> None:
        client = Api(server.url, tenant.token)
        barrier.wait()
        work(client)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


def test_concurrent_requests_with_one_key_make_one_job(acme: Api, server: ApiServer) -> None:
    statuses: Counter[int] = Counter()
    ids: set[str] = set()
    lock = threading.Lock()

    def post(client: Api) -> None:
        response = client.create(job_body(), **{"Idempotency-Key": "race"})
        with lock:
            statuses[response.status_code] += 1
            ids.add(response.json()["job_id"])

    _clients_at_once(server, acme, 6, post, 60)
    assert statuses == Counter({201: 1, 200: 5}) and len(ids) == 1


def test_idempotency_keys_are_kept_past_24_hours(sched: Scheduler, acme: Api) -> None:
    first = acme.create(job_body(), **{"Idempotency-Key": "old-key"}).json()
    created = sched.get_job(first["job_id"]).created_at
    with sched.store.tx() as connection:
        connection.execute(
            update(schema.jobs)
            .where(schema.jobs.c.job_id == first["job_id"])
            .values(created_at=created - timedelta(hours=25))
        )
    again = acme.create(job_body(), **{"Idempotency-Key": "old-key"})
    assert again.status_code == 200 and again.json()["job_id"] == first["job_id"]
    assert_error(
        acme.create(job_body(name="other"), **{"Idempotency-Key": "old-key"}), 409, "conflict"
    )


# -- paging ----------------------------------------------------------------------------


def test_cursor_paging_is_stable_while_jobs_are_added(acme: Api) -> None:
    created = {acme.new_job()["job_id"] for _ in range(25)}
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 10}
        if cursor:
            params["cursor"] = cursor
        page = acme.request("GET", "/v1/jobs", params=params).json()
        seen.extend(j["job_id"] for j in page["items"])
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
        acme.new_job()  # added between pages: must not shift or repeat anything listed
    assert len(seen) == len(set(seen)) and seen == sorted(seen)
    assert created <= set(seen) and pages >= 3


@pytest.mark.parametrize(
    "cursor",
    [
        "!!!",
        base64.urlsafe_b64encode(b"x\x00y").decode(),
        base64.urlsafe_b64encode(b"a|b").decode(),
    ],
)
def test_a_forged_cursor_is_422(acme: Api, cursor: str) -> None:
    job = acme.new_job()
    for path in ("/v1/jobs", f"/v1/jobs/{job['job_id']}/runs"):
        error = assert_error(acme.request("GET", path, params={"cursor": cursor}), 422, "invalid")
        assert error["field"] == "cursor"


def test_list_filters_by_status(acme: Api) -> None:
    keep = acme.new_job()
    gone = acme.new_job()
    acme.request("DELETE", f"/v1/jobs/{gone['job_id']}")
    active = acme.request("GET", "/v1/jobs", params={"status": "active"}).json()["items"]
    assert [j["job_id"] for j in active] == [keep["job_id"]]
    assert_error(acme.request("GET", "/v1/jobs", params={"status": "bogus"}), 422, "invalid")


# -- errors: every one in the same shape -----------------------------------------------


def test_every_error_has_the_json_shape(acme: Api) -> None:
    assert_error(acme.request("GET", "/v1/nothing-here"), 404, "not_found")
    assert_error(acme.request("GET", "/v1/jobs/not-an-id"), 404, "not_found")
    not_allowed = acme.request("PUT", "/v1/jobs")
    assert_error(not_allowed, 405, "method_not_allowed")
    assert "POST" in not_allowed.headers["allow"]
    malformed = acme.request(
        "POST", "/v1/jobs", data=b'{"schedule": ', headers={"Content-Type": "application/json"}
    )
    assert assert_error(malformed, 400, "malformed")["field"] == "body"
    assert_error(acme.request("POST", "/v1/jobs", data=b""), 400, "malformed")
    wrong_type = acme.request(
        "POST", "/v1/jobs", data=b"schedule=x", headers={"Content-Type": "text/plain"}
    )
    assert_error(wrong_type, 415, "unsupported_media_type")
    assert assert_error(acme.create([1, 2]), 422, "invalid")["field"] == "body"  # type: ignore[arg-type]
    bad_cron = acme.create(job_body(schedule={"cron": "0 25 * * *"}))
    assert assert_error(bad_cron, 422, "invalid")["field"] == "cron"
    bad_limit = acme.request("GET", "/v1/jobs", params={"limit": 0})
    assert assert_error(bad_limit, 422, "invalid")["field"] == "limit"
    assert_error(acme.request("GET", "/v1/jobs", params={"limit": "x"}), 422, "invalid")
    # JSON that json.loads cannot convert (an integer past int()'s digit limit, nesting past
    # the recursion limit) is refused naming the field it is in, never a 500
    huge = json.dumps(job_body())[:-1].encode() + b', "payload": ' + b"9" * 5000 + b"}"
    deep = b'{"payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for raw, field in (
        (huge, "payload"),
        (deep, "payload"),
        (b"[" * 100_000 + b"]" * 100_000, "body"),
    ):
        unparsable = acme.request(
            "POST", "/v1/jobs", data=raw, headers={"Content-Type": "application/json"}
        )
        assert assert_error(unparsable, 422, "invalid")["field"] == field


BAD_BODIES = {
    "unknown time zone": (
        job_body(schedule={"cron": "0 8 * * *", "timezone": "Nowhere/X"}),
        "timezone",
    ),
    "run_at in the past": (job_body(schedule={"run_at": "2001-01-01T00:00:00Z"}), "run_at"),
    "huge number duration": (job_body(schedule={"every": 1e300}), "interval"),
    "NUL in the name": (job_body(name="a\x00b"), "name"),
    "NUL in the key": (job_body(idempotency_key="k\x00"), "idempotency_key"),
    "unpaired surrogate": (job_body(name="a\ud800"), "name"),
    "unpaired surrogate in the payload": (job_body(payload={"k": "\ud800"}), "payload"),
    "payload nested too deep": (job_body(payload=json.loads("[" * 100 + "]" * 100)), "payload"),
    "run_at at the end of time": (
        job_body(schedule={"run_at": "9999-12-31T00:00:00Z"}, window="366d"),
        "run_at",
    ),
    "absurd cron": (job_body(schedule={"cron": "9" * 5000 + " * * * *"}), "cron"),
    "unknown key": (job_body(colour="blue"), "colour"),
    "Arabic-Indic digits in a delay": (job_body(schedule={"delay": "PT\u0663M"}), "delay"),
    "Arabic-Indic digits in a window": (job_body(window="\u0663m"), "window"),
    "max_concurrency past its bound": (job_body(max_concurrency=10**20), "max_concurrency"),
    "max_attempts past its bound": (job_body(retry={"max_attempts": 2**64}), "retry.max_attempts"),
    "payload integer past 2^63": (job_body(payload={"n": 2**63}), "payload"),
    "payload integer below -2^63": (job_body(payload=[-(2**63) - 1]), "payload"),
    "payload NaN": (job_body(payload={"x": float("nan")}), "payload"),
    "payload Infinity": (job_body(payload=[float("inf")]), "payload"),
    "no target": ({"schedule": {"delay": "1m"}}, "target"),
}


@pytest.mark.parametrize(("body", "field"), BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_input_is_422_and_changes_nothing(
    sched: Scheduler, acme: Api, body: dict[str, Any], field: str
) -> None:
    before = snapshot(sched.store)
    # json.dumps escapes what the HTTP body must carry (NUL, lone surrogates)
    response = acme.request(
        "POST",
        "/v1/jobs",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    assert assert_error(response, 422, "invalid")["field"] == field
    assert snapshot(sched.store) == before


# -- tokens ----------------------------------------------------------------------------


def test_missing_malformed_unknown_and_revoked_tokens_are_401(
    sched: Scheduler, acme: Api, server: ApiServer, db_url: str
) -> None:
    job = acme.new_job()
    url = f"{server.url}/v1/jobs/{job['job_id']}"
    wrong_secret = acme.token[:-4] + ("AAAA" if not acme.token.endswith("AAAA") else "BBBB")
    for headers in (
        {},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer not-a-token"},
        {"Authorization": f"Bearer {wrong_secret}"},
    ):
        response = requests.get(url, headers=headers, timeout=10)
        assert_error(response, 401, "unauthorized")
        assert response.headers["www-authenticate"].startswith("Bearer")
    # a second token, made and revoked with schedctl
    made = runner.invoke(
        cli_app, ["--db", db_url, "tenant", "token", "create", "acme", "--output", "json"]
    )
    assert made.exit_code == 0, made.output
    second = Api(server.url, json.loads(made.stdout)["token"])
    assert second.request("GET", f"/v1/jobs/{job['job_id']}").status_code == 200
    revoked = runner.invoke(cli_app, ["--db", db_url, "tenant", "token", "revoke", acme.token])
    assert revoked.exit_code == 0, revoked.output
    assert_error(acme.request("GET", f"/v1/jobs/{job['job_id']}"), 401, "unauthorized")
    assert_error(acme.create(), 401, "unauthorized")
    # the other token of the tenant still works, and the list says which is revoked
    assert second.request("GET", f"/v1/jobs/{job['job_id']}").status_code == 200
    listed = runner.invoke(
        cli_app, ["--db", db_url, "tenant", "token", "list", "acme", "--output", "json"]
    )
    states = {t["token_id"]: t["active"] for t in json.loads(listed.stdout)}
    assert states == {acme.token_id: False, second.token_id: True}


# -- quotas ----------------------------------------------------------------------------


def test_max_jobs_quota_is_429_with_retry_after(sched: Scheduler, acme: Api, db_url: str) -> None:
    result = runner.invoke(cli_app, ["--db", db_url, "tenant", "quota", "acme", "--max-jobs", "2"])
    assert result.exit_code == 0, result.output
    first = acme.create(job_body(), **{"Idempotency-Key": "one"}).json()
    acme.new_job()
    before = snapshot(sched.store)
    over = acme.create()
    error = assert_error(over, 429, "quota_exceeded")
    assert error["field"] == "max_jobs" and int(over.headers["retry-after"]) >= 1
    assert snapshot(sched.store) == before
    # a replay is not a new job
    assert acme.create(job_body(), **{"Idempotency-Key": "one"}).status_code == 200
    # ending a job frees its slot
    assert acme.request("DELETE", f"/v1/jobs/{first['job_id']}").status_code == 204
    assert acme.create().status_code == 201


def test_bringing_a_job_back_over_max_jobs_is_429_and_changes_nothing(
    sched: Scheduler, acme: Api
) -> None:
    sched.set_quotas("acme", max_jobs=1, actor="test")
    first = acme.new_job()
    path = f"/v1/jobs/{first['job_id']}"
    with sched.store.tx() as connection:  # its last run passed: what a claim writes
        connection.execute(
            update(schema.jobs)
            .where(schema.jobs.c.job_id == first["job_id"])
            .values(status="completed", next_run_at=None, next_fire_at=None)
        )
    acme.new_job()  # the freed slot, taken
    before = snapshot(sched.store)
    over = acme.request("PATCH", path, json={"schedule": {"delay": "1h"}})
    error = assert_error(over, 429, "quota_exceeded")
    assert error["field"] == "max_jobs" and int(over.headers["retry-after"]) >= 1
    assert snapshot(sched.store) == before
    assert acme.request("GET", path).json()["status"] == "completed"


def test_create_rate_quota_is_429_with_retry_after(sched: Scheduler, acme: Api) -> None:
    sched.set_quotas("acme", create_rate_per_minute=3, actor="test")
    made = [acme.create(job_body(), **{"Idempotency-Key": f"k{i}"}) for i in range(3)]
    assert [r.status_code for r in made] == [201, 201, 201]
    over = acme.create()
    error = assert_error(over, 429, "quota_exceeded")
    assert error["field"] == "create_rate_per_minute"
    assert 1 <= int(over.headers["retry-after"]) <= 60
    assert acme.create(job_body(), **{"Idempotency-Key": "k0"}).status_code == 200


def test_the_max_jobs_quota_holds_under_concurrent_creates(
    sched: Scheduler, acme: Api, server: ApiServer
) -> None:
    sched.set_quotas("acme", max_jobs=5, actor="test")
    statuses: Counter[int] = Counter()
    lock = threading.Lock()

    def post(client: Api) -> None:
        for _ in range(3):
            code = client.create().status_code
            with lock:
                statuses[code] += 1

    _clients_at_once(server, acme, 8, post, 120)
    assert statuses == Counter({201: 5, 429: 19})
    assert len(acme.request("GET", "/v1/jobs").json()["items"]) == 5


# -- size limits -----------------------------------------------------------------------


def test_request_over_the_size_limit_is_413(sched: Scheduler, acme: Api) -> None:
    with serving(sched, max_request_bytes=4096) as small:
        api = Api(small.url, acme.token)
        big = json.dumps(job_body(payload={"x": "y" * 5000})).encode()
        declared = api.request(
            "POST", "/v1/jobs", data=big, headers={"Content-Type": "application/json"}
        )
        assert_error(declared, 413, "request_too_large")

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(big), 1000):
                yield big[i : i + 1000]

        chunked = Api(small.url, acme.token).request(
            "POST", "/v1/jobs", data=chunks(), headers={"Content-Type": "application/json"}
        )
        assert_error(chunked, 413, "request_too_large")
        assert Api(small.url, acme.token).create().status_code == 201
    assert len(acme.request("GET", "/v1/jobs").json()["items"]) == 1


def test_payload_over_its_limit_is_413(sched: Scheduler, acme: Api) -> None:
    sched.max_payload_bytes = 1000
    before = snapshot(sched.store)
    over = acme.create(job_body(payload={"x": "y" * 1000}))
    error = assert_error(over, 413, "payload_too_large")
    assert error["field"] == "payload" and "1000 bytes" in error["message"]
    assert snapshot(sched.store) == before
    assert acme.create(job_body(payload={"x": "y" * 900})).status_code == 201


# -- audit -----------------------------------------------------------------------------


def test_audit_records_every_change_with_tenant_and_token(
    sched: Scheduler, acme: Api, db_url: str
) -> None:
    job = acme.new_job()
    path = f"/v1/jobs/{job['job_id']}"
    acme.request("PATCH", path, json={"schedule": {"every": "2h"}})
    acme.request("POST", path + "/pause")
    acme.request("POST", path + "/resume")
    acme.request("POST", path + "/trigger")
    acme.request("DELETE", path)
    entries = sched.audit("acme", job_id=job["job_id"]).items
    assert [e.action for e in entries] == [
        "delete",
        "trigger",
        "resume",
        "pause",
        "reschedule",
        "create",
    ]
    tenant_id = sched.get_tenant("acme").tenant_id
    assert {(e.tenant_id, e.actor) for e in entries} == {(tenant_id, f"token:{acme.token_id}")}
    result = runner.invoke(
        cli_app,
        ["--db", db_url, *"audit --tenant acme -n 4 -o json --job".split(), job["job_id"]],
    )
    assert result.exit_code == 0, result.output
    page = json.loads(result.stdout)
    assert [i["action"] for i in page["items"]] == ["delete", "trigger", "resume", "pause"]
    assert page["items"][0]["tenant"] == "acme"
    assert page["items"][0]["actor"] == f"token:{acme.token_id}"
    cursor = page["next_cursor"]
    rest = runner.invoke(
        cli_app, ["--db", db_url, "audit", "--job", job["job_id"], "--cursor", cursor, "-ojson"]
    )
    assert [i["action"] for i in json.loads(rest.stdout)["items"]] == ["reschedule", "create"]
    table = runner.invoke(cli_app, ["--db", db_url, "audit", "--tenant", "acme"])
    assert table.exit_code == 0 and "reschedule" in table.stdout


# -- payloads: never in logs, encrypted at rest ----------------------------------------


def test_payloads_never_reach_the_logs(
    sched: Scheduler, acme: Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    sched.max_payload_bytes = 2000
    with serving(sched, access_log=True) as logged:
        api = Api(logged.url, acme.token)
        secret = {"password": MARKER}
        created = api.create(job_body(payload=secret), **{"Idempotency-Key": "k"})
        assert created.status_code == 201
        job_id = created.json()["job_id"]
        assert api.create(job_body(payload=secret), **{"Idempotency-Key": "k"}).status_code == 200
        other_body = job_body(payload={"password": MARKER + "2"})
        assert api.create(other_body, **{"Idempotency-Key": "k"}).status_code == 409
        assert api.request("POST", f"/v1/jobs/{job_id}/trigger").status_code == 202
        assert api.request("GET", f"/v1/jobs/{job_id}").json()["payload"] == secret
        assert api.request("GET", "/v1/jobs").status_code == 200
        assert api.create(job_body(payload=secret, colour=MARKER)).status_code == 422
        assert api.create(job_body(payload={"x": MARKER * 200})).status_code == 413
        broken = api.request(
            "POST",
            "/v1/jobs",
            data=f'{{"payload": "{MARKER}", oops'.encode(),
            headers={"Content-Type": "application/json"},
        )
        assert broken.status_code == 400
    assert any(r.name == "uvicorn.access" for r in caplog.records)  # the logs were captured
    assert MARKER not in caplog.text
    for record in caplog.records:
        assert MARKER not in str(record.args)


def test_payloads_are_encrypted_at_rest(sched: Scheduler, acme: Api, keys: tuple[str, str]) -> None:
    key, _ = keys
    configure_payload_cipher(PayloadCipher([key]))
    job = acme.new_job(job_body(payload={"secret": MARKER}))
    stored = stored_payload(sched.store, job["job_id"])
    assert is_encrypted(stored) and MARKER not in stored
    assert acme.request("GET", f"/v1/jobs/{job['job_id']}").json()["payload"] == {"secret": MARKER}
    # the run's payload reaches a queue consumer in plaintext
    assert acme.request("POST", f"/v1/jobs/{job['job_id']}/trigger").status_code == 202
    queue = QueueRepo(sched.store)
    assert queue.move_outbox() == 1
    (lease,) = queue.lease(QUEUE["name"], "test-worker", 30.0, tenant_id=job["tenant_id"])
    assert lease.payload == {"secret": MARKER}


def test_rotation_old_rows_stay_readable_and_the_command_reencrypts(
    sched: Scheduler,
    acme: Api,
    keys: tuple[str, str],
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old, new = keys
    configure_payload_cipher(None)
    plain = acme.new_job(job_body(payload={"era": "before encryption"}))
    assert not is_encrypted(stored_payload(sched.store, plain["job_id"]))
    configure_payload_cipher(PayloadCipher([old]))
    under_old = acme.new_job(job_body(payload={"era": "old key"}))
    # step 1-2: the new key goes first, the old one stays: everything still reads
    configure_payload_cipher(PayloadCipher([new, old]))
    under_new = acme.new_job(job_body(payload={"era": "new key"}))
    for job in (plain, under_old, under_new):
        got = acme.request("GET", f"/v1/jobs/{job['job_id']}").json()
        assert got["payload"] == job["payload"]
    assert PayloadCipher([new]).is_current(stored_payload(sched.store, under_new["job_id"]))
    # step 3: the command (a separate process would read the same environment)
    reset_payload_cipher()
    monkeypatch.setenv(KEYS_ENV, f"{new},{old}")
    result = runner.invoke(cli_app, ["--db", db_url, "db", "rotate-payload-key", "-o", "json"])
    assert result.exit_code == 0, result.output
    rotated = json.loads(result.stdout)
    # the tenant's signing secret is re-encrypted by the same command
    signing = rotated.pop("signing_secrets")
    assert signing["examined"] == 1 and signing["rewritten"] + signing["already_current"] == 1
    assert rotated == {
        "examined": 3,
        "rewritten": 2,
        "already_current": 1,
        "keys": 2,
    }
    again = runner.invoke(cli_app, ["--db", db_url, "db", "rotate-payload-key", "-o", "json"])
    assert json.loads(again.stdout)["rewritten"] == 0
    # step 4: the old key can go
    configure_payload_cipher(PayloadCipher([new]))
    for job in (plain, under_old, under_new):
        stored = stored_payload(sched.store, job["job_id"])
        assert PayloadCipher([new]).is_current(stored)
        got = acme.request("GET", f"/v1/jobs/{job['job_id']}").json()
        assert got["payload"] == job["payload"]


def test_metrics_through_the_api_create_update_and_a_bad_value(acme: Api) -> None:
    created = acme.create(job_body(name="watched", metrics=True))
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["metrics"] is True
    plain = acme.create(job_body(name="plain")).json()
    assert plain["metrics"] is False
    changed = acme.request("PATCH", f"/v1/jobs/{plain['job_id']}", json={"metrics": True})
    assert changed.status_code == 200, changed.text
    assert changed.json()["metrics"] is True
    bad = acme.create(job_body(name="bad", metrics="yes"))
    assert bad.status_code in (400, 422), bad.text
    assert bad.json()["error"]["field"] == "metrics"
    names = {j["name"] for j in acme.request("GET", "/v1/jobs").json()["items"]}
    assert names == {"watched", "plain"}


# -- the OpenAPI document ----------------------------------------------------------------


def test_openapi_document(server: ApiServer) -> None:
    response = requests.get(server.url + "/openapi.json", timeout=10)
    assert response.status_code == 200
    doc = response.json()
    operations = {
        (method.upper(), path)
        for path, item in doc["paths"].items()
        for method in item
        if method in {"get", "post", "put", "patch", "delete"}
    }
    assert operations == {
        ("POST", "/v1/jobs"),
        ("POST", "/v1/jobs:batch"),
        ("GET", "/v1/jobs"),
        ("GET", "/v1/jobs/{job_id}"),
        ("PATCH", "/v1/jobs/{job_id}"),
        ("DELETE", "/v1/jobs/{job_id}"),
        ("POST", "/v1/jobs/{job_id}/cancel"),
        ("POST", "/v1/jobs/{job_id}/pause"),
        ("POST", "/v1/jobs/{job_id}/resume"),
        ("POST", "/v1/jobs/{job_id}/trigger"),
        ("GET", "/v1/jobs/{job_id}/runs"),
        ("GET", "/v1/jobs/by-name/{name}"),
        ("GET", "/v1/jobs/{job_id}/dependencies"),
        ("GET", "/v1/jobs/{job_id}/why"),
        ("GET", "/v1/tenant"),
        ("GET", "/healthz"),
        ("POST", "/v1/queues/{name}/leases"),
        ("POST", "/v1/leases/{lease_id}/heartbeat"),
        ("POST", "/v1/leases/{lease_id}/ack"),
        ("POST", "/v1/leases/{lease_id}/fail"),
        ("POST", "/v1/queues/{name}/alert-leases"),
        ("POST", "/v1/alert-leases/{lease_id}/finish"),
        ("POST", "/v1/boot-runs"),
        ("POST", "/v1/host-drift"),
        ("GET", "/v1/jobs/{job_id}/alerts"),
        ("PUT", "/v1/jobs/{job_id}/alerts"),
    }
    for path, item in doc["paths"].items():
        for operation in item.values():
            if path.startswith("/v1/"):
                assert "401" in operation["responses"]
                assert "403" in operation["responses"]  # a host token outside its scope
                assert operation["responses"]["401"]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorBody"
                }
    create = doc["paths"]["/v1/jobs"]["post"]
    assert {"200", "201", "400", "409", "413", "415", "422", "429"} <= set(create["responses"])
    assert create["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    # schedule or after (a dependent job), so only the target is always required
    assert create["requestBody"]["content"]["application/json"]["schema"]["required"] == [
        "target",
    ]
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    # issue 34: a job asks for its own series on /metrics (a boolean, false by default)
    body = create["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["metrics"]["type"] == "boolean"
    job_out = doc["components"]["schemas"]["JobOut"]["properties"]["metrics"]
    assert (job_out["type"], job_out["default"]) == ("boolean", False)
    # a job read or updated carries its version as ETag, beside the documented body
    for path, method in (
        ("/v1/jobs/{job_id}", "get"),
        ("/v1/jobs/{job_id}", "patch"),
        ("/v1/jobs/by-name/{name}", "get"),
    ):
        ok = doc["paths"][path][method]["responses"]["200"]
        assert ok["headers"]["ETag"]["required"] is True
        assert ok["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/JobOut"
        }


def test_request_and_quota_metrics(sched: Scheduler, acme: Api) -> None:
    def value(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    by_template = {"method": "GET", "route": "/v1/jobs/{job_id}", "status": "404"}
    before = value("scheduled_api_requests_total", by_template)
    acme.request("GET", "/v1/jobs/0123abcd")
    acme.request("GET", "/v1/jobs/4567ef")
    assert value("scheduled_api_requests_total", by_template) == before + 2
    sched.set_quotas("acme", max_jobs=0, actor="test")
    quota = {"tenant": "acme", "quota": "max_jobs"}
    rejected = value("scheduled_api_quota_rejections_total", quota)
    assert acme.create().status_code == 429
    assert value("scheduled_api_quota_rejections_total", quota) == rejected + 1


def test_job_alerts_in_the_create_body_and_their_own_routes(acme: Api, other: Api) -> None:
    alerts = {"on": ["dead_letter", "failure"], "email": ["ops@example.com"]}
    job = acme.new_job(job_body(alerts=alerts))
    path = f"/v1/jobs/{job['job_id']}/alerts"
    got = acme.request("GET", path)
    assert got.status_code == 200 and got.json()["alerts"] == alerts
    assert other.request("GET", path).status_code == 404  # another tenant's job
    bad = acme.request("PUT", path, json={"on": ["sometimes"]})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "alerts.on"
    assert acme.request("GET", path).json()["alerts"] == alerts  # unchanged
    put = acme.request("PUT", path, json={"webhook": "https://hooks.example.com/a"})
    assert put.status_code == 200
    assert put.json()["alerts"] == {"on": ["dead_letter"], "webhook": "https://hooks.example.com/a"}
    cleared = acme.request(
        "PUT", path, json=None, data="null", headers={"Content-Type": "application/json"}
    )
    assert cleared.status_code == 200 and cleared.json()["alerts"] is None
    refused = acme.create(job_body(alerts={"email": "nope"}))
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "alerts.email"


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x80", "\x9f", "\r"])
def test_control_and_line_separator_characters_in_names_are_refused(
    acme: Api, sched: Scheduler, char: str
) -> None:
    """A job name reaches alert mail headers: U+2028, U+0085, C1 (and C0) are refused on
    create and on rename, naming the field, and nothing changes."""
    before = snapshot(sched.store)
    refused = acme.create(job_body(name=f"nightly{char}Bcc: x@example.org"))
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["field"] == "name"
    assert snapshot(sched.store) == before
    job = acme.new_job(job_body(name="nightly"))
    renamed = acme.request("PATCH", f"/v1/jobs/{job['job_id']}", json={"name": f"n{char}"})
    assert renamed.status_code == 422 and renamed.json()["error"]["field"] == "name"
    assert acme.request("GET", f"/v1/jobs/{job['job_id']}").json()["name"] == "nightly"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",
        "http://localhost/hook",
        "http://10.1.2.3/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/hook",
    ],
)
def test_an_alert_webhook_is_checked_by_the_ssrf_guard_at_creation(
    acme: Api, sched: Scheduler, url: str
) -> None:
    """Loopback, private and metadata webhooks are refused when set (job body, the job's
    alerts route), naming alerts.webhook, nothing stored; the tenant's allow-list admits
    what it lists, as for an HTTP target."""
    before = snapshot(sched.store)
    refused = acme.create(job_body(alerts={"webhook": url}))
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["field"] == "alerts.webhook"
    assert snapshot(sched.store) == before
    job = acme.new_job()
    path = f"/v1/jobs/{job['job_id']}/alerts"
    put = acme.request("PUT", path, json={"webhook": url})
    assert put.status_code == 422 and put.json()["error"]["field"] == "alerts.webhook"
    assert acme.request("GET", path).json()["alerts"] is None
    host = urlsplit(url).hostname
    assert host is not None
    TenantDeliveryRepo(sched.store).allow("acme", normalize_entry(host), actor="test")
    allowed = acme.request("PUT", path, json={"webhook": url})
    assert allowed.status_code == 200, allowed.text


def test_schedctl_job_alerts_goes_through_the_api(acme: Api, server: ApiServer) -> None:
    job = acme.new_job()
    base = ["--api", server.url, "--token", acme.token, "--output", "json", "job", "alerts"]
    made = runner.invoke(cli_app, [*base, job["job_id"], "--email", "ops@example.com"])
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["alerts"] == {
        "on": ["dead_letter"],
        "email": ["ops@example.com"],
    }
    got = acme.request("GET", f"/v1/jobs/{job['job_id']}/alerts").json()["alerts"]
    assert got["email"] == ["ops@example.com"]
    cleared = runner.invoke(cli_app, [*base, job["job_id"], "--clear"])
    assert cleared.exit_code == 0 and json.loads(cleared.stdout)["alerts"] is None


def test_create_with_after(acme: Api, other: Api) -> None:
    upstream = acme.new_job(job_body(name="extract"))
    job = acme.new_job({"after": [upstream["job_id"]], "target": dict(QUEUE)})
    assert job["schedule"] == {"kind": "after"} and job["next_run_at"] is None
    assert acme.request("GET", f"/v1/jobs/{job['job_id']}").json()["schedule"] == {"kind": "after"}
    both = acme.create(job_body(after=[upstream["job_id"]]))
    assert assert_error(both, 422, "invalid")["field"] == "after"
    foreign = other.create({"after": [upstream["job_id"]], "target": dict(QUEUE)})
    assert assert_error(foreign, 404, "not_found")["field"] == "after"
    graph = acme.request("GET", f"/v1/jobs/{upstream['job_id']}/dependencies").json()
    assert graph["upstream"] == []
    assert [n["job_id"] for n in graph["downstream"]] == [job["job_id"]]
    hidden = other.request("GET", f"/v1/jobs/{upstream['job_id']}/dependencies")
    assert_error(hidden, 404, "not_found")


def test_patch_after_and_a_cycle_refused_naming_after(acme: Api) -> None:
    upstream = acme.new_job(job_body(name="extract"))
    job = acme.new_job(job_body(name="load"))
    path = f"/v1/jobs/{job['job_id']}"
    patched = acme.request("PATCH", path, json={"after": ["extract"]})
    assert patched.status_code == 200, patched.text
    assert patched.json()["schedule"] == {"kind": "after"} and patched.json()["next_run_at"] is None
    cycle = acme.request("PATCH", f"/v1/jobs/{upstream['job_id']}", json={"after": ["load"]})
    assert assert_error(cycle, 422, "invalid")["field"] == "after"
    graph = acme.request("GET", f"/v1/jobs/{upstream['job_id']}/dependencies").json()
    assert graph["upstream"] == [] and [n["job_id"] for n in graph["downstream"]] == [job["job_id"]]
