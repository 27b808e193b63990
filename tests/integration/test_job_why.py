"""Owns the tests of "why did my job not run" on SQLite and a real Postgres: a run skipped
by the misfire policy after an outage records its reason, `schedctl logs` shows it, and
`schedctl job why` (from the database and over the API) explains it with the schedule, the
next fires, the live workers of the queue and the pause and alert state."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import requests
from typer.testing import CliRunner

from schedctl.app.service import Scheduler
from schedctl.cli.app import app as cli_app
from schedctl.domain.models import RunStatus
from schedctl.scheduling.cron import CronSchedule
from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.storage.pipeline.claim import Claimer
from schedctl.storage.pipeline.workers import WorkerRepo
from scheduled_d.api.server import ApiServer
from tests.factories import create_job, move_next_run, spec
from tests.integration.test_claim import ALL, own_all

runner = CliRunner()
ACTOR = "test:why"


def cli(db_url: str, *args: str) -> object:
    return runner.invoke(cli_app, ["--db", db_url, *args])


def _missed(sched: Scheduler, tenant_id: str, *, grace: int = 60) -> tuple[str, datetime]:
    """A cron job that missed its last ten minutes (an outage) and a claim after it."""
    job_id = create_job(
        sched.store,
        tenant_id,
        spec(
            CronSchedule.parse("* * * * *", "UTC"),
            misfire=MisfirePolicy.skip,
            grace=grace,
            queue="backups",
        ),
    )
    missed_from = (datetime.now(UTC) - timedelta(minutes=10)).replace(second=0, microsecond=0)
    move_next_run(sched.store, job_id, missed_from)
    epochs = own_all(sched.store)
    claimer = Claimer(sched.store, "d1")
    now = datetime.now(UTC)
    result = claimer.claim(claimer.load_due(ALL, now), epochs, now)
    assert result.skipped >= 8 and result.dispatched == []
    return job_id, missed_from


def test_a_misfire_skip_records_its_reason_and_job_why_explains_it(
    sched: Scheduler, db_url: str
) -> None:
    tenant, _ = sched.create_tenant("acme", ACTOR)
    job_id, missed_from = _missed(sched, tenant.tenant_id, grace=60)
    runs = sched.runs(job_id, "acme", limit=100).items
    assert runs and all(r.status is RunStatus.skipped for r in runs)
    oldest = min(runs, key=lambda r: r.scheduled_at)
    assert oldest.scheduled_at == missed_from
    assert oldest.error is not None
    assert oldest.error.startswith("missed by ")
    assert "more than the 60 s grace; misfire policy skip" in oldest.error
    late = int(oldest.error.split()[2])
    assert 540 <= late <= 3600  # ten minutes late, give or take a slow machine

    # `schedctl logs` says why, not "no attempt yet"
    from schedctl.scheduling.timeparse import format_instant

    shown = cli(db_url, "logs", job_id, format_instant(missed_from))
    assert shown.exit_code == 0, shown.output
    assert "skipped: missed by" in shown.output and "no attempt yet" not in shown.output

    # a live worker of its queue, and the tenant's alerts
    WorkerRepo(sched.store).seen(tenant.tenant_id, "backups", "web1:worker", lease_seconds=300)
    sched.set_alerts("acme", {"email": ["ops@example.com"]})
    why = cli(db_url, "job", "why", job_id, "-o", "json")
    assert why.exit_code == 0, why.output
    data = json.loads(why.stdout)
    assert data["status"] == "active" and data["paused"] is False
    assert data["schedule"] == "cron * * * * * (UTC)"
    assert len(data["next_fires"]) == 5
    assert data["workers"] == ["web1:worker"]
    assert data["alerts"]["email"] == ["ops@example.com"] and data["alerts"]["from"] == "tenant"
    assert data["last_runs"][0]["status"] == "skipped"
    assert data["last_runs"][0]["reason"].startswith("missed by ")
    assert any("was skipped: missed by" in line for line in data["explanation"])
    text = cli(db_url, "job", "why", job_id)
    assert text.exit_code == 0, text.output
    assert "misfire policy skip" in text.output and "web1:worker" in text.output

    # paused, no worker: both said
    sched.pause_job(job_id, "acme", actor=ACTOR)
    paused = json.loads(cli(db_url, "job", "why", job_id, "-o", "json").stdout)
    assert paused["paused"] is True and paused["next_fires"] == []
    assert paused["explanation"][0].startswith("paused")


def test_job_why_without_a_live_worker_says_so(sched: Scheduler, db_url: str) -> None:
    tenant, _ = sched.create_tenant("acme", ACTOR)
    job_id, _ = _missed(sched, tenant.tenant_id)
    data = json.loads(cli(db_url, "job", "why", job_id, "-o", "json").stdout)
    assert data["workers"] == []
    assert any("no live worker serves queue 'backups'" in line for line in data["explanation"])
    assert any("no alerts are set" in line for line in data["explanation"])


def test_job_why_of_an_unknown_job_is_not_found(sched: Scheduler, db_url: str) -> None:
    sched.create_tenant("acme", ACTOR)
    result = cli(db_url, "job", "why", "no-such-job", "--tenant", "acme")
    assert result.exit_code == 3
    assert "no-such-job" in result.output


@pytest.fixture
def api(sched: Scheduler) -> Iterator[tuple[str, str, str]]:
    tenant, token = sched.create_tenant("remote", ACTOR)
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        yield server.url, token, tenant.tenant_id
    finally:
        server.stop()


def test_job_why_over_the_api_and_not_another_tenants(
    sched: Scheduler, api: tuple[str, str, str]
) -> None:
    url, token, tenant_id = api
    job_id, _ = _missed(sched, tenant_id)
    base = ["--api", url, "--token", token]
    result = runner.invoke(cli_app, [*base, "job", "why", job_id, "-o", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["job_id"] == job_id and data["last_runs"][0]["reason"].startswith("missed by")
    # another tenant's token: 404, like an unknown job
    _, other = sched.create_tenant("other", ACTOR)
    answer = requests.get(
        f"{url}/v1/jobs/{job_id}/why", headers={"Authorization": f"Bearer {other}"}, timeout=30
    )
    assert answer.status_code == 404


def _dead_letter(sched: Scheduler, tenant_id: str, job_id: str, error: str) -> None:
    from sqlalchemy import insert

    from schedctl.storage.db import schema

    with sched.store.tx() as connection:
        connection.execute(
            insert(schema.dead_letters).values(
                job_id=job_id,
                scheduled_at=datetime(2030, 1, 1, tzinfo=UTC),
                tenant_id=tenant_id,
                target_type="queue",
                target="backups",
                attempts=3,
                last_error=error,
                created_at=datetime.now(UTC),
            )
        )


def _narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 80-column terminal from now on."""
    from schedctl.cli import output

    monkeypatch.setenv("COLUMNS", "80")  # the CLI then keeps the terminal's width
    monkeypatch.setattr(output.console, "width", 80)


def test_dlq_list_names_jobs_and_80_columns_keep_unique_id_prefixes(
    sched: Scheduler, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant, _ = sched.create_tenant("acme", ACTOR)
    jobs = []
    for name in ("nightly-backup-of-the-main-database", "health-5min"):
        body = {"name": name, "schedule": {"every": "1h"}, "target": {"type": "queue", "name": "q"}}
        job, _ = sched.create_job("acme", body, actor=ACTOR)
        jobs.append(job)
        _dead_letter(sched, tenant.tenant_id, job.job_id, "exit code 3: " + "x" * 200)
    listed = json.loads(cli(db_url, "dlq", "list", "-o", "json").stdout)["items"]
    assert {i["job"] for i in listed} == {j.name for j in jobs}
    wide = cli(db_url, "dlq", "list")
    assert wide.exit_code == 0, wide.output
    assert all(j.name in wide.output for j in jobs)
    _narrow(monkeypatch)
    table = cli(db_url, "dlq", "list")
    assert table.exit_code == 0, table.output
    short = sched.short_job_ids("acme", [j.job_id for j in jobs])
    lines = table.output.splitlines()
    assert max(len(line) for line in lines) <= 80, table.output
    for job in jobs:
        # the whole unique prefix on one line of the table, never cut or wrapped
        assert any(short[job.job_id] in line for line in lines), (short, table.output)
    listed_jobs = cli(db_url, "job", "list", "--tenant", "acme")
    assert listed_jobs.exit_code == 0, listed_jobs.output
    for job in jobs:
        assert any(short[job.job_id] in line for line in listed_jobs.output.splitlines())


def test_the_times_missed_while_paused_are_recorded_skipped_at_resume(
    sched: Scheduler, db_url: str
) -> None:
    tenant, _ = sched.create_tenant("acme", ACTOR)
    job_id = create_job(sched.store, tenant.tenant_id, spec(CronSchedule.parse("* * * * *", "UTC")))
    sched.pause_job(job_id, "acme", actor=ACTOR)
    # paused five minutes ago (its next run then)
    paused_from = (datetime.now(UTC) - timedelta(minutes=5)).replace(second=0, microsecond=0)
    move_next_run(sched.store, job_id, paused_from)
    sched.resume_job(job_id, "acme", actor=ACTOR)
    runs = sched.runs(job_id, "acme", limit=100).items
    assert 4 <= len(runs) <= 7 and min(r.scheduled_at for r in runs) == paused_from
    assert all(r.status is RunStatus.skipped for r in runs)
    assert all(r.error and r.error.startswith("job paused at this time") for r in runs)
    data = json.loads(cli(db_url, "job", "why", job_id, "-o", "json").stdout)
    assert data["paused"] is False
    assert any("was skipped: job paused" in line for line in data["explanation"])
    # a second pause and resume at once records nothing new
    sched.pause_job(job_id, "acme", actor=ACTOR)
    sched.resume_job(job_id, "acme", actor=ACTOR)
    assert len(sched.runs(job_id, "acme", limit=100).items) == len(runs)
