"""Cron replaced on a fleet, end to end, as an ops engineer would do it: import a real
server's crontab (Debian's /etc/crontab format), apply it on two hosts (two worker processes
standing in for them, on Postgres), see the jobs run as the right user with their output in
`schedctl logs` and the daemon's log, get an e-mail for a failure, and change a job file and
reload it without a restart. Every process is real; the SMTP server is a loopback one."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.smtp_support import Inbox

BIN = Path(sys.executable).parent
WAIT_SECONDS = 90.0

CRONTAB = """\
# /etc/crontab: system-wide crontab
# Unlike any other crontab you don't have to run the `crontab'
# command to install the new version when you edit this file
SHELL=/bin/sh
PATH=/usr/local/sbin:/usr/local/bin:/sbin:/bin:/usr/sbin:/usr/bin
MAILTO=root

# Example of job definition:
# .---------------- minute (0 - 59)
# |  .------------- hour (0 - 23)
# m h dom mon dow user\tcommand
17 *\t* * *\troot    cd / && run-parts --report /etc/cron.hourly
25 6\t* * *\troot\ttest -x /usr/sbin/anacron || { cd / && run-parts --report /etc/cron.daily; }
*/5 * * * *   nobody  echo "who: $(id -un) $(id -u)"
0 2 * * mon-fri root  tr a-z A-Z %backup done%second line
30 3 * * *    root  echo disk full >&2; exit 3
@reboot       root  echo booted on this host
"""

# Beside the imported crontab, a job of the fleet's own that every host runs (its file
# templated per host, as configuration management would write it).
EVERY_HOST_FILE = """\
[[job]]
name = "inventory"
cron = "0 4 * * *"
shell = "echo inventory of $FLEET_HOST"
run_on = "every-host"
env = {{ FLEET_HOST = "{host}" }}
"""


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = WAIT_SECONDS) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


class Fleet:
    """The tenant's database and the hosts' processes and files."""

    def __init__(self, tmp_path: Path, db_url: str) -> None:
        self.tmp = tmp_path
        self.db_url = db_url
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def schedctl(self, *args: str, code: int = 0) -> str:
        result = subprocess.run(
            [str(BIN / "schedctl"), "--db", self.db_url, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == code, (args, result.stdout, result.stderr)
        return result.stdout

    def host_dir(self, host: str) -> Path:
        return self.tmp / host / "jobs.d"

    def start(self, host: str, mode: str, extra: str = "") -> None:
        config = self.tmp / host / "scheduled.toml"
        config.write_text(
            "poll_interval_seconds = 0.1\n"
            f"{extra}"
            "[host]\n"
            f'name = "{host}"\n'
            f'jobs_dir = "{self.host_dir(host)}"\n'
            f'state_dir = "{self.tmp / host / "state"}"\n'
            'tenant = "ops"\n'
            "rescan_seconds = 1\n"
        )
        log = (self.tmp / host / "daemon.log").open("ab")
        self.processes[host] = subprocess.Popen(
            [str(BIN / "scheduled-d"), mode, "--config", str(config), "--db", self.db_url],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")},
        )
        log.close()

    def log(self, host: str) -> str:
        return (self.tmp / host / "daemon.log").read_text(errors="replace")

    def output_lines(self, host: str, text: str) -> list[str]:
        """Lines of the host's log that carry a command's output line `text` (tagged with
        job and run), not the command's own text."""
        return [
            line
            for line in self.log(host).splitlines()
            if text in line and " run " in line and "echo " not in line
        ]

    def boot_lines(self, host: str, job: str) -> list[str]:
        return [
            line
            for line in self.log(host).splitlines()
            if f"boot job {job!r}: booted on this host" in line
        ]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)

    def trigger(self, job: str) -> None:
        self.schedctl("job", "trigger", job)

    def latest(self, job: str) -> dict[str, Any] | None:
        """The latest run of `job` with its attempts, from `schedctl logs -o json`."""
        result = subprocess.run(
            [str(BIN / "schedctl"), "--db", self.db_url, "logs", job, "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            return None
        runs = json.loads(result.stdout)["runs"]
        return dict(runs[0]) if runs else None

    def run_now(self, job: str) -> dict[str, Any]:
        """Trigger `job` and wait for that run to end; its `schedctl logs` record."""
        before = self.latest(job)
        self.trigger(job)

        def ended() -> dict[str, Any] | None:
            run = self.latest(job)
            if run is None or (before and run["run_key"] == before["run_key"]):
                return None
            return run if run["status"] in ("succeeded", "failed", "dead") else None

        result: dict[str, Any] = wait_for(ended, f"a run of {job}")
        return result


def output_of(run: dict[str, Any]) -> str:
    return "\n".join(str(a.get("output") or "") for a in run.get("attempts", [run]))


@pytest.fixture
def fleet(tmp_path: Path, pg_runtime_url: str) -> Iterator[Fleet]:
    # as operators run it: the daemons and schedctl as the runtime role (no DDL)
    f = Fleet(tmp_path, pg_runtime_url)
    try:
        yield f
    finally:
        f.stop()
        for host in f.processes:
            print(f"--- {host} daemon log ---\n{f.log(host)[-6000:]}")


def test_a_real_crontab_on_two_hosts(fleet: Fleet, smtp: tuple[Inbox, int]) -> None:
    inbox, smtp_port = smtp
    crontab = fleet.tmp / "crontab"
    crontab.write_text(CRONTAB)
    imported = json.loads(
        fleet.schedctl(
            "import-crontab", str(crontab), "--system", "--tz", "UTC",
            "--out", str(fleet.tmp / "imported"), "-o", "json",
        )
    )  # fmt: skip
    names = {job["line"]: job["name"] for job in imported["jobs"]}
    who, shout, broken, boot = names[14], names[15], names[16], names[17]
    assert not imported["skipped"]

    # the same files on both hosts (as configuration management would put them), applied
    # on each: the commands stay in the files, the central store gets NAME@HOST jobs
    fleet.schedctl("tenant", "create", "ops")
    for host in ("web1", "web2"):
        fleet.host_dir(host).mkdir(parents=True)
        shutil.copy(fleet.tmp / "imported" / "crontab.toml", fleet.host_dir(host))
        (fleet.host_dir(host) / "fleet.toml").write_text(EVERY_HOST_FILE.format(host=host))
        args = ("apply", str(fleet.host_dir(host)), "--host", host, "--tenant", "ops")
        plan = json.loads(fleet.schedctl(*args, "--mail-domain", "example.com", "-o", "json"))
        # 6 scheduled jobs and the @reboot one (a boot schedule, for its boot runs)
        assert len(plan["created"]) == 7 and plan["applied"]
        again = json.loads(fleet.schedctl(*args, "--mail-domain", "example.com", "-o", "json"))
        assert again["created"] == again["changed"] == [] and len(again["unchanged"]) == 7
    jobs = fleet.schedctl("job", "list", "-o", "json")
    assert "run-parts" not in jobs and "disk full" not in jobs  # commands never left

    # web1: the whole daemon (dispatcher, relay with the SMTP server, its host worker);
    # web2: only a host worker
    # (with an SMTP server, mail goes only to the domains the operator lists)
    smtp_conf = (
        f'smtp_host = "127.0.0.1"\nsmtp_port = {smtp_port}\n'
        '[alerts]\nemail_domains = ["example.com"]\n'
    )
    fleet.start("web1", "all", smtp_conf)
    fleet.start("web2", "worker")
    for host in ("web1", "web2"):
        # the @reboot job ran once as the worker started (its output line in the log)
        wait_for(functools.partial(fleet.boot_lines, host, boot), f"{boot}@{host}")

    # the right user on each host, output in `schedctl logs`
    for host in ("web1", "web2"):
        run = fleet.run_now(f"{who}@{host}")
        assert run["status"] == "succeeded", run
        assert "who: nobody 65534" in output_of(run)
    # an every-host job: one run per live host, each in its own host's run history
    for host in ("web1", "web2"):
        run = fleet.run_now(f"inventory@{host}")
        assert run["status"] == "succeeded", run
        assert f"inventory of {host}" in output_of(run)
    run = fleet.run_now(f"{shout}@web1")
    assert "BACKUP DONE\nSECOND LINE" in output_of(run)  # cron's % became stdin
    assert "who: nobody 65534" in fleet.schedctl("logs", f"{who}@web2")
    # each output line also in the host's daemon log, tagged with job and run
    assert fleet.output_lines("web2", "who: nobody 65534")

    # a failure: dead-lettered at once (cron never retries) and mailed to MAILTO
    run = fleet.run_now(f"{broken}@web2")
    assert run["status"] == "dead" and "disk full" in output_of(run)
    mail = wait_for(lambda: inbox.messages, "the failure e-mail")
    assert mail[0]["To"] == "root@example.com"
    assert f"job {broken}@web2 failed" in " ".join(str(mail[0]["Subject"]).split())

    # change a job file on web2 and reload it without a restart: SIGHUP (the periodic
    # rescan would find it too); re-applying shows the change as the file's digest
    pid = fleet.processes["web2"].pid
    job_file = fleet.host_dir("web2") / "crontab.toml"
    job_file.write_text(job_file.read_text().replace('echo \\"who:', 'echo \\"changed who:'))
    fleet.processes["web2"].send_signal(signal.SIGHUP)
    plan = json.loads(
        fleet.schedctl("apply", str(fleet.host_dir("web2")), "--host", "web2",
                       "--tenant", "ops", "--mail-domain", "example.com", "-o", "json")
    )  # fmt: skip
    assert [c["name"] for c in plan["changed"]] == [f"{who}@web2"]
    assert "payload.digest" in plan["changed"][0]["fields"]

    # the rescan or the SIGHUP may come just after the trigger: bounded retries
    for _ in range(20):
        if "changed who: nobody 65534" in output_of(fleet.run_now(f"{who}@web2")):
            break
    else:
        raise AssertionError("the changed job file never took effect")
    assert fleet.processes["web2"].pid == pid and fleet.processes["web2"].poll() is None
    # web1's file did not change: its job still runs the old command
    run = fleet.run_now(f"{who}@web1")
    assert "who: nobody 65534" in output_of(run) and "changed" not in output_of(run)
