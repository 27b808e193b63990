"""Host tokens (`schedctl tenant token create TENANT --host H --group G`): a cron host's
only credential. It leases and settles runs of its own queues (host:H, every:H, group:G
of its tenant) and reads, creates, changes and removes only the jobs its own files define
(as `schedctl apply` makes them); every other route of the API answers 403, and another
host's or another tenant's objects are 403 (a queue) or 404 (a job, a lease). The walk
covers every route of the app, so a route added later is covered without being named."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute, iter_route_contexts
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app
from schedctl.core import errors
from schedctl.domain.host_scope import HostScope
from schedctl.storage.pipeline.queue import QueueRepo
from scheduled_d.api.auth import HOST_TOKEN_ROUTES
from scheduled_d.api.server import ApiServer
from tests.integration.api_support import Api, snapshot

JOB_FILE = "/etc/scheduled/jobs.d/backup.toml"
# the routes that need no token at all: the same answer with or without one
PUBLIC_ROUTES = {("GET", "/healthz"), ("GET", "/openapi.json"), ("HEAD", "/openapi.json")}
_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def applied(name: str, host: str, *, group: str | None = None, **more: Any) -> dict[str, Any]:
    """The create body `schedctl apply` sends on `host` for job `name` of JOB_FILE."""
    queue = f"group:{group}" if group else f"host:{host}"
    return {
        "name": name if group else f"{name}@{host}",
        "schedule": {"cron": "0 3 * * *"},
        "target": {"type": "queue", "name": queue},
        "payload": {"job_file": JOB_FILE, "job": name, "host": host, "digest": "d" * 64},
        **more,
    }


def host_token(sched: Scheduler, server: ApiServer, host: str, *groups: str) -> Api:
    return Api(server.url, sched.new_token("acme", actor="test", host=host, groups=groups))


@pytest.fixture
def fleet(sched: Scheduler, server: ApiServer, acme: Api, other: Api) -> dict[str, Any]:
    """web1 (group db) and web2 host tokens of acme, a job and a lease of each, a job acme
    made by hand on web1's queue, and a job and a lease of the other tenant."""
    web1 = host_token(sched, server, "web1", "db")
    web2 = host_token(sched, server, "web2")
    found: dict[str, Any] = {"web1": web1, "web2": web2, "acme": acme, "other": other}
    found["web1_job"] = web1.new_job(applied("backup", "web1"))["job_id"]
    found["web1_group_job"] = web1.new_job(applied("vacuum", "web1", group="db"))["job_id"]
    found["web2_job"] = web2.new_job(applied("backup", "web2"))["job_id"]
    found["hand_job"] = acme.new_job(
        {**applied("backup", "web1"), "name": "by-hand", "payload": {"cmd": "x"}}
    )["job_id"]
    found["other_job"] = other.new_job(applied("backup", "web1"))["job_id"]
    for who, job in (("acme", "web2_job"), ("other", "other_job"), ("acme", "web1_job")):
        trigger = found[who].request("POST", f"/v1/jobs/{found[job]}/trigger")
        assert trigger.status_code == 202, trigger.text
    QueueRepo(sched.store).move_outbox()
    for who, queue in (("web2", "host:web2"), ("other", "host:web1"), ("web1", "host:web1")):
        leased = found[who].request("POST", f"/v1/queues/{queue}/leases", json={})
        assert leased.status_code == 200 and len(leased.json()["items"]) == 1, leased.text
        found[f"{who}_lease"] = leased.json()["items"][0]["lease_id"]
    return found


def routes(server: ApiServer) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, its included routers' too (the path the
    API's host-token check sees: the route's own)."""
    found = []
    for context in iter_route_contexts(server.app.routes):
        route = context.original_route
        for method in sorted(getattr(route, "methods", None) or ()):
            found.append((method, str(getattr(route, "path", ""))))
    return found


def routes_of(route: APIRoute) -> list[tuple[str, str]]:
    return [(method, route.path) for method in route.methods]


def fill(path: str, values: dict[str, str]) -> str:
    return _PARAM.sub(lambda m: values[m.group(1)], path)


def test_every_route_but_the_host_s_own_answers_403_to_a_host_token(
    sched: Scheduler, server: ApiServer, fleet: dict[str, Any]
) -> None:
    web1: Api = fleet["web1"]
    every = routes(server)
    assert HOST_TOKEN_ROUTES <= set(every)  # each allowed route exists (no typo)
    api_routes = {
        (method, path)
        for context in iter_route_contexts(server.app.routes)
        if isinstance(context.original_route, APIRoute)
        for method, path in routes_of(context.original_route)
    }
    assert len(api_routes - HOST_TOKEN_ROUTES - PUBLIC_ROUTES) >= 5  # something to refuse
    # the host's own objects: even with them, a route it may not call is 403
    own = {
        "job_id": fleet["web1_job"],
        "name": "host:web1",
        "lease_id": fleet["web1_lease"],
    }
    before = snapshot(sched.store)
    checked = 0
    for method, path in every:
        if (method, path) in HOST_TOKEN_ROUTES:
            continue
        if path.startswith("/ui"):
            # the web console reads no bearer token: its session is a cookie, which a host
            # token cannot get (tests/integration/test_console.py::
            # test_a_host_token_does_not_sign_in); to it this is a visitor not signed in
            console = {**own, "action": "pause", "at": "2026-01-01T00:00:00Z", "letter_id": "1"}
            response = web1.request(method, fill(path, console), data={})
            signed_out = response.url.endswith("/ui/signin") or response.status_code in (403, 404)
            assert signed_out, (method, path, response.status_code, response.url)
            continue
        response = web1.request(method, fill(path, own), json={})
        if (method, path) in PUBLIC_ROUTES:
            bare = web1.session.request(method, server.url + fill(path, own), timeout=30)
            assert response.status_code == bare.status_code, (method, path)
            continue
        assert response.status_code == 403, (method, path, response.text)
        assert response.json()["error"]["code"] == "forbidden", (method, path)
        checked += 1
    assert checked >= 5
    assert snapshot(sched.store) == before


@pytest.mark.parametrize("whose", ["web2", "other", "hand"])
def test_the_allowed_routes_refuse_another_host_s_or_tenant_s_objects(
    sched: Scheduler, server: ApiServer, fleet: dict[str, Any], whose: str
) -> None:
    web1: Api = fleet["web1"]
    foreign = {
        "web2": {"job_id": fleet["web2_job"], "name": "host:web2", "lease_id": fleet["web2_lease"]},
        "other": {
            "job_id": fleet["other_job"],
            "name": "group:ops",  # not one of web1's groups
            "lease_id": fleet["other_lease"],
        },
        "hand": {"job_id": fleet["hand_job"], "name": "every:web2", "lease_id": "1.0"},
    }[whose]
    bodies: dict[str, Any] = {
        "/v1/leases/{lease_id}/ack": {
            "started_at": "2026-01-01T00:00:00Z",
            "finished_at": "2026-01-01T00:00:01Z",
        },
        "/v1/leases/{lease_id}/fail": {
            "started_at": "2026-01-01T00:00:00Z",
            "finished_at": "2026-01-01T00:00:01Z",
            "error": "x",
        },
        "/v1/jobs/{job_id}": {"schedule": {"every": 1}},
        "/v1/jobs/{job_id}/alerts": {"email": ["ops@example.com"]},
    }
    before = snapshot(sched.store)
    for method, path in sorted(HOST_TOKEN_ROUTES):
        if "{" not in path:
            continue  # below: the routes without an object in their path
        body = bodies.get(path, {})
        response = web1.request(method, fill(path, foreign), json=body)
        assert response.status_code in (403, 404), (method, path, response.text)
    # creating another host's job, or a job of a group web1 is not in, or of another shape
    for body in (
        applied("backup", "web2"),
        applied("x", "web2", group="db"),  # applied "by" web2
        applied("x", "web1", group="ops"),
        {**applied("x", "web1"), "after": [fleet["web2_job"]]},
        {**applied("x", "web1"), "payload": {"job_file": JOB_FILE, "job": "x", "host": "web1"}},
        {**applied("x", "web1"), "name": "x@web2"},
    ):
        response = web1.create(body)
        assert response.status_code == 403, (body, response.text)
    # a job of its own cannot be moved to another host's queue or payload
    own = fleet["web1_job"]
    for patch in (
        {"target": {"type": "queue", "name": "host:web2"}},
        {"payload": applied("backup", "web2")["payload"]},
        {"target": {"type": "http", "url": "https://example.com/"}},
    ):
        response = web1.request("PATCH", f"/v1/jobs/{own}", json=patch)
        assert response.status_code == 403, (patch, response.text)
    assert snapshot(sched.store) == before
    listed = web1.request("GET", "/v1/jobs").json()["items"]
    assert {j["job_id"] for j in listed} == {fleet["web1_job"], fleet["web1_group_job"]}
    me = web1.request("GET", "/v1/tenant").json()
    assert (me["host"], me["groups"]) == ("web1", ["db"])


def test_a_host_token_serves_its_own_queues_and_jobs(
    sched: Scheduler, server: ApiServer, fleet: dict[str, Any]
) -> None:
    web1: Api = fleet["web1"]
    for queue in ("host:web1", "every:web1", "group:db"):
        response = web1.request("POST", f"/v1/queues/{queue}/leases", json={})
        assert response.status_code == 200, (queue, response.text)
    lease = fleet["web1_lease"]
    assert web1.request("POST", f"/v1/leases/{lease}/heartbeat", json={}).status_code == 200
    done = {"started_at": "2026-01-01T00:00:00Z", "finished_at": "2026-01-01T00:00:01Z"}
    assert web1.request("POST", f"/v1/leases/{lease}/ack", json=done).status_code == 200
    job = fleet["web1_job"]
    changed = web1.request("PATCH", f"/v1/jobs/{job}", json={"timeout": 60})
    assert changed.status_code == 200 and changed.json()["timeout_seconds"] == 60, changed.text
    alerts = {"email": ["ops@example.com"], "command": True}
    assert web1.request("PUT", f"/v1/jobs/{job}/alerts", json=alerts).status_code == 200
    assert web1.request("POST", f"/v1/jobs/{job}/pause").status_code == 200
    assert web1.request("POST", f"/v1/jobs/{job}/resume").status_code == 200
    assert web1.request("DELETE", f"/v1/jobs/{job}").status_code == 204
    group_job = fleet["web1_group_job"]
    assert web1.request("GET", f"/v1/jobs/{group_job}").status_code == 200


def test_a_host_token_is_made_with_its_host_and_groups(sched: Scheduler) -> None:
    sched.create_tenant("acme", "test")
    sched.new_token("acme", actor="test", host="web1", groups=["db", "db", "cache"])
    tokens = sched.list_tokens("acme")
    assert [t.host for t in tokens] == [None, HostScope("web1", ("cache", "db"))]
    before = snapshot(sched.store)
    for host, groups, field in (
        ("web 1", (), "host"),
        ("-web", (), "host"),
        ("web1", ("bad group",), "group"),
        (None, ("db",), "group"),
    ):
        with pytest.raises(errors.ValidationError) as caught:
            sched.new_token("acme", actor="test", host=host, groups=groups)
        assert caught.value.field == field
    assert snapshot(sched.store) == before


# -- schedctl apply over the API with a host token --------------------------------------

FILES = """
[[job]]
name = "backup"
cron = "30 2 * * *"
command = ["/usr/local/bin/backup"]

[[job]]
name = "vacuum"
every = "15m"
shell = "vacuumdb"
run_on = "host-group:db"
"""


def apply_cli(server: ApiServer, token: str, *args: str) -> Any:
    """`schedctl --api URL apply ...` in this process; (exit code, output)."""
    result = CliRunner().invoke(
        app, ["--api", server.url, "--token", token, "-o", "json", "apply", *args]
    )
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_apply_with_a_host_token_writes_only_its_own_jobs(
    sched: Scheduler, server: ApiServer, acme: Api, tmp_path: Path
) -> None:
    jobs_d = tmp_path / "jobs.d"
    jobs_d.mkdir()
    (jobs_d / "host.toml").write_text(FILES)
    web1 = host_token(sched, server, "web1", "db")
    web2 = host_token(sched, server, "web2")
    code, out = apply_cli(server, web1.token, str(jobs_d), "--host", "web1", "--group", "db")
    assert code == 0, out
    assert json.loads(out)["created"] == ["backup@web1", "vacuum"]
    code, out = apply_cli(server, web2.token, str(jobs_d / "none"), "--host", "web2")
    assert code != 0  # no such directory: nothing applied
    before = snapshot(sched.store)
    # web2 applying the same file: its own job only; the db group's is not its to write
    code, out = apply_cli(server, web2.token, str(jobs_d), "--host", "web2")
    assert code == 6 and "may not write it" in out and "vacuum" in out, out
    assert snapshot(sched.store) == before  # refused before the first write
    # a token of another host, or without this host's group, is refused before anything
    for token, args, words in (
        (web2.token, ("--host", "web1", "--group", "db"), "host token of 'web2'"),
        (web1.token, ("--host", "web1", "--group", "db", "--group", "ops"), "group(s) ops"),
    ):
        code, out = apply_cli(server, token, str(jobs_d), *args)
        assert code == 2 and words in out, out
    assert snapshot(sched.store) == before
    # web1 removes what its files no longer define (the default); web2 never sees web1's
    (jobs_d / "host.toml").write_text(FILES.split('[[job]]\nname = "vacuum"')[0])
    code, out = apply_cli(server, web1.token, str(jobs_d), "--host", "web1", "--group", "db")
    assert code == 0 and json.loads(out)["removed"] == ["vacuum"], out
    listed = web2.request("GET", "/v1/jobs").json()["items"]
    assert listed == []
    names = {j["name"] for j in acme.request("GET", "/v1/jobs").json()["items"]}
    assert names == {"backup@web1"}


def test_apply_on_a_cron_host_takes_the_api_and_token_of_its_host_table(
    sched: Scheduler, server: ApiServer, acme: Api, tmp_path: Path
) -> None:
    jobs_d = tmp_path / "jobs.d"
    jobs_d.mkdir()
    (jobs_d / "host.toml").write_text(FILES)
    token = tmp_path / "host.token"
    token.write_text(host_token(sched, server, "web1", "db").token + "\n")
    token.chmod(0o600)
    config = tmp_path / "scheduled.toml"
    config.write_text(
        f'[host]\nname = "web1"\ngroups = ["db"]\napi_url = "{server.url}"\n'
        f'token_file = "{token}"\n'
    )
    result = CliRunner().invoke(app, ["--config", str(config), "-o", "json", "apply", str(jobs_d)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["created"] == ["backup@web1", "vacuum"]
    token.unlink()
    result = CliRunner().invoke(app, ["--config", str(config), "apply", str(jobs_d)])
    assert result.exit_code == 2 and "host.token_file" in result.output, result.output


def test_tenant_token_create_host_from_the_cli(sched: Scheduler, db_url: str) -> None:
    sched.create_tenant("acme", "test")

    def cli(*args: str) -> Any:
        result = CliRunner().invoke(app, ["--db", db_url, "-o", "json", "tenant", "token", *args])
        assert "Traceback" not in result.output
        return result

    made = cli("create", "acme", "--host", "web1", "--group", "db", "--group", "cache")
    assert made.exit_code == 0, made.output
    data = json.loads(made.output)
    assert (data["host"], data["groups"]) == ("web1", ["cache", "db"])
    assert data["token"].startswith("st_")
    listed = json.loads(cli("list", "acme").output)
    assert [(t["host"], t["groups"]) for t in listed] == [(None, []), ("web1", ["cache", "db"])]
    before = snapshot(sched.store)
    for args, words in (
        (("--host", "web 1"), "host: must be 1-63 letters, digits and . _ -"),
        (("--host", "web1", "--group", "a b"), "group: must be 1-63 letters"),
        (("--group", "db"), "group: --group goes with --host"),
    ):
        refused = cli("create", "acme", *args)
        assert refused.exit_code == 2 and words in refused.output, refused.output
    assert snapshot(sched.store) == before


def test_a_host_token_s_after_names_only_its_own_jobs(
    fleet: dict[str, Any], sched: Scheduler, tmp_path: Path, server: ApiServer
) -> None:
    web1, web2, acme = fleet["web1"], fleet["web2"], fleet["acme"]
    mine = {k: v for k, v in applied("verify", "web1").items() if k != "schedule"}
    # its own jobs, by name or id: allowed
    made = web1.request("POST", "/v1/jobs", json={**mine, "after": ["backup@web1", "vacuum"]})
    assert made.status_code == 201, made.text
    deps = web1.request("GET", f"/v1/jobs/{made.json()['job_id']}/dependencies").json()
    assert sorted(u["name"] for u in deps["upstream"]) == ["backup@web1", "vacuum"]
    before = snapshot(sched.store)
    # another host's job, a job made by hand, or an unknown one: 403 naming `after`
    for ref in (fleet["web2_job"], "backup@web2", "by-hand", "nope"):
        other = {k: v for k, v in applied("verify2", "web1").items() if k != "schedule"}
        body = {**other, "after": [ref]}
        refused = web1.request("POST", "/v1/jobs", json=body)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["field"] == "after", refused.text
        changed = web1.request("PATCH", f"/v1/jobs/{made.json()['job_id']}", json={"after": [ref]})
        assert changed.status_code == 403 and "after" in changed.text, changed.text
    assert snapshot(sched.store) == before
    # a tenant job running after web1's job stays out of web1's view of the graph
    hand = acme.request(
        "POST",
        "/v1/jobs",
        json={"name": "report", "after": ["backup@web1"], "target": {"type": "queue", "name": "q"}},
    )
    assert hand.status_code == 201, hand.text
    deps = web1.request("GET", f"/v1/jobs/{fleet['web1_job']}/dependencies").json()
    assert [d["name"] for d in deps["downstream"]] == ["verify@web1"]
    assert web2.request("GET", f"/v1/jobs/{fleet['web1_job']}/dependencies").status_code == 404
