"""Owns the acceptance tests of `schedctl --api URL`: the job and runs commands against a real
uvicorn serving the tenant API on 127.0.0.1 (a free port, in a thread), with the same output
and exit codes as against the database; and `scheduled-d api` / `scheduled-d all` with the
API enabled, as real processes stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.app.views import job_to_dict
from schedctl.cli.app import app
from schedctl.domain.job_refs import shortest_among
from scheduled_d.api.server import ApiServer
from tests.acceptance.process_support import killed_if_left, stops_on_sigterm
from tests.services.ports import free_port

BIN = Path(sys.executable).parent
START_SECONDS = 60.0

runner = CliRunner()


@dataclass
class Remote:
    url: str
    token: str
    sched: Scheduler
    db_url: str


@pytest.fixture
def remote(db_url: str) -> Iterator[Remote]:
    sched = Scheduler.open(db_url)
    _, token = sched.create_tenant("acme", "test")
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        yield Remote(server.url, token, sched, db_url)
    finally:
        server.stop()
        sched.close()


def invoke(remote: Remote, *args: str, env: dict[str, str] | None = None) -> Any:
    argv = ["--api", remote.url, "--token", remote.token, *args]
    result = runner.invoke(app, argv, env=env)
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{result.output}")
    return result


def ok_json(remote: Remote, *args: str) -> Any:
    result = invoke(remote, *args, "--output", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_job_lifecycle_through_the_api(remote: Remote) -> None:
    created = ok_json(
        remote,
        "job", "create", "--tenant", "acme", "--every", "1h", "--queue", "reports",
        "--payload", '{"report": "hourly"}', "--idempotency-key", "hourly", "--name", "hourly",
    )  # fmt: skip
    assert created["created"] is True and created["payload"] == {"report": "hourly"}
    job_id = created["job_id"]
    again = ok_json(
        remote,
        "job", "create", "--tenant", "acme", "--every", "1h", "--queue", "reports",
        "--payload", '{"report": "hourly"}', "--idempotency-key", "hourly", "--name", "hourly",
    )  # fmt: skip
    assert again["created"] is False and again["job_id"] == job_id
    # with --api the token names the tenant, so --tenant may be left out
    tokened = ok_json(remote, "job", "create", "--in", "1h", "--queue", "reports")
    assert tokened["tenant_id"] == created["tenant_id"]
    assert ok_json(remote, "job", "cancel", tokened["job_id"])["status"] == "cancelled"
    # what the API shows is what the database holds
    shown = ok_json(remote, "job", "show", job_id)
    # with the job's dependency trees (`after`): none here
    assert shown == {**job_to_dict(remote.sched.get_job(job_id)), "upstream": [], "downstream": []}
    listed = ok_json(remote, "job", "list", "--status", "active")
    assert [j["job_id"] for j in listed["items"]] == [job_id]
    assert ok_json(remote, "job", "pause", job_id)["status"] == "paused"
    assert ok_json(remote, "job", "resume", job_id)["status"] == "active"
    run = ok_json(remote, "job", "trigger", job_id)
    assert run["trigger"] == "manual"
    runs = ok_json(remote, "runs", job_id)
    assert [r["scheduled_at"] for r in runs["items"]] == [run["scheduled_at"]]
    moved = ok_json(remote, "job", "reschedule", job_id, "--cron", "0 6 * * *", "--tz", "UTC")
    assert moved["schedule"] == {"kind": "cron", "cron": "0 6 * * *", "timezone": "UTC"}
    cancelled = ok_json(remote, "job", "cancel", job_id)
    assert cancelled["status"] == "cancelled"
    # the audit log names the token, not the operator's login
    actions = [e.action for e in remote.sched.audit("acme", job_id=job_id).items]
    assert actions == ["cancel", "reschedule", "trigger", "resume", "pause", "create"]
    token_id = remote.token.split("_")[1]
    assert {e.actor for e in remote.sched.audit("acme", job_id=job_id).items} == {
        f"token:{token_id}"
    }


def test_tables_and_paging_through_the_api(remote: Remote) -> None:
    ids = [
        ok_json(remote, *"job create --tenant acme --in 1h --queue q".split())["job_id"]
        for _ in range(3)
    ]
    page = ok_json(remote, "job", "list", "--limit", "2")
    assert [j["job_id"] for j in page["items"]] == ids[:2]
    rest = ok_json(remote, "job", "list", "--limit", "2", "--cursor", page["next_cursor"])
    assert [j["job_id"] for j in rest["items"]] == ids[2:]
    table = invoke(remote, "job", "list", "--limit", "2")
    # with --api the table shows each id's shortest prefix unique among the listed rows
    short = shortest_among(ids[:2])[ids[0]]
    assert table.exit_code == 0 and short in table.stdout and "more: --cursor" in table.stdout
    assert ok_json(remote, "job", "show", short)["job_id"] == ids[0]
    shown = invoke(remote, "job", "show", ids[0])
    assert shown.exit_code == 0 and ids[0] in shown.stdout
    empty = invoke(remote, "runs", ids[0])
    assert empty.exit_code == 0 and "has no runs yet" in empty.stdout


def test_the_environment_gives_url_and_token(remote: Remote) -> None:
    result = runner.invoke(
        app,
        ["job", "list", "-o", "json"],
        env={"SCHEDULED_API_URL": remote.url, "SCHEDULED_API_TOKEN": remote.token},
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["items"] == []


ERRORS = {
    "unknown job": (["job", "show", "0123456789abcdef"], 3, "no job"),
    "invalid cron": (
        ["job", "create", "-t", "acme", "--cron", "0 25 * * *", "--queue", "q"],
        2,
        "cron",
    ),
    "oversized payload": (
        [
            *"job create -t acme --in 1m --queue q --payload".split(),
            json.dumps({"x": "y" * 70_000}),
        ],
        2,
        "payload",
    ),
    "payload integer of 5,000 digits": (
        [*"job create -t acme --in 1m --queue q --payload".split(), "[" + "9" * 5000 + "]"],
        2,
        "payload",
    ),
    "payload nested 20,000 deep": (
        [*"job create -t acme --in 1m --queue q --payload".split(), "[" * 20_000 + "]" * 20_000],
        2,
        "payload",
    ),
    "Arabic-Indic minutes": (
        ["job", "create", "-t", "acme", "--in", "\u0663m", "--queue", "q"],
        2,
        "delay",
    ),
    "max concurrency 1e20": (
        [*"job create -t acme --in 1m --queue q --max-concurrency 1e20".split()],
        2,
        "max_concurrency",
    ),
    "cursor of 25 digits": (["job", "list", "--cursor", "1234567890123456789012345"], 2, "cursor"),
    "runs cursor of a huge id": (
        ["runs", "0123456789abcdef", "--cursor", "OTIyMzM3MjAzNjg1NDc3NTgwOA"],
        2,
        "cursor",
    ),
    "other tenant named": (["job", "list", "--tenant", "someone-else"], 2, "token decides"),
    "tenant command": (["tenant", "list"], 2, "cannot go through the API"),
    "db command": (["db", "status"], 2, "cannot go through the API"),
    "audit": (["audit"], 2, "cannot go through the API"),
}


@pytest.mark.parametrize(("args", "code", "text"), ERRORS.values(), ids=ERRORS.keys())
def test_errors_keep_their_exit_codes(
    remote: Remote, args: list[str], code: int, text: str
) -> None:
    result = invoke(remote, *args)
    assert result.exit_code == code, result.output
    assert text in result.stderr


def test_conflicts_quotas_and_tokens(remote: Remote) -> None:
    job = ok_json(remote, *"job create -t acme --in 1h --queue q --idempotency-key k".split())
    other_body = invoke(remote, *"job create -t acme --in 2h --queue q --idempotency-key k".split())
    assert other_body.exit_code == 4 and "idempotency" in other_body.stderr
    ok_json(remote, "job", "pause", job["job_id"])
    assert invoke(remote, "job", "pause", job["job_id"]).exit_code == 4
    remote.sched.set_quotas("acme", max_jobs=1, actor="test")
    over = invoke(remote, *"job create -t acme --in 1h --queue q".split())
    assert over.exit_code == 5 and "limit of 1 active jobs" in over.stderr
    bad = runner.invoke(
        app, ["--api", remote.url, "--token", remote.token[:-3] + "xyz", "job", "list"]
    )
    assert bad.exit_code == 6 and "invalid API token" in bad.stderr
    missing = runner.invoke(app, ["--api", remote.url, "job", "list"])
    assert missing.exit_code == 6 and "SCHEDULED_API_TOKEN" in missing.stderr


def test_an_unreachable_api_is_exit_7(remote: Remote) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["--api", closed, "--token", remote.token, "job", "list"])
    assert result.exit_code == 7 and "cannot reach the API" in result.stderr


def test_the_console_script_against_the_api(remote: Remote) -> None:
    env = {
        **os.environ,
        "SCHEDULED_API_URL": remote.url,
        "SCHEDULED_API_TOKEN": remote.token,
    }
    made = subprocess.run(
        [BIN / "schedctl", *"job create -t acme --in 10m --queue q -o json".split()],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    job_id = json.loads(made.stdout)["job_id"]
    shown = subprocess.run(
        [BIN / "schedctl", "job", "show", job_id, "-o", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert shown.returncode == 0 and json.loads(shown.stdout)["job_id"] == job_id


# -- the daemon modes ------------------------------------------------------------------


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            if requests.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"no /healthz within {START_SECONDS} s:\n{log.read_text()}")


@contextmanager
def _run_daemon(
    tmp_path: Path, args: list[str], url: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    log = tmp_path / "daemon.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [BIN / "scheduled-d", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    with killed_if_left(process):
        _wait_healthy(url, process, log)
        yield process


def test_scheduled_d_api_serves_the_cli_and_stops_on_sigterm(
    tmp_path: Path, sqlite_url: str
) -> None:
    with Scheduler.open(sqlite_url) as sched:
        _, token = sched.create_tenant("acme", "test")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["api", "--db", sqlite_url, "--listen", f"127.0.0.1:{port}"]
    with _run_daemon(tmp_path, args, url) as process:
        made = runner.invoke(
            app,
            [
                "--api",
                url,
                "--token",
                token,
                *"job create -t acme --in 1h --queue q -o json".split(),
            ],
        )
        assert made.exit_code == 0, made.output
        job_id = json.loads(made.stdout)["job_id"]
        assert requests.get(url + "/openapi.json", timeout=10).status_code == 200
        stops_on_sigterm(process, tmp_path / "daemon.log")
    with Scheduler.open(sqlite_url) as sched:
        assert sched.get_job(job_id).status.value == "active"


def test_scheduled_d_all_starts_the_api_when_enabled(tmp_path: Path, sqlite_url: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"SCHEDULED_API_ENABLED": "true", "SCHEDULED_API_LISTEN": f"127.0.0.1:{port}"}
    with _run_daemon(tmp_path, ["all", "--db", sqlite_url], url, env) as process:
        unauthenticated = requests.get(url + "/v1/jobs", timeout=10)
        assert unauthenticated.status_code == 401
        stops_on_sigterm(process, tmp_path / "daemon.log")


def test_a_taken_port_fails_the_start(sqlite_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [BIN / "scheduled-d", "api", "--db", sqlite_url, "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert "cannot listen on 127.0.0.1" in result.stderr
