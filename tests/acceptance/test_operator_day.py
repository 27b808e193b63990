"""Owns the acceptance test of issue 32: an operator's day with real processes (the
installed `schedctl` and `scheduled-d` on a SQLite file, a loopback SMTP server): a crontab
imported, applied, a pause surviving `apply`, a renamed job removed centrally, `apply
--check` for drift, an @reboot job run once across a worker restart and in the run
history; then under `scheduled-d all` (dispatcher, alert relay, host worker): a
skip-overlap job skipping with its reason, a timeout killing a `setsid` child (the run's
cgroup), the failure mail carrying the output and the exit code, and `schedctl job why`
explaining a misfire skip after the daemon was down longer than the job's grace."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.process_support import (
    killed_if_left,
    schedctl_command,
    stops_on_sigterm,
    wait_for,
)
from tests.smtp_support import Inbox, smtp_server

BIN = Path(schedctl_command()[0]).parent
HOST = "web1"
CRONTAB = """\
MAILTO=""
# nightly backup
30 2 * * * tar czf /tmp/backup.tgz /etc
*/5 * * * * echo health
@reboot echo booted-on-this-host
"""


class Day:
    """The central database, the host's files and its worker."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.db = f"sqlite:///{tmp / 'central.db'}"
        self.jobs_d = tmp / "jobs.d"
        self.boot_id = tmp / "boot_id"
        self.log = tmp / "worker.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
        self.env["COLUMNS"] = "200"

    def schedctl(self, *args: str, code: int = 0) -> str:
        done = subprocess.run(
            [*schedctl_command(), "--db", self.db, *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
        )
        assert "Traceback" not in done.stdout + done.stderr
        assert done.returncode == code, (args, done.stdout, done.stderr)
        return done.stdout

    def json(self, *args: str, code: int = 0) -> Any:
        return json.loads(self.schedctl(*args, "-o", "json", code=code))

    def apply(self, *args: str, code: int = 0) -> Any:
        return self.json("apply", str(self.jobs_d), "--host", HOST, *args, code=code)

    def worker(self) -> subprocess.Popen[bytes]:
        config = self.tmp / "scheduled.toml"
        config.write_text(
            "[host]\n"
            f'name = "{HOST}"\n'
            f'jobs_dir = "{self.jobs_d}"\n'
            'tenant = "ops"\n'
            f'state_dir = "{self.tmp / "state"}"\n'
            f'boot_id_file = "{self.boot_id}"\n'
        )
        with self.log.open("ab") as log:
            return subprocess.Popen(
                [str(BIN / "scheduled-d"), "worker", "--config", str(config), "--db", self.db],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def daemon(self, extra: str) -> subprocess.Popen[bytes]:
        """The whole daemon (dispatcher, alert relay, this host's worker) on the same files."""
        config = self.tmp / "scheduled-all.toml"
        config.write_text(
            "poll_interval_seconds = 0.1\n"
            f"{extra}"
            "[host]\n"
            f'name = "{HOST}"\n'
            f'jobs_dir = "{self.jobs_d}"\n'
            'tenant = "ops"\n'
            f'state_dir = "{self.tmp / "state"}"\n'
            f'boot_id_file = "{self.boot_id}"\n'
            "rescan_seconds = 1\n"
        )
        with self.log.open("ab") as log:
            return subprocess.Popen(
                [str(BIN / "scheduled-d"), "all", "--config", str(config), "--db", self.db],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def runs(self, job: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.json("runs", job)["items"]
        return items


@pytest.fixture
def day(tmp_path: Path) -> Iterator[Day]:
    yield Day(tmp_path)


def test_an_operators_day(day: Day) -> None:
    day.schedctl("tenant", "create", "ops")
    crontab = day.tmp / "crontab"
    crontab.write_text(CRONTAB)
    imported = day.json(
        "import-crontab", str(crontab), "--user", "nobody", "--tz", "UTC", "--out", str(day.jobs_d)
    )
    names = [job["name"] for job in imported["jobs"]]
    assert len(names) == 3
    text = "\n".join(p.read_text() for p in sorted(day.jobs_d.glob("*.toml")))
    boot = next(n for n in names if f'name = "{n}"\ncron = "@reboot"' in text)
    backup, health = (n for n in names if n != boot)

    # apply: every job gets its central job, the @reboot one too (for its boot runs)
    applied = day.apply("--mail-domain", "example.com")
    assert sorted(applied["created"]) == sorted(f"{n}@{HOST}" for n in names)
    assert day.schedctl("apply", str(day.jobs_d), "--host", HOST, "--check")

    # an operator pauses a job: apply leaves it paused
    day.schedctl("job", "pause", f"{backup}@{HOST}")
    again = day.apply()
    assert again["changed"] == [] and again["removed"] == []
    assert day.json("job", "show", f"{backup}@{HOST}")["status"] == "paused"

    # a job renamed in its file: the old central job is removed, not left firing
    toml = next(p for p in day.jobs_d.glob("*.toml") if f'name = "{health}"' in p.read_text())
    toml.write_text(toml.read_text().replace(f'name = "{health}"', 'name = "health-check"'))
    drift = day.schedctl("apply", str(day.jobs_d), "--host", HOST, "--check", code=1)
    assert f"{health}@{HOST}" in drift and "health-check@" in drift
    renamed = day.apply()
    assert renamed["removed"] == [f"{health}@{HOST}"]
    assert renamed["created"] == [f"health-check@{HOST}"]
    listed = {j["name"] for j in day.json("job", "list")["items"]}
    assert f"{health}@{HOST}" not in listed and f"health-check@{HOST}" in listed
    day.schedctl("apply", str(day.jobs_d), "--host", HOST, "--check")  # in step: exit 0

    # @reboot: once per boot, across a restart of the worker, in the run history
    day.boot_id.write_text("44444444-aaaa-4bbb-8ccc-000000000001\n")
    first = day.worker()
    with killed_if_left(first):
        assert wait_for(lambda: len(day.runs(f"{boot}@{HOST}")) == 1), day.log.read_text()
        stops_on_sigterm(first, day.log)
    (run,) = day.runs(f"{boot}@{HOST}")
    assert (run["trigger"], run["status"]) == ("boot", "succeeded")
    assert "booted-on-this-host" in (run["output_tail"] or "")
    second = day.worker()
    with killed_if_left(second):
        assert wait_for(lambda: "already run in this boot" in day.log.read_text())
        stops_on_sigterm(second, day.log)
    assert len(day.runs(f"{boot}@{HOST}")) == 1
    assert day.log.read_text().count("booted-on-this-host") == 1

    # the rest of the day needs the dispatcher and the alert relay: `scheduled-d all`
    (day.jobs_d / "day.toml").write_text(DAY_JOBS.format(pidfile=day.tmp / "child.pid"))
    day.apply()
    with smtp_server() as (inbox, smtp_port):
        smtp_conf = (
            f'smtp_host = "127.0.0.1"\nsmtp_port = {smtp_port}\n'
            '[alerts]\nemail_domains = ["example.com"]\n'
        )
        daemon = day.daemon(smtp_conf)
        with killed_if_left(daemon):
            day_with_the_dispatcher(day, inbox)
            # the misfire: the daemon stopped for longer than the grace (1s) of a 2s job
            assert wait_for(lambda: _ended(day.runs(f"missed@{HOST}"))), day.log.read_text()
            stops_on_sigterm(daemon, day.log)
        time.sleep(5)
        daemon = day.daemon(smtp_conf)
        with killed_if_left(daemon):
            assert wait_for(lambda: _skipped(day.runs(f"missed@{HOST}"))), day.log.read_text()
            why = day.schedctl("job", "why", f"missed@{HOST}")
            stops_on_sigterm(daemon, day.log)
        # alerts on failure and dead letter: the run's final failure sent one message
        assert len(inbox.messages) == 1, [str(m["Subject"]) for m in inbox.messages]
    (skip,) = _skipped(day.runs(f"missed@{HOST}"))[:1]
    assert re.fullmatch(
        r"missed by \d+ s, more than the 1 s grace; misfire policy skip", skip["error"]
    ), skip
    assert "misfire policy skip" in why, why
    assert "skipped" in why and skip["error"] in why, why


DAY_JOBS = """\
[[job]]
name = "slow"
every = "2s"
shell = "sleep 5"
overlap = "skip"
retry = {{ max_attempts = 1 }}

[[job]]
name = "contained"
cron = "0 0 1 1 *"
shell = "setsid sleep 300 & echo $! > {pidfile}; sleep 100"
timeout = "3s"
retry = {{ max_attempts = 1 }}

[[job]]
name = "broken"
cron = "0 0 1 1 *"
shell = "echo first line of output; echo disk full >&2; exit 3"
retry = {{ max_attempts = 1 }}
alert_email = ["ops@example.com"]
alert_on = ["failure", "dead_letter"]

[[job]]
name = "missed"
every = "2s"
shell = "echo on time"
misfire_policy = "skip"
grace = "1s"
retry = {{ max_attempts = 1 }}
"""
ENDED = ("succeeded", "failed", "dead", "lost", "cancelled")


def _ended(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r["status"] in ENDED]


def _skipped(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r["status"] == "skipped"]


def _is_sleep_300(pid: int) -> bool:
    """Whether `pid` is still a `sleep 300` (not a reused pid of some other process)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"300"]
    except (FileNotFoundError, ProcessLookupError):
        return False


def day_with_the_dispatcher(day: Day, inbox: Inbox) -> None:
    # overlap = "skip": a 5s job every 2s skips the runs due while it runs, with the reason
    slow = f"slow@{HOST}"
    assert wait_for(lambda: _skipped(day.runs(slow))), day.log.read_text()
    reasons = {r["error"] for r in _skipped(day.runs(slow))}
    assert reasons == {"previous run still running"}, reasons
    day.schedctl("job", "pause", slow)

    # a timeout kills the whole run, a `setsid` child (its own session and group) included
    contained = f"contained@{HOST}"
    day.schedctl("job", "trigger", contained)
    assert wait_for(lambda: _ended(day.runs(contained))), day.log.read_text()
    (run,) = _ended(day.runs(contained))
    assert run["status"] in ("failed", "dead") and "timed out" in (run["error"] or ""), run
    pid = int((day.tmp / "child.pid").read_text())
    # the cgroup is killed whole as the run ends: bounded wait for the kernel to reap it
    try:
        assert wait_for(lambda: not _is_sleep_300(pid), 30), f"sleep 300 (pid {pid}) survived"
    finally:
        if _is_sleep_300(pid):  # a failed containment leaves no orphan behind the test
            os.kill(pid, signal.SIGKILL)

    # the failure mail: plain text first, with the output and the exit code, one message
    broken = f"broken@{HOST}"
    day.schedctl("job", "trigger", broken)
    assert wait_for(lambda: inbox.messages), day.log.read_text()
    mail = inbox.messages[0]
    assert mail["To"] == "ops@example.com"
    assert "broken" in " ".join(str(mail["Subject"]).split())
    part = next(p for p in mail.walk() if p.get_content_type() == "text/plain")
    body = part.get_payload(decode=True).decode()
    assert "first line of output" in body and "disk full" in body, body
    assert re.search(r"exit code:\s+3\n", body.replace("\r\n", "\n")), body
    assert "attempt:    1 of 1" in body, body
