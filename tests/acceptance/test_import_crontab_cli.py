"""Owns the acceptance test of `schedctl import-crontab` as an operator runs it (the
installed console script, no database): a user crontab needs --user, the file written is
0600, lines end at a newline only, and a line with a NUL is skipped with its reason while
the rest is written, exit status 1 and the JSON listing the skipped lines."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from schedctl.domain.jobfiles import load_dir
from tests.acceptance.process_support import schedctl_command

CRONTAB = (
    b"PGPASSWORD=s3cret\n"
    b"# 0 1 * * * /usr/bin/retired\x0b0 1 * * * /usr/bin/retired --now\n"
    b"# 0 1 * * * /usr/bin/retired\xc2\x850 1 * * * /usr/bin/retired --nel\n"
    b"0 2 * * * /usr/bin/a\x00rm -rf /\n"
    b"30 3 * * * pg_dump app\n"
)


def run(tmp_path: Path, *args: str, code: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    done = subprocess.run(
        [*schedctl_command(), *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert "Traceback" not in done.stdout + done.stderr
    assert done.returncode == code, done.stdout + done.stderr
    return done


def test_import_a_user_crontab_from_the_console_script(tmp_path: Path) -> None:
    source = tmp_path / "alice"
    source.write_bytes(CRONTAB)
    out = tmp_path / "jobs.d"

    refused = run(tmp_path, "-o", "json", "import-crontab", str(source), "--out", str(out), code=2)
    assert "--user" in refused.stderr and refused.stdout == ""
    assert not out.exists()

    done = run(
        tmp_path, "-o", "json", "import-crontab", str(source), "-u", "alice", "--out", str(out),
        code=1,
    )  # fmt: skip
    report = json.loads(done.stdout)
    assert report["written"] is True and report["user"] == "alice"
    assert [(j["line"], j["cron"]) for j in report["jobs"]] == [(5, "30 3 * * *")]
    assert report["skipped"] == [
        {"line": 4, "reason": "contains a NUL byte", "text": "0 2 * * * /usr/bin/a\\0rm -rf /"}
    ]
    (written,) = out.iterdir()
    assert stat.S_IMODE(written.stat().st_mode) == 0o600  # it holds PGPASSWORD
    (job,) = load_dir(out)[0].jobs
    assert (job.user, job.shell, dict(job.env)) == (
        "alice",
        "pg_dump app",
        {"PGPASSWORD": "s3cret"},
    )
