"""Owns what a host's worker trusts of its job files: the permission rule (cron's), the set of
files currently loaded (rescanned on demand), the resolution of a run's reference
{job_file, job} to a Job of those files, and the account a job runs as.

A run's payload only *names* a job: the command, user, environment and working directory
always come from this host's own files, so whoever can create jobs centrally cannot make
the host run anything its files do not define.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedctl import errors
from schedctl.jobfiles.load import MAX_FILES, load_file
from schedctl.jobfiles.model import Job, JobFile, JobFilesError, Problem
from schedctl.jobfiles.placement import queue_for, runs_here

log = logging.getLogger(__name__)

# group- or other-writable: anyone in the group could make the worker run their command
UNSAFE_MODE = stat.S_IWGRP | stat.S_IWOTH


def _account_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _judged(path: str | Path) -> tuple[Path, list[Path], list[Path]]:
    """What permission_problem judges of `path`: the file after symlinks; the directories
    holding it and holding the entry itself (the two differ only for a symlink); and every
    directory above those, up to /."""
    real = Path(os.path.realpath(path))
    holder = Path(os.path.realpath(os.path.dirname(os.path.abspath(path))))
    near = list(dict.fromkeys((holder, real.parent)))
    above = list(dict.fromkeys(a for d in near for a in d.parents if a not in near))
    return real, near, above


def permission_problem(path: str | Path, uid: int | None = None) -> str | None:
    """Why the job file `path` must not be trusted, or None. As cron does: the file (after
    symlinks), the directory holding it and the directory holding `path` itself must be
    owned by root or by `uid` (default: this process's effective user) and writable by
    neither group nor others. As OpenSSH's StrictModes does: so must every directory above
    them, up to /, or a writable one may have the sticky bit (as /tmp does), which keeps
    others from renaming or removing what they do not own."""
    uid = os.geteuid() if uid is None else uid
    real, near, above = _judged(path)
    # near: in a directory anyone can write, anyone could put a job file, or a symlink to
    # any root-owned job file. Above: anyone who can write one could rename the jobs
    # directory away and put their own in its place
    judged = [*(("directory", d, False) for d in near), *(("directory", d, True) for d in above)]
    for what, target, sticky_will_do in (*judged, ("file", real, False)):
        try:
            info = os.stat(target)
        except OSError as exc:
            return f"{what} {target} cannot be read: {exc.strerror or exc}"
        if what == "file" and not stat.S_ISREG(info.st_mode):
            return f"{real} is not a regular file"
        if info.st_uid not in (0, uid):
            return (
                f"{what} {target} is owned by {_account_name(info.st_uid)}, not by root or "
                f"the worker's user ({_account_name(uid)})"
            )
        if info.st_mode & UNSAFE_MODE and not (sticky_will_do and info.st_mode & stat.S_ISVTX):
            return (
                f"{what} {target} is writable by group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}; chmod go-w)"
            )
    return None


def _signature(path: Path) -> tuple[object, ...] | None:
    """What changes when the file, its target, or a directory permission_problem judges is
    edited, replaced, re-owned or chmod-ed (None: gone)."""
    try:
        real, near, above = _judged(path)
        file = os.stat(real)
        directories = [os.stat(d) for d in (*near, *above)]
    except OSError:
        return None
    return (
        str(real),  # first: _entry matches a reference's real path against it
        *(file.st_ino, file.st_size, file.st_mtime_ns, file.st_ctime_ns),
        *(file.st_mode, file.st_uid),
        *((d.st_ino, d.st_mode, d.st_uid) for d in directories),
    )


def placement_problem(job: Job, host: str, groups: Iterable[str], queue: str) -> str | None:
    """Why a run of `job` taken from `queue` by the worker of `host` (member of `groups`)
    must not run it, or None. The run must come from the queue `schedctl apply` puts the
    job's runs on (placement.queue_for), on a host the job applies to: whoever can queue a
    run on one of this host's queues must not run any job of its files there. A @reboot job
    runs only at the worker's start, never from a queue."""
    groups = set(groups)
    if job.is_boot:
        return (
            "is a @reboot job: it runs only when this host's worker starts, never from a queued run"
        )
    if not runs_here(job, host, groups):
        member = ", ".join(sorted(groups)) or "none"
        return f"runs on {job.run_on}, not on this host ({host}, groups: {member})"
    proper = queue_for(job, host)
    if proper != queue:
        return f"runs from queue {proper!r}, not {queue!r}"
    return None


@dataclass(frozen=True)
class Changes:
    """What one scan found, by file path."""

    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    refused: tuple[Problem, ...] = ()  # files not loaded (permissions or invalid), and why

    @property
    def any(self) -> bool:
        return bool(self.added or self.changed or self.removed)


@dataclass
class _Entry:
    signature: tuple[object, ...] | None
    file: JobFile | None = None
    problems: tuple[Problem, ...] = ()


@dataclass
class HostFiles:
    """The job files of `directory` this host's worker trusts and has loaded. `scan()`
    (at start, on SIGHUP, periodically) reloads what changed; a file refused (permissions)
    or invalid is left out with its reasons logged, and the other files still load. A job
    resolved before a scan keeps its Job: runs in flight are not affected."""

    directory: Path
    uid: int = field(default_factory=os.geteuid)  # trusted as root is, as a file's owner
    _entries: dict[str, _Entry] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _missing_logged: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.directory = Path(os.path.abspath(self.directory))

    def _paths(self) -> list[Path]:
        try:
            names = sorted(os.listdir(self.directory))
        except OSError as exc:
            if not self._missing_logged:
                log.warning(
                    "job files: cannot read %s (%s); no jobs until it can be",
                    self.directory,
                    exc.strerror or exc,
                )
                self._missing_logged = True
            return []
        self._missing_logged = False
        paths = [self.directory / n for n in names if n.endswith(".toml") and n[0] != "."]
        if len(paths) > MAX_FILES:
            log.error("job files: %s holds more than %d files; only the first are read",
                      self.directory, MAX_FILES)  # fmt: skip
        return [p for p in paths[:MAX_FILES] if p.is_file()]

    def scan(self) -> Changes:
        """Reload the files that were added or changed, forget the removed ones."""
        added: list[str] = []
        changed: list[str] = []
        refused: list[Problem] = []
        seen: set[str] = set()
        for path in self._paths():
            key = str(path)
            seen.add(key)
            signature = _signature(path)
            with self._lock:
                old = self._entries.get(key)
            if old is not None and old.signature == signature:
                refused.extend(old.problems)
                continue
            entry = self._load(path, signature)
            refused.extend(entry.problems)
            with self._lock:
                self._entries[key] = entry
            (changed if old is not None else added).append(key)
        with self._lock:
            removed = sorted(k for k in self._entries if k not in seen)
            for key in removed:
                del self._entries[key]
        changes = Changes(tuple(added), tuple(changed), tuple(removed), tuple(refused))
        for key in removed:
            log.info("job files: %s removed; its jobs are no longer defined here", key)
        return changes

    def _load(self, path: Path, signature: tuple[object, ...] | None) -> _Entry:
        problem = permission_problem(path, self.uid)
        if problem is not None:
            log.error("job files: %s refused: %s", path, problem)
            return _Entry(signature, problems=(Problem(str(path), None, "file", problem),))
        try:
            loaded = load_file(path)
        except JobFilesError as exc:
            for each in exc.problems:
                log.error("job files: %s not loaded: %s", path, each)
            return _Entry(signature, problems=exc.problems)
        log.info(
            "job files: %s loaded (%s)",
            path,
            ", ".join(j.name for j in loaded.jobs) or "no jobs",
        )
        return _Entry(signature, file=loaded)

    def files(self) -> list[JobFile]:
        with self._lock:
            return [e.file for _, e in sorted(self._entries.items()) if e.file is not None]

    def jobs(self) -> list[Job]:
        return [job for file in self.files() for job in file.jobs]

    def _entry(self, key: str) -> _Entry | None:
        """The entry of the absolute, normalized path `key`: by that path, else by its real
        path (a reference written through a symlinked directory names the same file). Only
        a path with a loaded file's name is followed: a path from a run's payload is the
        tenant's, and following it could trigger an automount or hang on a dead mount."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry
            name = os.path.basename(key)
            candidates = [
                (e, e.signature[0])
                for path, e in self._entries.items()
                if e.signature
                and name in (os.path.basename(path), os.path.basename(str(e.signature[0])))
            ]
        if not candidates:
            return None
        real = os.path.realpath(key)  # outside the lock: it reads the filesystem
        return next((e for e, target in candidates if target == real), None)

    def resolve(self, payload: Any, *, host: str, groups: Iterable[str], queue: str) -> Job:
        """The Job a run's payload {job_file, job} names, from the files loaded now, for a
        run taken from `queue` by the worker of `host` (member of `groups`); else NotFound
        "job X of FILE is not defined on this host" (with why, when the file was refused),
        or naming why the job does not run from that queue (placement_problem). Nothing of
        the payload but those two names is used."""
        if (
            not isinstance(payload, dict)
            or not isinstance(payload.get("job_file"), str)
            or not isinstance(payload.get("job"), str)
        ):
            raise errors.NotFound(
                "the run's payload names no job file and job ({job_file, job}): this "
                "host's worker runs only jobs of its own job files",
                field="job",
            )
        job_file, name = payload["job_file"], payload["job"]
        entry = None
        # a NUL names no file nor job (and os.path raises ValueError on it): not found
        if job_file.startswith("/") and "\0" not in job_file and "\0" not in name:
            entry = self._entry(os.path.normpath(job_file))
        found = None
        if entry is not None and entry.file is not None:
            found = next((j for j in entry.file.jobs if j.name == name), None)
        if found is None:
            why = ""
            if entry is not None and entry.problems:
                why = f" (the file is not loaded: {entry.problems[0].message})"
            # repr: a newline in the tenant's names cannot forge a line of the daemon's log
            raise errors.NotFound(
                f"job {name!r} of {job_file!r} is not defined on this host{why}", field="job"
            )
        if not found.enabled:
            raise errors.NotFound(
                f"job {name!r} of {job_file!r} is disabled (enabled = false) on this host",
                field="job",
            )
        problem = placement_problem(found, host, groups, queue)
        if problem is not None:
            raise errors.NotFound(f"job {name!r} of {job_file!r} {problem}", field="job")
        return found

    def boot_jobs(self, host: str, groups: Iterable[str] = ()) -> list[Job]:
        """The enabled @reboot jobs this host runs at its worker's start: its own, its
        groups' and every-host ones (of its groups, when given)."""
        groups = set(groups)
        return [
            job
            for job in self.jobs()
            if job.is_boot and job.enabled and runs_here(job, host, groups)
        ]


def check_dir(directory: str | Path, uid: int | None = None) -> list[JobFile]:
    """`scheduled-d check-config`: every job file of `directory` as the worker would load
    it, validated together (names unique across files); the permission refusals and every
    validation problem raised at once as JobFilesError (FILE:LINE: key)."""
    from schedctl.jobfiles.load import load_dir

    root = Path(directory)
    problems: list[Problem] = []
    if root.is_dir():
        for path in sorted(root.glob("*.toml")):
            if not path.name.startswith(".") and path.is_file():
                reason = permission_problem(path, uid)
                if reason:
                    problems.append(Problem(str(path), None, "file", f"refused: {reason}"))
    try:
        files = load_dir(root)
    except JobFilesError as exc:
        problems.extend(exc.problems)
        files = []
    if problems:
        raise JobFilesError(problems)
    return files


@dataclass(frozen=True)
class Account:
    """Who a job's command runs as, when it is not the worker's own user."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # the supplementary groups (the user's, as cron's initgroups)
    home: str


def run_as(job: Job, *, euid: int | None = None, egid: int | None = None) -> Account | None:
    """The account of `job`'s user/group, or None when that is the worker's own (`euid`,
    `egid`: default this process's). Raises NotFound for an unknown user or group,
    ConfigError when the job needs another user and the worker does not run as root (only
    root can switch)."""
    if job.user is None and job.group is None:
        return None
    euid = os.geteuid() if euid is None else euid
    egid = os.getegid() if egid is None else egid
    try:
        entry = pwd.getpwnam(job.user) if job.user else pwd.getpwuid(euid)
    except KeyError:
        raise errors.NotFound(
            f"user {job.user!r} does not exist on this host", field="user"
        ) from None
    try:
        gid = grp.getgrnam(job.group).gr_gid if job.group else entry.pw_gid
    except KeyError:
        raise errors.NotFound(
            f"group {job.group!r} does not exist on this host", field="group"
        ) from None
    if entry.pw_uid == euid and (job.group is None or gid == egid):
        return None
    if euid != 0:
        wanted = " and ".join(
            f"{kind} {name!r}" for kind, name in (("user", job.user), ("group", job.group)) if name
        )
        raise errors.ConfigError(
            f"job {job.name!r} runs as {wanted}, but the worker runs as "
            f"{_account_name(euid)}, not root: only a worker running as root runs jobs as "
            "other users",
            field="user",
        )
    if job.user:
        groups = tuple(os.getgrouplist(entry.pw_name, gid))
    else:
        groups = (gid,)
    return Account(entry.pw_name, entry.pw_uid, gid, groups, entry.pw_dir)
