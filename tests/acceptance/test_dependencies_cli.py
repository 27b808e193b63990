"""`schedctl job create --after` and `schedctl job show`'s dependency tree, on SQLite and
Postgres: a dependent job has no schedule, bad `after`s name the field and create nothing."""

from __future__ import annotations

import pytest

from tests.acceptance.test_cli import create_job, invoke, ok, ok_json, tenant
from tests.acceptance.test_cli_remote import Remote, remote
from tests.acceptance.test_cli_remote import invoke as remote_invoke
from tests.acceptance.test_cli_remote import ok_json as remote_json

__all__ = ["remote", "tenant"]  # the fixtures, used by name


def test_after_chain_and_tree(db_url: str, tenant: str) -> None:
    a = create_job(db_url, "--cron", "0 2 * * *", "--queue", "q", "--name", "extract")
    b = create_job(db_url, "--after", "extract", "--queue", "q", "--name", "load")
    c = create_job(db_url, "--after", f"{b['job_id']},{a['job_id']}", "--queue", "q")
    assert b["schedule"] == {"kind": "after"} and b["next_run_at"] is None
    assert b["status"] == "active"
    shown = ok_json("job", "show", b["job_id"], db=db_url)
    assert [n["job_id"] for n in shown["upstream"]] == [a["job_id"]]
    assert [n["job_id"] for n in shown["downstream"]] == [c["job_id"]]
    top = ok_json("job", "show", a["job_id"], db=db_url)
    (load,) = [n for n in top["downstream"] if n["job_id"] == b["job_id"]]
    assert [n["job_id"] for n in load["children"]] == [c["job_id"]]
    table = ok("job", "show", b["job_id"], db=db_url).stdout
    assert "after (upstream)" in table and "extract" in table
    assert "before (downstream)" in table


@pytest.mark.parametrize(
    ("options", "code", "field"),
    [
        (["--after", "nope", "--queue", "q"], 3, "after"),
        (["--after", "extract", "--in", "10m", "--queue", "q"], 2, "after"),
    ],
)
def test_bad_after_creates_nothing(
    db_url: str, tenant: str, options: list[str], code: int, field: str
) -> None:
    create_job(db_url, "--cron", "0 2 * * *", "--queue", "q", "--name", "extract")
    result = invoke("job", "create", "--tenant", "acme", *options, db=db_url)
    assert result.exit_code == code, result.output
    assert field in result.output
    listed = ok_json("job", "list", db=db_url)["items"]
    assert len(listed) == 1


def test_after_through_the_api(remote: Remote) -> None:
    a = remote_json(remote, "job", "create", "--every", "1h", "--queue", "q", "--name", "up")
    b = remote_json(remote, "job", "create", "--after", a["job_id"], "--queue", "q")
    assert b["schedule"] == {"kind": "after"}
    shown = remote_json(remote, "job", "show", a["job_id"])
    assert [n["job_id"] for n in shown["downstream"]] == [b["job_id"]]
    table = remote_invoke(remote, "job", "show", b["job_id"])
    assert table.exit_code == 0 and "after (upstream)" in table.stdout
