"""State you can keep, from the CLI: with no configuration a command that only looks
refuses a missing database (saying where it looked) and one that creates makes it (saying
where); a system configuration without a database is refused, never replaced by a per-user
file."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import schedctl.domain.config
from schedctl.cli.app import app

runner = CliRunner()


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine with no configuration (no system file, no SCHEDULED_* variable); returns
    where the embedded default database would be."""
    for name in list(os.environ):
        if name.startswith("SCHEDULED_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setattr(
        schedctl.domain.config, "DEFAULT_CONFIG_PATH", tmp_path / "etc" / "none.toml"
    )
    return tmp_path / "data" / "scheduled" / "scheduled.db"


def invoke(*args: str) -> Any:
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"unhandled {result.exception!r}\n{result.output}")
    return result


def test_a_look_at_a_missing_default_database_says_where_it_looked(fresh: Path) -> None:
    for args in (["job", "list"], ["db", "status"], ["tenant", "list"]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert f"no database at {fresh}" in result.stderr
        assert "SCHEDULED_CONFIG" in result.stderr and "scheduled-d all" in result.stderr
        assert "database_url" in result.stderr
        assert not fresh.exists()  # nothing made by a look


def test_a_creating_command_makes_the_default_database_and_says_so_once(fresh: Path) -> None:
    created = invoke("tenant", "create", "demo")
    assert created.exit_code == 0, created.output
    assert f"creating a new database at {fresh}" in created.stderr
    assert fresh.exists()
    listed = invoke("job", "list")
    assert listed.exit_code == 0, listed.output
    assert "creating" not in listed.stderr


def test_a_system_configuration_without_a_database_is_refused(
    fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = tmp_path / "etc" / "scheduled.toml"
    system.parent.mkdir()
    system.write_text('log_level = "INFO"\n')
    monkeypatch.setattr(schedctl.domain.config, "DEFAULT_CONFIG_PATH", system)
    for args in (["job", "list"], ["tenant", "create", "demo"], ["db", "upgrade"]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert "database_url" in result.stderr and str(system) in result.stderr
        assert not fresh.exists()  # no per-user file in its place


def test_an_unreadable_system_configuration_is_refused(
    fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a directory where the file should be: present, and not readable as a file (a mode
    # cannot make a file unreadable to root, who runs these tests on CI)
    system = tmp_path / "etc" / "scheduled.toml"
    system.mkdir(parents=True)
    monkeypatch.setattr(schedctl.domain.config, "DEFAULT_CONFIG_PATH", system)
    result = invoke("job", "list")
    assert result.exit_code == 2, result.output
    assert f"cannot read {system}" in result.stderr
    assert not fresh.exists()


def test_an_explicit_database_is_still_made_by_any_command(fresh: Path, tmp_path: Path) -> None:
    """--db names the file on purpose: the refusal is for the default nobody chose."""
    db = tmp_path / "explicit.db"
    result = invoke("--db", f"sqlite:///{db}", "job", "list")
    assert result.exit_code == 0, result.output
    assert db.exists()


def test_schedctl_checkpoints_after_writes_so_the_file_alone_holds_them(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Another connection stays open (as a running daemon's would), so SQLite does not
    checkpoint on its own when schedctl's last connection closes."""
    import contextlib
    import shutil
    import sqlite3

    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with contextlib.closing(sqlite3.connect(path)) as other:
        other.execute("SELECT count(*) FROM tenants").fetchone()
        result = invoke("--db", sqlite_url, "tenant", "create", "kept")
        assert result.exit_code == 0, result.output
        copy = tmp_path / "copy.db"
        shutil.copyfile(path, copy)  # the main file alone
        with contextlib.closing(sqlite3.connect(f"file:{copy}?immutable=1", uri=True)) as alone:
            names = [row[0] for row in alone.execute("SELECT name FROM tenants")]
    assert names == ["kept"]


def test_scheduled_d_refuses_a_system_configuration_without_a_database(
    fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduled_d.__main__ import app as daemon_app

    system = tmp_path / "etc" / "scheduled.toml"
    system.parent.mkdir()
    system.write_text('log_level = "INFO"\n')
    monkeypatch.setattr(schedctl.domain.config, "DEFAULT_CONFIG_PATH", system)
    # scheduled-d sets up logging on the root logger, here to CliRunner's stream, which is
    # closed afterwards: the next tests' log lines must not go there
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        result = runner.invoke(daemon_app, ["all"])
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
    assert result.exit_code == 2, result.output
    assert "database_url" in result.stderr and str(system) in result.stderr
    assert not fresh.exists()
