"""Owns the acceptance test of issue 32: an operator's day with real processes (the
installed `schedctl` and `scheduled-d` on a SQLite file): a crontab imported, applied,
a pause surviving `apply`, a renamed job removed centrally, `apply --check` for drift,
and an @reboot job run once across a worker restart, in the run history.

The other parts of the acceptance (a skip-overlap job skipping with its reason, a timeout
killing a setsid child, the failure mail carrying the output, `job why` explaining a
misfire skip) come with their branches: see the TODO hooks below."""

from __future__ import annotations

import json
import os
import subprocess
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

    # TODO(issue 32 item 1, on main since cronrun): a skip-overlap job skips its next run with
    #   the reason "previous run still running" (`schedctl runs`).
    # TODO(issue 32 item 2, on main since cronrun): a timeout kills a `setsid sleep` child
    #   (cgroup.kill).
    # TODO(issue 32 item 6, on main): the failure mail carries the output's last lines
    #   (needs the SMTP fixture of test_cron_fleet and `scheduled-d all`).
    # TODO(issue 32 item 7, on main): `schedctl job why JOB` explains a misfire skip
    #   (needs a run missed while the dispatcher was down).
    # (items 1, 6 and 7 need the dispatcher: `scheduled-d all` instead of `worker` above)
