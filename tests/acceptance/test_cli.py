"""Owns the acceptance tests of the `schedctl` CLI: every command group on a real database
(SQLite, and Postgres where cheap), exit codes, error messages, and the console script."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app
from tests.acceptance.process_support import schedctl_command

UNREACHABLE = "postgresql+psycopg://postgres@127.0.0.1:1/x"

runner = CliRunner()
NO_DEPENDENCIES: dict[str, Any] = {"upstream": [], "downstream": []}


def invoke(*args: str, db: str | None = None, env: dict[str, str] | None = None) -> Any:
    argv = (["--db", db] if db is not None else []) + list(args)
    result = runner.invoke(app, argv, env=env)
    # a traceback reaching a user is a bug, whatever the exit code
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{result.output}")
    return result


def ok(*args: str, db: str | None = None) -> Any:
    result = invoke(*args, db=db)
    assert result.exit_code == 0, result.output
    return result


def ok_json(*args: str, db: str | None = None) -> Any:
    return json.loads(ok(*args, "--output", "json", db=db).stdout)


def future(hours: int = 2) -> str:
    return (datetime.now(UTC) + timedelta(hours=hours)).replace(microsecond=0).isoformat()


@pytest.fixture
def tenant(db_url: str) -> str:
    ok("tenant", "create", "acme", db=db_url)
    return "acme"


def create_job(db: str, *options: str) -> dict[str, Any]:
    data: dict[str, Any] = ok_json("job", "create", "--tenant", "acme", *options, db=db)
    return data


# -- db --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_db_upgrade_is_idempotent(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("empty_sqlite_url" if backend == "sqlite" else "empty_pg_url")
    behind = invoke("db", "status", "-o", "json", db=url)
    assert behind.exit_code == 2, behind.output  # a schema behind is not a success
    status = json.loads(behind.stdout)
    assert status["current"] is None and status["up_to_date"] is False
    table = invoke("db", "status", db=url)
    assert table.exit_code == 2 and "schedctl db upgrade" in table.stdout
    first = ok_json("db", "upgrade", db=url)
    assert first["before"] is None and first["after"] == status["head"] and first["changed"]
    assert first["partition_count"] == 1024
    second = ok_json("db", "upgrade", db=url)
    assert (second["before"], second["after"], second["changed"]) == (
        status["head"],
        status["head"],
        False,
    )
    assert ok_json("db", "status", db=url)["up_to_date"] is True
    assert "already at revision" in ok("db", "upgrade", db=url).stdout


def test_a_new_sqlite_file_gets_its_schema_on_first_use(empty_sqlite_url: str) -> None:
    # as scheduled-d does: a new (or empty) SQLite file is set up by the first command
    created = invoke("tenant", "create", "demo", db=empty_sqlite_url)
    assert created.exit_code == 0, created.output
    assert ok_json("db", "status", db=empty_sqlite_url)["up_to_date"] is True
    assert [t["name"] for t in ok_json("tenant", "list", db=empty_sqlite_url)] == ["demo"]


def test_a_sqlite_file_behind_is_not_upgraded_behind_the_operators_back(tmp_path: Path) -> None:
    from schedctl.storage.db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0001")
    result = invoke("tenant", "list", db=url)
    assert result.exit_code == 2, result.output
    assert "revision 0001" in result.stderr and "schedctl db upgrade" in result.stderr
    assert ok_json("db", "upgrade", db=url)["before"] == "0001"
    assert invoke("tenant", "list", db=url).exit_code == 0


@pytest.mark.postgres
def test_postgres_without_the_schema_says_to_upgrade(empty_pg_url: str) -> None:
    result = invoke("tenant", "create", "demo", db=empty_pg_url)
    assert result.exit_code == 2, result.output
    assert "schedctl db upgrade" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert invoke("db", "status", db=empty_pg_url).exit_code == 2  # nothing was created


def test_unreachable_database() -> None:
    for args in (
        ["tenant", "list"],
        ["db", "upgrade"],
        ["db", "downgrade"],
        ["db", "status"],
        ["job", "show", "x"],
    ):
        result = invoke(*args, db=UNREACHABLE)
        assert result.exit_code == 7, result.output
        assert result.stderr.startswith("error: cannot reach the database"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_embedded_default_sets_itself_up(tmp_path: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path / "data"), "SCHEDULED_DATABASE_URL": None}
    result = runner.invoke(app, ["tenant", "create", "demo"], env=env)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "data" / "scheduled" / "scheduled.db").exists()
    listed = runner.invoke(app, ["-o", "json", "tenant", "list"], env=env)
    assert [t["name"] for t in json.loads(listed.stdout)] == ["demo"]


# -- tenants ---------------------------------------------------------------------------


def test_tenant_create_shows_the_token_once(db_url: str) -> None:
    result = ok("tenant", "create", "acme", db=db_url)
    token = next(line for line in result.stdout.splitlines() if line.startswith("st_"))
    assert "will not be shown again" in result.stdout
    with Scheduler.open(db_url) as sched:
        assert sched.tenants.authenticate(token)[0] == sched.get_tenant("acme").tenant_id
    listed = ok_json("tenant", "list", db=db_url)
    assert [t["name"] for t in listed] == ["acme"]
    shown = ok_json("tenant", "show", "acme", db=db_url)
    assert shown == listed[0]
    for output in (json.dumps(listed), ok("tenant", "show", "acme", db=db_url).stdout):
        assert token not in output
    as_json = ok_json("tenant", "create", "other", db=db_url)
    assert as_json["token"].startswith("st_") and as_json["name"] == "other"
    duplicate = invoke("tenant", "create", "acme", db=db_url)
    assert duplicate.exit_code == 4 and "name" in duplicate.stderr


# -- jobs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "kind"),
    [
        (["--at", "AT"], "once"),
        (["--in", "10m"], "once"),
        (["--cron", "0 8 * * MON", "--tz", "Asia/Kolkata"], "cron"),
        (["--cron", "@hourly"], "cron"),
        (["--every", "30s"], "interval"),
    ],
    ids=["at", "in", "cron-tz", "cron-utc", "every"],
)
def test_job_create_each_kind(db_url: str, tenant: str, options: list[str], kind: str) -> None:
    options = [future() if o == "AT" else o for o in options]
    job = create_job(db_url, *options, "--queue", "backups")
    assert job["created"] is True and job["status"] == "active"
    assert job["schedule"]["kind"] == kind
    assert job["target"] == {"type": "queue", "name": "backups"}
    assert job["next_run_at"].endswith("Z")
    if "--tz" in options:
        assert job["schedule"]["timezone"] == "Asia/Kolkata"


def test_job_create_all_options(db_url: str, tenant: str, tmp_path: Path) -> None:
    payload_file = tmp_path / "payload.json"
    payload_file.write_text('{"report": "daily", "ids": [1, 2]}')
    job = create_job(
        db_url,
        "--every", "1h",
        "--url", "https://hooks.example.com/run",
        "--payload-file", str(payload_file),
        "--max-attempts", "5",
        "--misfire", "skip",
        "--grace", "2m",
        "--window", "5m",
        "--max-concurrency", "0",
        "--timeout", "30m",
        "--start", future(1),
        "--end", future(48),
        "--idempotency-key", "k-1",
        "--name", "hourly report",
    )  # fmt: skip
    assert job["payload"] == {"report": "daily", "ids": [1, 2]}
    assert job["target"] == {"type": "http", "url": "https://hooks.example.com/run"}
    assert job["retry"]["max_attempts"] == 5 and job["misfire_policy"] == "skip"
    assert (job["grace_seconds"], job["window_seconds"], job["timeout_seconds"]) == (120, 300, 1800)
    assert job["max_concurrency"] is None and job["name"] == "hourly report"
    assert job["start_at"] and job["end_at"] and job["idempotency_key"] == "k-1"


def test_job_create_idempotency_key(db_url: str, tenant: str) -> None:
    args = ("--in", "1h", "--queue", "q", "--idempotency-key", "same", "--payload", '{"a": 1}')
    first = create_job(db_url, *args)
    again = create_job(db_url, *args)
    assert again["job_id"] == first["job_id"] and again["created"] is False
    other = invoke(
        "job", "create", "--tenant", "acme", "--in", "1h", "--queue", "q",
        "--idempotency-key", "same", "--payload", '{"a": 2}', db=db_url,
    )  # fmt: skip
    assert other.exit_code == 4 and "idempotency_key" in other.stderr


def test_job_lifecycle(db_url: str, tenant: str) -> None:
    job = create_job(db_url, "--cron", "*/5 * * * *", "--queue", "q", "--name", "five")
    job_id = job["job_id"]

    listed = ok_json("job", "list", "--tenant", "acme", db=db_url)
    assert [j["job_id"] for j in listed["items"]] == [job_id] and listed["next_cursor"] is None
    table = ok("job", "list", db=db_url).stdout
    # the table shows the shortest unique id prefix (8+ characters), which commands accept
    assert job_id[:8] in table and "five" in table and "cron */5 * * * * (UTC)" in table
    # --output on the root works as well as on the command
    shown = json.loads(ok("-o", "json", "job", "show", job_id, db=db_url).stdout)
    # show adds the job's dependency trees (`after`): none here
    assert shown == {**{k: v for k, v in job.items() if k != "created"}, **NO_DEPENDENCIES}
    assert job_id in ok("job", "show", job_id, db=db_url).stdout

    paused = ok_json("job", "pause", job_id, db=db_url)
    assert paused["status"] == "paused" and paused["version"] == 2
    resumed = ok_json("job", "resume", job_id, db=db_url)
    assert resumed["status"] == "active" and resumed["version"] == 3

    run = ok_json("job", "trigger", job_id, db=db_url)
    assert run["trigger"] == "manual" and run["status"] == "dispatched"
    assert run["idempotency_key"] == f"{job_id}:{run['scheduled_at']}"
    runs = ok_json("runs", job_id, db=db_url)
    assert [r["scheduled_at"] for r in runs["items"]] == [run["scheduled_at"]]
    runs_table = ok("runs", job_id, db=db_url).stdout
    assert "manual" in runs_table and "dispatched" in runs_table

    at = future(5)
    moved = ok_json("job", "reschedule", job_id, "--at", at, db=db_url)
    assert moved["schedule"]["kind"] == "once" and moved["version"] == 4
    assert datetime.fromisoformat(moved["next_run_at"]) == datetime.fromisoformat(at)
    cron = ok_json(
        "job", "reschedule", job_id, "--cron", "0 9 * * *", "--tz", "Europe/Paris", db=db_url
    )
    assert cron["schedule"] == {"kind": "cron", "cron": "0 9 * * *", "timezone": "Europe/Paris"}

    cancelled = ok_json("job", "cancel", job_id, db=db_url)
    assert cancelled["status"] == "cancelled" and cancelled["next_run_at"] is None
    again = invoke("job", "cancel", job_id, db=db_url)
    assert again.exit_code == 4 and "cancelled" in again.stderr
    assert (
        ok_json("job", "list", "--status", "cancelled", db=db_url)["items"][0]["job_id"] == job_id
    )


def test_list_and_runs_paging_print_the_next_cursor(db_url: str, tenant: str) -> None:
    ids = [create_job(db_url, "--in", "1h", "--queue", "q")["job_id"] for _ in range(3)]
    first = ok_json("job", "list", "--limit", "2", db=db_url)
    second = ok_json("job", "list", "--limit", "2", "--cursor", first["next_cursor"], db=db_url)
    assert [j["job_id"] for j in first["items"] + second["items"]] == ids
    assert second["next_cursor"] is None
    assert f"--cursor {first['next_cursor']}" in ok("job", "list", "--limit", "2", db=db_url).stdout

    for _ in range(3):
        ok("job", "trigger", ids[0], db=db_url)
    page = ok_json("runs", ids[0], "--limit", "2", db=db_url)
    rest = ok_json("runs", ids[0], "--limit", "2", "--cursor", page["next_cursor"], db=db_url)
    times = [r["scheduled_at"] for r in page["items"] + rest["items"]]
    assert len(times) == 3 and times == sorted(times, reverse=True)


def test_other_tenants_jobs_are_not_found(db_url: str, tenant: str) -> None:
    ok("tenant", "create", "other", db=db_url)
    job = create_job(db_url, "--in", "1h", "--queue", "q")
    result = invoke("job", "show", job["job_id"], "--tenant", "other", db=db_url)
    assert result.exit_code == 3 and "job_id" in result.stderr
    assert ok_json("job", "list", "--tenant", "other", db=db_url)["items"] == []


# -- bad input -------------------------------------------------------------------------

BAD = {
    "unknown time zone": (["--cron", "0 8 * * *", "--tz", "Mars/Base", "--queue", "q"], "timezone"),
    "invalid cron": (["--cron", "0 8 * *", "--queue", "q"], "cron"),
    "never-firing cron": (["--cron", "0 0 30 2 *", "--queue", "q"], "cron"),
    "run_at in the past": (["--at", "2001-01-01T00:00:00Z", "--queue", "q"], "run_at"),
    "run_at without offset": (["--at", "2099-01-01T00:00:00", "--queue", "q"], "run_at"),
    "malformed payload": (["--in", "1m", "--queue", "q", "--payload", "{oops"], "payload"),
    "oversized payload": (
        ["--in", "1m", "--queue", "q", "--payload", json.dumps({"x": "y" * 70_000})],
        "payload",
    ),
    "zero interval": (["--every", "0s", "--queue", "q"], "interval"),
    "zero delay": (["--in", "0s", "--queue", "q"], "delay"),
    "max attempts 0": (["--in", "1m", "--queue", "q", "--max-attempts", "0"], "retry.max_attempts"),
    "bad misfire": (["--in", "1m", "--queue", "q", "--misfire", "later"], "misfire_policy"),
    "url without host": (["--in", "1m", "--url", "https://"], "target.url"),
    "no schedule": (["--queue", "q"], "--at, --in, --cron, --every"),
    "two schedules": (["--in", "1m", "--every", "1m", "--queue", "q"], "schedule"),
    "no target": (["--in", "1m"], "--queue, --url"),
    "two targets": (["--in", "1m", "--queue", "q", "--url", "https://x.example"], "target"),
    "tz without cron": (["--in", "1m", "--tz", "UTC", "--queue", "q"], "--tz"),
    "end before start": (
        [
            "--every",
            "1m",
            "--queue",
            "q",
            "--start",
            "2099-02-01T00:00:00Z",
            "--end",
            "2099-01-01T00:00:00Z",
        ],
        "end",
    ),
}


@pytest.mark.parametrize(("options", "field"), BAD.values(), ids=BAD.keys())
def test_bad_input_names_the_field_and_changes_nothing(
    sqlite_url: str, options: list[str], field: str
) -> None:
    ok("tenant", "create", "acme", db=sqlite_url)
    result = invoke("job", "create", "--tenant", "acme", *options, db=sqlite_url)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ")
    assert field in result.stderr
    assert ok_json("job", "list", db=sqlite_url)["items"] == []


def test_other_errors_and_their_exit_codes(sqlite_url: str) -> None:
    ok("tenant", "create", "acme", db=sqlite_url)
    cases = [
        (["job", "show", "nope"], 3, "job_id"),
        (["job", "create", "--tenant", "ghost", "--in", "1m", "--queue", "q"], 3, "tenant"),
        (["tenant", "show", "ghost"], 3, "tenant"),
        (["tenant", "create", "bad name"], 2, "name"),
        (["job", "list", "--status", "sleeping"], 2, "status"),
        (["job", "list", "--limit", "0"], 2, "limit"),
        (["job", "list", "--cursor", "!!!not-a-cursor"], 2, "cursor"),
        (["job", "reschedule", "nope", "--in", "1m"], 3, "job_id"),
        (["job", "create", "--tenant", "acme", "--in", "1m", "--queue", "q", "--output", "xml"],
         2, "--output"),
        (["job", "frobnicate"], 2, "frobnicate"),
    ]  # fmt: skip
    for args, code, needle in cases:
        result = invoke(*args, db=sqlite_url)
        assert result.exit_code == code, (args, result.output)
        assert needle in result.stderr, (args, result.stderr)


def test_internal_errors_are_one_line_unless_debugging(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(self: Scheduler) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Scheduler, "list_tenants", boom)
    result = invoke("tenant", "list", db=sqlite_url)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == "internal error: RuntimeError: disk on fire"
    debug = runner.invoke(app, ["--debug", "--db", sqlite_url, "tenant", "list"])
    assert debug.exit_code == 1 and "Traceback" in debug.stderr


def test_names_with_brackets_render_in_tables(sqlite_url: str) -> None:
    ok("tenant", "create", "acme", db=sqlite_url)
    create_job(sqlite_url, "--in", "1h", "--queue", "q", "--name", "[/x] odd [bold]name")
    assert "[/x] odd [bold]name" in ok("job", "list", db=sqlite_url).stdout


def test_cron_preview_is_registered() -> None:
    result = ok("cron", "next", "0 8 * * *", "--tz", "UTC", "-n", "2", "--output", "json")
    assert len(json.loads(result.stdout)) == 2
    rooted = runner.invoke(app, ["-o", "json", "cron", "next", "0 8 * * *", "-n", "2"])
    assert rooted.exit_code == 0 and len(json.loads(rooted.stdout)) == 2


def test_help_lists_the_commands_and_exit_codes() -> None:
    text = ok("--help").stdout
    for command in ("db", "tenant", "job", "runs", "cron"):
        assert command in text
    assert "7 database unavailable" in text
    assert "--output" in ok("job", "create", "--help").stdout


# -- the installed console script ------------------------------------------------------


def test_console_script(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*schedctl_command(), *args], capture_output=True, text=True, env=env, timeout=60
        )
        assert "Traceback" not in done.stdout + done.stderr
        return done

    assert run("--help").returncode == 0
    assert run("--version").stdout.startswith("schedctl ")
    db = f"sqlite:///{tmp_path / 'explicit.db'}"
    assert run("--db", db, "db", "upgrade").returncode == 0
    created = run("--db", db, "-o", "json", "tenant", "create", "demo")
    assert created.returncode == 0 and json.loads(created.stdout)["token"].startswith("st_")
    bad = run(
        "--db", db, "job", "create", "--tenant", "demo", "--cron", "0 0 30 2 *", "--queue", "q"
    )
    assert bad.returncode == 2 and "cron" in bad.stderr
    down = run("--db", UNREACHABLE, "job", "list")
    assert down.returncode == 7 and down.stderr.startswith("error: cannot reach the database")
    # the embedded default: no configuration at all, on a fresh machine
    fresh = run("tenant", "create", "demo")
    assert fresh.returncode == 0 and "st_" in fresh.stdout
