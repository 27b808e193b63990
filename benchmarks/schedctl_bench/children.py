"""Owns stopping the benchmarks' child processes: SIGTERM, a bounded wait for the exit, then
SIGKILL (and a short wait for that), so that no benchmark leaves a process behind.
Standard library only: cli/bench.py uses it and `schedctl --help` loads that."""

from __future__ import annotations

import signal
import subprocess

KILL_WAIT_SECONDS = 10.0


def reap(process: subprocess.Popen[bytes], grace_seconds: float) -> int | None:
    """Wait up to `grace_seconds` for `process` to exit, then kill it; its exit code, or
    None when it had to be killed."""
    try:
        return process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(KILL_WAIT_SECONDS)
        return None


def stop(process: subprocess.Popen[bytes], grace_seconds: float) -> int | None:
    """SIGTERM `process` if it still runs, then `reap` it."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return reap(process, grace_seconds)
