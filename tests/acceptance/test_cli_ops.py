"""Owns the tests of `schedctl` as an ops tool: what the real console script imports for
`--help` and `job list` (no database driver, HTTP or broker library until a command needs
one), its shell completion scripts, and a closed output pipe ending quietly."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.process_support import schedctl_command

# never needed before a command needs them; `job list` on SQLite needs sqlalchemy only
HEAVY = ("psycopg", "sqlalchemy", "alembic", "requests", "pika", "kazoo", "fastapi")

# runs the console script's main() and reports, at exit, which of HEAVY were imported
_PROBE = """
import atexit, json, sys
atexit.register(lambda: sys.stderr.write(
    "\\nLOADED=" + json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)) + "\\n"))
sys.argv = ["schedctl", *sys.argv[1:]]
from schedctl.cli.app import main
main()
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")  # the embedded default, if any, goes here
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    return env


def _loaded(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY), *args],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
    )
    marker = [line for line in done.stderr.splitlines() if line.startswith("LOADED=")]
    assert marker, done.stderr
    return done, set(json.loads(marker[-1].removeprefix("LOADED=")))


def test_help_imports_no_database_http_or_broker_library(tmp_path: Path) -> None:
    for args in (
        ["--help"],
        ["job", "--help"],
        ["--version"],
        ["cron", "--help"],
        ["apply", "--help"],
    ):
        done, loaded = _loaded(tmp_path, *args)
        assert done.returncode == 0, done.stderr
        assert loaded == set(), (args, loaded)


def test_job_list_on_sqlite_imports_sqlalchemy_only(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'fresh.db'}"
    # first use of a new file: the schema is created, which takes alembic (the migrations)
    first, loaded = _loaded(tmp_path, "--db", db, "job", "list")
    assert first.returncode == 0, first.stderr
    assert loaded == {"sqlalchemy", "alembic"}, loaded
    # from then on: the revision check reads the version table, without alembic
    again, loaded = _loaded(tmp_path, "--db", db, "job", "list", "-o", "json")
    assert again.returncode == 0, again.stderr
    json.loads(again.stdout)  # a listing, empty
    assert loaded == {"sqlalchemy"}, loaded


def test_revision_checks_agree_with_alembic(tmp_path: Path) -> None:
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from schedctl.storage.db.engine import make_engine
    from schedctl.storage.db.migrate import MIGRATIONS, current_revision, head_revision, upgrade

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    assert head_revision() == ScriptDirectory.from_config(config).get_current_head()
    url = f"sqlite:///{tmp_path / 'r.db'}"
    engine = make_engine(url)
    try:
        assert current_revision(engine) is None
        for revision in ("0001", "head"):
            upgrade(url, revision)
            with engine.connect() as connection:
                expected = MigrationContext.configure(connection).get_current_revision()
            assert current_revision(engine) == expected
    finally:
        engine.dispose()


# -- shell completion --------------------------------------------------------------------


SHELL_MARK = {"bash": "complete -o default -F", "zsh": "compdef", "fish": "complete --command"}


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_script_of_that_shell(shell: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [*schedctl_command(), "completion", shell],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "schedctl" in done.stdout and "_SCHEDCTL_COMPLETE" in done.stdout
    assert SHELL_MARK[shell] in done.stdout, done.stdout
    for other, mark in SHELL_MARK.items():
        if other != shell:
            assert mark not in done.stdout


def test_completion_of_an_unknown_shell_is_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [*schedctl_command(), "completion", "tcsh"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=60,
    )
    assert done.returncode == 2 and "tcsh" in done.stderr


def test_show_completion_prints_a_script_for_the_current_shell(tmp_path: Path) -> None:
    # typer finds "the current shell" among the process's ancestors (shellingham), so the
    # command runs under a bash that stays its parent (`; exit` keeps bash from exec'ing
    # it): under pytest alone, started by no shell, the detection finds none
    command = " ".join(shlex.quote(part) for part in schedctl_command())
    done = subprocess.run(
        ["/bin/bash", "-c", f"{command} --show-completion; exit $?"],
        capture_output=True,
        text=True,
        env=_env(tmp_path) | {"SHELL": "/bin/bash"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "_SCHEDCTL_COMPLETE" in done.stdout


def test_zsh_and_fish_completion_complete_commands(tmp_path: Path) -> None:
    for shell in ("zsh", "fish"):
        env = _env(tmp_path) | {
            "_SCHEDCTL_COMPLETE": f"complete_{shell}",
            "_TYPER_COMPLETE_ARGS": "schedctl db ",
            "_TYPER_COMPLETE_FISH_ACTION": "get-args",
        }
        done = subprocess.run(
            schedctl_command(), capture_output=True, text=True, env=env, timeout=60
        )
        assert "upgrade" in done.stdout and "status" in done.stdout, (shell, done.stdout)


def test_bash_completion_completes_commands(tmp_path: Path) -> None:
    # what the bash script does on TAB: call schedctl back with the words typed so far
    env = _env(tmp_path) | {
        "_SCHEDCTL_COMPLETE": "complete_bash",
        "COMP_WORDS": "schedctl jo",
        "COMP_CWORD": "1",
    }
    done = subprocess.run(
        schedctl_command(), capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.stdout.split() == ["job"], (done.stdout, done.stderr)
    env |= {"COMP_WORDS": "schedctl job l", "COMP_CWORD": "2"}
    done = subprocess.run(
        schedctl_command(), capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert "list" in done.stdout.split(), (done.stdout, done.stderr)


def test_bash_completion_script_works_in_bash(tmp_path: Path) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    schedctl = schedctl_command()
    if len(schedctl) != 1:
        pytest.skip("no schedctl console script")
    script = subprocess.run(
        [*schedctl, "completion", "bash"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=60,
        check=True,
    ).stdout
    # source the script, then do what TAB does after `schedctl db `
    program = (
        f"{script}\n"
        f'PATH="{Path(schedctl[0]).parent}:$PATH"\n'
        "COMP_WORDS=(schedctl db '')\nCOMP_CWORD=2\n"
        "_schedctl_completion schedctl\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        [bash, "--norc", "--noprofile", "-c", program],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=60,
    )
    assert {"upgrade", "status"} <= set(done.stdout.split()), (done.stdout, done.stderr)


# -- a closed pipe -------------------------------------------------------------------------


# a command whose output is far more than the one-page pipe holds; its output format follows
_THOUSAND_LINES = ["cron", "next", "* * * * *", "--tz", "UTC", "-n", "1000", "-o"]


def _small_pipe() -> tuple[int, int]:
    """A pipe holding one page: a command writing more blocks until the reader reads."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    return read_end, write_end


def _ends_quietly(process: subprocess.Popen[bytes], timeout: float) -> None:
    """What `| head` must see of a command whose reader went away: no message, exit 141."""
    _out, err = process.communicate(timeout=timeout)
    assert err == b"", err.decode()
    assert process.returncode == 141


def _into_closed_pipe(argv: list[str], tmp_path: Path, timeout: float = 60) -> None:
    """Run `argv` with stdout on a pipe whose reader is gone before the first byte."""
    read_end, write_end = _small_pipe()
    os.close(read_end)
    process = subprocess.Popen(argv, stdout=write_end, stderr=subprocess.PIPE, env=_env(tmp_path))
    os.close(write_end)
    _ends_quietly(process, timeout)


def test_a_reader_that_stops_after_one_line_ends_the_command_quietly(tmp_path: Path) -> None:
    """`schedctl cron next ... -n 1000 -o json | head -1`: no traceback, no message, 141."""
    read_end, write_end = _small_pipe()
    process = subprocess.Popen(
        [*schedctl_command(), *_THOUSAND_LINES, "json"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        env=_env(tmp_path),
    )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        first = reader.readline()  # head -1
    assert first.strip() == b"["
    _ends_quietly(process, 60)


@pytest.mark.parametrize("output", ["json", "table"])
def test_a_reader_gone_before_the_output_ends_the_command_quietly(
    output: str, tmp_path: Path
) -> None:
    """The same when every write fails: tables (rich) and JSON take the same way out."""
    _into_closed_pipe(
        [*schedctl_command(), *_THOUSAND_LINES, output],
        tmp_path,
    )


def test_status_json_into_a_closed_pipe(tmp_path: Path) -> None:
    """`schedctl status -o json | head -1` once head has gone: every write fails."""
    db = f"sqlite:///{tmp_path / 'status.db'}"
    _into_closed_pipe([*schedctl_command(), "--db", db, "status", "-o", "json"], tmp_path, 120)


@pytest.mark.parametrize("args", [["--help"], ["job", "--help"]])
def test_help_into_a_closed_pipe_ends_the_same_way(args: list[str], tmp_path: Path) -> None:
    """Help text is printed by typer's own console, which would exit 1: 141 as well."""
    _into_closed_pipe([*schedctl_command(), *args], tmp_path)


def test_an_error_with_stdout_on_dev_null_keeps_its_code(tmp_path: Path) -> None:
    """Only a pipe that closed is 141: stdout on /dev/null from the start changes nothing."""
    done = subprocess.run(
        [*schedctl_command(), "--db", "mysql://nowhere/x", "job", "list"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(tmp_path),
        timeout=60,
    )
    assert done.returncode == 2 and b"unsupported database" in done.stderr
