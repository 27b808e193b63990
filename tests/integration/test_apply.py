"""Owns the tests of `schedctl apply` (issue 11 item 1) on SQLite and Postgres: created,
changed, unchanged and removed central jobs by name, the diff, --dry-run and a second run
writing nothing, gone jobs removed (only this host's own) unless --keep-removed, an
operator's pause surviving apply, `apply --check` and the 0664 file refused, two hosts
applying one directory, a bad file applying nothing, and the command never reaching the
central store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from schedctl.app import jobfiles_apply as applying
from schedctl.app.service import Scheduler
from schedctl.cli.app import app
from schedctl.core import errors
from schedctl.domain import jobfiles
from schedctl.domain.models import JobStatus
from schedctl.scheduling.schedules import schedule_to_dict
from schedctl.storage.db import schema

ACTOR = "test"
runner = CliRunner()
SECRET = "/usr/local/bin/backup-secret-7f3a"

FILE = f"""
[[job]]
name = "backup"
cron = "30 2 * * *"
timezone = "Europe/Berlin"
command = ["{SECRET}", "--full"]
user = "backup"
timeout = "2h"
alert_email = ["ops@example.com"]
[job.env]
TOKEN = "env-secret-42"

[[job]]
name = "report"
every = "15m"
shell = "echo shell-secret-99"
run_on = "host-group:web"

[[job]]
name = "warm"
cron = "@reboot"
command = ["/bin/true"]

[[job]]
name = "dbonly"
every = "1h"
command = ["/bin/true"]
run_on = "every-host:db"
"""


@pytest.fixture
def sched(db_url: str) -> Iterator[Scheduler]:
    scheduler = Scheduler.open(db_url)
    scheduler.create_tenant("acme", ACTOR)
    try:
        yield scheduler
    finally:
        scheduler.close()


@pytest.fixture
def jobs_d(tmp_path: Path) -> Path:
    directory = tmp_path / "jobs.d"
    directory.mkdir()
    (directory / "host.toml").write_text(FILE)
    return directory


def run(
    sched: Scheduler, directory: Path, host: str = "web1", *, dry_run: bool = False, **kw: Any
) -> applying.Plan:
    """What the command does, through the library."""
    files = jobfiles.load_dir(directory)
    plan = applying.plan(
        files,
        host,
        kw.pop("groups", ()),
        applying.read_central(sched, "acme"),
        directory=directory,
        now=sched.store.now(),
        **kw,
    )
    if not dry_run:
        applying.execute(sched, "acme", plan, actor=ACTOR)
    return plan


def names(plan: applying.Plan, action: applying.Action) -> list[str]:
    return [e.name for e in plan.of(action)]


def rows(sched: Scheduler) -> list[dict[str, Any]]:
    with sched.store.read() as connection:
        jobs = connection.execute(select(schema.jobs).order_by(schema.jobs.c.job_id))
        return [dict(r) for r in jobs.mappings()]


def audit_count(sched: Scheduler) -> int:
    with sched.store.read() as connection:
        return int(
            connection.execute(select(func.count()).select_from(schema.audit_log)).scalar_one()
        )


def by_name(sched: Scheduler, name: str) -> Any:
    return sched.get_job_by_name(name, "acme")


def test_apply_creates_then_a_second_run_changes_nothing(sched: Scheduler, jobs_d: Path) -> None:
    plan = run(sched, jobs_d)
    assert names(plan, applying.Action.created) == ["backup@web1", "report", "warm@web1"]
    skipped = {s.name: s.reason for s in plan.skipped}
    assert set(skipped) == {"dbonly"} and "group db" in skipped["dbonly"]
    # an @reboot job: a central job the dispatcher never fires, for its boot runs
    warm = by_name(sched, "warm@web1")
    assert schedule_to_dict(warm.schedule) == {"kind": "boot"}
    assert warm.next_run_at is None
    backup = by_name(sched, "backup@web1")
    assert backup.target.address == "host:web1" and backup.timeout_seconds == 7200
    assert set(backup.payload) == {"job_file", "job", "host", "digest"}
    assert backup.payload["job_file"] == str(jobs_d / "host.toml")
    assert backup.payload["host"] == "web1" and backup.payload["job"] == "backup"
    alerts = sched.get_alerts("acme", backup.job_id)
    assert alerts is not None and alerts.email == ("ops@example.com",)
    assert by_name(sched, "report").target.address == "group:web"

    before, audits = rows(sched), audit_count(sched)
    again = run(sched, jobs_d)
    assert names(again, applying.Action.unchanged) == ["backup@web1", "report", "warm@web1"]
    assert not again.writes and rows(sched) == before and audit_count(sched) == audits


def test_dry_run_writes_nothing(sched: Scheduler, jobs_d: Path) -> None:
    audits = audit_count(sched)  # the tenant's creation
    plan = run(sched, jobs_d, dry_run=True)
    assert names(plan, applying.Action.created) == ["backup@web1", "report", "warm@web1"]
    assert rows(sched) == [] and audit_count(sched) == audits
    run(sched, jobs_d)
    (jobs_d / "host.toml").write_text(FILE.replace('"2h"', '"3h"'))
    before = rows(sched)
    plan = run(sched, jobs_d, dry_run=True)
    (entry,) = plan.of(applying.Action.changed)
    assert entry.fields["timeout"] == (7200, 10800)
    assert rows(sched) == before


def test_changes_show_per_field_and_are_applied(sched: Scheduler, jobs_d: Path) -> None:
    run(sched, jobs_d)
    first = by_name(sched, "backup@web1")
    # a command-only change shows as a changed digest; the command itself never shows
    text = (
        FILE.replace("--full", "--incremental")
        .replace('"30 2 * * *"', '"0 3 * * *"')
        .replace('name = "report"', 'name = "report"\nenabled = false')
        .replace('alert_email = ["ops@example.com"]', 'alert_email = ["sre@example.com"]')
    )
    (jobs_d / "host.toml").write_text(text)
    plan = run(sched, jobs_d)
    changed = {e.name: e.fields for e in plan.of(applying.Action.changed)}
    assert set(changed) == {"backup@web1", "report"}
    backup = changed["backup@web1"]
    assert set(backup) == {"schedule", "payload.digest", "alerts"}
    assert backup["schedule"][1]["cron"] == "0 3 * * *"
    # the digest covers the whole definition, enabled included
    assert set(changed["report"]) == {"status", "payload.digest", "payload.disabled"}
    assert changed["report"]["status"] == ("active", "paused")
    job = by_name(sched, "backup@web1")
    assert job.job_id == first.job_id and job.payload["digest"] != first.payload["digest"]
    assert job.schedule.expr == "0 3 * * *"  # type: ignore[attr-defined]
    alerts = sched.get_alerts("acme", job.job_id)
    assert alerts is not None and alerts.email == ("sre@example.com",)
    assert by_name(sched, "report").status is JobStatus.paused
    assert not run(sched, jobs_d).writes


def test_a_disabled_job_is_created_paused(sched: Scheduler, jobs_d: Path) -> None:
    (jobs_d / "host.toml").write_text(
        FILE.replace('name = "report"', 'name = "report"\nenabled = false')
    )
    run(sched, jobs_d)
    assert by_name(sched, "report").status is JobStatus.paused
    assert not run(sched, jobs_d).writes


def test_gone_jobs_are_removed_by_default_only_this_hosts(sched: Scheduler, jobs_d: Path) -> None:
    (jobs_d / "extra.toml").write_text('[[job]]\nname = "tmp"\nevery = "1h"\ncommand = ["/x"]\n')
    run(sched, jobs_d)
    run(sched, jobs_d, host="web2")
    other, _ = sched.create_job(
        "acme",
        {"name": "manual", "schedule": {"every": "1h"}, "target": {"type": "queue", "name": "q"}},
        actor=ACTOR,
    )
    (jobs_d / "extra.toml").unlink()
    kept = run(sched, jobs_d, keep_removed=True)
    assert names(kept, applying.Action.removed) == []
    assert {s.name for s in kept.skipped} >= {"tmp@web1"}
    by_name(sched, "tmp@web1")  # still there with --keep-removed
    pruned = run(sched, jobs_d)
    assert names(pruned, applying.Action.removed) == ["tmp@web1"]
    left = {j.name for j in sched.list_jobs("acme", limit=100).items}
    assert left == {
        "backup@web1", "backup@web2", "report", "tmp@web2", "manual", "warm@web1", "warm@web2"
    }  # fmt: skip
    assert sched.get_job(other.job_id).status is JobStatus.active
    assert not run(sched, jobs_d).writes


def test_two_hosts_get_their_own_jobs_and_share_the_group_job(
    sched: Scheduler, jobs_d: Path
) -> None:
    run(sched, jobs_d, host="web1")
    second = run(sched, jobs_d, host="web2")
    assert names(second, applying.Action.created) == ["backup@web2", "warm@web2"]
    assert names(second, applying.Action.unchanged) == ["report"]
    jobs = {j.name: j for j in sched.list_jobs("acme", limit=100).items}
    assert set(jobs) == {"backup@web1", "backup@web2", "report", "warm@web1", "warm@web2"}
    assert jobs["backup@web2"].target.address == "host:web2"
    # each host sees the other's apply as no change
    assert not run(sched, jobs_d, host="web1").writes
    assert not run(sched, jobs_d, host="web2").writes
    db = run(sched, jobs_d, host="db1", groups=("db",))
    assert names(db, applying.Action.created) == ["backup@db1", "warm@db1", "dbonly@db1"]


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        # an invalid file
        (
            '[[job]]\nname = "oops"\nevery = "1h"\ncommand = ["/x"]\ntimeout = "forever"\n',
            "job.timeout",
            5,
        ),
        # a value only the clock refuses
        ('[[job]]\nname = "once"\nat = 2001-01-01T00:00:00Z\ncommand = ["/x"]\n', "job.at", 3),
    ],
    ids=["invalid", "past"],
)
def test_a_refused_file_applies_nothing_and_names_file_line_key(
    sched: Scheduler, jobs_d: Path, text: str, key: str, line: int
) -> None:
    refused = jobs_d / "refused.toml"
    refused.write_text(text)
    with pytest.raises(jobfiles.JobFilesError) as caught:
        run(sched, jobs_d)
    assert f"{key}: {refused}:{line}:" in str(caught.value)
    assert rows(sched) == []


def test_a_job_not_made_by_apply_is_never_taken_over(sched: Scheduler, jobs_d: Path) -> None:
    sched.create_job(
        "acme",
        {"name": "report", "schedule": {"every": "1h"}, "target": {"type": "queue", "name": "q"}},
        actor=ACTOR,
    )
    before = rows(sched)
    with pytest.raises(jobfiles.JobFilesError, match="not made by `schedctl apply`"):
        run(sched, jobs_d)
    assert rows(sched) == before


def test_the_command_never_reaches_the_central_store(sched: Scheduler, jobs_d: Path) -> None:
    run(sched, jobs_d)
    (jobs_d / "host.toml").write_text(FILE.replace("--full", "--other"))
    run(sched, jobs_d)
    with sched.store.read() as connection:
        stored = [
            dict(r)
            for table in (schema.jobs, schema.audit_log, schema.alert_settings)
            for r in connection.execute(select(table)).mappings()
        ]
    assert len(stored) > 2
    text = repr(stored)
    for secret in (SECRET, "--full", "--other", "env-secret-42", "shell-secret-99", "TOKEN"):
        assert secret not in text, secret


def test_cli_json_output_and_dry_run(db_url: str, sched: Scheduler, jobs_d: Path) -> None:
    base = ["--db", db_url, "apply", str(jobs_d), "--host", "web1", "-o", "json"]
    dry = runner.invoke(app, [*base, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    data = json.loads(dry.stdout)
    assert data == {
        "created": ["backup@web1", "report", "warm@web1"],
        "changed": [],
        "unchanged": [],
        "removed": [],
        "skipped": [
            {
                "name": "dbonly",
                "file": str(jobs_d / "host.toml"),
                "reason": "runs on every host of group db, not this one",
            },
        ],
        "applied": False,
    }
    assert rows(sched) == []
    assert json.loads(runner.invoke(app, base).stdout)["applied"] is True
    (jobs_d / "host.toml").write_text(FILE.replace('"2h"', '"3h"'))
    changed = json.loads(runner.invoke(app, base).stdout)
    assert changed["changed"] == [
        {
            "name": "backup@web1",
            "fields": {
                "payload.digest": changed["changed"][0]["fields"]["payload.digest"],
                "timeout": [7200, 10800],
            },
        }
    ]
    assert changed["unchanged"] == ["report", "warm@web1"]
    table = runner.invoke(app, ["--db", db_url, "apply", str(jobs_d), "--host", "web1"])
    assert table.exit_code == 0
    assert "0 created, 0 changed, 3 unchanged, 0 removed, 1 skipped" in table.stdout


def test_cli_refuses_a_bad_file_naming_it(db_url: str, sched: Scheduler, jobs_d: Path) -> None:
    bad = jobs_d / "bad.toml"
    bad.write_text('[[job]]\nname = "oops"\nevery = "1h"\ncommand = ["/x"]\nretries = 3\n')
    result = runner.invoke(app, ["--db", db_url, "apply", str(jobs_d), "--host", "web1"])
    assert result.exit_code == 2, result.output
    assert f"job.retries: {bad}:5: unknown key" in result.output
    assert rows(sched) == []


def test_the_host_table_is_read_for_name_and_groups(tmp_path: Path) -> None:
    config = tmp_path / "scheduled.toml"
    config.write_text('database_url = "sqlite://"\n[host]\nname = "web7"\ngroups = ["web"]\n')
    assert applying.read_host(config) == ("web7", ("web",))
    config.write_text("[host]\nname = 'bad host'\n")
    with pytest.raises(errors.ConfigError, match=r"host\.name: .*:2: must be 1-63 letters"):
        applying.read_host(config)
    name, groups = applying.read_host(None)
    assert name and groups == ()


def test_a_cancelled_job_or_a_moved_end_is_replaced(sched: Scheduler, jobs_d: Path) -> None:
    run(sched, jobs_d)
    first = by_name(sched, "backup@web1")
    sched.cancel_job(first.job_id, "acme", actor=ACTOR)
    plan = run(sched, jobs_d)
    (entry,) = plan.of(applying.Action.changed)
    assert entry.replace and entry.fields == {"status": ("cancelled", "active")}
    second = by_name(sched, "backup@web1")
    assert second.job_id != first.job_id and second.status is JobStatus.active
    (jobs_d / "host.toml").write_text(
        FILE.replace('timeout = "2h"', 'timeout = "2h"\nend = 2099-01-01T00:00:00Z')
    )
    (entry,) = run(sched, jobs_d).of(applying.Action.changed)
    assert entry.replace and set(entry.fields) == {"end", "payload.digest"}
    assert by_name(sched, "backup@web1").end_at is not None
    assert not run(sched, jobs_d).writes


def test_alerts_the_central_store_cannot_hold_are_refused_by_key(
    sched: Scheduler, jobs_d: Path
) -> None:
    for old, new, key in (
        ('["ops@example.com"]', '["root"]', "alert_email"),
        (
            'alert_email = ["ops@example.com"]',
            'alert_webhook = ["https://a.example.com/h", "https://b.example.com/h"]',
            "alert_webhook",
        ),
    ):
        (jobs_d / "host.toml").write_text(FILE.replace(old, new))
        with pytest.raises(jobfiles.JobFilesError) as caught:
            run(sched, jobs_d)
        assert f"job.{key}: {jobs_d / 'host.toml'}:9:" in str(caught.value), caught.value
        assert rows(sched) == []


def test_a_one_off_that_ran_stays_unchanged(sched: Scheduler, jobs_d: Path) -> None:
    once = jobs_d / "once.toml"
    text = '[[job]]\nname = "once"\nat = 2099-01-01T00:00:00Z\ncommand = ["/x"]\n'
    once.write_text(text)
    run(sched, jobs_d)
    with sched.store.tx() as connection:
        # the dispatcher completes a one-off after its run; set it directly
        connection.execute(
            schema.jobs.update().where(schema.jobs.c.name == "once@web1").values(status="completed")
        )
    once.write_text(text + "enabled = false\n")
    plan = run(sched, jobs_d)
    (entry,) = plan.of(applying.Action.changed)
    assert entry.name == "once@web1" and set(entry.fields) == {"payload.digest", "payload.disabled"}
    assert by_name(sched, "once@web1").status is JobStatus.completed
    assert not run(sched, jobs_d).writes


def test_a_local_mailbox_is_mailed_at_the_mail_domain(sched: Scheduler, jobs_d: Path) -> None:
    # cron's MAILTO=root (as import-crontab writes it) becomes root@DOMAIN centrally
    (jobs_d / "host.toml").write_text(FILE.replace('["ops@example.com"]', '["root"]'))
    run(sched, jobs_d, mail_domain="web1.example.com")
    alerts = sched.get_alerts("acme", by_name(sched, "backup@web1").job_id)
    assert alerts is not None and alerts.email == ("root@web1.example.com",)
    assert not run(sched, jobs_d, mail_domain="web1.example.com").writes


def test_a_renamed_job_is_removed_centrally(sched: Scheduler, jobs_d: Path) -> None:
    run(sched, jobs_d)
    (jobs_d / "host.toml").write_text(FILE.replace('name = "backup"', 'name = "backup2"'))
    plan = run(sched, jobs_d)
    assert names(plan, applying.Action.created) == ["backup2@web1"]
    assert names(plan, applying.Action.removed) == ["backup@web1"]
    left = {j.name for j in sched.list_jobs("acme", limit=100).items}
    assert left == {"backup2@web1", "report", "warm@web1"}


def test_an_operators_pause_survives_apply(sched: Scheduler, jobs_d: Path) -> None:
    run(sched, jobs_d)
    job = by_name(sched, "backup@web1")
    sched.pause_job(job.job_id, "acme", actor="operator")
    assert not run(sched, jobs_d).writes
    # a changed file changes the job, and still not its status
    (jobs_d / "host.toml").write_text(FILE.replace('"2h"', '"3h"'))
    plan = run(sched, jobs_d)
    assert set(plan.of(applying.Action.changed)[0].fields) == {"timeout", "payload.digest"}
    assert by_name(sched, "backup@web1").status is JobStatus.paused
    # a replacement (a moved end) keeps the pause too
    (jobs_d / "host.toml").write_text(
        FILE.replace('"2h"', '"3h"').replace(
            'timeout = "3h"', 'timeout = "3h"\nend = "2099-01-01T00:00:00Z"'
        )
    )
    plan = run(sched, jobs_d)
    assert plan.of(applying.Action.changed)[0].replace
    assert by_name(sched, "backup@web1").status is JobStatus.paused
    # the operator's resume is theirs to make
    sched.resume_job(by_name(sched, "backup@web1").job_id, "acme", actor="operator")
    assert not run(sched, jobs_d).writes


def test_enabled_false_pauses_and_enabled_true_resumes_only_that_pause(
    sched: Scheduler, jobs_d: Path
) -> None:
    off = FILE.replace('name = "report"', 'name = "report"\nenabled = false')
    (jobs_d / "host.toml").write_text(off)
    run(sched, jobs_d)
    report = by_name(sched, "report")
    assert report.status is JobStatus.paused and report.payload["disabled"] is True
    (jobs_d / "host.toml").write_text(FILE)
    plan = run(sched, jobs_d)
    assert plan.of(applying.Action.changed)[0].fields["status"] == ("paused", "active")
    report = by_name(sched, "report")
    assert report.status is JobStatus.active and "disabled" not in report.payload
    # an operator resuming a job its file disables: the file's off wins at the next apply
    (jobs_d / "host.toml").write_text(off)
    run(sched, jobs_d)
    sched.resume_job(report.job_id, "acme", actor="operator")
    assert run(sched, jobs_d).of(applying.Action.changed)[0].fields == {
        "status": ("active", "paused")
    }
    assert by_name(sched, "report").status is JobStatus.paused


def test_check_exits_1_on_drift_and_0_in_step(db_url: str, sched: Scheduler, jobs_d: Path) -> None:
    base = ["--db", db_url, "apply", str(jobs_d), "--host", "web1"]
    drift = runner.invoke(app, [*base, "--check"])
    assert drift.exit_code == 1, drift.output
    assert "backup@web1" in drift.stdout and "drift" in drift.stdout
    assert rows(sched) == []  # --check writes nothing
    assert runner.invoke(app, base).exit_code == 0
    step = runner.invoke(app, [*base, "--check"])
    assert step.exit_code == 0, step.output
    assert "in step" in step.stdout and "backup@web1" not in step.stdout
    (jobs_d / "host.toml").write_text(FILE.replace('"2h"', '"3h"'))
    changed = runner.invoke(app, [*base, "--check", "-o", "json"])
    assert changed.exit_code == 1
    assert [c["name"] for c in json.loads(changed.stdout)["changed"]] == ["backup@web1"]
    (jobs_d / "host.toml").write_text(FILE)
    (jobs_d / "extra.toml").write_text('[[job]]\nname = "tmp"\nevery = "1h"\ncommand = ["/x"]\n')
    assert runner.invoke(app, base).exit_code == 0
    (jobs_d / "extra.toml").unlink()
    gone = runner.invoke(app, [*base, "--check"])
    assert gone.exit_code == 1 and "tmp@web1" in gone.stdout
    # --prune is accepted, a no-op: removing is the default
    pruned = runner.invoke(app, [*base, "--prune"])
    assert pruned.exit_code == 0 and "deprecated" in pruned.stderr
    assert runner.invoke(app, [*base, "--check"]).exit_code == 0


def test_apply_refuses_a_group_writable_file_as_the_worker_does(
    db_url: str, sched: Scheduler, jobs_d: Path
) -> None:
    (jobs_d / "host.toml").chmod(0o664)
    result = runner.invoke(app, ["--db", db_url, "apply", str(jobs_d), "--host", "web1"])
    assert result.exit_code == 2, result.output
    assert "writable" in result.output and str(jobs_d / "host.toml") in result.output
    assert rows(sched) == []


def upstream_names(sched: Scheduler, name: str) -> list[str]:
    graph = sched.job_dependencies(by_name(sched, name).job_id, "acme")
    return sorted(str(u["name"]) for u in graph["upstream"])


def test_after_in_files_maps_to_the_central_names(sched: Scheduler, jobs_d: Path) -> None:
    (jobs_d / "zz.toml").write_text(
        '[[job]]\nname = "verify"\nafter = ["backup", "report"]\ncommand = ["/x"]\n'
    )
    plan = run(sched, jobs_d)
    # the upstream jobs are created first, whatever the files' order
    created = names(plan, applying.Action.created)
    assert created.index("verify@web1") > created.index("backup@web1")
    assert upstream_names(sched, "verify@web1") == ["backup@web1", "report"]
    assert not run(sched, jobs_d).writes
    (jobs_d / "zz.toml").write_text(
        '[[job]]\nname = "verify"\nafter = ["backup"]\ncommand = ["/x"]\n'
    )
    (entry,) = run(sched, jobs_d).of(applying.Action.changed)
    assert entry.fields["after"] == (["backup@web1", "report"], ["backup@web1"])
    assert upstream_names(sched, "verify@web1") == ["backup@web1"]
    # an upstream replaced (a moved end: a new id) keeps its dependent pointing at it
    (jobs_d / "host.toml").write_text(
        FILE.replace('timeout = "2h"', 'timeout = "2h"\nend = "2099-01-01T00:00:00Z"')
    )
    plan = run(sched, jobs_d)
    assert plan.of(applying.Action.changed)[0].replace
    graph = sched.job_dependencies(by_name(sched, "verify@web1").job_id, "acme")
    assert [u["job_id"] for u in graph["upstream"]] == [by_name(sched, "backup@web1").job_id]
    assert not run(sched, jobs_d).writes
    # from `after` to a schedule of its own: the job is replaced
    (jobs_d / "zz.toml").write_text('[[job]]\nname = "verify"\nevery = "1h"\ncommand = ["/x"]\n')
    (entry,) = run(sched, jobs_d).of(applying.Action.changed)
    assert entry.replace and upstream_names(sched, "verify@web1") == []


def test_after_a_job_this_host_does_not_apply_is_refused(sched: Scheduler, jobs_d: Path) -> None:
    bad = jobs_d / "zz.toml"
    bad.write_text('[[job]]\nname = "verify"\nafter = ["dbonly"]\ncommand = ["/x"]\n')
    with pytest.raises(jobfiles.JobFilesError) as caught:
        run(sched, jobs_d)
    assert f"job.after: {bad}:3:" in str(caught.value)
    assert "does not apply" in str(caught.value)
    assert rows(sched) == []


def test_a_boot_schedule_is_only_made_at_create(sched: Scheduler, jobs_d: Path) -> None:
    run(sched, jobs_d)
    backup = by_name(sched, "backup@web1")
    for change in (
        lambda: sched.update_job(backup.job_id, {"schedule": {"boot": True}}, "acme", actor=ACTOR),
        lambda: sched.reschedule_job(backup.job_id, {"boot": True}, "acme", actor=ACTOR),
    ):
        with pytest.raises(errors.ValidationError) as caught:
            change()
        assert caught.value.field == "boot"
    assert by_name(sched, "backup@web1").schedule == backup.schedule
    # a boot job is never triggered by the dispatcher: no next run
    assert by_name(sched, "warm@web1").next_run_at is None
