"""Owns the acceptance tests of `schedctl logs JOB [RUN] [--follow]` on a real database with a
real worker running real commands: by name, by run (time or run key), each attempt under its
header, -o json, a bad RUN naming the field, --follow seeing a run that finishes after it
started (a real `schedctl` process), and the same through `--api`."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import QueueRepo
from scheduled_d.api.server import ApiServer
from scheduled_d.worker import Worker
from tests.factories import make_tenant
from tests.integration.queue_support import queue_job, run_row, trigger, wait_for

BIN = Path(sys.executable).parent
runner = CliRunner()
# fails its first attempt (exit 3), succeeds on the second; says which on both streams
COMMAND = [
    sys.executable,
    "-c",
    "import os, sys\n"
    "attempt = os.environ['SCHED_ATTEMPT']\n"
    "print('output of attempt', attempt, 'of', os.environ['SCHED_SCHEDULED_AT'])\n"
    "sys.stderr.write('complaint ' + attempt + '\\n')\n"
    "sys.exit(3 if attempt == '1' else 0)\n",
]


def invoke(*args: str) -> Any:
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{result.output}")
    return result


@pytest.fixture
def store(sqlite_url: str) -> Iterator[Store]:
    store = Store.open(sqlite_url)
    make_tenant(store)
    yield store
    store.close()


def named_job(store: Store, db: str) -> str:
    job = queue_job(store, max_attempts=2)
    result = invoke("--db", db, "job", "update", job, "--name", "backup")
    assert result.exit_code == 0, result.output
    return job


def run_once(store: Store, job: str) -> datetime:
    """A manual run of `job`, run by a real worker until it succeeded (on its second try)."""
    at = trigger(store, job)
    QueueRepo(store).move_outbox()
    w = Worker(store, "q", COMMAND, lease_seconds=2.0, heartbeat_seconds=0.3, poll_seconds=0.05)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: w.run(stop), daemon=True)
    thread.start()
    try:
        wait_for(lambda: run_row(store, job, at)["status"] == "succeeded", "the run")
    finally:
        stop.set()
        thread.join(60)
    return at


def test_logs_by_name_shows_each_attempt_under_its_header(store: Store, sqlite_url: str) -> None:
    job = named_job(store, sqlite_url)
    at = run_once(store, job)
    result = invoke("--db", sqlite_url, "logs", "backup")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    when = format_instant(at)
    first = next(i for i, line in enumerate(lines) if "attempt 1: failed" in line)
    second = next(i for i, line in enumerate(lines) if "attempt 2: succeeded" in line)
    assert first < second
    assert lines[first].startswith(f"=== job {job} run {when} attempt 1: failed, started ")
    assert "exit code 3" in lines[first] and "finished" in lines[first]
    assert "exit code 0" in lines[second]
    assert f"output of attempt 1 of {when}" in lines[first + 1 : second]
    assert "complaint 1" in "\n".join(lines[first + 1 : second])
    assert f"output of attempt 2 of {when}" in lines[second + 1 :]


def test_logs_by_run_time_or_key_and_the_latest_by_default(store: Store, sqlite_url: str) -> None:
    job = named_job(store, sqlite_url)
    older, newer = run_once(store, job), run_once(store, job)
    latest = invoke("--db", sqlite_url, "logs", job[:8]).stdout
    assert f"of {format_instant(newer)}" in latest and format_instant(older) not in latest
    for run in (format_instant(older), f"{job}:{format_instant(older)}"):
        shown = invoke("--db", sqlite_url, "logs", "backup", run)
        assert shown.exit_code == 0, shown.output
        assert f"output of attempt 2 of {format_instant(older)}" in shown.stdout
        assert format_instant(newer) not in shown.stdout
    missing = invoke("--db", sqlite_url, "logs", "backup", "2020-01-01T00:00:00Z")
    assert missing.exit_code == 3 and "no run scheduled at" in missing.output


def test_logs_json_gives_the_runs_with_their_output(store: Store, sqlite_url: str) -> None:
    job = named_job(store, sqlite_url)
    at = run_once(store, job)
    result = invoke("--db", sqlite_url, "logs", "backup", "-o", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["job_id"] == job
    (run,) = data["runs"]
    assert run["scheduled_at"] == format_instant(at) and run["status"] == "succeeded"
    assert run["run_key"] == f"{job}:{format_instant(at)}"
    one, two = run["attempts"]
    assert (one["attempt"], one["status"], one["exit_code"]) == (1, "failed", 3)
    assert (two["attempt"], two["status"], two["exit_code"]) == (2, "succeeded", 0)
    assert two["output"].startswith("output of attempt 2") and "complaint 2" in two["output"]


@pytest.mark.parametrize("bad", ["yesterday", "2026-13-01T00:00:00Z", "abc:def", "12:00"])
def test_a_bad_run_is_refused_naming_the_field(store: Store, sqlite_url: str, bad: str) -> None:
    named_job(store, sqlite_url)
    result = invoke("--db", sqlite_url, "logs", "backup", bad)
    assert result.exit_code == 2, result.output
    assert "run" in result.output.split(":")[1], result.output


def test_a_run_key_of_another_job_is_refused(store: Store, sqlite_url: str) -> None:
    named_job(store, sqlite_url)
    result = invoke("--db", sqlite_url, "logs", "backup", "ffffffff:2026-01-01T00:00:00Z")
    assert result.exit_code == 2 and "another job" in result.output


def test_follow_sees_a_run_that_finishes_after_it_started(store: Store, sqlite_url: str) -> None:
    job = named_job(store, sqlite_url)
    first = run_once(store, job)
    argv = ["logs", "backup", "--follow", "--timeout", "120", "--interval", "0.2"]
    with subprocess.Popen(
        [str(BIN / "schedctl"), "--db", sqlite_url, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    ) as follower:
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert follower.stdout is not None
            for line in follower.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        seen: list[str] = []

        def until(text: str) -> None:
            while not any(text in line for line in seen):  # bounded: the reader's end, or 60 s
                line = lines.get(timeout=60)
                assert line is not None, "".join(seen)
                seen.append(line)

        try:
            until(f"output of attempt 2 of {format_instant(first)}")  # the latest run, at once
            second = run_once(store, job)  # after it started following
            until(f"output of attempt 2 of {format_instant(second)}")
        finally:
            follower.terminate()
            follower.wait(60)
            reader.join(60)
    text = "".join(seen)
    assert text.count(f"run {format_instant(second)} attempt 1: failed") == 1
    assert f"output of attempt 1 of {format_instant(second)}" in text


def test_follow_ends_at_its_timeout(store: Store, sqlite_url: str) -> None:
    named_job(store, sqlite_url)
    result = invoke("--db", sqlite_url, "logs", "backup", "--follow", "--timeout", "0.3")
    assert result.exit_code == 0, result.output
    assert "has no runs yet; waiting" in result.stdout


def test_logs_through_the_api(store: Store, sqlite_url: str) -> None:
    job = named_job(store, sqlite_url)
    at = run_once(store, job)
    sched = Scheduler.open(sqlite_url)
    token = sched.new_token("acme", actor="test")
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        api = ("--api", server.url, "--token", token)
        shown = invoke(*api, "logs", "backup")
        assert shown.exit_code == 0, shown.output
        # the API shows a run's latest attempt
        assert "attempt 2: succeeded" in shown.stdout
        assert f"output of attempt 2 of {format_instant(at)}" in shown.stdout
        data = json.loads(invoke(*api, "logs", "backup", format_instant(at), "-o", "json").stdout)
        assert data["runs"][0]["attempts"][0]["output"].startswith("output of attempt 2")
    finally:
        server.stop()
        sched.close()


def test_follow_ends_quietly_when_its_reader_goes_away(store: Store, sqlite_url: str) -> None:
    job = named_job(store, sqlite_url)
    run_once(store, job)
    argv = ["logs", "backup", "--follow", "--timeout", "120", "--interval", "0.2"]
    with subprocess.Popen(
        [str(BIN / "schedctl"), "--db", sqlite_url, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as follower:
        assert follower.stdout is not None and follower.stderr is not None
        assert follower.stdout.readline().startswith(b"=== job ")
        follower.stdout.close()  # as `head -1` does
        run_once(store, job)  # new output to write: into the closed pipe
        assert follower.wait(60) == 141
        assert follower.stderr.read() == b""


def test_logs_help_imports_no_database_or_http_library() -> None:
    probe = (
        "import sys\n"
        "sys.argv = ['schedctl', 'logs', '--help']\n"
        "from schedctl.cli.app import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "heavy = ('sqlalchemy', 'alembic', 'psycopg', 'requests', 'pika', 'kazoo', 'fastapi')\n"
        "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "--follow" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr
