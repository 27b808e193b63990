"""The one file's dispatch (scheduled_d.onefile.resolve): by the name it runs under, else
by its first argument."""

from __future__ import annotations

import pytest

from scheduled_d.onefile import UsageError, resolve


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/usr/local/bin/schedctl", "job", "list"], ("schedctl", ["job", "list"])),
        (["./scheduled-d", "all", "--db", "x"], ("scheduled-d", ["all", "--db", "x"])),
        # a link's name wins over the first argument
        (["schedctl", "scheduled-d"], ("schedctl", ["scheduled-d"])),
        (["/opt/scheduled.pyz", "schedctl", "--help"], ("schedctl", ["--help"])),
        (["scheduled.pyz", "scheduled-d", "--version"], ("scheduled-d", ["--version"])),
        (["scheduled.pyz", "demo"], ("demo", [])),
        (["scheduled.pyz", "--version"], ("version", [])),
        (["scheduled.pyz"], ("help", [])),
        (["scheduled.pyz", "--help"], ("help", [])),
        (["schedctl.pyz", "status"], ("schedctl", ["status"])),
    ],
)
def test_resolve(argv: list[str], expected: tuple[str, list[str]]) -> None:
    assert resolve(argv) == expected


def test_an_unknown_tool_is_named() -> None:
    with pytest.raises(UsageError, match="'sched'"):
        resolve(["scheduled.pyz", "sched", "status"])
