"""Acceptance of `schedctl dlq` (list, show, replay, purge) on dead letters made by real
failed deliveries, and of the delivery commands of `schedctl tenant` (allow, disallow,
delivery, broker, signing-secret), on SQLite and a real Postgres."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from schedctl.cli import app as app_module
from schedctl.cli import dlq, tenant_allow, tenants
from schedctl.storage.db.store import Store
from scheduled_d.relay import Relay
from tests.integration.queue_support import (
    Received,
    dead_letters,
    hook_server,
    http_job,
    run_row,
    running_relay,
    trigger,
    wait_for,
)

runner = CliRunner()


def _register() -> None:
    """Until app.py registers them: the commands under test, where the CLI will have them."""
    root = app_module.app
    if not any(group.name == "dlq" for group in root.registered_groups):
        root.add_typer(dlq.app, name="dlq")
    names = {command.name for command in tenants.app.registered_commands}
    for name, function in (
        ("allow", tenant_allow.allow),
        ("disallow", tenant_allow.disallow),
        ("delivery", tenant_allow.delivery),
        ("broker", tenant_allow.broker),
    ):
        if name not in names:
            tenants.app.command(name)(function)


_register()


def invoke(db: str, *args: str) -> Any:
    result = runner.invoke(app_module.app, ["--db", db, *args])
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{result.output}")
    return result


def ok(db: str, *args: str) -> Any:
    result = invoke(db, *args)
    assert result.exit_code == 0, result.output
    return result


def ok_json(db: str, *args: str) -> Any:
    return json.loads(ok(db, *args, "--output", "json").stdout)


def fails(db: str, code: int, *args: str) -> str:
    result = invoke(db, *args)
    assert result.exit_code == code, result.output
    return str(result.output)


@pytest.fixture
def db(db_url: str) -> Iterator[str]:
    ok(db_url, "tenant", "create", "acme")
    ok(db_url, "tenant", "create", "globex")
    ok(db_url, "tenant", "allow", "acme", "127.0.0.1")
    ok(db_url, "tenant", "allow", "globex", "127.0.0.0/8")
    yield db_url


def test_dlq_list_show_replay_purge(db: str) -> None:
    healthy = {"now": False}

    def respond(received: Received, _number: int) -> tuple[int, dict[str, str], bytes]:
        return (200, {}, b"ok") if healthy["now"] else (500, {}, b"database down")

    store = Store.open(db)
    try:
        with hook_server(respond) as server:
            acme_jobs = [
                http_job(store, server.url("/acme"), tenant=_tenant_id(db, "acme"), max_attempts=1)
                for _ in range(2)
            ]
            globex_job = http_job(
                store, server.url("/globex"), tenant=_tenant_id(db, "globex"), max_attempts=1
            )
            runs = [(j, trigger(store, j)) for j in [*acme_jobs, globex_job]]
            relay = Relay(store, poll_seconds=0.05, settings_seconds=0.2)
            with running_relay(relay):
                wait_for(lambda: len(dead_letters(store)) == 3, "three dead letters")

                listed = ok_json(db, "dlq", "list")
                assert len(listed["items"]) == 3 and listed["next_cursor"] is None
                assert {i["tenant"] for i in listed["items"]} == {"acme", "globex"}
                acme = ok_json(db, "dlq", "list", "--tenant", "acme")["items"]
                assert {i["job_id"] for i in acme} == set(acme_jobs)
                first_page = ok_json(db, "dlq", "list", "--limit", "2")
                assert len(first_page["items"]) == 2 and first_page["next_cursor"]
                rest = ok_json(
                    db, "dlq", "list", "--limit", "2", "--cursor", first_page["next_cursor"]
                )
                assert len(rest["items"]) == 1
                table = ok(db, "dlq", "list").stdout
                assert "HTTP 500" in table and "acme" in table

                letter = acme[0]
                shown = ok_json(db, "dlq", "show", str(letter["id"]))
                assert shown["last_error"] == "HTTP 500 Internal Server Error: database down"
                assert shown["attempts"] == 1 and shown["target_type"] == "http"
                assert shown["idempotency_key"] == f"{letter['job_id']}:{letter['scheduled_at']}"
                assert [a["status"] for a in shown["attempt_history"]] == ["failed"]
                assert "attempts" in ok(db, "dlq", "show", str(letter["id"])).stdout
                # another tenant's letter is not found through --tenant
                fails(db, 3, "dlq", "show", str(letter["id"]), "--tenant", "globex")

                healthy["now"] = True
                replayed = ok_json(db, "dlq", "replay", str(letter["id"]))
                assert replayed["replayed_at"] is not None
                relay.wake()
                job, at = next((j, a) for j, a in runs if j == letter["job_id"])
                wait_for(lambda: run_row(store, job, at)["status"] == "succeeded", "the replay")
                assert "already" in fails(db, 4, "dlq", "replay", str(letter["id"]))
                pending = ok_json(db, "dlq", "list")["items"]
                assert len(pending) == 2
                every = ok_json(db, "dlq", "list", "--all")["items"]
                assert len(every) == 3

                summary = ok_json(db, "dlq", "replay", "--all", "--tenant", "globex")
                assert summary == {"replayed": 1, "skipped_cancelled": 0}
                relay.wake()
                wait_for(
                    lambda: run_row(store, globex_job, runs[2][1])["status"] == "succeeded",
                    "the globex replay",
                )
            # the replayed run was delivered again with the same identity, from attempt 1
            bodies = [r.json for r in server.requests() if r.path == "/acme"]
            again = [b for b in bodies if b["job_id"] == letter["job_id"]]
            assert [b["attempt"] for b in again] == [1, 1]
    finally:
        store.close()

    assert ok_json(db, "dlq", "purge", str(letter["id"])) == {"purged": 1}
    fails(db, 3, "dlq", "purge", str(letter["id"]))
    assert ok_json(db, "dlq", "purge", "--all", "--older-than", "7d") == {"purged": 0}
    assert ok_json(db, "dlq", "purge", "--all", "--tenant", "acme") == {"purged": 1}
    assert "1 dead letter(s) purged" in ok(db, "dlq", "purge", "--all").stdout
    assert "no dead letters" in ok(db, "dlq", "list", "--all").stdout


def _tenant_id(db: str, name: str) -> str:
    return str(ok_json(db, "tenant", "show", name)["tenant_id"])


def test_dlq_usage_errors(db: str) -> None:
    assert "give a dead letter ID, or --all" in fails(db, 2, "dlq", "replay")
    assert "not both" in fails(db, 2, "dlq", "purge", "1", "--all")
    assert "--older-than goes with --all" in fails(db, 2, "dlq", "purge", "--older-than", "7d")
    fails(db, 2, "dlq", "purge", "--all", "--older-than", "soon")
    fails(db, 3, "dlq", "show", "999")
    fails(db, 3, "dlq", "replay", "999")
    fails(db, 3, "dlq", "list", "--tenant", "nobody")
    fails(db, 2, "dlq", "list", "--cursor", "garbage")


def test_tenant_delivery_commands(db: str) -> None:
    listed = ok_json(db, "tenant", "allow", "acme", "Hooks.Internal.")
    assert listed["allow_list"] == ["127.0.0.1/32", "hooks.internal"] and listed["changed"]
    again = ok_json(db, "tenant", "allow", "acme", "hooks.internal")
    assert again["changed"] is False
    assert "not a valid CIDR" in fails(db, 2, "tenant", "allow", "acme", "10.0.0.0/40")
    assert "allowed: 10.0.0.0/8" in ok(db, "tenant", "allow", "acme", "10.1.2.3/8").stdout
    shown = ok_json(db, "tenant", "show", "acme")
    assert shown["allow_list"] == ["127.0.0.1/32", "hooks.internal", "10.0.0.0/8"]
    # given as it was added, or canonical
    ok(db, "tenant", "disallow", "acme", "127.0.0.1")
    assert ok_json(db, "tenant", "disallow", "acme", "10.0.0.0/8")["allow_list"] == [
        "hooks.internal"
    ]
    assert "is not on" in fails(db, 3, "tenant", "disallow", "acme", "192.168.0.0/16")
    fails(db, 3, "tenant", "allow", "nobody", "127.0.0.1")

    settings = ok_json(db, "tenant", "delivery", "acme")
    assert settings["delivery_concurrency"] == 16 and settings["broker_url"] is None
    changed = ok_json(db, "tenant", "delivery", "acme", "--concurrency", "4", "--rate", "50")
    assert (changed["delivery_concurrency"], changed["dispatch_rate_per_second"]) == (4, 50)
    fails(db, 2, "tenant", "delivery", "acme", "--concurrency", "0")

    broker = ok_json(db, "tenant", "broker", "acme", "amqp://app:hunter2@127.0.0.1:5672/acme")
    assert broker["broker_url"] == "amqp://app:***@127.0.0.1:5672/acme"
    assert "hunter2" not in ok(db, "tenant", "delivery", "acme").stdout
    assert "amqp://" in fails(db, 2, "tenant", "broker", "acme", "http://127.0.0.1/")
    fails(db, 2, "tenant", "broker", "acme")
    assert ok_json(db, "tenant", "broker", "acme", "--builtin")["broker_url"] is None

    secret = ok(db, "tenant", "signing-secret", "acme").stdout.strip()
    assert len(secret) >= 32
    assert ok_json(db, "tenant", "signing-secret", "acme")["signing_secret"] == secret
