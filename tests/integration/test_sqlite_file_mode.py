"""The embedded SQLite database is its owner's alone: created 0600 with its -wal and -shm
files whatever the umask, and an existing file readable by others tightened with a warning."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from schedctl.app.service import Scheduler


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The common default umask, under which files are made 0644."""
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def side_files(path: Path) -> list[Path]:
    return [path, Path(f"{path}-wal"), Path(f"{path}-shm")]


@pytest.mark.usefixtures("loose_umask")
def test_a_new_database_and_its_wal_and_shm_are_0600(tmp_path: Path) -> None:
    path = tmp_path / "state" / "scheduled.db"
    sched = Scheduler.open(str(path), upgrade=True)
    try:
        sched.create_tenant("acme", "test")  # a write: the -wal and -shm exist while open
        for each in side_files(path):
            assert each.exists(), each
            assert mode(each) == 0o600, (each, oct(mode(each)))
    finally:
        sched.close()
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700


@pytest.mark.usefixtures("loose_umask")
def test_an_existing_world_readable_database_is_tightened_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "scheduled.db"
    sqlite3.connect(path).close()  # made with the umask, as an older release did
    path.chmod(0o644)
    assert mode(path) == 0o644
    with caplog.at_level(logging.WARNING, logger="schedctl.storage.db.engine"):
        sched = Scheduler.open(str(path), upgrade=True)
    try:
        sched.create_tenant("acme", "test")
        for each in side_files(path):
            assert mode(each) == 0o600, (each, oct(mode(each)))
    finally:
        sched.close()
    (warning,) = [r for r in caplog.records if r.name == "schedctl.storage.db.engine"]
    assert str(path) in warning.getMessage()
    assert "0644" in warning.getMessage() and "0600" in warning.getMessage()
