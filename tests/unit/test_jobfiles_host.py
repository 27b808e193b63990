"""The host side of job files: the [host] table of scheduled-d.toml (errors name the key and
line), cron's permission rule (a file or directory writable by group/others, or owned by
another user, is refused with the reason while the other files load), the resolution of a
run's {job_file, job} from the loaded files only, rescans, and the account a job runs as.
Tests run as root: files are chown-ed to `nobody` to stand for "another user"."""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path
from typing import Any

import pytest

from schedctl.core import errors
from schedctl.domain.config import HostConfig, load_config
from schedctl.domain.jobfiles.host import HostFiles, check_dir, permission_problem, run_as
from schedctl.domain.jobfiles.load import parse_text
from schedctl.domain.jobfiles.model import FileJob, JobFilesError
from scheduled_d.checks import check_configuration

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files")
JOB = """\
[[job]]
name = "{name}"
cron = "{cron}"
command = ["/bin/echo", "{name}"]
"""


# the worker of host h1 (no groups) taking a run from its own queue
HERE: dict[str, Any] = {"host": "h1", "groups": (), "queue": "host:h1"}


def jobs_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "jobs.d"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    return directory


def write(directory: Path, file: str, name: str, cron: str = "0 3 * * *") -> Path:
    path = directory / file
    path.write_text(JOB.format(name=name, cron=cron))
    path.chmod(0o644)
    return path


def config_error(tmp_path: Path, text: str) -> errors.ConfigError:
    path = tmp_path / "scheduled.toml"
    path.write_text(text)
    with pytest.raises(errors.ConfigError) as caught:
        load_config(path, environ={})
    return caught.value


# -- [host] ----------------------------------------------------------------------------------


def test_the_host_table_loads_with_its_defaults(tmp_path: Path) -> None:
    path = tmp_path / "scheduled.toml"
    path.write_text('[host]\nname = "web-1"\ngroups = ["web", "eu"]\n')
    host = load_config(path, environ={}).host
    assert host == HostConfig(name="web-1", groups=("web", "eu"))
    assert (host.jobs_dir, host.concurrency, host.output_bytes, host.rescan_seconds) == (
        "/etc/scheduled/jobs.d",
        4,
        65536,
        10.0,
    )
    path.write_text(
        '[host]\napi_url = "https://api.example:8080"\ntoken_file = "/etc/scheduled/token"\n'
    )
    host = load_config(path, environ={}).host
    assert host is not None
    assert (host.api_url, host.token_file) == ("https://api.example:8080", "/etc/scheduled/token")
    path.write_text('log_level = "INFO"\n')
    assert load_config(path, environ={}).host is None


@pytest.mark.parametrize(
    ("body", "field", "line", "words"),
    [
        ("concurency = 3", "host.concurency", 4, "did you mean concurrency"),
        ('name = "web 1"', "host.name", 4, "letters, digits"),
        ('groups = "web"', "host.groups", 4, "list of group names"),
        ('jobs_dir = "jobs.d"', "host.jobs_dir", 4, "absolute"),
        ("concurrency = 0", "host.concurrency", 4, "from 1"),
        ("output_bytes = 2000000", "host.output_bytes", 4, "1048576"),
        ("rescan_seconds = 0", "host.rescan_seconds", 4, "above 0"),
        ("tenant = 3", "host.tenant", 4, "tenant name"),
        ('api_url = "ftp://api:8080"', "host.api_url", 4, "http:// or https://"),
        ("api_url = 8080", "host.api_url", 4, "http:// or https://"),
        ('token_file = "token"', "host.token_file", 4, "absolute file path"),
    ],
)
def test_a_bad_host_key_is_an_error_naming_key_file_and_line(
    tmp_path: Path, body: str, field: str, line: int, words: str
) -> None:
    error = config_error(tmp_path, f'log_level = "INFO"\n\n[host]\n{body}\n')
    assert error.field == field
    assert f"scheduled.toml:{line}:" in str(error)
    assert words in str(error)


def test_host_must_be_a_table(tmp_path: Path) -> None:
    error = config_error(tmp_path, 'host = "web-1"\n')
    assert error.field == "host"
    assert "[host] table" in str(error)


# -- permissions -----------------------------------------------------------------------------


@ROOT_ONLY
def test_files_writable_by_others_or_owned_by_another_user_are_refused(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    good = write(directory, "good.toml", "good")
    writable = write(directory, "writable.toml", "writable")
    writable.chmod(0o664)
    foreign = write(directory, "foreign.toml", "foreign")
    nobody = pwd.getpwnam("nobody")
    os.chown(foreign, nobody.pw_uid, nobody.pw_gid)

    assert permission_problem(good) is None
    assert "writable by group or others (mode 0664" in (permission_problem(writable) or "")
    assert "owned by nobody, not by root" in (permission_problem(foreign) or "")

    files = HostFiles(directory)
    changes = files.scan()
    assert [j.name for j in files.jobs()] == ["good"]  # the others still load
    refused = {Path(p.path).name: p.message for p in changes.refused}
    assert set(refused) == {"writable.toml", "foreign.toml"}
    # a run naming a refused file's job says why it does not run
    with pytest.raises(errors.NotFound, match=r"not defined on this host.*writable by group"):
        files.resolve({"job_file": str(writable), "job": "writable"}, **HERE)


@ROOT_ONLY
def test_a_directory_writable_by_others_refuses_every_file(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    write(directory, "a.toml", "a")
    directory.chmod(0o777)
    files = HostFiles(directory)
    changes = files.scan()
    assert files.jobs() == []
    assert "directory" in changes.refused[0].message
    assert "mode 0777" in changes.refused[0].message


@ROOT_ONLY
def test_a_symlink_in_a_directory_writable_by_others_is_refused(tmp_path: Path) -> None:
    """The directory holding the link is checked, not only the target's: anyone could have
    put the link there, to any root-owned job file elsewhere. Closed, the link is still
    refused: a job file is never opened through a link."""
    safe = jobs_dir(tmp_path)
    target = write(safe, "root.toml", "root")
    directory = tmp_path / "open.d"
    directory.mkdir()
    directory.chmod(0o777)
    link = directory / "link.toml"
    link.symlink_to(target)
    assert permission_problem(target) is None
    problem = permission_problem(link) or ""
    assert f"directory {directory} is writable by group or others (mode 0777" in problem
    files = HostFiles(directory)
    changes = files.scan()
    assert files.jobs() == []
    assert [Path(p.path).name for p in changes.refused] == ["link.toml"]
    # the link's directory is part of what a scan compares: closed, the link is judged
    # again, and refused as a link
    directory.chmod(0o755)
    changes = files.scan()
    assert changes.changed == (str(link),)
    assert files.jobs() == []
    assert "is a symbolic link" in changes.refused[0].message


@ROOT_ONLY
def test_a_directory_above_writable_by_others_refuses_every_file(tmp_path: Path) -> None:
    """Anyone who can write a directory above the jobs directory can rename it away and
    put their own in its place: refused as OpenSSH's StrictModes does, unless the
    directory has the sticky bit (as /tmp does), and an owner other than root or the
    worker's user is refused too."""
    outer = tmp_path / "srv"
    outer.mkdir(mode=0o755)
    outer.chmod(0o755)
    directory = jobs_dir(outer)
    path = write(directory, "a.toml", "a")
    files = HostFiles(directory)
    assert files.scan().added == (str(path),)
    assert [j.name for j in files.jobs()] == ["a"]

    outer.chmod(0o777)
    problem = permission_problem(path) or ""
    assert f"directory {outer} is writable by group or others (mode 0777" in problem
    # a scan notices the change above the jobs directory and drops its jobs
    changes = files.scan()
    assert changes.changed == (str(path),)
    assert files.jobs() == []
    assert f"directory {outer}" in changes.refused[0].message

    outer.chmod(0o1777)  # sticky: others cannot rename or remove jobs.d
    assert permission_problem(path) is None
    assert files.scan().changed == (str(path),)
    assert [j.name for j in files.jobs()] == ["a"]
    # the sticky bit does not excuse the jobs directory itself: anyone could add a file
    directory.chmod(0o1777)
    assert "mode 1777" in (permission_problem(path) or "")
    directory.chmod(0o755)

    outer.chmod(0o755)
    nobody = pwd.getpwnam("nobody")
    os.chown(outer, nobody.pw_uid, nobody.pw_gid)
    assert f"directory {outer} is owned by nobody" in (permission_problem(path) or "")


def test_the_worker_s_own_user_may_own_its_files(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    path = write(directory, "a.toml", "a")
    # the worker's own uid is trusted as root is; any other is not
    assert permission_problem(path, uid=os.geteuid()) is None
    stat_uid = path.stat().st_uid
    assert permission_problem(path, uid=stat_uid) is None


# -- resolution and rescans --------------------------------------------------------------------


def test_resolution_uses_only_the_loaded_files(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    path = write(directory, "backup.toml", "backup")
    files = HostFiles(directory)
    files.scan()
    payload = {"job_file": str(path), "job": "backup", "command": ["/bin/rm"]}
    job = files.resolve(payload, **HERE)
    assert job.argv() == ["/bin/echo", "backup"]  # the payload's "command" plays no part
    for payload, words in [
        ({"job_file": str(path), "job": "other"}, f"job 'other' of '{path}' is not defined"),
        ({"job_file": "/etc/passwd", "job": "backup"}, "of '/etc/passwd' is not defined"),
        ({"job_file": "backup.toml", "job": "backup"}, "is not defined on this host"),
        ({"command": ["/bin/true"]}, "names no job file and job"),
        ("backup", "names no job file and job"),
    ]:
        with pytest.raises(errors.NotFound, match=words):
            files.resolve(payload, **HERE)


def test_disabled_jobs_do_not_resolve(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    path = directory / "off.toml"
    path.write_text(JOB.format(name="off", cron="@daily") + "enabled = false\n")
    path.chmod(0o644)
    files = HostFiles(directory)
    files.scan()
    with pytest.raises(errors.NotFound, match="disabled"):
        files.resolve({"job_file": str(path), "job": "off"}, **HERE)


def test_a_job_resolves_only_on_its_host_and_from_its_own_queue(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    path = directory / "fleet.toml"
    path.write_text(
        "".join(
            JOB.format(name=name, cron=cron) + (f'run_on = "{run_on}"\n' if run_on else "")
            for name, cron, run_on in [
                ("mine", "@daily", None),
                ("web", "@daily", "host-group:web"),
                ("db", "@daily", "host-group:db"),
                ("all", "@daily", "every-host"),
                ("all-db", "@daily", "every-host:db"),
                ("boot", "@reboot", None),
            ]
        )
    )
    path.chmod(0o644)
    files = HostFiles(directory)
    files.scan()

    def resolve(name: str, queue: str) -> FileJob:
        payload = {"job_file": str(path), "job": name}
        return files.resolve(payload, host="web-1", groups=("web",), queue=queue)

    # each job from the queue `schedctl apply` puts its runs on
    for name, queue in [("mine", "host:web-1"), ("web", "group:web"), ("all", "every:web-1")]:
        assert resolve(name, queue).name == name
    for name, queue, words in [
        ("db", "group:db", "runs on host-group:db, not on this host (web-1, groups: web)"),
        ("db", "host:web-1", "runs on host-group:db, not on this host"),
        ("all-db", "every:web-1", "runs on every-host:db, not on this host"),
        ("mine", "group:web", "runs from queue 'host:web-1', not 'group:web'"),
        ("mine", "every:web-1", "runs from queue 'host:web-1', not 'every:web-1'"),
        ("web", "host:web-1", "runs from queue 'group:web', not 'host:web-1'"),
        ("all", "host:web-1", "runs from queue 'every:web-1', not 'host:web-1'"),
        ("boot", "host:web-1", "is a @reboot job: it runs only when this host's worker starts"),
    ]:
        with pytest.raises(errors.NotFound, match=re.escape(words)) as caught:
            resolve(name, queue)
        assert caught.value.field == "job"
        assert f"job {name!r} of {str(path)!r} " in str(caught.value)


def test_a_nul_or_newline_in_the_reference_is_refused_and_quoted(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    path = write(directory, "a.toml", "a")
    files = HostFiles(directory)
    files.scan()
    for payload in [
        {"job_file": f"{path}\u0000x", "job": "a"},
        {"job_file": "/etc/x\u0000y", "job": "a"},
        {"job_file": str(path), "job": "a\u0000"},
    ]:
        with pytest.raises(errors.NotFound, match="is not defined on this host"):
            files.resolve(payload, **HERE)
    # a newline cannot forge a line of the daemon's log: the names are quoted
    with pytest.raises(errors.NotFound) as caught:
        files.resolve({"job_file": "/x\nforged: line", "job": "b\nc"}, **HERE)
    assert "\n" not in str(caught.value)
    assert "job 'b\\nc' of '/x\\nforged: line' is not defined" in str(caught.value)


def test_a_reference_through_a_symlinked_directory_names_the_same_file(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    write(directory, "a.toml", "a")
    alias = tmp_path / "alias.d"
    alias.symlink_to(directory)
    files = HostFiles(directory)
    files.scan()
    job = files.resolve({"job_file": str(alias / "a.toml"), "job": "a"}, **HERE)
    assert job.name == "a"


def test_a_scan_follows_added_changed_and_removed_files(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    first = write(directory, "a.toml", "a")
    files = HostFiles(directory)
    assert files.scan().added == (str(first),)
    assert not files.scan().any  # nothing changed: nothing reloaded
    second = write(directory, "b.toml", "b")
    first.write_text(JOB.format(name="a2", cron="@hourly"))
    changes = files.scan()
    assert (changes.added, changes.changed) == ((str(second),), (str(first),))
    assert sorted(j.name for j in files.jobs()) == ["a2", "b"]
    second.unlink()
    assert files.scan().removed == (str(second),)
    with pytest.raises(errors.NotFound):
        files.resolve({"job_file": str(second), "job": "b"}, **HERE)
    # an invalid file is left out with its problem (file:line:key); the others stay
    first.write_text('[[job]]\nname = "a"\ncron = "0 3 * * *"\ncommand = ["/bin/true"]\nusr = 1\n')
    changes = files.scan()
    assert files.jobs() == []
    assert changes.refused[0].key == "job.usr"
    assert changes.refused[0].line == 5


def test_boot_jobs_of_this_host_and_its_groups(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    path = directory / "boot.toml"
    path.write_text(
        "".join(
            JOB.format(name=name, cron="@reboot") + (f'run_on = "{run_on}"\n' if run_on else "")
            for name, run_on in [
                ("mine", None),
                ("web", "host-group:web"),
                ("db", "host-group:db"),
                ("all", "every-host"),
                ("all-db", "every-host:db"),
            ]
        )
        + JOB.format(name="nightly", cron="0 3 * * *")
    )
    path.chmod(0o644)
    files = HostFiles(directory)
    files.scan()
    assert [j.name for j in files.boot_jobs("web-1", ["web"])] == ["mine", "web", "all"]


# -- check-config ------------------------------------------------------------------------------


@ROOT_ONLY
def test_check_config_validates_the_job_files_of_the_host(tmp_path: Path) -> None:
    directory = jobs_dir(tmp_path)
    write(directory, "a.toml", "a")
    config = tmp_path / "scheduled.toml"
    config.write_text(f'[host]\nname = "h1"\njobs_dir = "{directory}"\n')
    assert "1 job file(s), 1 job(s)" in check_configuration(str(config), bind=False)
    bad = directory / "b.toml"
    bad.write_text(
        '[[job]]\nname = "b"\ncron = "0 3 * * *"\ncommand = ["/bin/true"]\ntimeout = "x"\n'
    )
    bad.chmod(0o644)
    writable = write(directory, "c.toml", "c")
    writable.chmod(0o666)
    with pytest.raises(JobFilesError) as caught:
        check_configuration(str(config), bind=False)
    text = str(caught.value)
    assert f"job.timeout: {bad}:5:" in text
    assert f"file: {writable}: refused:" in text
    with pytest.raises(JobFilesError):
        check_dir(directory)


# -- the account -------------------------------------------------------------------------------


def job_as(user: str | None, group: str | None = None) -> FileJob:
    text = JOB.format(name="j", cron="@daily")
    if user:
        text += f'user = "{user}"\n'
    if group:
        text += f'group = "{group}"\n'
    return parse_text(text, "/etc/scheduled/jobs.d/j.toml").jobs[0]


@ROOT_ONLY
def test_the_account_of_a_job() -> None:
    nobody = pwd.getpwnam("nobody")
    assert run_as(job_as(None)) is None
    assert run_as(job_as("root")) is None
    account = run_as(job_as("nobody"))
    assert account is not None
    assert (account.uid, account.gid, account.home) == (nobody.pw_uid, nobody.pw_gid, nobody.pw_dir)
    with pytest.raises(errors.NotFound, match="user 'no-such-user' does not exist"):
        run_as(job_as("no-such-user"))
    with pytest.raises(errors.NotFound, match="group 'no-such-group' does not exist"):
        run_as(job_as(None, "no-such-group"))


def test_a_worker_not_running_as_root_refuses_jobs_of_other_users() -> None:
    nobody = pwd.getpwnam("nobody")
    as_nobody = {"euid": nobody.pw_uid, "egid": nobody.pw_gid}
    assert run_as(job_as("nobody"), **as_nobody) is None
    with pytest.raises(errors.ConfigError) as caught:
        run_as(job_as("root"), **as_nobody)
    assert caught.value.field == "user"
    assert "runs as user 'root', but the worker runs as nobody, not root" in str(caught.value)
