"""The one-file build's entry point (`make onefile`, dist/scheduled.pyz): one executable that
is `schedctl`, `scheduled-d` or the demo, chosen by the name it runs under or by its first
argument.

    scheduled.pyz schedctl job list        ln -s scheduled.pyz schedctl; ./schedctl job list
    scheduled.pyz scheduled-d all          ln -s scheduled.pyz scheduled-d; ./scheduled-d all
    scheduled.pyz demo                     the tour of `make demo`, using this same file
    scheduled.pyz --version
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from schedctl import __version__

TOOLS = ("schedctl", "scheduled-d", "demo")
# The demo runs its `schedctl` and `scheduled-d` commands as `python3 THIS_FILE TOOL ...`
# when this names the one file (see scheduled_d.demo.command).
ONEFILE_ENV = "SCHEDULED_DEMO_ONEFILE"

USAGE = f"""\
scheduled.pyz {__version__}: schedctl and scheduled-d in one file.

usage: scheduled.pyz schedctl ARGS...      (or run it through a link named schedctl)
       scheduled.pyz scheduled-d ARGS...   (or run it through a link named scheduled-d)
       scheduled.pyz demo                  (the five-minute tour, with this file)
       scheduled.pyz --version
"""


class UsageError(Exception):
    """The command line names no tool this file contains."""


def resolve(argv: Sequence[str]) -> tuple[str, list[str]]:
    """The tool to run and its arguments: by argv[0]'s base name (a link named schedctl or
    scheduled-d; a `.pyz` suffix is ignored), else by the first argument. ("help", []) and
    ("version", []) for the file's own --help and --version."""
    name = Path(argv[0]).name if argv else ""
    stem = name.removesuffix(".pyz")
    if stem in TOOLS:
        return stem, list(argv[1:])
    rest = list(argv[1:])
    if not rest or rest[0] in ("-h", "--help", "help"):
        return "help", []
    if rest[0] == "--version":
        return "version", []
    if rest[0] in TOOLS:
        return rest[0], rest[1:]
    raise UsageError(f"unknown command {rest[0]!r}: expected one of {', '.join(TOOLS)}")


def _entry(tool: str) -> Callable[[], object]:
    """Import only the tool that runs: schedctl's start-up stays free of the daemon's."""
    if tool == "schedctl":
        from schedctl.cli.app import main as schedctl_main

        return schedctl_main
    if tool == "scheduled-d":
        from scheduled_d.__main__ import main as daemon_main

        return daemon_main
    from scheduled_d.demo import main as demo_main

    return demo_main


def main() -> None:
    """The one file's console entry (shiv's `-e scheduled_d.onefile:main`)."""
    try:
        tool, args = resolve(sys.argv)
    except UsageError as error:
        sys.stderr.write(f"scheduled.pyz: {error}\n\n{USAGE}")
        sys.exit(2)
    if tool == "help":
        sys.stdout.write(USAGE)
        sys.exit(0)
    if tool == "version":
        sys.stdout.write(f"scheduled.pyz {__version__} (schedctl, scheduled-d)\n")
        sys.exit(0)
    if tool == "demo":
        # sys.argv[0] is the file as it was started (shiv and zipapp keep it)
        os.environ[ONEFILE_ENV] = str(Path(sys.argv[0]).resolve())
    # the tools take their program name (usage lines, errors) from sys.argv[0]
    sys.argv = [tool, *args]
    result = _entry(tool)()
    sys.exit(result if isinstance(result, int) else 0)
