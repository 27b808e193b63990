"""The web console (/ui) over HTTP on SQLite and Postgres: sign in and out, every page, the
isolation between tenants (each page and action with the other tenant's ids is 404 and
changes nothing), escaping, CSRF and the security headers, and bad input naming its field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from schedctl.app.service import Scheduler
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db import schema
from schedctl_bench.console import server_seconds
from scheduled_d.api.server import ApiServer
from tests.integration.api_support import snapshot
from tests.integration.console_support import seed
from tests.integration.queue_support import table_snapshot

CHANGED_TABLES = (schema.jobs, schema.runs, schema.dead_letters, schema.audit_log, schema.outbox)


class Browserish:
    """A browser's view of the served console: cookies kept, redirects not followed."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.session = requests.Session()

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.session.get(self.base_url + path, timeout=30, allow_redirects=False, **kwargs)

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        return self.session.post(self.base_url + path, timeout=30, allow_redirects=False, **kwargs)


@pytest.fixture
def app_client(server: ApiServer) -> Iterator[Browserish]:
    client = Browserish(server.url)
    try:
        yield client
    finally:
        client.session.close()


def sign_in(client: Browserish, token: str) -> str:
    response = client.post("/ui/signin", data={"token": token})
    assert response.status_code == 303, response.text
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert "Secure" not in cookie  # plain HTTP here; over TLS the cookie is Secure
    page = client.get("/ui/jobs")
    assert page.status_code == 200
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert match
    return match.group(1)


def state(sched: Scheduler) -> dict[str, object]:
    return table_snapshot(sched.store, CHANGED_TABLES)


def test_pages_show_the_tenants_data(sched: Scheduler, app_client: Browserish) -> None:
    a = seed(sched, "acme")
    assert app_client.get("/ui/jobs").status_code == 303  # not signed in: to sign in
    sign_in(app_client, a.token)
    jobs = app_client.get("/ui/jobs", params={"q": "NIGHTLY", "tz": "Asia/Tokyo"})
    assert "nightly-report" in jobs.text and "JST" in jobs.text and "CET" in jobs.text
    headers = jobs.headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "unsafe-inline" not in headers["content-security-policy"]
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"
    assert "nightly-report" in app_client.get("/ui/jobs", params={"id": a.job_id[:8]}).text
    assert "No job matches" in app_client.get("/ui/jobs", params={"q": "nothing-like"}).text
    job = app_client.get(f"/ui/jobs/{a.job_id}").text
    assert 'id="timeline"' in job and "run-succeeded" in job and "bar fire" in job
    assert "missed by more than its grace period" in job  # a skip's reason
    assert app_client.get(a.run_path).text.count("report of acme done") == 1
    running = app_client.get(a.running_path).text
    assert "data-follow" in running and "step 1 of 3" in running
    assert "following live" in app_client.get(a.running_path + "/output").text
    assert "worker said no" in app_client.get("/ui/dead-letters").text
    assert f"#{a.letter_id}" in app_client.get(f"/ui/dead-letters/{a.letter_id}").text
    assert "late now" in app_client.get("/ui/late").text
    assert "nightly-report" in app_client.get("/ui/late").text  # a dead run: failing
    assert app_client.get("/ui/workers").status_code == 200
    cluster = app_client.get("/ui/cluster")
    assert cluster.status_code == 200 and "partitions owned" in cluster.text


def test_dst_shifts_are_marked(sched: Scheduler, app_client: Browserish) -> None:
    tenant, token = sched.create_tenant("acme", "test")
    # monthly in Berlin: its next ten fires cross a change between CET and CEST whatever
    # the day the test runs
    job, _ = sched.create_job(
        tenant,
        {
            "name": "monthly",
            "schedule": {"cron": "0 12 1 * *", "timezone": "Europe/Berlin"},
            "target": {"type": "queue", "name": "q"},
        },
        actor="test",
    )
    sign_in(app_client, token)
    page = app_client.get(f"/ui/jobs/{job.job_id}").text
    assert "DST shift" in page and "+0200" in page and "+0100" in page


def test_another_tenants_ids_are_404_everywhere(sched: Scheduler, app_client: Browserish) -> None:
    a = seed(sched, "acme")
    b = seed(sched, "other", job_name="b-secret-job")
    csrf = sign_in(app_client, a.token)
    before = state(sched)
    pages = [
        f"/ui/jobs/{b.job_id}",
        b.run_path,
        b.running_path + "/output",
        f"/ui/dead-letters/{b.letter_id}",
        *(f"/ui/jobs/{b.job_id}/{action}" for action in ("pause", "resume", "trigger", "cancel")),
        *(f"/ui/dead-letters/{b.letter_id}/{action}" for action in ("replay", "purge")),
        # a's job with b's run time: a run that is not a's
        f"/ui/jobs/{a.job_id}/runs/{format_instant(b.run_at.replace(second=1))}",
    ]
    for path in pages:
        response = app_client.get(path)
        assert response.status_code == 404, path
        assert "b-secret-job" not in response.text and "report of other" not in response.text
    for path in pages[4:10]:
        response = app_client.post(path, data={"csrf": csrf})
        assert response.status_code == 404, path
    assert state(sched) == before
    for page in ("/ui/jobs", "/ui/dead-letters", "/ui/late", "/ui/workers", "/ui/cluster"):
        text = app_client.get(page, params={"status": "active"} if page == "/ui/jobs" else {}).text
        assert b.job_id not in text and "b-secret-job" not in text, page
        assert "other" not in text.replace("another", ""), page


def test_a_script_in_a_name_is_text(sched: Scheduler, app_client: Browserish) -> None:
    a = seed(sched, "acme", job_name="<script>alert(1)</script>")
    sign_in(app_client, a.token)
    for path in ("/ui/jobs", f"/ui/jobs/{a.job_id}", a.run_path, f"/ui/jobs/{a.job_id}/pause"):
        text = app_client.get(path).text
        assert "<script>alert(1)</script>" not in text, path
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text, path


def test_actions_need_the_csrf_token(sched: Scheduler, app_client: Browserish) -> None:
    a = seed(sched, "acme")
    csrf = sign_in(app_client, a.token)
    before = state(sched)
    for data in ({}, {"csrf": "0" * 64}, {"csrf": csrf[:-1]}):
        for path in (f"/ui/jobs/{a.job_id}/pause", f"/ui/dead-letters/{a.letter_id}/purge"):
            response = app_client.post(path, data=data)
            assert response.status_code == 403, (path, data)
            assert "csrf" in response.text
    cross = app_client.post(
        f"/ui/jobs/{a.job_id}/pause", data={"csrf": csrf}, headers={"Origin": "https://evil.test"}
    )
    assert cross.status_code == 403 and "origin" in cross.text
    assert state(sched) == before
    # with the token: done, and audited with the API's actor
    paused = app_client.post(f"/ui/jobs/{a.job_id}/pause", data={"csrf": csrf})
    assert paused.status_code == 303
    assert sched.get_job(a.job_id).status.value == "paused"
    entries = sched.audit(a.tenant, job_id=a.job_id, action="pause").items
    assert entries and entries[0].actor.startswith("token:")
    resumed = app_client.post(f"/ui/jobs/{a.job_id}/resume", data={"csrf": csrf})
    assert resumed.status_code == 303 and sched.get_job(a.job_id).status.value == "active"
    replayed = app_client.post(f"/ui/dead-letters/{a.letter_id}/replay", data={"csrf": csrf})
    assert replayed.status_code == 303
    assert "Replayed at" in app_client.get(f"/ui/dead-letters/{a.letter_id}").text
    out = app_client.post("/ui/signout", data={"csrf": csrf})
    assert out.status_code == 303
    assert app_client.get("/ui/jobs").status_code == 303


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/ui/jobs", {"status": "sleeping"}, "status"),
        ("/ui/jobs", {"cursor": "not-a-cursor!"}, "cursor"),
        ("/ui/jobs", {"tz": "Mars/Olympus"}, "tz"),
        ("/ui/jobs", {"id": "xyz"}, "id"),
        ("/ui/jobs", {"q": "x" * 300}, "q"),
        ("/ui/dead-letters", {"cursor": "zz"}, "cursor"),
        ("/ui/dead-letters", {"replayed": "maybe"}, "replayed"),
        ("JOB", {"cursor": "bm90LWEtdGltZQ"}, "cursor"),
    ],
)
def test_bad_input_is_an_error_page_naming_the_field(
    sched: Scheduler, app_client: Browserish, path: str, params: dict[str, str], field: str
) -> None:
    a = seed(sched, "acme")
    sign_in(app_client, a.token)
    before = snapshot(sched.store)
    response = app_client.get(f"/ui/jobs/{a.job_id}" if path == "JOB" else path, params=params)
    assert response.status_code == 422, response.text
    assert f'<b class="field" id="error-field">{field}</b>' in response.text
    assert snapshot(sched.store) == before


def test_a_bad_or_revoked_token_does_not_sign_in(sched: Scheduler, app_client: Browserish) -> None:
    a = seed(sched, "acme")
    refused = app_client.post("/ui/signin", data={"token": "st_nothing_like_a_token"})
    assert refused.status_code == 401 and "set-cookie" not in refused.headers
    sign_in(app_client, a.token)
    sched.revoke_token(a.token, actor="test")
    from schedctl.storage.tenants.token_cache import VERIFIED_TOKENS

    VERIFIED_TOKENS.clear()
    assert app_client.get("/ui/jobs").status_code == 303


def test_the_cookie_is_secure_behind_tls(sched: Scheduler, app_client: Browserish) -> None:
    # a TLS-terminating proxy on this machine says so (uvicorn trusts loopback's headers)
    a = seed(sched, "acme")
    response = app_client.post(
        "/ui/signin", data={"token": a.token}, headers={"X-Forwarded-Proto": "https"}
    )
    assert response.status_code == 303
    cookie = response.headers["set-cookie"]
    assert "Secure" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie


def test_the_script_and_stylesheet_are_served_from_the_package(app_client: Browserish) -> None:
    script = app_client.get("/ui/static/console.js")
    assert script.status_code == 200 and "text/javascript" in script.headers["content-type"]
    assert script.headers["x-content-type-options"] == "nosniff"
    assert "sd_tz" in script.text
    assert app_client.get("/ui/static/console.css").status_code == 200
    assert app_client.get("/ui/static/..%2Fpages.py").status_code == 404
    # the sign-in page loads no script but the package's own
    page = app_client.get("/ui/signin").text
    assert '<script src="/ui/static/console.js" defer></script>' in page
    assert page.count("<script") == 1


def test_a_host_token_does_not_sign_in(sched: Scheduler, app_client: Browserish) -> None:
    a = seed(sched, "acme")
    host_token = sched.new_token(a.tenant.name, actor="test", host="web-1")
    refused = app_client.post("/ui/signin", data={"token": host_token})
    assert refused.status_code == 403 and "set-cookie" not in refused.headers
    assert '<b class="field" id="error-field">token</b>' in refused.text
    # nor does a cookie holding one open a page
    app_client.session.cookies.set("sd_console", host_token, path="/ui")
    assert app_client.get("/ui/jobs").status_code == 303


def test_console_responses_say_their_server_time(app_client: Browserish) -> None:
    """Server-Timing on /ui (what `schedctl bench console` reports as server time), and
    only there: the JSON API's responses are unchanged."""
    page = app_client.get("/ui/signin")
    header = page.headers.get("server-timing", "")
    assert re.fullmatch(r"app;dur=\d+\.\d", header), header
    took = server_seconds(header)
    assert took is not None and took >= 0
    assert "server-timing" not in app_client.get("/healthz").headers
    assert server_seconds("") is None
    assert server_seconds("db;dur=3, app;dur=12.5") == 0.0125
    assert server_seconds("app;dur=x") is None
