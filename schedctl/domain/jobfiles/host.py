"""Owns what a host's worker trusts of its job files: the permission rule (cron's, applied to
each file as it is opened once: schedctl.domain.jobfiles.opening), the set of files currently
loaded (rescanned on demand), the resolution of a run's reference
{job_file, job} to a FileJob of those files, and the account a job runs as.

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

from schedctl.core import errors
from schedctl.domain.jobfiles.load import MAX_FILES, load_dir, read_job_file
from schedctl.domain.jobfiles.model import FileJob, JobFile, JobFilesError, Problem
from schedctl.domain.jobfiles.opening import OpenDir, Refused, account_name, file_stamp, open_dir
from schedctl.domain.jobfiles.placement import queue_for, runs_here

log = logging.getLogger(__name__)

_account_name = account_name


def permission_problem(path: str | Path, uid: int | None = None) -> str | None:
    """Why the job file `path` must not be trusted, or None: as the worker judges it when
    it loads it (schedctl.domain.jobfiles.opening): the file is a regular file, not a symlink; it
    and every directory from / down to it are owned by root or by `uid` (default: this
    process's effective user) and writable by neither group nor others, except that a
    directory above the jobs directory may be writable with the sticky bit (as /tmp)."""
    path = os.path.abspath(path)
    try:
        opened = open_dir(os.path.dirname(path), uid)
    except OSError as exc:
        return f"directory {os.path.dirname(path)} cannot be read: {exc.strerror or exc}"
    with opened:
        try:
            opened.read(os.path.basename(path))
        except Refused as exc:
            return exc.reason
        except OSError as exc:
            return f"file {path} cannot be read: {exc.strerror or exc}"
    return None


def _signature(opened: OpenDir, name: str, info: os.stat_result) -> tuple[object, ...]:
    """What changes when the file (`info`: its lstat or fstat), or a directory walked to
    it, is edited, replaced, re-owned or chmod-ed."""
    # the real path first: _entry matches a reference's real path against it
    return (opened.path_of(name), *file_stamp(info), *opened.stamps)


def placement_problem(job: FileJob, host: str, groups: Iterable[str], queue: str) -> str | None:
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
class FileChanges:
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
    resolved before a scan keeps its FileJob: runs in flight are not affected."""

    directory: Path
    uid: int = field(default_factory=os.geteuid)  # trusted as root is, as a file's owner
    _entries: dict[str, _Entry] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _missing_logged: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.directory = Path(os.path.abspath(self.directory))

    def _open(self) -> OpenDir | None:
        try:
            opened = open_dir(self.directory, self.uid)
        except OSError as exc:
            if not self._missing_logged:
                log.warning(
                    "job files: cannot read %s (%s); no jobs until it can be",
                    self.directory,
                    exc.strerror or exc,
                )
                self._missing_logged = True
            return None
        self._missing_logged = False
        return opened

    def scan(self) -> FileChanges:
        """Reload the files that were added or changed, forget the removed ones. The
        directory is walked once (opening.open_dir) and each file is opened, judged and
        read through one descriptor: what is loaded is what was judged."""
        added: list[str] = []
        changed: list[str] = []
        refused: list[Problem] = []
        seen: set[str] = set()
        opened = self._open()
        try:
            names = opened.names() if opened is not None else []
        except OSError:
            names = []
        names = [n for n in names if n.endswith(".toml") and n[0] != "."]
        if len(names) > MAX_FILES:
            log.error("job files: %s holds more than %d files; only the first are read",
                      self.directory, MAX_FILES)  # fmt: skip
        try:
            for name in names[:MAX_FILES]:
                assert opened is not None
                try:
                    info = opened.lstat(name)
                except OSError:
                    continue  # gone since the listing
                if stat.S_ISDIR(info.st_mode):
                    continue
                key = str(self.directory / name)
                seen.add(key)
                signature = _signature(opened, name, info)
                with self._lock:
                    old = self._entries.get(key)
                if old is not None and old.signature == signature:
                    refused.extend(old.problems)
                    continue
                entry = self._load(opened, name, Path(key), signature)
                refused.extend(entry.problems)
                with self._lock:
                    self._entries[key] = entry
                (changed if old is not None else added).append(key)
        finally:
            if opened is not None:
                opened.close()
        with self._lock:
            removed = sorted(k for k in self._entries if k not in seen)
            for key in removed:
                del self._entries[key]
        changes = FileChanges(tuple(added), tuple(changed), tuple(removed), tuple(refused))
        for key in removed:
            log.info("job files: %s removed; its jobs are no longer defined here", key)
        return changes

    def _load(
        self, opened: OpenDir, name: str, path: Path, signature: tuple[object, ...]
    ) -> _Entry:
        try:
            read = read_job_file(opened, name, path)
        except JobFilesError as exc:
            for each in exc.problems:
                log.error("job files: %s not loaded: %s", path, each)
            return _Entry(signature, problems=exc.problems)
        if read is None:  # a directory since the lstat
            return _Entry(None)
        # the descriptor's own fstat: what was judged and read (a change since the lstat
        # makes the next scan read it again)
        info, loaded = read
        log.info(
            "job files: %s loaded (%s)",
            path,
            ", ".join(j.name for j in loaded.jobs) or "no jobs",
        )
        return _Entry(_signature(opened, name, info), file=loaded)

    def files(self) -> list[JobFile]:
        with self._lock:
            return [e.file for _, e in sorted(self._entries.items()) if e.file is not None]

    def jobs(self) -> list[FileJob]:
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

    def resolve(self, payload: Any, *, host: str, groups: Iterable[str], queue: str) -> FileJob:
        """The FileJob a run's payload {job_file, job} names, from the files loaded now, for a
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

    def boot_jobs(self, host: str, groups: Iterable[str] = ()) -> list[FileJob]:
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
    it (the same opening and judgement), validated together (names unique across files);
    the permission refusals and every validation problem raised at once as JobFilesError
    (FILE:LINE: key)."""
    return load_dir(directory, uid)


@dataclass(frozen=True)
class Account:
    """Who a job's command runs as, when it is not the worker's own user."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # the supplementary groups (the user's, as cron's initgroups)
    home: str


def run_as(job: FileJob, *, euid: int | None = None, egid: int | None = None) -> Account | None:
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
