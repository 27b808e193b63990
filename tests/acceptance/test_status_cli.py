"""Owns the acceptance tests of `schedctl status`: the rich view and --output json on SQLite
and Postgres, members from a real ZooKeeper ($SCHEDULED_ZOOKEEPER), a ZooKeeper that does
not answer (reported, exit 0), an unreachable database (exit 7), and the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from schedctl.cli.app import app
from schedctl.coordination.zookeeper import ZooKeeperCoordinator
from schedctl.storage.db.store import Store
from tests.factories import ago, bulk_once_jobs, make_tenant
from tests.services.ports import free_port

UNREACHABLE = "postgresql+psycopg://postgres@127.0.0.1:1/x"
P = 16

runner = CliRunner()


def invoke(*args: str, env: dict[str, str | None] | None = None) -> Any:
    result = runner.invoke(app, list(args), env=env)
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{result.output}")
    return result


def status_json(db: str, env: dict[str, str | None] | None = None) -> dict[str, Any]:
    result = invoke("--db", db, "status", "--output", "json", env=env)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


@pytest.fixture
def small_store(db_url: str) -> Iterator[Store]:
    with closing(Store.open(db_url)) as store:
        store.ensure_settings(P)
        yield store


def test_status_of_a_quiet_database(db_url: str, small_store: Store) -> None:
    data = status_json(db_url)
    assert data["coordinator"] == {"kind": "local", "zookeeper": None, "root": None, "error": None}
    assert data["members"] == [] and data["queues"] == []
    assert data["partitions"]["count"] == P and data["partitions"]["owned"] == 0
    assert data["lag"] == {"oldest_due_at": None, "seconds": 0.0, "due": 0}
    assert data["outbox"]["depth"] == 0
    assert data["dead_letters"] == {"pending": 0, "total": 0}
    assert data["at"].endswith("Z")

    table = invoke("--db", db_url, "status")
    assert table.exit_code == 0, table.output
    for text in ("local coordinator", f"{P} partitions", "members", "(none)", "0/16 owned"):
        assert text in table.stdout, table.stdout
    assert "nothing due" in table.stdout and "dead letters" in table.stdout


def test_the_root_output_option_applies(db_url: str, small_store: Store) -> None:
    result = invoke("--db", db_url, "--output", "json", "status")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["partitions"]["count"] == P


@pytest.mark.zookeeper
def test_members_partitions_epochs_and_lag(pg_url: str, zk_hosts: str) -> None:
    store = Store.open(pg_url)
    store.ensure_settings(P)
    coordinator = ZooKeeperCoordinator(store, zk_hosts, node_name="disp-a", partition_count=P)
    try:
        coordinator.start(timeout=30)
        assert coordinator.wait_until_stable(30)
        epochs = set(coordinator.owned().values())
        tenant = make_tenant(store)
        bulk_once_jobs(store, tenant, [ago(20)])
        env: dict[str, str | None] = {"SCHEDULED_ZOOKEEPER": zk_hosts}

        data = status_json(pg_url, env)
        assert data["coordinator"]["kind"] == "zookeeper" and data["coordinator"]["error"] is None
        (member,) = data["members"]
        assert (member["name"], member["live"], member["pid"]) == ("disp-a", True, os.getpid())
        assert member["partition_count"] == P and sorted(member["partitions"]) == list(range(P))
        assert {member["epoch_min"], member["epoch_max"]} <= epochs
        assert data["partitions"]["owned"] == P and data["partitions"]["moving"] == 0
        assert data["lag"]["due"] == 1 and data["lag"]["seconds"] >= 20
        assert {row["owner"] for row in data["partitions"]["table"]} == {"disp-a"}

        table = invoke("--db", pg_url, "status", env=env)
        assert table.exit_code == 0, table.output
        for text in ("zookeeper", "disp-a", "yes", f"{P}/{P} owned", "1 due and unclaimed"):
            assert text in table.stdout, table.stdout
    finally:
        coordinator.stop()
        store.close()


def test_a_zookeeper_that_does_not_answer_is_reported(sqlite_url: str) -> None:
    env: dict[str, str | None] = {"SCHEDULED_ZOOKEEPER": f"127.0.0.1:{free_port()}"}
    table = invoke("--db", sqlite_url, "status", env=env)
    assert table.exit_code == 0, table.output
    assert "note: members unknown" in table.stdout and "did not answer" in table.stdout


def test_an_unreachable_database_is_exit_7() -> None:
    for args in (["status"], ["status", "-o", "json"]):
        result = invoke("--db", UNREACHABLE, *args)
        assert result.exit_code == 7, result.output
        assert result.stderr.startswith("error: cannot reach the database"), result.stderr


def test_the_console_script(sqlite_url: str) -> None:
    schedctl = Path(sys.executable).parent / "schedctl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    completed = subprocess.run(
        [str(schedctl), "--db", sqlite_url, "status", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["coordinator"]["kind"] == "local"
