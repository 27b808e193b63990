"""Owns the acceptance test of `schedctl apply` as an operator runs it: the installed console
script on a SQLite file, two hosts applying one directory, the diff table and its counts,
a dry run, an idempotent second run, gone jobs removed, and a bad file refused with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.acceptance.process_support import schedctl_command

FILE = """
[[job]]
name = "backup"
cron = "30 2 * * *"
command = ["/usr/local/bin/backup", "--full"]

[[job]]
name = "report"
every = "15m"
shell = "echo report"
run_on = "host-group:web"

[[job]]
name = "warm"
cron = "@reboot"
command = ["/bin/true"]
"""


def test_apply_on_two_hosts_from_the_console_script(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    env["SCHEDULED_DATABASE_URL"] = f"sqlite:///{tmp_path / 'central.db'}"
    env["COLUMNS"] = "200"
    jobs_d = tmp_path / "jobs.d"
    jobs_d.mkdir()
    (jobs_d / "host.toml").write_text(FILE)

    def run(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*schedctl_command(), *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert "Traceback" not in done.stdout + done.stderr
        assert done.returncode == code, done.stdout + done.stderr
        return done

    def as_json(*args: str) -> Any:
        return json.loads(run(*args, "-o", "json").stdout)

    run("tenant", "create", "acme")
    dry = run("apply", str(jobs_d), "--host", "web1", "--dry-run").stdout
    assert "backup@web1" in dry and "@reboot (run by the host once per boot)" in dry
    assert "3 created, 0 changed, 0 unchanged, 0 removed, 0 skipped" in dry
    assert "nothing written" in dry
    assert json.loads(run("job", "list", "-o", "json").stdout)["items"] == []

    created = as_json("apply", str(jobs_d), "--host", "web1")["created"]
    assert created == ["backup@web1", "report", "warm@web1"]
    web2 = as_json("apply", str(jobs_d), "--host", "web2", "--group", "web")
    assert (web2["created"], web2["unchanged"]) == (["backup@web2", "warm@web2"], ["report"])
    again = run("apply", str(jobs_d), "--host", "web1").stdout
    assert "0 created, 0 changed, 3 unchanged, 0 removed, 0 skipped" in again

    (jobs_d / "host.toml").write_text(FILE.replace("--full", "--incremental"))
    changed = run("apply", str(jobs_d), "--host", "web1").stdout
    assert "payload.digest" in changed and "--incremental" not in changed

    (jobs_d / "host.toml").write_text(FILE.split('[[job]]\nname = "report"')[0])
    pruned = as_json("apply", str(jobs_d), "--host", "web1")
    # the group job was created by web1: its removal is web1's; web2's jobs stay
    assert sorted(pruned["removed"]) == ["report", "warm@web1"]
    names = {j["name"] for j in json.loads(run("job", "list", "-o", "json").stdout)["items"]}
    assert names == {"backup@web1", "backup@web2", "warm@web2"}

    (jobs_d / "bad.toml").write_text('[[job]]\nname = "x"\nevery = "1h"\n')
    bad = run("apply", str(jobs_d), "--host", "web1", code=2)
    assert f"job.command: {jobs_d / 'bad.toml'}:1:" in bad.stderr


def test_apply_refuses_what_the_worker_refuses(tmp_path: Path) -> None:
    """`schedctl apply` loads a directory as the host's worker does (opened once, judged):
    a group-writable job file or a symlink is refused with the worker's reason, exit 2, and
    nothing is written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    env["SCHEDULED_DATABASE_URL"] = f"sqlite:///{tmp_path / 'central.db'}"
    jobs_d = tmp_path / "jobs.d"
    jobs_d.mkdir(mode=0o755)
    (jobs_d / "host.toml").write_text(FILE)
    (jobs_d / "host.toml").chmod(0o664)
    (tmp_path / "elsewhere.toml").write_text(FILE.replace('"backup"', '"other"'))
    (jobs_d / "link.toml").symlink_to(tmp_path / "elsewhere.toml")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*schedctl_command(), *args], capture_output=True, text=True, env=env, timeout=120
        )

    assert run("tenant", "create", "acme").returncode == 0
    done = run("apply", str(jobs_d), "--host", "web1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert (
        f"file: {jobs_d / 'host.toml'}: refused: file {jobs_d / 'host.toml'} is writable by "
        "group or others (mode 0664; chmod go-w)"
    ) in done.stderr
    assert f"refused: {jobs_d / 'link.toml'} is a symbolic link" in done.stderr
    listed = run("job", "list", "-o", "json")
    assert json.loads(listed.stdout)["items"] == []
