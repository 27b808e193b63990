"""Owns keeping the daemon's own environment out of reach of the commands it runs: a
variable popped from os.environ is still in the kernel's copy, /proc/PID/environ, which
any process of the same user may read; a process that is not dumpable has that file
readable by root only. exec makes each command dumpable again, so commands are
unaffected; core dumps of the daemon (which would hold its secrets too) are off."""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4  # <linux/prctl.h>
PR_GET_DUMPABLE = 3


def keep_environment_private() -> bool:
    """Make this process not dumpable (Linux); whether it is now. Elsewhere, or if prctl
    fails, it stays as it was (logged): a command of the daemon's user could then read
    the daemon's environment as given at its start."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")
        return bool(libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0)
    except (OSError, AttributeError) as exc:
        log.warning("cannot make the daemon's environment private: %s", exc)
        return False
