"""Owns opening a job file once: the walk from / to its directory through directory
descriptors, the judgement of every directory on the way and of the opened file's own
fstat, and the content read from that same descriptor.

Checking a path and then reading it again by path lets whoever can change a directory on
the way swap what is read after the check (and what the worker loads runs as root). Here
nothing is looked up by path twice: each directory is opened relative to the one before it
(O_NOFOLLOW), judged by fstat of that descriptor, and the next one is opened from it, so a
directory renamed or replaced during the walk cannot redirect it; the file is opened from
the last directory's descriptor without following a link (O_NOFOLLOW; O_NONBLOCK so that a
FIFO cannot hang the worker) and judged and read through that descriptor.

The rule (cron's, and OpenSSH's StrictModes for the directories above): the file is a
regular file; the file and every directory on the path are owned by root or by the
worker's user and writable by neither group nor others; a directory above the jobs
directory may be writable if it is sticky (as /tmp is: others cannot rename or remove what
they do not own). A symlink among the directories is followed only from a directory
already judged, and only when root or the worker's user owns the link itself; the
directories it leads through are judged as well. A job file itself is never a link.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from dataclasses import dataclass, field
from types import TracebackType

# group- or other-writable: anyone in the group could make the worker run their command
UNSAFE_MODE = stat.S_IWGRP | stat.S_IWOTH
MAX_LINKS = 40  # as the kernel's own limit of links followed in one lookup
MAX_FILE_BYTES = 16 * 1024 * 1024  # a job file larger than this is refused, not read
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_READ_BYTES = 1 << 16


class Refused(Exception):
    """A job file that is not trusted; `reason` says why (the refusal's message)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def account_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def judge(
    info: os.stat_result, what: str, path: str, uid: int, *, sticky_will_do: bool
) -> str | None:
    """Why `info` (the fstat of `what` at `path`) must not be trusted, or None."""
    if info.st_uid not in (0, uid):
        return (
            f"{what} {path} is owned by {account_name(info.st_uid)}, not by root or "
            f"the worker's user ({account_name(uid)})"
        )
    if info.st_mode & UNSAFE_MODE and not (sticky_will_do and info.st_mode & stat.S_ISVTX):
        return (
            f"{what} {path} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):04o}; chmod go-w)"
        )
    return None


def _dir_stamp(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_mode, info.st_uid)


def file_stamp(info: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is edited, replaced, re-owned or chmod-ed."""
    return (
        info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns,
        info.st_mode, info.st_uid,
    )  # fmt: skip


@dataclass
class OpenDir:
    """A directory opened by `open_dir`: its descriptor, the path the walk took (symlinks
    resolved), what each directory walked was (for a rescan to notice a change) and the
    first reason one of them is not trusted (None: all are)."""

    fd: int
    path: str
    stamps: tuple[tuple[int, int, int, int], ...]
    problem: str | None
    uid: int
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> OpenDir:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def names(self) -> list[str]:
        """The entries of the directory, read through its descriptor, sorted."""
        return sorted(os.listdir(self.fd))

    def path_of(self, name: str) -> str:
        return os.path.join(self.path, name)

    def lstat(self, name: str) -> os.stat_result:
        """The entry `name` itself (a link is not followed). OSError when it is gone."""
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def read(self, name: str, limit: int = MAX_FILE_BYTES) -> tuple[os.stat_result, bytes]:
        """The fstat and the content of the job file `name` of this directory, opened once
        and judged by that descriptor. Raises Refused with the reason it is not trusted, or
        OSError when it cannot be read."""
        path = self.path_of(name)
        if self.problem is not None:
            raise Refused(self.problem)
        if stat.S_ISLNK(self.lstat(name).st_mode):
            raise Refused(_link_reason(path))
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # replaced by a link since the lstat
                raise Refused(_link_reason(path)) from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise Refused(f"{path} is not a regular file")
            problem = judge(info, "file", path, self.uid, sticky_will_do=False)
            if problem is not None:
                raise Refused(problem)
            if info.st_size > limit:
                raise Refused(f"file {path} is larger than {limit} bytes")
            chunks: list[bytes] = []
            size = 0
            while size <= limit:  # bounded: a file growing while read stops at the limit
                chunk = os.read(fd, _READ_BYTES)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > limit:
                raise Refused(f"file {path} is larger than {limit} bytes")
            return info, b"".join(chunks)
        finally:
            os.close(fd)


def _link_reason(path: str) -> str:
    return (
        f"{path} is a symbolic link: job files are opened without following links (put the "
        "file itself in the directory)"
    )


def open_dir(directory: str | os.PathLike[str], uid: int | None = None) -> OpenDir:
    """The directory `directory`, walked from / one directory descriptor at a time, every
    directory judged (see the module's rule; the last one without the sticky excuse). A
    problem is kept in OpenDir.problem (the names can still be listed, and each file is
    refused with it); OSError when the path cannot be walked (missing, not a directory,
    too many links)."""
    uid = os.geteuid() if uid is None else uid
    todo = [p for p in reversed(os.path.abspath(os.fspath(directory)).split("/")) if p]
    stack: list[tuple[int, str]] = []
    stamps: list[tuple[int, int, int, int]] = []
    problems: list[str] = []
    links = 0

    def enter(fd: int, name: str) -> None:
        stack.append((fd, name))
        info = os.fstat(fd)
        stamps.append(_dir_stamp(info))
        problem = judge(info, "directory", _joined(stack), uid, sticky_will_do=True)
        if problem is not None:
            problems.append(problem)

    try:
        enter(os.open("/", _DIR_FLAGS), "")
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            here = stack[-1][0]
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=here)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                link = os.stat(name, dir_fd=here, follow_symlinks=False)
                if not stat.S_ISLNK(link.st_mode):
                    raise
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(directory)) from None
                where = os.path.join(_joined(stack), name)
                # the link's directory is judged already; the link is as trusted as its
                # owner (a link's own mode means nothing)
                if link.st_uid not in (0, uid):
                    problems.append(
                        f"symbolic link {where} is owned by {account_name(link.st_uid)}, not "
                        f"by root or the worker's user ({account_name(uid)})"
                    )
                target = os.readlink(name, dir_fd=here)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                todo.extend(p for p in reversed(target.split("/")) if p)
                continue
            enter(fd, name)
        fd = stack[-1][0]
        info = os.fstat(fd)
        path = _joined(stack)
        # the jobs directory itself: sticky or not, anyone who can write it can add a file
        last = judge(info, "directory", path, uid, sticky_will_do=False)
        if last is not None and not problems:
            problems.append(last)
        stack.pop()  # the caller's to close from here on
        return OpenDir(fd, path, tuple(stamps), problems[0] if problems else None, uid)
    finally:
        for opened, _ in stack:
            os.close(opened)


def _joined(stack: list[tuple[int, str]]) -> str:
    return "/" + "/".join(name for _, name in stack if name)
