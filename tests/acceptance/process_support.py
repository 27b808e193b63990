"""Helpers of the acceptance tests that run the installed commands as real processes: where
the console script is, waiting until a process has done something, and stopping it."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# how long a process may take to do what a test waits for, on a loaded CI machine
WAIT_SECONDS = 120.0


def schedctl_command() -> list[str]:
    """The installed `schedctl` console script (beside this interpreter, else on PATH), or
    the module when neither is installed."""
    beside = Path(sys.executable).with_name("schedctl")
    found = str(beside) if beside.exists() else shutil.which("schedctl")
    return [found] if found else [sys.executable, "-m", "schedctl.cli.app"]


def wait_for(
    predicate: Callable[[], object], timeout: float = WAIT_SECONDS, *, poll: float = 0.1
) -> bool:
    """Whether `predicate` came true within `timeout` seconds, asked every `poll` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


@contextlib.contextmanager
def killed_if_left(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """The block's process is killed and reaped at the end if it is still running (a failed
    assertion must not leave a daemon behind)."""
    try:
        yield
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def stops_on_sigterm(process: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM ends the daemon cleanly (exit 0) within a minute; else its log is shown."""
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0, log.read_text()
