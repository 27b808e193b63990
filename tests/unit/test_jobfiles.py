"""Job files (jobs.d/*.toml): a full example loads; every kind of mistake is refused with
its file, line and key, before anything is returned."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from schedctl.core import errors
from schedctl.domain import jobspec
from schedctl.domain.jobfiles import (
    JobFilesError,
    JobRef,
    Problem,
    RunOn,
    RunOnKind,
    load_dir,
    parse_text,
    render,
    resolve,
)
from schedctl.domain.jobfiles.tomllines import key_lines

EXAMPLE = '''\
# nightly jobs of this host
[[job]]
name = "backup"
description = "full backup"
cron = "30 2 * * *"
timezone = "Europe/Berlin"
command = ["/usr/local/bin/backup", "--full"]
user = "backup"
group = "backup"
workdir = "/var/backups"
timeout = "2h"
retry = { max_attempts = 3, base_delay = "1m", max_delay = "10m" }
misfire_policy = "skip"
grace = "5m"
window = "10m"
max_concurrency = 1
alert_email = ["ops@example.com", "root"]
alert_webhook = "https://alerts.example.com/hook"
alert_command = ["/usr/local/bin/page", "backup"]
alert_on = ["dead_letter", "failure"]
alert_no_success = "26h"

[job.env]
PATH = "/usr/local/bin:/usr/bin:/bin"
LANG = "C.UTF-8"

[[job]]
name = "report"
every = "15m"
shell = "cd /srv && ./report | mail -s report ops"
shell_path = "/bin/bash"
stdin = """
name = "not a key"
[[job]]
"""
run_on = "host-group:web"

[[job]]
name = "warm-cache"
cron = "@reboot"
command = ["/usr/local/bin/warm-cache"]
run_on = "every-host"

[[job]]
name = "once"
at = 2030-01-01T08:00:00+01:00
command = ["/bin/true"]
run_on = "every-host:db"
enabled = false
'''


def _problems(text: str, name: str = "jobs.toml") -> list[Problem]:
    with pytest.raises(JobFilesError) as caught:
        parse_text(text, name)
    return list(caught.value.problems)


def _one(text: str) -> Problem:
    problems = _problems(text)
    assert len(problems) == 1, problems
    return problems[0]


def _job(body: str) -> str:
    return '[[job]]\nname = "j"\ncron = "0 * * * *"\n' + body


def test_the_example_loads_every_key() -> None:
    file = parse_text(EXAMPLE, "/etc/scheduled/jobs.d/host.toml")
    backup, report, warm, once = file.jobs
    assert backup.line == 2 and report.line == 27 and warm.line == 38 and once.line == 44
    assert backup.schedule == {"cron": "30 2 * * *", "timezone": "Europe/Berlin"}
    assert backup.argv() == ["/usr/local/bin/backup", "--full"]
    assert backup.env == (("PATH", "/usr/local/bin:/usr/bin:/bin"), ("LANG", "C.UTF-8"))
    assert (backup.user, backup.group, backup.workdir) == ("backup", "backup", "/var/backups")
    assert backup.alerts.email == ("ops@example.com", "root")
    assert backup.alerts.webhook == ("https://alerts.example.com/hook",)
    assert backup.alerts.on == ("dead_letter", "failure")
    assert backup.alerts.no_success_seconds == 26 * 3600
    assert backup.run_on == RunOn()
    assert report.argv() == ["/bin/bash", "-c", "cd /srv && ./report | mail -s report ops"]
    assert report.stdin == 'name = "not a key"\n[[job]]\n'
    assert report.run_on == RunOn(RunOnKind.host_group, "web")
    assert warm.is_boot and warm.run_on.kind is RunOnKind.every_host
    assert once.schedule == {"run_at": "2030-01-01T08:00:00+01:00"}
    assert str(once.run_on) == "every-host:db" and not once.enabled


def test_job_body_is_what_job_create_accepts_without_the_command() -> None:
    backup = parse_text(EXAMPLE, "/etc/scheduled/jobs.d/host.toml").jobs[0]
    body = backup.job_body("host:web-1")
    assert "command" not in str(body) and "/usr/local/bin/backup" not in str(body)
    assert body["payload"] == {"job_file": "/etc/scheduled/jobs.d/host.toml", "job": "backup"}
    spec = jobspec.parse_job_request(body, now=datetime(2026, 1, 1, tzinfo=UTC))
    assert spec.name == "backup"
    assert spec.retry.max_attempts == 3
    assert (spec.timeout_seconds, spec.grace_seconds, spec.window_seconds) == (7200, 300, 600)
    assert spec.misfire_policy.value == "skip"


def test_max_concurrency_zero_means_no_limit() -> None:
    job = parse_text(_job('command = ["/x"]\nmax_concurrency = 0\n'), "x.toml").jobs[0]
    body = job.job_body("q")
    assert body["max_concurrency"] is None
    assert (
        jobspec.parse_job_request(body, now=datetime(2026, 1, 1, tzinfo=UTC)).max_concurrency == 0
    )


def test_metrics_goes_to_the_central_job() -> None:
    job = parse_text(_job('command = ["/x"]\nmetrics = true\n'), "x.toml").jobs[0]
    body = job.job_body("q")
    assert body["metrics"] is True
    assert jobspec.parse_job_request(body, now=datetime(2026, 1, 1, tzinfo=UTC)).metrics is True
    plain = parse_text(_job('command = ["/x"]\n'), "x.toml").jobs[0]
    assert "metrics" not in plain.job_body("q")


def test_boot_jobs_have_no_central_schedule() -> None:
    warm = parse_text(EXAMPLE, "x.toml").jobs[2]
    with pytest.raises(Exception, match="@reboot"):
        warm.job_body("q")


def test_digest_follows_the_definition() -> None:
    first = parse_text(EXAMPLE, "a.toml").jobs[0]
    moved = parse_text("\n\n" + EXAMPLE, "b.toml").jobs[0]
    changed = parse_text(EXAMPLE.replace("--full", "--incremental"), "a.toml").jobs[0]
    assert first.digest() == moved.digest() != changed.digest()
    assert len({first, changed, first}) == 2


@pytest.mark.parametrize(
    ("body", "line", "key", "message"),
    [
        ('command = ["/bin/true"]\nusr = "x"\n', 5, "job.usr", "did you mean user?"),
        ('command = ["/bin/true"]\nuser = "9lives"\n', 5, "job.user", "user name"),
        ('command = ["/bin/true"]\ngroup = "a b"\n', 5, "job.group", "group name"),
        ('command = ["/bin/true"]\ntimeout = "forever"\n', 5, "job.timeout", "duration"),
        ('command = ["/bin/true"]\ngrace = -5\n', 5, "job.grace", "negative"),
        ('command = ["/bin/true"]\nrun_on = "everywhere"\n', 5, "job.run_on", "host-group:NAME"),
        ('command = ["/bin/true"]\nrun_on = "host-group"\n', 5, "job.run_on", "needs a group"),
        ('command = ["/bin/true"]\nmisfire_policy = "later"\n', 5, "job.misfire_policy", "one of"),
        ('command = ["/bin/true"]\nmax_concurrency = 0.5\n', 5, "job.max_concurrency", "integer"),
        ('command = ["/bin/true"]\nmetrics = "yes"\n', 5, "job.metrics", "true or false"),
        ('command = ["/bin/true"]\nworkdir = "srv"\n', 5, "job.workdir", "absolute"),
        ('command = ["/bin/true"]\nalert_email = ["a b"]\n', 5, "job.alert_email", "e-mail"),
        (
            'command = ["/bin/true"]\nalert_webhook = "ftp://x"\n',
            5,
            "job.alert_webhook",
            "http or https",
        ),
        ('command = ["/bin/true"]\nalert_on = ["sometimes"]\n', 5, "job.alert_on", "dead_letter"),
        ("command = []\n", 4, "job.command", "list of 1"),
        ('command = ["/bin/true"]\nshell = "true"\n', 5, "job.shell", "not both"),
        ('user = "root"\n', 1, "job.command", "needs a command"),
        ('shell = "x"\nshell_path = "bash"\n', 5, "job.shell_path", "absolute"),
        ('command = ["/bin/true"]\nshell_path = "/bin/bash"\n', 5, "job.shell_path", "only with"),
        (
            'command = ["/bin/true"]\nretry = { max_attempts = 0 }\n',
            5,
            "job.retry.max_attempts",
            "from 1",
        ),
        (
            'command = ["/bin/true"]\n\n[job.retry]\nbackoff = "linear"\n',
            7,
            "job.retry.backoff",
            "exponential",
        ),
        (
            'command = ["/bin/true"]\n\n[job.env]\nOK = "1"\nSCHEDULED_TOKEN = "x"\n',
            8,
            "job.env.SCHEDULED_TOKEN",
            "worker's own settings",
        ),
        (
            'command = ["/bin/true"]\n\n[job.env]\nBAD = 1\n',
            7,
            "job.env.BAD",
            "must be a string",
        ),
        ('command = ["/bin/true"]\nstart = 2026-01-01T00:00:00\n', 5, "job.start", "offset"),
        ('command = ["/bin/true"]\nevery = "5m"\n', 5, "job.every", "one schedule"),
        ('command = ["/bin/true"]\noutput = "journal"\n', 5, "job.output", '"local"'),
        ('command = ["/bin/true"]\noutput = true\n', 5, "job.output", "got True"),
        ('command = ["/bin/true"]\noutput = "Local"\n', 5, "job.output", '"central"'),
    ],
)
def test_each_mistake_names_file_line_and_key(body: str, line: int, key: str, message: str) -> None:
    problem = _one(_job(body))
    assert (problem.path, problem.line, problem.key) == ("jobs.toml", line, key)
    assert message in problem.message
    assert problem.job == "j"
    assert str(problem).startswith(f"{key}: jobs.toml:{line}: ")


@pytest.mark.parametrize(
    ("schedule", "key", "message"),
    [
        ('cron = "61 * * * *"', "job.cron", "minute: value 61 out of range"),
        ('cron = "0 0 31 2 *"', "job.cron", "can never fire"),
        ('cron = "@fortnightly"', "job.cron", "not supported"),
        ('cron = "0 * * * *"\ntimezone = "Mars/Olympus"', "job.timezone", "unknown time zone"),
        ('every = "0s"', "job.every", "positive"),
        ('every = "soon"', "job.every", "duration"),
        ('at = "tomorrow"', "job.at", "ISO"),
        ("at = 2030-01-01T08:00:00", "job.at", "offset"),
        ('every = "1h"\ntimezone = "UTC"', "job.timezone", "only to cron"),
        ('cron = "@reboot"\ntimezone = "UTC"', "job.timezone", "no meaning"),
    ],
)
def test_bad_schedules(schedule: str, key: str, message: str) -> None:
    text = f'\n[[job]]\nname = "j"\ncommand = ["/bin/true"]\n{schedule}\n'
    problem = _one(text)
    assert problem.key == key
    assert message in problem.message
    # the line of the key itself (the last schedule line names the zone)
    expected = 5 if key in ("job.cron", "job.every", "job.at") else 6
    assert problem.line == expected


def test_missing_name_and_schedule_point_at_the_table() -> None:
    problems = _problems('# header\n\n[[job]]\ncommand = ["/bin/true"]\n')
    assert [(p.key, p.line) for p in problems] == [("job.name", 3), ("job.cron", 3)]


def test_unknown_top_level_key_and_invalid_toml() -> None:
    problem = _one('title = "x"\n')
    assert (problem.key, problem.line) == ("title", 1)
    problem = _one('[[job]]\nname = "j"\ncron = "0 * * * *\n')
    assert (problem.key, problem.line) == ("toml", 3)
    assert "not valid TOML" in problem.message


def test_every_problem_is_listed_in_one_error() -> None:
    text = _job('command = ["/bin/true"]\nuser = "-x"\ntimeout = "x"\n') + _job("")
    with pytest.raises(JobFilesError) as caught:
        parse_text(text, "many.toml")
    keys = [(p.key, p.line) for p in caught.value.problems]
    assert keys == [("job.user", 5), ("job.timeout", 6), ("job.command", 7)]
    assert str(caught.value).startswith("3 problems in job files:\n")
    assert caught.value.exit_code == 2


def test_duplicate_names_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(_job('command = ["/bin/true"]\n'))
    (tmp_path / "b.toml").write_text("# other\n\n" + _job('command = ["/bin/false"]\n'))
    with pytest.raises(JobFilesError) as caught:
        load_dir(tmp_path)
    (problem,) = caught.value.problems
    assert (problem.path, problem.line, problem.key) == (str(tmp_path / "b.toml"), 3, "job.name")
    assert f"{tmp_path / 'a.toml'}:1" in problem.message


def test_duplicate_names_within_a_file() -> None:
    problem = _one(_job('command = ["/bin/true"]\n') + _job('command = ["/bin/true"]\n'))
    assert (problem.key, problem.line) == ("job.name", 5)


def test_load_dir_reads_toml_files_in_order_and_skips_hidden(tmp_path: Path) -> None:
    (tmp_path / "b.toml").write_text(EXAMPLE)
    (tmp_path / "a.toml").write_text('[[job]]\nname = "first"\nevery = 60\ncommand = ["/x"]\n')
    (tmp_path / ".editing.toml").write_text("not toml [")
    (tmp_path / "notes.txt").write_text("not a job file")
    files = load_dir(tmp_path)
    assert [f.path.name for f in files] == ["a.toml", "b.toml"]
    assert [j.name for f in files for j in f.jobs][:2] == ["first", "backup"]


def test_load_dir_collects_problems_of_every_file(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(_job('command = ["/bin/true"]\nuser = "!"\n'))
    (tmp_path / "b.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(JobFilesError) as caught:
        load_dir(tmp_path)
    assert [(Path(p.path).name, p.key) for p in caught.value.problems] == [
        ("a.toml", "job.user"),
        ("b.toml", "file"),
    ]
    with pytest.raises(JobFilesError, match="is not a directory"):
        load_dir(tmp_path / "missing")


def test_key_lines_skip_strings_and_arrays() -> None:
    text = (
        '[[job]]\nname = "a"\ncommand = [\n  "x=1",\n  "name = 2",\n]\n'
        "stdin = '''\nuser = 3\n'''\n"
        '"quoted key" = 1\n[[job]]\n[job.env]\nA = "1"\n'
    )
    lines = key_lines(text)
    assert lines[("job", 0)] == 1
    assert lines[("job", 0, "command")] == 3
    assert ("job", 0, "x") not in lines and ("job", 0, "user") not in lines
    assert lines[("job", 0, "quoted key")] == 10
    assert lines[("job", 1)] == 11
    assert lines[("job", 1, "env", "A")] == 13


def test_resolve_reads_a_reference_back_from_the_directory_only(tmp_path: Path) -> None:
    jobs_d = tmp_path / "jobs.d"
    jobs_d.mkdir()
    (jobs_d / "host.toml").write_text(EXAMPLE)
    (tmp_path / "evil.toml").write_text(EXAMPLE.replace("/usr/local/bin/backup", "/bin/evil"))
    job = resolve(JobRef(str(jobs_d / "host.toml"), "backup"), jobs_d)
    assert job.argv()[0] == "/usr/local/bin/backup"
    body = job.job_body("q")["payload"]
    assert resolve(JobRef(body["job_file"], body["job"]), jobs_d) == job
    for path in (tmp_path / "evil.toml", jobs_d / ".." / "evil.toml", jobs_d / "x.txt"):
        with pytest.raises(errors.NotFound, match="not a job file"):
            resolve(JobRef(str(path), "backup"), jobs_d)
    with pytest.raises(errors.NotFound, match="no job 'gone'"):
        resolve(JobRef(str(jobs_d / "host.toml"), "gone"), jobs_d)


@pytest.mark.parametrize("escape", ["\\u2028", "\\u2029", "\\u0085", "\\u0080", "\\u009f", "\\n"])
def test_control_and_line_separator_characters_are_refused_in_names_and_addresses(
    escape: str,
) -> None:
    """A name reaches alert mail headers (as NAME@HOST): no control or line-separator
    character (the TOML escape stands for the character); nor may an address hold one."""
    text = f'[[job]]\nname = "nightly{escape}x"\ncron = "0 * * * *"\ncommand = ["/bin/true"]\n'
    problem = _one(text)
    assert (problem.key, problem.line) == ("job.name", 2)
    assert "letters, digits" in problem.message
    problem = _one(_job(f'command = ["/bin/true"]\nalert_email = ["a@b.c{escape}"]\n'))
    assert (problem.key, problem.line) == ("job.alert_email", 5)
    assert "e-mail address" in problem.message


def test_output_is_central_unless_the_file_keeps_it_local() -> None:
    """`output = "local"` keeps a run's output on its host; the default is the run history
    (as before). Where the output goes is the host's alone: the digest (what apply sends)
    does not change with it."""
    central = parse_text(_job('command = ["/bin/true"]\n'), "jobs.toml").jobs[0]
    local = parse_text(_job('command = ["/bin/true"]\noutput = "local"\n'), "jobs.toml").jobs[0]
    explicit = parse_text(_job('command = ["/bin/true"]\noutput = "central"\n'), "jobs.toml")
    assert (central.output, local.output, explicit.jobs[0].output) == (
        "central",
        "local",
        "central",
    )
    assert central.digest() == local.digest()
    assert (
        render([{"name": "j", "cron": "0 * * * *", "shell": "x", "output": "local"}]).count(
            'output = "local"'
        )
        == 1
    )


def _dep(name: str, after: str) -> str:
    return f'[[job]]\nname = "{name}"\nafter = {after}\ncommand = ["/bin/true"]\n'


def test_after_names_jobs_of_the_directory_instead_of_a_schedule(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(_job('command = ["/bin/true"]\n'))
    (tmp_path / "b.toml").write_text(_dep("k", '["j"]'))
    files = load_dir(tmp_path)
    (dependent,) = files[1].jobs
    assert dependent.after == ("j",) and dependent.schedule is None
    assert not dependent.is_boot
    body = dependent.job_body("q")
    assert body["after"] == ["j"] and "schedule" not in body
    # a job without `after` keeps the digest it had before the key existed
    plain = files[0].jobs[0]
    assert "after" not in str(plain.digest()) and plain.digest() == plain.digest()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_dep("k", '["j"]') + 'every = "1h"\n', "give every or after, not both"),
        (_dep("k", "[]"), "non-empty list of job names"),
        (_dep("k", '["k"]'), "names the job itself"),
        (_dep("k", '["bad name"]'), "each entry is the name of a job"),
        (_dep("k", '"j"'), "non-empty list of job names"),
    ],
)
def test_a_bad_after_is_refused_naming_after(text: str, message: str) -> None:
    problem = _one(text)
    assert problem.key == "job.after" and message in problem.message, problem


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ((_dep("k", '["nope"]'),), "names 'nope', which is no job of"),
        (
            (_dep("k", '["boot"]'), '[[job]]\nname = "boot"\ncron = "@reboot"\ncommand = ["/x"]\n'),
            "an @reboot job",
        ),
        (
            (_dep("a", '["b"]'), _dep("b", '["c"]'), _dep("c", '["a"]')),
            "makes a cycle: a -> b -> c -> a",
        ),
    ],
)
def test_after_across_the_directory_unknown_boot_or_cycle(
    tmp_path: Path, texts: tuple[str, ...], message: str
) -> None:
    for index, text in enumerate(texts):
        (tmp_path / f"{index}.toml").write_text(text)
    with pytest.raises(JobFilesError) as caught:
        load_dir(tmp_path)
    (problem,) = caught.value.problems
    assert problem.key == "job.after" and message in problem.message, problem
