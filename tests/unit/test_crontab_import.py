"""Crontab import: realistic user and system crontabs convert line by line, with cron's
semantics (environment, MAILTO, CRON_TZ, SHELL, %, macros); a line that cannot convert is
listed with its number and reason; what is written loads back through the validator."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schedctl.app import crontab
from schedctl.cli.app import app
from schedctl.core import errors
from schedctl.domain.jobfiles import load_dir, parse_text, render

runner = CliRunner()

USER_CRONTAB = r"""# Edit this file to introduce tasks to be run by cron.
# m h  dom mon dow   command
SHELL=/bin/bash
PATH=/home/alice/bin:/usr/local/bin:/usr/bin:/bin
MAILTO="alice@example.com,ops@example.com"
CRON_TZ=Europe/Berlin

*/15 9-17 * * MON-FRI  /home/alice/bin/sync-orders --quiet
0 3 1,15 JAN-JUN,OCT SUN  cd /srv/app && ./rotate.sh >> /var/log/rotate.log 2>&1
@reboot /usr/local/bin/warm-cache
@daily  mail -s "daily report" ops%Hello,%the job is 50\% done%
MAILTO=""
@hourly /usr/bin/php /var/www/cron.php > /dev/null 2>&1
5 4 * * sun     echo "run at 5 after 4 every sunday"
@yearly /usr/local/bin/renew
@annually /usr/local/bin/renew
@monthly /usr/local/bin/bill
@weekly /usr/local/bin/vacuum
@midnight /usr/local/bin/rollup
61 * * * * /bin/false
@every_5m /bin/true
0 0 * *
CRON_TZ=Mars/Olympus
SCHEDULED_DATABASE_URL=sqlite:///x
0 12 * * *
"""

DEBIAN_CRONTAB = """\
# /etc/crontab: system-wide crontab
# Unlike any other crontab you don't have to run the `crontab'
# command to install the new version when you edit this file
# and files in /etc/cron.d. These files also have username fields,
# that none of the other crontabs do.

SHELL=/bin/sh
PATH=/usr/local/sbin:/usr/local/bin:/sbin:/bin:/usr/sbin:/usr/bin

# Example of job definition:
# .---------------- minute (0 - 59)
# |  .------------- hour (0 - 23)
# |  |  .---------- day of month (1 - 31)
# |  |  |  .------- month (1 - 12) OR jan,feb,mar,apr ...
# |  |  |  |  .---- day of week (0 - 6) (Sunday=0 or 7) OR sun,mon,tue,wed,thu,fri,sat
# |  |  |  |  |
# *  *  *  *  * user-name command to be executed
17 *\t* * *\troot    cd / && run-parts --report /etc/cron.hourly
25 6\t* * *\troot\ttest -x /usr/sbin/anacron || { cd / && run-parts --report /etc/cron.daily; }
47 6\t* * 7\troot\ttest -x /usr/sbin/anacron || { cd / && run-parts --report /etc/cron.weekly; }
52 6\t1 * *\troot\ttest -x /usr/sbin/anacron || { cd / && run-parts --report /etc/cron.monthly; }
#
"""

CRON_D = """\
# /etc/cron.d/certbot: crontab entries for the certbot package
SHELL=/bin/sh
PATH=/usr/local/sbin:/usr/local/bin:/sbin:/bin:/usr/sbin:/usr/bin
RANDOM_DELAY=30

0 */12 * * * root test -x /usr/bin/certbot && perl -e 'sleep int(rand(43200))' && certbot -q renew
@reboot www-data /usr/local/bin/prime-cache
30 2 * * * 1bad /bin/true
30 2 * * * postgres
"""


def _by_line(conversion: crontab.Conversion) -> dict[int, dict[str, object]]:
    return dict(zip(conversion.lines, conversion.jobs, strict=True))


def test_user_crontab() -> None:
    result = crontab.convert(USER_CRONTAB, user="alice", timezone="UTC")
    jobs = _by_line(result)
    sync = jobs[8]
    assert sync["cron"] == "*/15 9-17 * * MON-FRI"
    assert sync["timezone"] == "Europe/Berlin"
    assert sync["shell"] == "/home/alice/bin/sync-orders --quiet"
    assert sync["shell_path"] == "/bin/bash"
    assert sync["user"] == "alice"
    assert sync["env"] == {
        "SHELL": "/bin/bash",
        "PATH": "/home/alice/bin:/usr/local/bin:/usr/bin:/bin",
    }
    assert sync["alert_email"] == ["alice@example.com", "ops@example.com"]
    assert sync["retry"] == {"max_attempts": 1}
    assert str(sync["name"]).startswith("sync-orders-")
    assert jobs[9]["cron"] == "0 3 1,15 JAN-JUN,OCT SUN"
    assert str(jobs[9]["name"]).startswith("rotate.sh-")
    assert jobs[10]["cron"] == "@reboot" and "timezone" not in jobs[10]
    mail = jobs[11]
    assert mail["shell"] == 'mail -s "daily report" ops'
    assert mail["stdin"] == "Hello,\nthe job is 50% done\n"
    # MAILTO="" turns the alert off for the lines below it
    assert "alert_email" not in jobs[13] and "alert_email" in jobs[11]
    assert [jobs[n]["cron"] for n in range(15, 20)] == [
        "@yearly",
        "@annually",
        "@monthly",
        "@weekly",
        "@midnight",
    ]
    skipped = {s.line: s.reason for s in result.skipped}
    assert set(skipped) == {20, 21, 22, 23, 24, 25}
    assert "minute: value 61 out of range" in skipped[20]
    assert "unknown macro '@every_5m'" in skipped[21]
    assert "neither a schedule" in skipped[22]
    assert "unknown time zone 'Mars/Olympus'" in skipped[23]
    assert "SCHEDULED_*" in skipped[24]
    assert skipped[25] == "has no command"


def test_names_are_stable_and_unique() -> None:
    first = crontab.convert(USER_CRONTAB, user="alice")
    again = crontab.convert("# moved\n\n" + USER_CRONTAB, user="alice")
    assert [j["name"] for j in first.jobs] == [j["name"] for j in again.jobs]
    twice = crontab.convert("@daily /usr/bin/backup\n@daily /usr/bin/backup\n")
    names = [j["name"] for j in twice.jobs]
    assert names[1] == f"{names[0]}-2"


def test_debian_system_crontab() -> None:
    result = crontab.convert(DEBIAN_CRONTAB, system=True, timezone="Europe/London")
    assert result.skipped == []
    assert [j["user"] for j in result.jobs] == ["root"] * 4
    assert [str(j["name"]).rsplit("-", 1)[0] for j in result.jobs] == [
        "cron.hourly",
        "cron.daily",
        "cron.weekly",
        "cron.monthly",
    ]
    assert result.jobs[0]["shell"] == "cd / && run-parts --report /etc/cron.hourly"
    assert result.jobs[2]["cron"] == "47 6 * * 7"
    assert "shell_path" not in result.jobs[0]  # /bin/sh is the default
    assert result.jobs[0]["env"] == {
        "SHELL": "/bin/sh",
        "PATH": "/usr/local/sbin:/usr/local/bin:/sbin:/bin:/usr/sbin:/usr/bin",
    }


def test_cron_d_file() -> None:
    result = crontab.convert(CRON_D, system=True, host_group="web")
    jobs = _by_line(result)
    assert jobs[6]["user"] == "root" and jobs[6]["window"] == "30m"
    assert jobs[6]["run_on"] == "host-group:web"
    assert str(jobs[6]["shell"]).endswith("certbot -q renew")
    assert jobs[7]["user"] == "www-data" and jobs[7]["cron"] == "@reboot"
    skipped = {s.line: s.reason for s in result.skipped}
    assert "not a user name" in skipped[8]
    assert skipped[9] == "has no command"


def test_system_paths_are_detected() -> None:
    assert crontab.is_system_crontab("/etc/crontab")
    assert crontab.is_system_crontab("/etc/cron.d/certbot")
    assert not crontab.is_system_crontab("/var/spool/cron/crontabs/alice")


def test_percent_rules() -> None:
    assert crontab.split_percent("echo hi") == ("echo hi", None)
    assert crontab.split_percent(r"date +\%Y") == ("date +%Y", None)
    assert crontab.split_percent("cat%a%%b") == ("cat", "a\n\nb\n")
    assert crontab.split_percent("cat%line\n") == ("cat", "line\n")


def test_bad_options_are_refused() -> None:
    with pytest.raises(errors.ValidationError, match="--user"):
        crontab.convert("", user="a b")
    with pytest.raises(errors.ValidationError, match="--host-group"):
        crontab.convert("", host_group="web servers")
    with pytest.raises(errors.ValidationError, match="--user: a system crontab"):
        crontab.convert("", user="alice", system=True)
    with pytest.raises(errors.ValidationError, match="--tz"):
        crontab.convert("", timezone="Nowhere")


@pytest.mark.parametrize(
    ("text", "system"), [(USER_CRONTAB, False), (DEBIAN_CRONTAB, True), (CRON_D, True)]
)
def test_round_trip_through_the_validator(text: str, system: bool) -> None:
    result = crontab.convert(text, system=system, user=None if system else "alice")
    file = parse_text(render(result.jobs, header="h", comments=["c"] * 99), "out.toml")
    assert [j.name for j in file.jobs] == [j["name"] for j in result.jobs]
    for job, table in zip(file.jobs, result.jobs, strict=True):
        assert job.shell == table["shell"]
        assert job.stdin == table.get("stdin")
        assert job.user == table.get("user")
        assert dict(job.env) == table.get("env", {})
        assert job.alerts.email == tuple(table.get("alert_email", ()))
        assert job.is_boot == (table["cron"] == "@reboot")


def test_render_escapes_anything_a_crontab_holds() -> None:
    nasty = 'printf "a\\tb" \x7f \'q\' """ \\\\ é'
    text = render([{"name": "n", "every": "1m", "shell": nasty, "env": {"A B": "x"}}])
    with pytest.raises(Exception, match="env"):
        parse_text(text, "x.toml")  # the name is refused by the validator, not the writer
    file = parse_text(render([{"name": "n", "every": "1m", "shell": nasty}]), "x.toml")
    assert file.jobs[0].shell == nasty


# -- the command ------------------------------------------------------------------------


def test_cli_writes_a_file_that_loads(tmp_path: Path) -> None:
    source = tmp_path / "alice"
    source.write_text(USER_CRONTAB)
    out = tmp_path / "jobs.d"
    result = runner.invoke(
        app, ["-o", "json", "import-crontab", str(source), "--user", "alice", "--out", str(out)]
    )
    assert result.exit_code == 1, result.output  # lines were skipped; the rest is written
    report = json.loads(result.stdout)
    assert report["written"] is True and report["file"] == str(out / "crontab-alice.toml")
    assert len(report["jobs"]) == 11
    assert [s["line"] for s in report["skipped"]] == [20, 21, 22, 23, 24, 25]
    assert report["jobs"][0] == {
        "name": report["jobs"][0]["name"],
        "line": 8,
        "cron": "*/15 9-17 * * MON-FRI",
        "user": "alice",
    }
    files = load_dir(out)
    assert len(files[0].jobs) == 11
    assert (out / "crontab-alice.toml").stat().st_mode & 0o777 == 0o600
    # a second import does not overwrite, and names are unique across the directory
    again = runner.invoke(app, ["import-crontab", str(source), "-u", "alice", "--out", str(out)])
    assert again.exit_code == 4 and "--force" in again.output
    (tmp_path / "copy").write_text(USER_CRONTAB)
    clash = runner.invoke(
        app, ["import-crontab", str(tmp_path / "copy"), "-u", "alice", "--out", str(out)]
    )
    assert clash.exit_code == 4 and "already used in" in clash.output
    forced = runner.invoke(
        app, ["import-crontab", str(source), "-u", "bob", "--out", str(out), "--force"]
    )
    assert forced.exit_code == 1, forced.output
    assert load_dir(out)[0].jobs[0].user == "bob"


def test_cli_dry_run_prints_the_file_and_writes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "crontab"
    source.write_text(DEBIAN_CRONTAB)
    out = tmp_path / "jobs.d"
    result = runner.invoke(
        app,
        ["import-crontab", str(source), "--system", "--tz", "UTC", "--out", str(out), "--dry-run"],
    )
    assert result.exit_code == 0, result.output
    assert not out.exists()
    file = parse_text(result.stdout, out / "crontab.toml")
    assert [j.user for j in file.jobs] == ["root"] * 4
    assert all(
        j.schedule == {"cron": j.schedule["cron"], "timezone": "UTC"}
        for j in file.jobs
        if j.schedule
    )
    as_json = runner.invoke(
        app, ["import-crontab", str(source), "--system", "--dry-run", "-o", "json"]
    )
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["written"] is False
    assert "[[job]]" in json.loads(as_json.stdout)["content"]


def test_cli_lists_skipped_lines_and_fails_when_nothing_converts(tmp_path: Path) -> None:
    source = tmp_path / "bad"
    source.write_text("0 0 * *\n61 * * * * x\n")
    result = runner.invoke(
        app, ["import-crontab", str(source), "-u", "alice", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    assert "skipped line 1: is neither a schedule" in result.stderr
    assert "skipped line 2: cron: minute: value 61" in result.stderr
    assert "no line could be converted" in result.stderr
    missing = runner.invoke(app, ["import-crontab", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "cannot read" in missing.stderr


def test_cli_reads_standard_input(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["import-crontab", "-", "-u", "alice", "--tz", "UTC", "--out", str(tmp_path)],
        input="@daily /usr/bin/backup%secret\n",
    )
    assert result.exit_code == 0, result.output
    (job,) = load_dir(tmp_path)[0].jobs
    assert (job.user, job.shell, job.stdin) == ("alice", "/usr/bin/backup", "secret\n")
    assert (tmp_path / "crontab-stdin.toml").is_file()


def test_progress_bar_only_on_a_terminal_for_big_files(monkeypatch: pytest.MonkeyPatch) -> None:
    from schedctl.cli import import_crontab

    with import_crontab._progress(10 * import_crontab.PROGRESS_MIN_LINES) as progress:
        assert progress is None  # captured stderr is not a terminal
    monkeypatch.setattr(import_crontab.err_console, "_force_terminal", True)
    with import_crontab._progress(10) as progress:
        assert progress is None  # a small file: no bar
    total = import_crontab.PROGRESS_MIN_LINES
    with import_crontab._progress(total) as progress:
        assert progress is not None
        for done in range(1, total + 1):
            progress(done, total)


# -- issue 30: the user, the file's mode, cron's lines, NUL -------------------------------


def test_a_user_crontab_needs_user_and_nothing_is_written(tmp_path: Path) -> None:
    """Without --user the jobs would run as the worker's own user (root): refused, with
    the field named, in both output formats, and nothing written."""
    source = tmp_path / "mine"
    source.write_text("0 3 * * * /usr/bin/backup\n")
    out = tmp_path / "jobs.d"
    for before, after in (([], []), (["-o", "json"], []), ([], ["--dry-run"])):
        args = [*before, "import-crontab", str(source), "--out", str(out), *after]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "--user: a user crontab (no user column) needs --user" in result.stderr
        assert result.stdout == ""
        assert not out.exists()
    # a system crontab names its users: no --user needed
    source.write_text("0 3 * * * backup /usr/bin/backup\n")
    system = runner.invoke(
        app, ["import-crontab", str(source), "--system", "--out", str(out), "--dry-run"]
    )
    assert system.exit_code == 0, system.output
    assert 'user = "backup"' in system.stdout


def test_the_user_of_cron_s_spool_file_is_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert crontab.spool_user("/var/spool/cron/crontabs/alice") == "alice"
    assert crontab.spool_user("/var/spool/cron/bob") == "bob"
    assert crontab.spool_user("/home/alice/crontab") is None
    assert crontab.spool_user("/var/spool/cron/crontabs/a b") is None
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "carol").write_text("@daily /usr/bin/report\n")
    monkeypatch.setattr(crontab, "SPOOL_DIRS", (str(spool),))
    out = tmp_path / "jobs.d"
    result = runner.invoke(
        app, ["-o", "json", "import-crontab", str(spool / "carol"), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["user"] == "carol"
    assert load_dir(out)[0].jobs[0].user == "carol"


def test_the_written_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    source = tmp_path / "mine"
    source.write_text("PGPASSWORD=secret\n0 3 * * * pg_dump app\n")
    out = tmp_path / "jobs.d"
    old = os.umask(0)
    try:
        result = runner.invoke(
            app, ["import-crontab", str(source), "-u", "alice", "--out", str(out)]
        )
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    (written,) = out.iterdir()  # no temporary file left behind
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "separator", ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
)
def test_lines_end_only_at_a_newline(separator: str) -> None:
    """cron ends a line at "\\n" only: an entry after another separator in a comment stays
    commented out, and one inside a command stays part of it."""
    text = f"# 0 1 * * * /usr/bin/old{separator}0 2 * * * /usr/bin/evil\n0 3 * * * /usr/bin/ok\n"
    result = crontab.convert(text, user="alice")
    assert [j["shell"] for j in result.jobs] == ["/usr/bin/ok"]
    assert result.lines == [2] and result.skipped == []
    inside = crontab.convert(f"0 4 * * * /usr/bin/say a{separator}b\n", user="alice")
    (job,) = inside.jobs
    assert job["shell"] == f"/usr/bin/say a{separator}b"
    (loaded,) = parse_text(render(inside.jobs), "x.toml").jobs  # and it loads back
    assert loaded.shell == job["shell"]


def test_a_line_with_a_nul_is_skipped_and_the_rest_imported(tmp_path: Path) -> None:
    text = "0 1 * * * /usr/bin/a\0rm -rf /\n0 2 * * * /usr/bin/ok\nX=1\0\n"
    result = crontab.convert(text, user="alice")
    assert [j["shell"] for j in result.jobs] == ["/usr/bin/ok"]
    assert [(s.line, s.reason) for s in result.skipped] == [
        (1, "contains a NUL byte"),
        (3, "contains a NUL byte"),
    ]
    source = tmp_path / "mine"
    source.write_bytes(text.encode())
    out = tmp_path / "jobs.d"
    args = ["import-crontab", str(source), "-u", "alice", "--out", str(out)]
    as_json = runner.invoke(app, ["-o", "json", *args])
    assert as_json.exit_code == 1, as_json.output  # lines were skipped
    report = json.loads(as_json.stdout)
    assert report["written"] is True
    assert report["skipped"] == [
        {"line": 1, "reason": "contains a NUL byte", "text": "0 1 * * * /usr/bin/a\\0rm -rf /"},
        {"line": 3, "reason": "contains a NUL byte", "text": "X=1\\0"},
    ]
    assert [j.shell for j in load_dir(out)[0].jobs] == ["/usr/bin/ok"]
    table = runner.invoke(app, [*args, "--force"])
    assert table.exit_code == 1
    assert "skipped line 1: contains a NUL byte: 0 1 * * * /usr/bin/a\\0rm -rf /" in table.stderr
    assert "wrote 1 job(s)" in table.stdout


def test_a_skipped_line_is_shown_with_its_control_characters_escaped(tmp_path: Path) -> None:
    """A skipped line goes to the terminal: an escape sequence or a line separator in it is
    shown escaped, never acted on."""
    source = tmp_path / "mine"
    source.write_text("61 * * * * /x\x1b[2J\u2028forged\n0 1 * * * /usr/bin/ok\n")
    result = runner.invoke(
        app, ["import-crontab", str(source), "-u", "alice", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 1, result.output
    assert "skipped line 1: cron: minute: value 61" in result.stderr
    assert "/x\\x1b[2J\\u2028forged" in result.stderr
    assert "\x1b" not in result.stderr and "\u2028" not in result.stderr


TEAM_CRONTAB = """\
# m h  dom mon dow   command
CRON_TZ=Europe/Berlin
MAILTO=ops@example.com
# Nightly backup of /srv (keep 7 days!)
0 3 * * * /usr/local/bin/backup --all
*/5 * * * * /usr/local/bin/health --quiet
0 8 * * 1 /usr/bin/report weekly
17 * * * * cd /srv && /usr/bin/sync >/dev/null
# 0 4 * * * /usr/local/bin/old-thing
@reboot /usr/local/bin/warm-cache
# Ünïcode ☃ — only safe characters
30 1 * * 1-5 /usr/bin/report daily
# a comment with a blank line below it names nothing

45 2 1 * * /usr/bin/report monthly
30 2 * * * /usr/local/bin/backup --incremental
"""


def test_names_from_the_comment_above_else_program_and_schedule_word() -> None:
    result = crontab.convert(TEAM_CRONTAB, user="alice")
    assert result.skipped == [] and result.warnings == []
    assert [j["name"] for j in result.jobs] == [
        "nightly-backup-of-srv-keep-7-days",  # the comment directly above
        "health-5min",
        "report-weekly",
        "sync-hourly",
        "warm-cache-boot",  # a commented-out entry above names nothing
        "unicode-only-safe-characters",  # accents and unsafe characters dropped
        "report-monthly",  # a comment with a blank line after it names nothing
        "backup-daily",
    ]
    # the same program and schedule twice: unique in file order
    twice = crontab.convert("@daily /usr/bin/backup\n@daily /usr/bin/backup -x\n")
    assert [j["name"] for j in twice.jobs] == ["backup-daily", "backup-daily-2"]
    # a comment that slugs to the same name as another job's is made unique too
    clash = crontab.convert("# backup daily\n0 1 * * * /bin/true\n@daily /usr/bin/backup\n")
    assert [j["name"] for j in clash.jobs] == ["backup-daily", "backup-daily-2"]


@pytest.mark.parametrize(
    ("expr", "word"),
    [
        ("@reboot", "boot"),
        ("@midnight", "daily"),
        ("@annually", "yearly"),
        ("* * * * *", "1min"),
        ("*/15 9-17 * * MON-FRI", "15min"),
        ("5 */2 * * *", "2h"),
        ("0 6 * * MON-FRI", "weekdays"),
        ("0 6 * * 0", "weekly"),
        ("0 6 1 * *", "monthly"),
        ("0 6 1 1 *", "yearly"),
        ("0 3 1,15 JAN-JUN,OCT SUN", "cron"),
    ],
)
def test_schedule_words(expr: str, word: str) -> None:
    assert crontab.schedule_word(expr) == word


def test_boot_jobs_get_no_alert_address() -> None:
    result = crontab.convert(TEAM_CRONTAB, user="alice")
    by_name = {j["name"]: j for j in result.jobs}
    assert "alert_email" not in by_name["warm-cache-boot"]
    assert by_name["health-5min"]["alert_email"] == ["ops@example.com"]


def test_the_summary_names_the_zones_used(tmp_path: Path) -> None:
    source = tmp_path / "team"
    source.write_text(TEAM_CRONTAB)
    out = tmp_path / "jobs.d"
    result = runner.invoke(app, ["import-crontab", str(source), "-u", "alice", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "schedules in Europe/Berlin)" in result.output and "UTC" not in result.output
    mixed = tmp_path / "mixed"
    mixed.write_text("0 1 * * * /bin/a\nCRON_TZ=Asia/Tokyo\n0 2 * * * /bin/b\n")
    report = runner.invoke(
        app,
        ["-o", "json", "import-crontab", str(mixed), "-u", "alice", "--tz", "UTC", "--dry-run"],
    )
    assert report.exit_code == 0, report.output
    assert json.loads(report.stdout)["timezones"] == ["Asia/Tokyo", "UTC"]
    written = runner.invoke(
        app, ["import-crontab", str(mixed), "-u", "alice", "--tz", "UTC", "--out", str(out)]
    )
    assert "schedules in Asia/Tokyo, UTC)" in written.output


def test_a_user_column_in_a_user_crontab_is_warned_about(tmp_path: Path) -> None:
    text = "* * * * * root /usr/bin/backup\n0 1 * * * alice /bin/true\n@daily mail -s x ops\n"
    result = crontab.convert(text, user="alice")
    assert len(result.jobs) == 3  # converted as cron would run them
    assert [w.line for w in result.warnings] == [1, 2]
    assert "looks like a user column ('root')" in result.warnings[0].reason
    assert "--system" in result.warnings[0].reason
    # a system crontab's user column is expected: no warning
    assert crontab.convert(text, system=True).warnings == []
    source = tmp_path / "alice"
    source.write_text(text)
    shown = runner.invoke(
        app, ["import-crontab", str(source), "-u", "alice", "--out", str(tmp_path / "o")]
    )
    assert shown.exit_code == 0, shown.output
    assert "warning: line 1: looks like a user column ('root')" in shown.stderr
    as_json = runner.invoke(
        app, ["-o", "json", "import-crontab", str(source), "-u", "alice", "--dry-run"]
    )
    assert [w["line"] for w in json.loads(as_json.stdout)["warnings"]] == [1, 2]
