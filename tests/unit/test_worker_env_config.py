"""What a worker adds to its command's environment: the [worker.env] table of a [[worker]]
and the --env KEY=VALUE flags of `scheduled-d worker` take string values under valid names,
and refuse, naming the field, any SCHEDULED_* name (the worker's own database URL, payload
keys and API token must never reach a command) and the SCHED_* run variables."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from schedctl.core import errors
from schedctl.domain.config import Config, command_env, load_config
from scheduled_d.__main__ import app

WORKER = '[[worker]]\nqueue = "q"\ncommand = ["/usr/local/bin/backup.sh"]\n'


def load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "scheduled.toml"
    path.write_text(text)
    return load_config(path, environ={})


def test_the_env_table_is_read(tmp_path: Path) -> None:
    config = load(
        tmp_path, WORKER + '[worker.env]\nREPORT_DIR = "/srv/reports"\nPATH = "/usr/bin"\n'
    )
    (worker,) = config.workers
    assert dict(worker.env) == {"REPORT_DIR": "/srv/reports", "PATH": "/usr/bin"}


def test_no_env_table_means_nothing_added(tmp_path: Path) -> None:
    (worker,) = load(tmp_path, WORKER).workers
    assert worker.env == ()


@pytest.mark.parametrize(
    "name", ["SCHEDULED_DATABASE_URL", "SCHEDULED_PAYLOAD_KEYS", "SCHEDULED_API_TOKEN"]
)
def test_a_scheduled_variable_is_refused_naming_the_field(tmp_path: Path, name: str) -> None:
    with pytest.raises(errors.ConfigError) as info:
        load(tmp_path, WORKER + f'[worker.env]\n{name} = "x"\n')
    assert info.value.field == f"worker.env.{name}"
    message = str(info.value)
    assert message.startswith(f"worker.env.{name}: ")
    assert str(tmp_path / "scheduled.toml") in message
    assert "SCHEDULED_*" in message and "never reach" in message


def test_lower_case_scheduled_names_are_refused_too() -> None:
    with pytest.raises(errors.ConfigError) as info:
        command_env({"scheduled_api_token": "x"}, "worker.env")
    assert info.value.field == "worker.env.scheduled_api_token"


@pytest.mark.parametrize(
    ("table", "field", "words"),
    [
        ("SCHED_JOB_ID = 'x'", "worker.env.SCHED_JOB_ID", "set by the worker"),
        ("SCHED_ATTEMPT = '9'", "worker.env.SCHED_ATTEMPT", "set by the worker"),
        ("COUNT = 3", "worker.env.COUNT", "must be a string"),
        ("FLAG = true", "worker.env.FLAG", "must be a string"),
        ('"1ST" = "x"', "worker.env.1ST", "not an environment variable name"),
        ('"A-B" = "x"', "worker.env.A-B", "not an environment variable name"),
        ('"A=B" = "x"', "worker.env.A=B", "not an environment variable name"),
        ('"" = "x"', "worker.env.", "not an environment variable name"),
        ('NUL = "a\\u0000b"', "worker.env.NUL", "NUL"),
    ],
)
def test_bad_entries_are_refused(tmp_path: Path, table: str, field: str, words: str) -> None:
    with pytest.raises(errors.ConfigError) as info:
        load(tmp_path, WORKER + "[worker.env]\n" + table + "\n")
    assert info.value.field == field
    assert words in str(info.value)


def test_env_must_be_a_table(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError) as info:
        load(tmp_path, WORKER + 'env = ["A=B"]\n')
    assert info.value.field == "worker.env"


# -- scheduled-d worker --env ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("SCHEDULED_DATABASE_URL=postgresql://x", "--env SCHEDULED_DATABASE_URL: SCHEDULED_*"),
        ("SCHEDULED_API_TOKEN=t", "--env SCHEDULED_API_TOKEN: SCHEDULED_*"),
        ("SCHED_IDEMPOTENCY_KEY=k", "--env SCHED_IDEMPOTENCY_KEY: is set by the worker"),
        ("NO_EQUALS_SIGN", "--env: expected KEY=VALUE"),
        ("=value", "not an environment variable name"),
    ],
)
def test_bad_env_flags_are_refused_before_anything_runs(
    tmp_path: Path, flag: str, words: str
) -> None:
    # refused before the database is opened: this one does not exist
    result = CliRunner().invoke(
        app,
        [
            "worker",
            "--db",
            f"sqlite:///{tmp_path / 'missing' / 'none.db'}",
            "--queue",
            "q",
            "--env",
            "FINE=1",
            "--env",
            flag,
            "--",
            "true",
        ],
        env={"SCHEDULED_CONFIG": ""},
    )
    assert result.exit_code == 2, result.output
    assert words in result.output
    assert not (tmp_path / "missing").exists()
