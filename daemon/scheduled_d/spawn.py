"""Owns starting a worker's command and watching it end: `spawn` starts it in a session and
process group of its own with its stdin, stdout and stderr on non-blocking pipes, and
returns a `Child`, whose exit shows as its `exit_fd` (a pidfd) becoming readable, so that
one selector watches the pipes and the exits of every command a worker runs.

subprocess.Popen starts it (vfork, close_fds, the signals Python ignores restored): it lets
go of the interpreter lock while the child starts, so several threads can start commands
at once (os.posix_spawn, cheaper per call, holds the lock until the child has exec'd: on
a busy machine that serialized every start behind the slowest). The pipes are made here
and handed to Popen as plain descriptors: Popen then makes no pipes and wraps nothing in
file objects, much of its cost per start.

With a run cgroup (cgroups.py), the command is started by /bin/sh, which first enters the
cgroup by writing to a descriptor of its cgroup.procs the worker opened (the kernel checks
the opener's rights: a command run as another user enters it too) and then executes the
command: nothing the command does happens outside its cgroup. (A pre-exec hook in Python
would make Popen fork the whole worker instead of vfork, which is far slower.)

That shell is one more exec a run, and each exec of a dynamic program costs a lot of CPU
on a virtual machine (its loader's CPU feature probes trap to the hypervisor): the start
rate of a worker halved. So where the native helper is built (native/vspawn.c, by the
Makefile into native/_vspawn.so; loaded with ctypes, which lets go of the interpreter lock
for the call), every command is started by it instead: vfork, then in the child what
Popen's child does (the signals back to their defaults and an empty mask, the pipes as 0,
1 and 2, the working directory, a new session, the groups, group and user by raw system
calls, every other descriptor closed) with the cgroup entered first, then execve; a
failure comes back as an errno, raised as Popen raises it. Where it is missing (no
compiler at build time, a pure wheel) or turned off (SCHEDULED_D_SPAWN=sh), Popen and the
shell start them as above; `describe` says which (start-up log, check-config).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduled_d.cgroups import RunCgroup

# The child shell enters the cgroup through descriptor N (dash takes one digit only, so N is
# one of a few low descriptors held for it: _slots) and closes it before the command runs
_ENTER = (
    "echo 0 >&{fd} 2>/dev/null || echo \"scheduled-d: cannot enter the run's cgroup;"
    ' contained by its process group only" >&2; exec {fd}>&-; exec "$@"'
)
BASH = "/bin/bash"
_slots: SimpleQueue[int] | None = None
_slot_total = 0
_slots_lock = threading.Lock()


def _low_slots() -> SimpleQueue[int]:
    """Descriptors 3-9 held open on /dev/null (those free when first asked): where a run's
    cgroup.procs descriptor is put for the shell while the child starts."""
    global _slots, _slot_total
    with _slots_lock:
        if _slots is None:
            _slots = SimpleQueue()
            for _ in range(7):
                fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                if fd > 9:
                    os.close(fd)
                    break
                _slots.put(fd)
                _slot_total += 1
        return _slots


class Process(Protocol):
    """What Child needs of a started process: a Popen, or `Started` (the native helper's)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


class Child:
    """A started command: its pid (also its process group's id), the worker's ends of its
    pipes (non-blocking; stdin None once closed) and `exit_fd`, readable once it has exited
    (None where pidfds are missing: then `reap` is polled)."""

    def __init__(
        self,
        process: Process,
        stdin: int,
        stdout: int,
        stderr: int,
        cgroup: RunCgroup | None = None,
    ) -> None:
        self.pid = process.pid
        self.cgroup = cgroup
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
        if self.cgroup is not None:
            # every process of the run, those that left its group (setsid) included
            self.cgroup.signal(sig)
        try:
            # its own session made the command a group leader: its pid is the group id,
            # and the kernel does not hand that number out again while any member lives
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already (or beyond the worker's reach)

    def release(self, *, kill: bool = True) -> None:
        """After the command's end: what the run left running in its cgroup is killed
        (unless `kill` is false) and the cgroup removed once empty."""
        if self.cgroup is not None:
            self.cgroup.release(kill=kill)

    def group_alive(self) -> bool:
        """Whether anything of the command's process group (or cgroup) is left (zombies
        included)."""
        if self.cgroup is not None and self.cgroup.populated():
            return True
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
    cgroup: RunCgroup | None = None,
) -> Child:
    """Start `argv` with exactly `env`, in a new session (and `cgroup`, when given), with
    non-blocking pipes for its stdin, stdout and stderr; OSError if it cannot be started
    (e.g. no such program)."""
    helper = native
    if helper is not None:
        return _start_native(helper, argv, env, user, group, extra_groups, workdir, cgroup)
    if cgroup is not None and cgroup.procs_fd is not None:
        # the same refusal as Popen's own for a program that is not there
        _check_program(argv[0], env)
        slots = _low_slots()
        if not _slot_total:
            # no descriptor 3-9 was free at the start: bash takes any number (slower to
            # start than dash, so only here)
            if os.access(BASH, os.X_OK):
                enter = ["-c", _ENTER.format(fd=cgroup.procs_fd), "scheduled-d-run", *argv]
                return _spawn([BASH, *enter], env, user, group, extra_groups, workdir,
                              cgroup, (cgroup.procs_fd,))  # fmt: skip
            # moved just after it starts (what it forks in that first moment stays in its
            # process group, which is signalled too)
            child = _spawn(argv, env, user, group, extra_groups, workdir, cgroup, ())
            with contextlib.suppress(OSError):
                os.write(cgroup.procs_fd, str(child.pid).encode())
            cgroup.started()
            return child
        try:
            # as many commands start into cgroups at once as there are slots
            slot = slots.get(timeout=10.0)
        except Empty:
            raise OSError(
                errno.EAGAIN, "no descriptor free to start the run in its cgroup"
            ) from None
        try:
            os.dup2(cgroup.procs_fd, slot, inheritable=False)
            return _spawn(["/bin/sh", "-c", _ENTER.format(fd=slot), "scheduled-d-run", *argv],
                          env, user, group, extra_groups, workdir, cgroup, (slot,))  # fmt: skip
        finally:
            # the slot holds /dev/null again: the cgroup's file is not kept open
            null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            os.dup2(null, slot, inheritable=False)
            os.close(null)
            slots.put(slot)
    return _spawn(argv, env, user, group, extra_groups, workdir, None, ())


def _spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    user: int | None,
    group: int | None,
    extra_groups: Sequence[int] | None,
    workdir: str | None,
    cgroup: RunCgroup | None,
    pass_fds: tuple[int, ...],
) -> Child:
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
            pass_fds=pass_fds,
        )
    except BaseException:
        for fd in (stdin_w, stdout_r, stderr_r):
            os.close(fd)
        raise
    finally:
        for fd in (stdin_r, stdout_w, stderr_w):  # the child's ends: the child has its own
            os.close(fd)
    if cgroup is not None and pass_fds:
        cgroup.started()
    return Child(process, stdin_w, stdout_r, stderr_r, cgroup)


# held from the import on, while descriptors 3-9 are still free (the daemon imports this
# before it opens its log files, sockets and database connections)
_low_slots()


def _check_program(program: str, env: Mapping[str, str]) -> None:
    if "/" in program:
        found: str | None = program if os.path.isfile(program) else None
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if not os.access(found, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)


# -- the native helper ------------------------------------------------------------------------

SPAWN_ENV = "SCHEDULED_D_SPAWN"  # "sh": Popen and the /bin/sh trampoline even where it is built
HELPER = Path(__file__).parent / "native" / "_vspawn.so"
_ABI = 1  # vspawn_abi() of the helper this module speaks to (native/vspawn.c: VSPAWN_ABI)
_STAGE_EXEC, _STAGE_SETUP = 0, 1  # where the child failed (else: in the worker itself)
_NGROUPS_MAX = 65536  # Linux's, as Popen checks it


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The helper with its signatures set, or None and why."""
    if os.environ.get(SPAWN_ENV, "") == "sh":
        return None, f"turned off ({SPAWN_ENV}=sh)"
    if not HELPER.is_file():
        return None, f"{HELPER} is not built (make deps, make install: needs a C compiler)"
    try:
        library = ctypes.CDLL(str(HELPER))
        if library.vspawn_abi() != _ABI:
            return None, f"{HELPER} was built from another version of native/vspawn.c"
    except (OSError, AttributeError) as exc:
        return None, f"cannot load {HELPER}: {exc}"
    strings = ctypes.POINTER(ctypes.c_char_p)
    c_int = ctypes.c_int
    library.vspawn_start.argtypes = [
        strings, strings, strings, ctypes.c_char_p,  # exec_list, argv, envp, cwd
        c_int, c_int, c_int, c_int,  # stdin, stdout, stderr, the cgroup.procs descriptor
        c_int, c_int, ctypes.POINTER(ctypes.c_uint),  # set_groups, ngroups, groups
        ctypes.c_long, ctypes.c_long,  # gid, uid (-1: the worker's)
        ctypes.POINTER(c_int), ctypes.POINTER(c_int),  # err_stage, err_errno
    ]  # fmt: skip
    library.vspawn_start.restype = c_int
    return library, ""


# the helper every spawn uses (None: Popen and the shell); tests set it to None for the fallback
native, native_reason = _load()


def describe() -> str:
    """One line for the start-up log and check-config: how commands are started."""
    if native is not None:
        return f"commands started by the native helper {HELPER} (vfork, cgroup, exec)"
    return (
        f"commands started by subprocess, a run cgroup entered through /bin/sh (one more exec "
        f"a run: about half the start rate): {native_reason}"
    )


class Started:
    """A command the native helper started, reaped as Popen reaps its children."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reaped(self, options: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, options)
        except ChildProcessError:
            self.returncode = 0  # reaped elsewhere: Popen says 0 too
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None:
                    self._reaped(os.WNOHANG)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self) -> int:
        with self._lock:
            while self.returncode is None:
                self._reaped(0)
        return self.returncode


def _strings(items: Sequence[bytes]) -> ctypes.Array[ctypes.c_char_p]:
    for item in items:
        if b"\0" in item:
            raise ValueError("embedded null byte")  # Popen's words
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def _start_native(
    helper: ctypes.CDLL,
    argv: Sequence[str],
    env: Mapping[str, str],
    user: int | None,
    group: int | None,
    extra_groups: Sequence[int] | None,
    workdir: str | None,
    cgroup: RunCgroup | None,
) -> Child:
    # prepared (and refused) as Popen prepares it: the environment exactly, the program
    # searched for in the PATH of that environment
    env_list = []
    for key, value in env.items():
        name = os.fsencode(key)
        if b"=" in name:
            raise ValueError("illegal environment variable name")
        env_list.append(name + b"=" + os.fsencode(value))
    args = [os.fsencode(arg) for arg in argv]
    program = args[0]
    if os.path.dirname(program):
        exec_list = [program]
    else:
        exec_list = [os.path.join(os.fsencode(d), program) for d in os.get_exec_path(env)]
    for what, number in (
        ("User", user),
        ("Group", group),
        *(("Group", g) for g in extra_groups or ()),
    ):
        if number is not None and number < 0:
            raise ValueError(f"{what} ID cannot be negative, got {number}")
    groups = list(extra_groups or ())
    if len(groups) > _NGROUPS_MAX:
        raise ValueError("too many groups")
    c_groups = (ctypes.c_uint * max(len(groups), 1))(*groups)
    cwd = os.fsencode(workdir) if workdir is not None else None
    if cwd is not None and b"\0" in cwd:
        raise ValueError("embedded null byte")
    exec_array, argv_array, env_array = _strings(exec_list), _strings(args), _strings(env_list)
    procs = cgroup.procs_fd if cgroup is not None and cgroup.procs_fd is not None else -1
    stage, code = ctypes.c_int(), ctypes.c_int()
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    try:
        pid = helper.vspawn_start(
            exec_array, argv_array, env_array, cwd, stdin_r, stdout_w, stderr_w, procs,
            int(extra_groups is not None), len(groups), c_groups,
            -1 if group is None else group, -1 if user is None else user,
            ctypes.byref(stage), ctypes.byref(code),
        )  # fmt: skip
    except BaseException:
        for fd in (stdin_w, stdout_r, stderr_r):
            os.close(fd)
        raise
    finally:
        for fd in (stdin_r, stdout_w, stderr_w):
            os.close(fd)
    if pid < 0:
        for fd in (stdin_w, stdout_r, stderr_r):
            os.close(fd)
        number = code.value or errno.EIO
        if stage.value == _STAGE_EXEC:  # the program named, as Popen does
            raise OSError(number, os.strerror(number), argv[0])
        if stage.value == _STAGE_SETUP:  # before exec: Popen names the working directory
            raise OSError(number, os.strerror(number), workdir)
        raise OSError(number, os.strerror(number))
    if cgroup is not None:
        cgroup.started()
    return Child(Started(pid), stdin_w, stdout_r, stderr_r, cgroup)
