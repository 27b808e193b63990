"""Owns run containment: each run of a worker in a cgroup v2 of its own, killed whole.

The worker finds its own cgroup (the `0::` line of /proc/self/cgroup under the cgroup2
mount of /proc/self/mountinfo) and a subtree it owns there:

- delegated (a systemd unit with Delegate=yes, or any cgroup of its own that it may
  write): the worker moves itself into a leaf `supervisor` (cgroup v2 lets only a cgroup
  without processes hand controllers to its children) and the runs go beside it;
- in the root cgroup (no systemd, a container's root): a subtree `scheduled-d.PID` of its
  own, removed at exit (and a dead worker's, found empty, at the next start).

Each run gets `run-N` there before its command executes: the child enters it itself
(through a descriptor of its cgroup.procs that the worker opened, so a command run as
another user enters it too), so nothing it starts, `setsid` ones included, is outside.
A timeout, cancel or lost lease kills the whole cgroup (cgroup.kill; SIGKILL to every pid
of cgroup.procs where it is missing); once the run is over, what it left behind is killed
too and the cgroup removed; one that its run left empty, if the run had no limits, is kept
for the next such run instead (at most as many as ran at once; all removed at exit).
memory_max, cpu_weight and tasks_max go to memory.max, cpu.weight and pids.max where those
controllers can be enabled in the subtree (said once at start, and by check-config, where
not).

Where no cgroup can be had (no cgroup2 mount, not writable, or SCHEDULED_D_CONTAINMENT=
process-group), runs are contained by their process group only, as before; the worker
says so at start and check-config says so.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import logging
import os
import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from schedctl.domain.runpolicy import RunLimits

log = logging.getLogger(__name__)

MODE_ENV = "SCHEDULED_D_CONTAINMENT"  # "process-group": no cgroups (anything else: auto)
CONTROLLERS = ("memory", "cpu", "pids")  # what run limits need
_LIMIT_FILES = (("memory", "memory.max"), ("cpu", "cpu.weight"), ("pids", "pids.max"))


@dataclass
class Containment:
    """How this process contains its runs: `subtree` None is the process group only."""

    subtree: Path | None
    reason: str  # why the process group only, or where the cgroups are
    controllers: frozenset[str] = frozenset()  # enabled for the runs
    owned: bool = False  # a subtree of its own in the root cgroup, removed at exit
    _numbers: itertools.count[int] = field(default_factory=itertools.count)
    _lingering: list[Path] = field(default_factory=list)
    # empty run cgroups of runs without limits, their cgroup.procs and cgroup.events open:
    # the next such run takes one (a cgroup made and removed each run cost the worker a
    # tenth of its CPU); at most as many as runs were ever in flight at once
    _free: list[tuple[Path, int, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(c for c in CONTROLLERS if c not in self.controllers)

    def describe(self) -> str:
        """One line for the start-up log and check-config."""
        if self.subtree is None:
            return f"runs contained by process group only: {self.reason}"
        text = f"each run in a cgroup v2 of its own under {self.subtree}"
        if self.missing:
            text += (
                f"; no {', '.join(self.missing)} controller there: the job limits "
                f"{_limit_names(self.missing)} are accepted but not applied"
            )
        return text

    def new_run(self, limits: RunLimits | None = None) -> RunCgroup | None:
        """A cgroup for one run, its limits written, its cgroup.procs open for the child;
        None (the process group only) where there are none or this one cannot be made."""
        if self.subtree is None:
            return None
        self._sweep()
        reusable = limits is None or limits == RunLimits()
        if reusable:
            try:
                free = self._free.pop()  # (atomic: no lock needed)
            except IndexError:
                pass
            else:
                return RunCgroup(*free[:2], self, free[2])
        # plain strings on this path: it runs once a run, and pathlib's joins cost more
        # than the mkdir
        name = f"{self.subtree}/run-{next(self._numbers)}"
        path = Path(name)
        try:
            os.mkdir(name)
            if limits is not None:
                self._limit(path, limits)
            procs = os.open(f"{name}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cannot make the run's cgroup %s (%s): process group only", path, exc)
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        events: int | None = None
        if reusable:
            try:
                events = os.open(f"{name}/cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass  # then removed after its run, as one with limits
        return RunCgroup(path, procs, self, events)

    def _limit(self, path: Path, limits: RunLimits) -> None:
        values = {
            "memory.max": limits.memory_max,
            "cpu.weight": limits.cpu_weight,
            "pids.max": limits.tasks_max,
        }
        for controller, name in _LIMIT_FILES:
            value = values[name]
            if value is not None and controller in self.controllers:
                (path / name).write_text(str(value))

    def _sweep(self) -> None:
        """Remove the cgroups of runs over whose last processes were still dying."""
        if not self._lingering:
            return
        with self._lock:
            paths, self._lingering[:] = list(self._lingering), []
        for path in paths:
            _remove(path, self)

    def trim(self) -> None:
        """Remove the empty run cgroups kept for reuse."""
        while True:
            try:
                path, procs, events = self._free.pop()
            except IndexError:
                return
            os.close(procs)
            os.close(events)
            _remove(path, self)

    def close(self) -> None:
        """At exit: what is left of the runs is killed, their cgroups and an owned subtree
        removed."""
        if self.subtree is None:
            return
        self.trim()
        for path in list(self.subtree.glob("run-*")):
            _kill(path)
            _remove(path, None, wait=True)
        if self.owned:
            with contextlib.suppress(OSError):
                self.subtree.rmdir()


class RunCgroup:
    """One run's cgroup: the child enters it through `procs_fd` before it executes. With
    `events_fd` (a run without limits) it goes back to its Containment for the next run
    once its run is over and nothing is left in it."""

    def __init__(
        self, path: Path, procs_fd: int, owner: Containment, events_fd: int | None = None
    ) -> None:
        self.path = path
        self.procs_fd: int | None = procs_fd
        self._events_fd = events_fd
        self._owner = owner
        self._released = False

    def started(self) -> None:
        """The child has its own copy of the descriptor: the worker's is closed (kept, for
        the next run, in a cgroup for reuse)."""
        if self.procs_fd is not None and self._events_fd is None:
            os.close(self.procs_fd)
            self.procs_fd = None

    def _close(self) -> None:
        for fd in (self.procs_fd, self._events_fd):
            if fd is not None:
                os.close(fd)
        self.procs_fd = self._events_fd = None

    def pids(self) -> list[int]:
        return _pids(self.path)

    def populated(self) -> bool:
        try:
            return "populated 1" in (self.path / "cgroup.events").read_text()
        except OSError:
            return False

    def signal(self, sig: signal.Signals) -> None:
        """SIGKILL: the whole cgroup at once (cgroup.kill); other signals: each process."""
        if sig == signal.SIGKILL:
            _kill(self.path)
            return
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

    def release(self, *, kill: bool = True) -> None:
        """The run is over: anything it left running is killed (unless `kill` is false: a
        command that exited by itself keeps its background children, as under cron), the
        cgroup removed (at a later run's start where processes are still in it). Once only:
        a cgroup gone back for reuse is another run's."""
        if self._released:
            return
        self._released = True
        if self._events_fd is not None and self.procs_fd is not None:
            try:
                empty = b"populated 0" in os.pread(self._events_fd, 256, 0)
            except OSError:
                empty = False
            if empty:  # nothing of the run is left: the cgroup is reused as it is
                self._owner._free.append((self.path, self.procs_fd, self._events_fd))
                self.procs_fd = self._events_fd = None
                return
        self._close()
        # most runs leave nothing behind: the rmdir alone ends those (EBUSY otherwise,
        # then what is left is killed, or kept, and the cgroup removed later)
        try:
            os.rmdir(self.path)
            return
        except FileNotFoundError:
            return
        except OSError:
            pass
        if kill:
            _kill(self.path)
        _remove(self.path, self._owner)


def _limit_names(controllers: Iterable[str]) -> str:
    names = {"memory": "memory_max", "cpu": "cpu_weight", "pids": "tasks_max"}
    return ", ".join(names[c] for c in controllers)


def _pids(path: Path) -> list[int]:
    try:
        return [int(line) for line in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill(path: Path) -> None:
    try:
        (path / "cgroup.kill").write_text("1")
        return
    except FileNotFoundError:
        pass  # before Linux 5.14: each process, a few rounds for those forked meanwhile
    except OSError:
        return  # the cgroup is gone
    for _ in range(10):
        pids = _pids(path)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _remove(path: Path, owner: Containment | None, *, wait: bool = False) -> None:
    # a killed process leaves its cgroup a moment later: EBUSY until then
    for _ in range(200 if wait else 1):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.warning("cannot remove the run's cgroup %s: %s", path, exc)
                return
        if wait:
            threading.Event().wait(0.01)
    if owner is not None:
        with owner._lock:
            owner._lingering.append(path)


# -- finding and setting up the subtree ------------------------------------------------------


def find_v2_mount(mountinfo: str) -> Path | None:
    """The cgroup2 mount point of a /proc/self/mountinfo text (whose root is the
    hierarchy's), or None."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if after and after[0] == "cgroup2" and fields[3] == "/":
            return Path(fields[4].replace("\\040", " "))
    return None


def own_path(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path (the `0::` line), or None."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def probe(mountinfo: str, proc_cgroup: str) -> tuple[Path | None, Path | None, str]:
    """(mount, own cgroup directory, why not) from the two /proc texts, changing nothing."""
    if os.environ.get(MODE_ENV, "") == "process-group":
        return None, None, f"turned off ({MODE_ENV}=process-group)"
    mount = find_v2_mount(mountinfo)
    if mount is None:
        return None, None, "no cgroup v2 hierarchy is mounted"
    path = own_path(proc_cgroup)
    if path is None or path.endswith(" (deleted)"):
        return mount, None, "this process has no cgroup v2 (no 0:: line in /proc/self/cgroup)"
    own = mount / path.lstrip("/")
    if not own.is_dir():
        return mount, None, f"its cgroup {own} is not visible here (another cgroup namespace?)"
    if not os.access(own, os.W_OK) or not os.access(own / "cgroup.procs", os.W_OK):
        return mount, None, f"its cgroup {own} is not writable (systemd: Delegate=yes)"
    return mount, own, ""


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _available(directory: Path) -> frozenset[str]:
    try:
        return frozenset((directory / "cgroup.controllers").read_text().split())
    except OSError:
        return frozenset()


def describe_probe() -> str:
    """What a worker started now would do (check-config): nothing is created or moved."""
    mount, own, why = probe(_read("/proc/self/mountinfo"), _read("/proc/self/cgroup"))
    if own is None or mount is None:
        return f"runs contained by process group only: {why}"
    # in the root cgroup, the subtree gets what the root hands its children
    root = own == mount
    offered = _subtree_control(own) if root else _available(own)
    missing = [c for c in CONTROLLERS if c not in offered]
    text = f"each run in a cgroup v2 of its own under {own}"
    if missing:
        text += f"; no {', '.join(missing)} controller: {_limit_names(missing)} not applied"
    return text


def _subtree_control(directory: Path) -> frozenset[str]:
    try:
        return frozenset((directory / "cgroup.subtree_control").read_text().split())
    except OSError:
        return frozenset()


def set_up() -> Containment:
    """Find or make this process's subtree (see the module's docstring); never raises."""
    mount, own, why = probe(_read("/proc/self/mountinfo"), _read("/proc/self/cgroup"))
    if own is None or mount is None:
        return Containment(None, why)
    try:
        if own == mount:
            _sweep_dead(own)
            subtree, owned = own / f"scheduled-d.{os.getpid()}", True
            subtree.mkdir(exist_ok=True)
        else:
            subtree, owned = own, False
            leaf = own / "supervisor"
            leaf.mkdir(exist_ok=True)
            # every process of the unit (the worker, anything ExecStartPre left) into the
            # leaf: the no-internal-processes rule
            for pid in _pids(own):
                with contextlib.suppress(ProcessLookupError):
                    (leaf / "cgroup.procs").write_text(str(pid))
        for stale in subtree.glob("run-*"):  # a crashed worker's runs
            _kill(stale)
            _remove(stale, None, wait=True)
    except OSError as exc:
        return Containment(None, f"cannot make a cgroup subtree under {own}: {exc}")
    enabled = set()
    available = _available(subtree)
    for controller in CONTROLLERS:
        if controller in available:
            try:
                (subtree / "cgroup.subtree_control").write_text(f"+{controller}")
                enabled.add(controller)
            except OSError:
                pass
    return Containment(subtree, "", frozenset(enabled), owned)


def _sweep_dead(root: Path) -> None:
    """The subtrees of dead workers (scheduled-d.PID with no such process): what is left
    in them is killed and they are removed."""
    for subtree in root.glob("scheduled-d.*"):
        pid = subtree.name.rpartition(".")[2]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        for stale in subtree.glob("run-*"):
            _kill(stale)
            _remove(stale, None, wait=True)
        with contextlib.suppress(OSError):
            subtree.rmdir()


_containment: Containment | None = None
_setup_lock = threading.Lock()


def containment() -> Containment:
    """This process's containment, set up (and logged) by its first worker."""
    global _containment
    with _setup_lock:
        if _containment is None:
            _containment = set_up()
            level = logging.WARNING if _containment.subtree is None else logging.INFO
            log.log(level, "%s", _containment.describe())
            if _containment.subtree is not None and _containment.missing:
                log.warning("run limits: %s", _containment.describe())
            atexit.register(_containment.close)
        return _containment
