"""A command started by the daemon cannot read the daemon's environment from
/proc/PPID/environ (where a variable popped from os.environ, such as the API token, is
still to be found), while the same command started by a process that did not make itself
private can: checked with real processes of one unprivileged user (root may read any)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

SECRET = "st_private_env_check_5b2e"

# the daemon's side: as an unprivileged user (root may read every process's environ), pop
# the variable (as _api_token does), maybe go private, then start a command through the
# worker's own spawn; the command tries to read its parent's environment
PARENT = textwrap.dedent(
    """
    import ctypes, os, sys
    from scheduled_d.private_env import keep_environment_private
    from scheduled_d.spawn import spawn
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        # setuid made it not dumpable; a process started as that user is dumpable
        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
    os.environ.pop("SCHEDULED_API_TOKEN")
    if sys.argv[1] == "private":
        assert keep_environment_private()
    child = spawn(["/bin/sh", "-c", sys.argv[2]], {"PATH": "/usr/bin:/bin"})
    child.close_stdin()
    code = child.wait()
    print(code, os.read(child.stdout, 65536).decode().strip())
    """
)
COMMAND = 'if cat "/proc/$PPID/environ" > /dev/null 2>&1; then echo read; else echo refused; fi'


def _run(mode: str) -> str:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "SCHEDULED_API_TOKEN": SECRET,
    }
    done = subprocess.run(
        [sys.executable, "-c", PARENT, mode, COMMAND],
        env=env,
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_command_cannot_read_the_daemons_environment() -> None:
    assert _run("private") == "0 refused"


def test_without_it_the_popped_token_would_be_readable() -> None:
    # the control: this is what keep_environment_private closes
    assert _run("plain") == "0 read"
