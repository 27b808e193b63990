"""Owns starting a worker's command and watching it end: `spawn` starts it in a session and
process group of its own with its stdin, stdout and stderr on non-blocking pipes, and
returns a `Child`, whose exit shows as its `exit_fd` (a pidfd) becoming readable, so that
one selector watches the pipes and the exits of every command a worker runs.

subprocess.Popen starts it (vfork, close_fds, the signals Python ignores restored): it lets
go of the interpreter lock while the child starts, so several threads can start commands
at once (os.posix_spawn, cheaper per call, holds the lock until the child has exec'd: on
a busy machine that serialized every start behind the slowest). The pipes are made here
and handed to Popen as plain descriptors: Popen then makes no pipes and wraps nothing in
file objects, a third of its cost per start.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence


class Child:
    """A started command: its pid (also its process group's id), the worker's ends of its
    pipes (non-blocking; stdin None once closed) and `exit_fd`, readable once it has exited
    (None where pidfds are missing: then `reap` is polled)."""

    def __init__(
        self, process: subprocess.Popen[bytes], stdin: int, stdout: int, stderr: int
    ) -> None:
        self.pid = process.pid
        self._process = process
        self._fds = {stdin, stdout, stderr}  # the worker's ends, open until closed
        self.stdin: int | None = stdin
        self.stdout = stdout
        self.stderr = stderr
        for fd in self._fds:
            os.set_blocking(fd, False)
        self.exit_fd: int | None = None
        try:
            self.exit_fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            pass  # no pidfds here (old kernel): the caller polls reap()

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    def reap(self) -> int | None:
        """The exit code (negative: killed by that signal) if the command has exited, else
        None; never blocks."""
        code = self._process.poll()
        if code is not None:
            self.close_exit_fd()
        return code

    def wait(self) -> int:
        """Block until the command has exited; its exit code."""
        code = self._process.wait()
        self.close_exit_fd()
        return code

    def close(self, fd: int) -> None:
        """Close the worker's end of one of the command's pipes."""
        self._fds.remove(fd)
        os.close(fd)
        if fd == self.stdin:
            self.stdin = None

    def close_stdin(self) -> None:
        if self.stdin is not None:
            self.close(self.stdin)

    def close_exit_fd(self) -> None:
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal the command's whole process group, the leader's children included, even
        when the leader itself has exited (the group lives on as long as any member does)."""
        try:
            # its own session made the command a group leader: its pid is the group id,
            # and the kernel does not hand that number out again while any member lives
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already (or beyond the worker's reach)

    def group_alive(self) -> bool:
        """Whether anything of the command's process group is left (zombies included)."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # a member the worker cannot signal: still there
        return True


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    user: int | None = None,
    group: int | None = None,
    extra_groups: Sequence[int] | None = None,
    workdir: str | None = None,
) -> Child:
    """Start `argv` with exactly `env`, in a new session, with non-blocking pipes for its
    stdin, stdout and stderr; OSError if it cannot be started (e.g. no such program)."""
    # (the child's end, the worker's end) of each; close-on-exec, as every descriptor
    # Python makes: the child gets them as 0, 1 and 2 only (and close_fds closes the rest)
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    try:
        process = subprocess.Popen(
            argv,
            stdin=stdin_r,
            stdout=stdout_w,
            stderr=stderr_w,
            # its own process group: a timeout or lost lease kills the command and
            # everything it started, and the worker's own signals do not reach it
            start_new_session=True,
            env=env,
            cwd=workdir,
            user=user,
            group=group,
            extra_groups=extra_groups,
        )
    except BaseException:
        for fd in (stdin_w, stdout_r, stderr_r):
            os.close(fd)
        raise
    finally:
        for fd in (stdin_r, stdout_w, stderr_w):  # the child's ends: the child has its own
            os.close(fd)
    return Child(process, stdin_w, stdout_r, stderr_r)
