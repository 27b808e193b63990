"""Alerts on SQLite and a real Postgres: a dead letter sends a signed webhook and an e-mail
(to a local SMTP server) and logs a WARNING; failure alerts only when asked; settling twice
queues one alert; the no-success check alerts once per episode; an unreachable SMTP server
is retried without holding up deliveries; the per-tenant metrics count."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.header import decode_header, make_header
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import update
from typer.testing import CliRunner

from schedctl.app.alerts.command import run_alert_commands
from schedctl.app.alerts.lane import AlertLane
from schedctl.app.service import Scheduler
from schedctl.cli.app import app as cli_app
from schedctl.core import errors
from schedctl.core.signing import verify
from schedctl.delivery.email import SmtpSettings
from schedctl.delivery.http import HttpDelivery
from schedctl.domain.alerts.metrics import export_last_success
from schedctl.domain.alerts.model import parse_alerts
from schedctl.domain.alerts.policy import AlertPolicy
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.dead_letters import DeadLetterRepo
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.records import alerts as alerts_repo
from schedctl.storage.tenants.signing_secrets import SigningKeyCache
from scheduled_d.relay import Relay
from scheduled_d.worker import Worker
from tests.factories import make_tenant
from tests.integration.queue_support import (
    allow_loopback_tenant,
    answer,
    attempts,
    dead_letters,
    hook_server,
    http_job,
    queue_job,
    run_row,
    running_relay,
    trigger,
    wait_for,
)
from tests.smtp_support import Inbox

runner = CliRunner()


@pytest.fixture
def store(store: Store) -> Store:
    allow_loopback_tenant(store)
    return store


# the operator's [alerts]: mail to example.com only
POLICY = AlertPolicy(email_domains=("example.com",), smtp_configured=True)


def relay(store: Store, port: int | None, policy: AlertPolicy = POLICY) -> Relay:
    smtp = SmtpSettings(host="127.0.0.1", port=port or 9, timeout=2.0)
    return Relay(
        store,
        poll_seconds=0.05,
        settings_seconds=0.2,
        http_timeout=5.0,
        smtp=smtp,
        alert_poll_seconds=0.05,
        alert_policy=policy,
    )


def counter(name: str, tenant: str) -> float:
    return REGISTRY.get_sample_value(name, {"tenant": tenant}) or 0.0


def delivered(store: Store) -> list[dict[str, Any]]:
    return [a for a in alerts_repo.list_alerts(store) if a["status"] == "delivered"]


def test_a_dead_letter_alerts_by_webhook_and_email_and_logs_a_warning(
    store: Store, smtp: tuple[Inbox, int], caplog: pytest.LogCaptureFixture
) -> None:
    inbox, port = smtp
    tenant = "tenant-acme"
    dead_before = counter("scheduled_dead_letters_total", "acme")
    failures_before = counter("scheduled_run_failures_total", "acme")
    with hook_server(answer(200)) as alerts_hook, hook_server(answer(500)) as target:
        job = http_job(store, target.url(), max_attempts=2)
        alerts_repo.set_settings(
            store,
            tenant,
            "",
            parse_alerts({"webhook": alerts_hook.url(), "email": ["ops@example.com"]}),
        )
        at = trigger(store, job)
        with caplog.at_level(logging.WARNING, logger="schedctl.alerts"):
            with running_relay(relay(store, port)):
                wait_for(lambda: run_row(store, job, at)["status"] == "dead", "the dead letter")
                wait_for(lambda: len(delivered(store)) == 2, "both alerts")
                # a replayed run that dies again alerts no more: one alert per run and kind
                (letter,) = dead_letters(store)
                DeadLetterRepo(store).replay(letter["id"], actor="test")
                wait_for(lambda: len(attempts(store, job, at)) == 4, "the replay's attempts")
                wait_for(lambda: run_row(store, job, at)["status"] == "dead", "dead again")
                assert len(alerts_repo.list_alerts(store)) == 2
        (received,) = alerts_hook.requests()
    verify("secret", received.headers, received.body, method="POST", path=received.path)
    alert = received.json["payload"]
    assert (alert["alert"], alert["job_id"], alert["tenant_id"]) == ("dead_letter", job, tenant)
    assert alert["error"].startswith("HTTP 500")
    # the webhook's JSON keeps its shape, with the names beside the ids
    assert (alert["tenant_name"], alert["final"], alert["max_attempts"]) == ("acme", True, 2)
    assert alert["job_name"] and alert["job_name"] != job
    (mail,) = inbox.messages
    assert mail["To"] == "ops@example.com" and "dead-lettered" in mail["Subject"]
    text, attached = mail.get_payload()
    assert job in text.get_payload(decode=True).decode()
    assert json.loads(attached.get_payload(decode=True))["job_id"] == job
    # only the dead letter: failure alerts were not asked for
    assert {a["kind"] for a in alerts_repo.list_alerts(store)} == {"dead_letter"}
    lines = [r for r in caplog.records if r.name == "schedctl.alerts"]
    assert len(lines) == 2  # the dead letter and the replay's
    line = lines[0]
    assert line.levelno == logging.WARNING
    assert job in line.getMessage() and tenant in line.getMessage()
    assert "HTTP 500" in line.getMessage()
    assert counter("scheduled_dead_letters_total", "acme") == dead_before + 2
    assert counter("scheduled_run_failures_total", "acme") == failures_before + 4


def test_failure_alerts_only_when_asked_and_settling_twice_queues_one(store: Store) -> None:
    tenant = "tenant-acme"
    job = http_job(store, "http://127.0.0.1:9/x")
    at = datetime(2030, 1, 1, tzinfo=UTC)
    failure = alerts_repo.Failure(tenant, job, at, 1, "boom", False, "http", "u")
    dead = alerts_repo.Failure(tenant, job, at, 2, "boom", True, "http", "u")
    alerts_repo.set_settings(store, tenant, job, parse_alerts({"webhook": "http://127.0.0.1:9/a"}))
    with store.tx() as connection:
        alerts_repo.queue_for_failures(connection, [failure], at)
    assert alerts_repo.list_alerts(store) == []  # on: dead_letter only (the default)
    alerts_repo.set_settings(
        store,
        tenant,
        job,
        parse_alerts({"on": ["dead_letter", "failure"], "email": ["a@example.com"]}),
    )
    for _ in range(2):  # settled twice (a replayed settle): still one alert each
        with store.tx() as connection:
            alerts_repo.queue_for_failures(connection, [failure, dead], at)
    # the run's final failure is one alert (the dead letter's), not a failure alert too
    kinds = sorted((a["kind"], a["channel"]) for a in alerts_repo.list_alerts(store))
    assert kinds == [("dead_letter", "email"), ("failure", "email")]


def test_no_success_alerts_once_per_episode(store: Store) -> None:
    tenant = "tenant-acme"
    job = http_job(store, "http://127.0.0.1:9/x")
    alerts_repo.set_settings(
        store,
        tenant,
        job,
        parse_alerts({"on": [], "webhook": "http://127.0.0.1:9/a", "no_success": "PT1H"}),
    )
    assert alerts_repo.check_no_success(store) == 0  # created just now
    with store.tx() as connection:  # created two hours ago, never succeeded
        connection.execute(
            update(schema.jobs)
            .where(schema.jobs.c.job_id == job)
            .values(created_at=store.now() - timedelta(hours=2))
        )
    assert alerts_repo.check_no_success(store) == 1
    assert alerts_repo.check_no_success(store) == 0  # the same episode
    (alert,) = alerts_repo.list_alerts(store)
    assert alert["kind"] == "no_success"
    assert [j for _, j, _ in alerts_repo.last_successes(store)] == []


def test_an_unreachable_smtp_server_is_retried_without_holding_up_deliveries(
    store: Store,
) -> None:
    tenant = "tenant-acme"
    alerts_repo.set_settings(
        store, tenant, "", parse_alerts({"on": ["failure"], "email": ["ops@example.com"]})
    )
    with hook_server(answer(500)) as failing, hook_server(answer(200)) as ok:
        bad = http_job(store, failing.url(), max_attempts=1)
        trigger(store, bad)
        with running_relay(relay(store, None)):  # port 9: nothing listens
            wait_for(
                lambda: any(a["last_error"] for a in alerts_repo.list_alerts(store)),
                "a failed e-mail attempt",
            )
            good = http_job(store, ok.url())
            at = trigger(store, good)
            wait_for(lambda: run_row(store, good, at)["status"] == "succeeded", "delivery")
    (alert,) = alerts_repo.list_alerts(store)
    assert alert["status"] == "pending" and "SMTP 127.0.0.1:9" in alert["last_error"]


def test_bad_alert_settings_name_the_field() -> None:
    for value, field in [
        ({"on": ["sometimes"]}, "alerts.on"),
        ({"email": ["not an address"]}, "alerts.email"),
        ({"webhook": "ftp://x"}, "alerts.webhook"),
        ({"no_success": "soon"}, "alerts.no_success"),
        ({"pager": True}, "alerts"),
    ]:
        with pytest.raises(errors.ValidationError) as caught:
            parse_alerts(value)
        assert caught.value.field == field


def test_a_dead_letter_runs_the_hosts_alert_command_on_its_worker(
    store: Store, tmp_path: Path
) -> None:
    tenant = "tenant-acme"
    out = tmp_path / "alert.json"
    job = queue_job(store, max_attempts=1)
    alerts_repo.set_settings(store, tenant, job, parse_alerts({"command": True}))
    at = trigger(store, job)
    QueueRepo(store).move_outbox()
    w = Worker(
        store,
        "q",
        ["sh", "-c", "exit 4"],
        lease_seconds=5.0,
        heartbeat_seconds=1.0,
        poll_seconds=0.05,
        # the host's own command: it gets the alert on stdin
        alert_command=[
            sys.executable,
            "-c",
            f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())",
        ],
    )
    stop = threading.Event()
    thread = threading.Thread(target=w.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(delivered(store)) == 1, "the command alert")
    finally:
        stop.set()
        thread.join(60)
    assert run_row(store, job, at)["status"] == "dead"
    alert = json.loads(out.read_text())
    assert (alert["alert"], alert["job_id"], alert["error"]) == ("dead_letter", job, "exit code 4")
    (row,) = alerts_repo.list_alerts(store)
    assert (row["channel"], row["destination"]) == ("command", "q")


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie whose parent has not reaped it counts)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


LIVES = 300  # seconds a child of an alert command lives unless killed
KILLED_SECONDS = 20.0  # how long a SIGKILLed child may take to be gone (far less than LIVES)


def _kill_left(pids: Path) -> None:
    """Cleanup: kill what the test's command started, should the code under test not have."""
    if pids.exists():
        leader, child = map(int, pids.read_text().split())
        with contextlib.suppress(OSError):
            os.killpg(leader, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)


def _no_group_left(pgid: int, *members: int) -> None:
    """Nothing of process group `pgid` is left, once its killed members are reaped (where
    pid 1 does not reap orphans, a zombie may linger: then it only counts as gone)."""
    if any(os.path.exists(f"/proc/{pid}") for pid in members):
        return
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def _command_alert(store: Store, job: str, at: datetime) -> None:
    """A due command alert of `job`'s dead run at `at` (queue q), as settling queues it."""
    dead = alerts_repo.Failure("tenant-acme", job, at, 1, "boom", True, "queue", "q")
    with store.tx() as connection:
        alerts_repo.queue_for_failures(connection, [dead], store.now())


def _run_bounded(store: Store, command: list[str], timeout: float) -> int:
    """run_alert_commands of queue q in a thread: it must return well before a child of
    the command holding its stderr (LIVES) would end."""
    taken: list[int] = []
    thread = threading.Thread(
        target=lambda: taken.append(
            run_alert_commands(
                store,
                tenant_id="tenant-acme",
                queue="q",
                command=command,
                owner="test",
                timeout=timeout,
            )
        ),
        daemon=True,
    )
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the alert pass waited for a child of the command"
    (count,) = taken
    return count


def test_an_alert_command_and_all_it_started_are_killed_and_none_outlives_it(
    store: Store, tmp_path: Path
) -> None:
    """A command that times out while a background child of it holds its stderr: the pass
    returns (not held up by the child's output), the alert records the timeout, and the
    command's whole process group is gone; a command that exits leaving a child behind:
    delivered, and the child is killed too."""
    job = queue_job(store, max_attempts=1)
    alerts_repo.set_settings(store, "tenant-acme", job, parse_alerts({"command": True}))
    pids = tmp_path / "pids"
    first = datetime(2030, 1, 1, tzinfo=UTC)
    _command_alert(store, job, first)
    hanging = ["/bin/sh", "-c", f"sleep {LIVES} & echo $$ $! > {pids}; wait"]
    try:
        assert _run_bounded(store, hanging, timeout=1.0) == 1
        (row,) = alerts_repo.list_alerts(store)
        assert row["status"] == "pending" and row["lease_owner"] is None
        assert "alert command timed out after 1 s" in row["last_error"]
        leader, child = map(int, pids.read_text().split())
        wait_for(lambda: _gone(leader) and _gone(child), "the group killed", KILLED_SECONDS)
        _no_group_left(leader, child)
    finally:
        _kill_left(pids)
    pids.unlink()
    # the timed-out alert's retry stays out of the next pass however slow this one was
    with store.tx() as connection:
        connection.execute(
            schema.alerts.update().values(available_at=datetime(2100, 1, 1, tzinfo=UTC))
        )

    _command_alert(store, job, first + timedelta(days=1))
    leaving = ["/bin/sh", "-c", f"sleep {LIVES} & echo $$ $! > {pids}; echo bye >&2"]
    try:
        assert _run_bounded(store, leaving, timeout=20.0) == 1
        assert len(delivered(store)) == 1
        leader, child = map(int, pids.read_text().split())
        wait_for(lambda: _gone(child), "the child left behind killed", KILLED_SECONDS)
        _no_group_left(leader, child)
    finally:
        _kill_left(pids)


def test_a_failing_alert_command_records_the_end_of_its_stderr(store: Store) -> None:
    job = queue_job(store, max_attempts=1)
    alerts_repo.set_settings(store, "tenant-acme", job, parse_alerts({"command": True}))
    _command_alert(store, job, datetime(2030, 1, 1, tzinfo=UTC))
    chatty = ["/bin/sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x >&2; echo END >&2; exit 3"]
    assert _run_bounded(store, chatty, timeout=20.0) == 1
    (row,) = alerts_repo.list_alerts(store)
    error = row["last_error"]
    assert error.startswith("alert command exited with 3: ") and error.endswith("xxxEND\n")
    assert len(error) < 600  # the end of stderr only


def test_cli_sets_tenant_and_job_alerts_and_a_job_body_carries_them(db_url: str) -> None:
    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(cli_app, ["--db", db_url, "--output", "json", *args])
        assert result.exit_code == code, result.output
        return str(result.output)

    run("tenant", "create", "acme")
    said = json.loads(
        run(
            "tenant",
            "alerts",
            "acme",
            "--webhook",
            "https://hooks.example.com/a",
            "--email",
            "a@example.com",
            "--on",
            "dead_letter,failure",
        )
    )
    assert said["alerts"] == {
        "on": ["dead_letter", "failure"],
        "webhook": "https://hooks.example.com/a",
        "email": ["a@example.com"],
    }
    bad = run("tenant", "alerts", "acme", "--on", "sometimes", code=2)
    assert "alerts.on" in bad
    assert json.loads(run("tenant", "alerts", "acme"))["alerts"]["on"] == ["dead_letter", "failure"]
    store = Store.open(db_url)
    try:
        scheduler = Scheduler(store)
        body = {
            "schedule": {"delay": "PT1H"},
            "target": {"type": "queue", "name": "q"},
            "alerts": {"command": True, "no_success": "PT26H"},
        }
        job, _ = scheduler.create_job("acme", body, actor="test")
        assert scheduler.get_alerts("acme", job.job_id) == parse_alerts(body["alerts"])
        with pytest.raises(errors.ValidationError) as caught:
            scheduler.create_job("acme", {**body, "alerts": {"email": "nope"}}, actor="test")
        assert caught.value.field == "alerts.email"
    finally:
        store.close()
    shown = json.loads(run("job", "alerts", job.job_id))
    assert shown["alerts"] == {"on": ["dead_letter"], "command": True, "no_success": "PT93600S"}
    run("job", "alerts", job.job_id, "--clear")
    assert json.loads(run("job", "alerts", job.job_id))["alerts"] is None


def test_the_last_success_series_is_only_for_jobs_with_a_no_success_alert(store: Store) -> None:
    tenant = "tenant-acme"
    watched = http_job(store, "http://127.0.0.1:9/x")
    other = http_job(store, "http://127.0.0.1:9/y")
    alerts_repo.set_settings(
        store, tenant, watched, parse_alerts({"email": ["a@example.com"], "no_success": "PT1H"})
    )
    finished = datetime(2026, 6, 1, 12, tzinfo=UTC)
    for job in (watched, other):
        at = trigger(store, job)
        with store.tx() as connection:
            connection.execute(
                update(schema.runs)
                .where(schema.runs.c.job_id == job, schema.runs.c.scheduled_at == at)
                .values(status="succeeded", finished_at=finished)
            )
    export_last_success(partial(alerts_repo.last_successes, store))
    try:
        # labelled with the tenant's and the job's names, not their ids
        name = "scheduled_job_last_success_timestamp_seconds"
        watched_name, other_name = (JobRepo(store).get(j).name for j in (watched, other))
        seen = REGISTRY.get_sample_value(name, {"tenant": "acme", "job": watched_name})
        assert seen == finished.timestamp()
        assert REGISTRY.get_sample_value(name, {"tenant": "acme", "job": other_name}) is None
    finally:
        export_last_success(None)


# -- alerts that never block each other (issue 30) ----------------------------------------


@contextlib.contextmanager
def alert_lane(store: Store, port: int, policy: AlertPolicy = POLICY) -> Iterator[AlertLane]:
    """The relay's alert lane, its passes run by the test (run_once), its HTTP client
    closed at the end."""
    http = HttpDelivery(timeout=5.0)
    try:
        yield AlertLane(
            store,
            http=http,
            signing=SigningKeyCache(store),
            smtp=SmtpSettings(host="127.0.0.1", port=port, timeout=5.0),
            owner="test",
            policy=policy,
        )
    finally:
        http.close()


def _queue_dead_letter(store: Store, tenant: str, job: str, at: datetime) -> None:
    dead = alerts_repo.Failure(tenant, job, at, 1, "boom", True, "http", "u")
    with store.tx() as connection:
        alerts_repo.queue_for_failures(connection, [dead], store.now())


def _set_alert(store: Store, job: str, **values: Any) -> None:
    """Write an alert row's columns straight, as an older version (or a crash) left them."""
    with store.tx() as connection:
        connection.execute(
            update(schema.alerts).where(schema.alerts.c.job_id == job).values(**values)
        )


def _alert_of(store: Store, job: str) -> dict[str, Any]:
    (row,) = [a for a in alerts_repo.list_alerts(store) if a["job_id"] == job]
    return row


def test_a_poison_alert_of_one_tenant_never_holds_up_another_tenants(
    store: Store, smtp: tuple[Inbox, int]
) -> None:
    """Tenant beta's alerts are due first, in the same batch as tenant acme's: one whose
    job name (stored before names refused them) holds U+2028 and U+0085, one whose sending
    raises on every attempt (at its last attempt) and one whose lease ran out at every
    attempt. acme's mail arrives; the bad name's mail goes out with a safe subject; the
    raising alert is given up at the limit with its reason, the abandoned one too."""
    inbox, port = smtp
    acme, beta = "tenant-acme", make_tenant(store, "beta")
    earlier = store.now() - timedelta(minutes=5)
    poison_name = http_job(store, "http://127.0.0.1:9/x", tenant=beta)
    raising = http_job(store, "http://127.0.0.1:9/y", tenant=beta)
    abandoned = http_job(store, "http://127.0.0.1:9/z", tenant=beta)
    normal = http_job(store, "http://127.0.0.1:9/w", tenant=acme)
    with store.tx() as connection:
        connection.execute(
            update(schema.jobs)
            .where(schema.jobs.c.job_id == poison_name)
            .values(name="nightly\u2028Bcc: victim@example.org\x85x")
        )
    mail = parse_alerts({"email": ["ops@example.com"]})
    for tenant, job in [(beta, poison_name), (beta, raising), (beta, abandoned), (acme, normal)]:
        alerts_repo.set_settings(store, tenant, job, mail)
        _queue_dead_letter(store, tenant, job, datetime(2030, 1, 1, tzinfo=UTC))
    last = alerts_repo.MAX_ALERT_ATTEMPTS
    # an e-mail alert whose body is not an object: every attempt raises (AttributeError)
    _set_alert(store, raising, body="[]", attempt=last - 1, available_at=earlier)
    _set_alert(store, abandoned, attempt=last, available_at=earlier, last_error=None)
    _set_alert(store, poison_name, available_at=earlier)
    with alert_lane(store, port) as lane:
        assert lane.run_once() == 3  # the abandoned one is given up, not leased
    assert _alert_of(store, normal)["status"] == "delivered"
    assert _alert_of(store, poison_name)["status"] == "delivered"
    given_up = _alert_of(store, raising)
    assert (given_up["status"], given_up["attempt"]) == ("failed", last)
    assert given_up["lease_owner"] is None
    assert given_up["last_error"].startswith("AttributeError")
    gone = _alert_of(store, abandoned)
    assert (gone["status"], gone["attempt"]) == ("failed", last)
    assert "no attempt ended" in gone["last_error"]
    subjects = {str(make_header(decode_header(m["Subject"]))): m for m in inbox.messages}
    assert len(inbox.messages) == 2
    # subjects name jobs by name; the ids are in the bodies
    (bad,) = [s for s in subjects if "nightly" in s]
    assert "\u2028" not in bad and "\x85" not in bad and "\ufffd" in bad
    assert poison_name in subjects[bad].get_payload()[0].get_payload(decode=True).decode()
    assert all(m["Bcc"] is None for m in inbox.messages)
    bodies = [m.get_payload()[0].get_payload(decode=True).decode() for m in inbox.messages]
    assert any(normal in b for b in bodies)


def test_an_address_that_is_not_whole_is_refused_and_never_mailed(
    store: Store, smtp: tuple[Inbox, int]
) -> None:
    """ "a@b.c\\n" (a newline after a whole address) is refused at input naming the field
    and changes nothing; one stored before that is given up at once, never mailed."""
    inbox, port = smtp
    tenant = "tenant-acme"
    scheduler = Scheduler(store)
    for bad in ["a@b.c\n", "a@b.c\r\nBcc: x@y.z", "a@b.c\u2028", "a@b.c\x85", "a b@c.d"]:
        with pytest.raises(errors.ValidationError) as caught:
            scheduler.set_alerts("acme", {"email": [bad]})
        assert caught.value.field == "alerts.email", repr(bad)
    assert alerts_repo.get_settings(store, tenant, "") is None
    job = http_job(store, "http://127.0.0.1:9/x")
    alerts_repo.set_settings(store, tenant, job, parse_alerts({"email": ["ops@example.com"]}))
    stored = {"on": ["dead_letter"], "email": ["victim@example.org\nBcc: ops@example.com"]}
    with store.tx() as connection:  # as a version with the looser rule stored it
        connection.execute(
            update(schema.alert_settings)
            .where(schema.alert_settings.c.job_id == job)
            .values(config=json.dumps(stored))
        )
    # settling still works (the settings are read there) and queues the alert
    _queue_dead_letter(store, tenant, job, datetime(2030, 1, 1, tzinfo=UTC))
    with alert_lane(store, port) as lane:
        assert lane.run_once() == 1
    row = _alert_of(store, job)
    assert (row["status"], row["attempt"]) == ("failed", 1)
    assert "not an e-mail address" in row["last_error"]
    assert inbox.messages == []


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x80", "\x9f", "\n", "\x7f"])
def test_control_and_line_separator_characters_are_refused_in_job_names(
    store: Store, char: str
) -> None:
    scheduler = Scheduler(store)
    body = {
        "name": f"nightly{char}x",
        "schedule": {"delay": "PT1H"},
        "target": {"type": "queue", "name": "q"},
    }
    with pytest.raises(errors.ValidationError) as caught:
        scheduler.create_job("acme", body, actor="test")
    assert caught.value.field == "name"
    assert "control or line-separator" in caught.value.message
    assert not scheduler.list_jobs("acme", limit=10).items
    job, _ = scheduler.create_job("acme", {**body, "name": "nightly"}, actor="test")
    with pytest.raises(errors.ValidationError) as caught:
        scheduler.update_job(job.job_id, {"name": f"n{char}"}, "acme", actor="test")
    assert caught.value.field == "name"
    assert scheduler.get_job(job.job_id, "acme").name == "nightly"


def test_cli_refuses_a_private_webhook_and_recipients_the_operator_does_not_allow(
    db_url: str, tmp_path: Path
) -> None:
    """Through the CLI: a loopback, private or metadata webhook is refused naming
    alerts.webhook; with an SMTP server, recipients must be in [alerts] email_domains (none
    listed: e-mail alerts are refused); a refusal changes nothing."""
    config = tmp_path / "scheduled.toml"

    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(
            cli_app, ["--db", db_url, "--config", str(config), "--output", "json", *args]
        )
        assert result.exit_code == code, result.output
        return str(result.output)

    config.write_text(
        'smtp_host = "127.0.0.1"\n[alerts]\nemail_domains = ["example.com", "*.example.net"]\n'
    )
    run("tenant", "create", "acme")
    run("tenant", "alerts", "acme", "--email", "ops@example.com", "--email", "b@sre.example.net")
    for url in ["http://127.0.0.1:9/h", "http://10.0.0.7/h", "http://169.254.169.254/x"]:
        assert "alerts.webhook" in run("tenant", "alerts", "acme", "--webhook", url, code=2)
    for address in ["a@example.org", "a@example.com.evil.org", "a@example.net"]:
        refused = run("tenant", "alerts", "acme", "--email", address, code=2)
        assert "alerts.email" in refused and "email_domains" in refused
    shown = json.loads(run("tenant", "alerts", "acme"))["alerts"]
    assert shown["email"] == ["ops@example.com", "b@sre.example.net"] and "webhook" not in shown
    config.write_text('smtp_host = "127.0.0.1"\n')  # an SMTP server and no list: none
    refused = run("tenant", "alerts", "acme", "--email", "ops@example.com", code=2)
    assert "alerts.email" in refused and "not enabled" in refused
    config.write_text("")  # no SMTP server: nothing leaves, nothing to refuse
    run("tenant", "alerts", "acme", "--email", "ops@example.org")


def test_at_send_recipients_the_operator_does_not_allow_are_given_up(
    store: Store, smtp: tuple[Inbox, int]
) -> None:
    """An alert to a domain the operator allows no longer (or never did: set before the
    list) is given up at once with the reason; mail to an allowed domain goes."""
    inbox, port = smtp
    tenant = "tenant-acme"
    allowed, other = (
        http_job(store, "http://127.0.0.1:9/x"),
        http_job(store, "http://127.0.0.1:9/y"),
    )
    alerts_repo.set_settings(store, tenant, allowed, parse_alerts({"email": ["a@example.com"]}))
    alerts_repo.set_settings(store, tenant, other, parse_alerts({"email": ["a@example.org"]}))
    for job in (allowed, other):
        _queue_dead_letter(store, tenant, job, datetime(2030, 1, 1, tzinfo=UTC))
    with alert_lane(store, port) as lane:
        assert lane.run_once() == 2
    assert _alert_of(store, allowed)["status"] == "delivered"
    refused = _alert_of(store, other)
    assert (refused["status"], refused["attempt"]) == ("failed", 1)
    assert "email_domains" in refused["last_error"]
    (mail,) = inbox.messages
    assert mail["To"] == "a@example.com"


def test_alerts_over_the_tenants_hourly_limit_are_given_up_as_rate_limited(
    store: Store, smtp: tuple[Inbox, int]
) -> None:
    """max_per_tenant_per_hour: the tenant's alerts past it in the hour are not sent and
    are recorded given up, "rate limited"; another tenant's still go."""
    inbox, port = smtp
    acme, beta = "tenant-acme", make_tenant(store, "beta")
    mail = parse_alerts({"email": ["ops@example.com"]})
    jobs = [http_job(store, f"http://127.0.0.1:9/{n}", tenant=acme) for n in range(3)]
    jobs.append(http_job(store, "http://127.0.0.1:9/b", tenant=beta))
    for job in jobs:
        tenant = beta if job == jobs[-1] else acme
        alerts_repo.set_settings(store, tenant, job, mail)
        _queue_dead_letter(store, tenant, job, datetime(2030, 1, 1, tzinfo=UTC))
    policy = AlertPolicy(
        email_domains=("example.com",), max_per_tenant_per_hour=2, smtp_configured=True
    )
    with alert_lane(store, port, policy) as lane:
        assert lane.run_once() == 4
    statuses = [_alert_of(store, job)["status"] for job in jobs]
    assert statuses == ["delivered", "delivered", "failed", "delivered"]
    limited = _alert_of(store, jobs[2])
    assert limited["last_error"].startswith("rate limited")
    assert "max_per_tenant_per_hour" in limited["last_error"]
    assert len(inbox.messages) == 3
    # a later pass counts the hour's deliveries from the database
    later = http_job(store, "http://127.0.0.1:9/later", tenant=acme)
    alerts_repo.set_settings(store, acme, later, mail)
    _queue_dead_letter(store, acme, later, datetime(2030, 1, 1, tzinfo=UTC))
    with alert_lane(store, port, policy) as lane:
        assert lane.run_once() == 1
    assert _alert_of(store, later)["status"] == "failed"
    assert len(inbox.messages) == 3


def test_one_tenants_unreadable_alert_settings_break_no_other_tenants_alerts(
    store: Store,
) -> None:
    """Settings rows that cannot be read (written past the API) are ignored, logged: the
    settle hook still queues the other tenant's alerts in the same batch, and the
    no-success check still runs."""
    acme, beta = "tenant-acme", make_tenant(store, "beta")
    good = http_job(store, "http://127.0.0.1:9/x", tenant=acme)
    bad = http_job(store, "http://127.0.0.1:9/y", tenant=beta)
    alerts_repo.set_settings(store, acme, good, parse_alerts({"email": ["a@example.com"]}))
    alerts_repo.set_settings(store, beta, bad, parse_alerts({"email": ["b@example.com"]}))
    alerts_repo.set_settings(store, beta, "", parse_alerts({"email": ["c@example.com"]}))
    with store.tx() as connection:
        connection.execute(
            update(schema.alert_settings)
            .where(schema.alert_settings.c.tenant_id == beta)
            .values(config='{"on": ["never"], "no_success": "PT1H"')
        )
    at = datetime(2030, 1, 1, tzinfo=UTC)
    failures = [
        alerts_repo.Failure(beta, bad, at, 1, "boom", True, "http", "u"),
        alerts_repo.Failure(acme, good, at, 1, "boom", True, "http", "u"),
    ]
    with store.tx() as connection:
        alerts_repo.queue_for_failures(connection, failures, store.now())
    assert [a["job_id"] for a in alerts_repo.list_alerts(store)] == [good]
    assert alerts_repo.check_no_success(store) == 0


@pytest.mark.parametrize("char", ["\u2028", "\x85", "\x9b"])
def test_cli_refuses_line_separators_in_a_job_name(db_url: str, char: str) -> None:
    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(cli_app, ["--db", db_url, "--output", "json", *args])
        assert result.exit_code == code, result.output
        return str(result.output)

    run("tenant", "create", "acme")
    args = ("job", "create", "--tenant", "acme", "--every", "1h", "--queue", "q")
    refused = run(*args, "--name", f"nightly{char}x", code=2)
    assert "name" in refused and "line-separator" in refused
    assert json.loads(run("job", "list", "--tenant", "acme"))["items"] == []


def _text_and_json(mail: Any) -> tuple[str, dict[str, Any]]:
    """An alert mail's plain-text body and its attached JSON (multipart/mixed)."""
    assert mail.get_content_type() == "multipart/mixed"
    text, attached = mail.get_payload()
    assert text.get_content_type() == "text/plain"
    assert attached.get_content_type() == "application/json"
    assert attached.get_filename() == "alert.json"
    body = text.get_payload(decode=True).decode().replace("\r\n", "\n")
    return body, json.loads(attached.get_payload(decode=True))


def test_a_runs_final_failure_mails_once_with_its_output_host_and_attempts(
    store: Store, smtp: tuple[Inbox, int], caplog: pytest.LogCaptureFixture
) -> None:
    """Alerts on failure and dead letter: the first attempt's failure is one mail, the last
    attempt's (the dead letter) one more, not two; each is plain text first (job and tenant
    by name, host, command, exit code, attempt of max, times, the output's last 50 lines,
    the command to see more) with the JSON attached; log lines name the job."""
    import socket

    inbox, port = smtp
    tenant = "tenant-acme"
    job = queue_job(store, max_attempts=2)
    alerts_repo.set_settings(
        store,
        tenant,
        job,
        parse_alerts({"on": ["failure", "dead_letter"], "email": ["ops@example.com"]}),
    )
    at = trigger(store, job)
    QueueRepo(store).move_outbox()
    w = Worker(
        store,
        "q",
        ["sh", "-c", "for i in $(seq 1 70); do echo output line $i; done; exit 3"],
        lease_seconds=5.0,
        heartbeat_seconds=1.0,
        poll_seconds=0.05,
    )
    stop = threading.Event()
    thread = threading.Thread(target=w.run, args=(stop,), daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="schedctl.alerts"):
            with running_relay(relay(store, port)):
                wait_for(lambda: run_row(store, job, at)["status"] == "dead", "the dead letter")
                wait_for(lambda: len(delivered(store)) == 2, "both mails")
    finally:
        stop.set()
        thread.join(60)
    rows = alerts_repo.list_alerts(store)
    assert sorted((a["kind"], a["run_attempt"]) for a in rows) == [
        ("dead_letter", 2),
        ("failure", 1),
    ]
    assert len(inbox.messages) == 2
    subjects = [
        " ".join(str(make_header(decode_header(m["Subject"]))).split()) for m in inbox.messages
    ]
    final = next(m for m, s in zip(inbox.messages, subjects, strict=True) if "the last" in s)
    subject = " ".join(str(make_header(decode_header(final["Subject"]))).split())
    assert "failed for good" in subject and "attempt 2 of 2, the last" in subject
    assert "tenant acme" in subject and job not in subject
    text, alert = _text_and_json(final)
    assert f"(id {job})" in text and "tenant:     acme (id tenant-acme)" in text
    assert f"host:       {socket.gethostname()}" in text
    assert "exit code:  3" in text and "attempt:    2 of 2, the last" in text
    assert "command:    the command of the workers of queue q" in text
    assert "scheduled:" in text and "started:" in text and "finished:" in text
    assert "| output line 70" in text and "| output line 21" in text
    assert "| output line 20\n" not in text  # the last 50 lines only
    assert f"See more: schedctl logs {job} " in text
    assert (alert["alert"], alert["job_id"], alert["exit_code"], alert["final"]) == (
        "dead_letter",
        job,
        3,
        True,
    )
    assert alert["tenant_name"] == "acme" and alert["max_attempts"] == 2
    # the daemon's dead-letter line names the job and tenant (their ids after)
    (line,) = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert "of tenant 'acme'" in line and f"job_id={job}" in line
