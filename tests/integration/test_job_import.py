"""Owns the tests of `schedctl job import FILE.jsonl` on SQLite and Postgres, straight to the
database and through the API (--api): every good line created across batches of 1,000, a
line that is not JSON and a refused job reported by line number with the field, the other
lines of their batch still created, a second run replayed by idempotency key, JSON output
and the exit code."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app as cli_app
from schedctl.storage.db import schema
from scheduled_d.api.server import ApiServer

runner = CliRunner()


def body(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "schedule": {"delay": "1d"},
        "target": {"type": "queue", "name": "imports"},
        "payload": {"i": i},
        "idempotency_key": f"line-{i}",
        **extra,
    }


@pytest.fixture
def sched(db_url: str) -> Iterator[Scheduler]:
    scheduler = Scheduler.open(db_url)
    try:
        scheduler.create_tenant("acme", "test")
        scheduler.set_quotas("acme", max_jobs=100_000, create_rate_per_minute=100_000, actor="t")
        yield scheduler
    finally:
        scheduler.close()


def jobs_of(sched: Scheduler, tenant: str) -> int:
    tenant_id = sched.get_tenant(tenant).tenant_id
    with sched.store.read() as connection:
        return int(
            connection.execute(
                select(func.count())
                .select_from(schema.jobs)
                .where(schema.jobs.c.tenant_id == tenant_id)
            ).scalar_one()
        )


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def mixed_file(tmp_path: Path, good: int) -> tuple[Path, dict[int, str]]:
    """`good` job lines, with a line that is not JSON, a refused job and a blank line
    among them; returns the file and {bad line number: the field named}."""
    lines = [json.dumps(body(i)) for i in range(good)]
    lines.insert(3, "{this is not json")  # line 4
    lines.insert(7, json.dumps(body(-1, schedule={"every": "soon"})))  # line 8
    lines.insert(9, "")  # line 10: skipped
    return write(tmp_path / "jobs.jsonl", lines), {4: "line", 8: "interval"}


def run_import(args: list[str], path: Path, *options: str) -> tuple[int, dict[str, Any]]:
    result = runner.invoke(cli_app, [*args, "job", "import", str(path), *options, "-o", "json"])
    assert result.stdout, result.stderr
    return result.exit_code, json.loads(result.stdout)


def test_import_to_the_database(sched: Scheduler, db_url: str, tmp_path: Path) -> None:
    path, bad = mixed_file(tmp_path, good=1203)  # two batches
    code, report = run_import(["--db", db_url], path, "--tenant", "acme")
    # the line that is not JSON fails alone: the rest of its batch is created
    assert code == 2
    assert (report["created"], report["replayed"], report["failed"]) == (1203, 0, 2)
    assert report["lines"] == 1206
    assert {f["line"]: f["field"] for f in report["failures"]} == bad
    assert "line 4" in report["failures"][0]["message"]
    assert jobs_of(sched, "acme") == 1203
    # again: every good line replayed by its idempotency key, nothing new
    code, report = run_import(["--db", db_url], path, "--tenant", "acme")
    assert code == 2
    assert (report["created"], report["replayed"], report["failed"]) == (0, 1203, 2)
    assert jobs_of(sched, "acme") == 1203


def test_a_clean_import_exits_zero_and_shows_a_summary(
    sched: Scheduler, db_url: str, tmp_path: Path
) -> None:
    path = write(tmp_path / "ok.jsonl", [json.dumps(body(i)) for i in range(5)])
    result = runner.invoke(cli_app, ["--db", db_url, "job", "import", str(path), "-t", "acme"])
    assert result.exit_code == 0, result.output
    assert "created" in result.stdout
    assert jobs_of(sched, "acme") == 5


def test_import_needs_a_tenant_and_a_readable_file(db_url: str, tmp_path: Path) -> None:
    path = write(tmp_path / "ok.jsonl", [json.dumps(body(0))])
    result = runner.invoke(cli_app, ["--db", db_url, "job", "import", str(path)])
    assert result.exit_code == 2
    assert "--tenant" in result.stderr
    missing = runner.invoke(
        cli_app, ["--db", db_url, "job", "import", str(tmp_path / "nope"), "-t", "x"]
    )
    assert missing.exit_code == 2
    assert "file" in missing.stderr


def test_import_through_the_api_creates_in_the_tokens_tenant(
    sched: Scheduler, tmp_path: Path
) -> None:
    _, token = sched.create_tenant("other", "test")
    path, bad = mixed_file(tmp_path, good=20)
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        code, report = run_import(["--api", server.url, "--token", token], path)
    finally:
        server.stop()
    assert code == 2
    assert (report["created"], report["failed"]) == (20, 2)
    assert {f["line"]: f["field"] for f in report["failures"]} == bad
    assert jobs_of(sched, "other") == 20
    assert jobs_of(sched, "acme") == 0


def test_a_batch_refused_whole_fails_its_lines_and_the_next_batch_is_created(
    sched: Scheduler, tmp_path: Path
) -> None:
    """The first batch (1,000 lines) is over the API's request limit: each of its lines is
    reported, while the second batch, in flight beside it, is created. Fails when a batch
    refused as a whole stops the import or is tallied as created."""
    _, token = sched.create_tenant("other", "test")
    path = write(tmp_path / "jobs.jsonl", [json.dumps(body(i)) for i in range(1010)])
    server = ApiServer(sched, "127.0.0.1:0", access_log=False, max_request_bytes=50_000)
    server.start()
    try:
        code, report = run_import(["--api", server.url, "--token", token], path)
    finally:
        server.stop()
    assert code != 0
    assert (report["created"], report["failed"]) == (10, 1000)
    assert [f["line"] for f in report["failures"]] == list(range(1, 1001))
    assert jobs_of(sched, "other") == 10


def test_lines_sent_as_written_are_judged_as_on_the_database(
    sched: Scheduler, db_url: str, tmp_path: Path
) -> None:
    """Through the API each line goes as it was written when orjson reads it, else parsed
    and encoded again as before: a name past ASCII arrives intact, and a line orjson
    refuses (an integer past 64 bits, NaN, a lone surrogate, nesting too deep) gets the
    answer the database path gives, alone. Fails when a raw line is mangled on the way, a
    refused one is dropped or takes its batch with it."""
    _, token = sched.create_tenant("other", "test")
    lines = [
        json.dumps(body(0, name="café-ünïcode"), ensure_ascii=False),
        json.dumps(body(1, payload={"big": 2**70})),
        '{"schedule": {"delay": "1d"}, "target": {"type": "queue", "name": "q"}, '
        '"payload": {"x": NaN}, "idempotency_key": "nan"}',
        json.dumps(body(3, payload={"s": "\ud800"})),
        json.dumps(body(4)) + "   ",
        # deeper than json reads inside a batch's envelope: this line alone fails
        json.dumps(body(5)).replace('{"i": 5}', "[" * 1000 + "]" * 1000),
    ]
    path = write(tmp_path / "odd.jsonl", lines)
    _, on_db = run_import(["--db", db_url], path, "--tenant", "acme")
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        _, via_api = run_import(["--api", server.url, "--token", token], path)
        _, again = run_import(["--api", server.url, "--token", token], path)
    finally:
        server.stop()
    assert (via_api["created"], via_api["failed"]) == (on_db["created"], on_db["failed"])
    assert [(f["line"], f["field"]) for f in via_api["failures"]] == [
        (f["line"], f["field"]) for f in on_db["failures"]
    ]
    assert via_api["created"] >= 2  # lines 1 and 5 at least
    assert (again["created"], again["replayed"]) == (0, via_api["created"])
    names = {job.name for job in sched.list_jobs("other", limit=50).items}
    assert "café-ünïcode" in names
