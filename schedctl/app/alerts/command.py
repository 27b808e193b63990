"""Owns the host-command alert channel (like systemd's OnFailure=): a worker of a queue
runs an alert command of its host once per alert of that queue's jobs, with the alert JSON
on stdin. The command comes from the host's own configuration (a [[worker]] table's
`alert_command`, or the host's job file defining the job), never from the alert. A job
file's alert command runs as the job's runs do: as its user and group (with the user's
groups), with its environment and working directory (an AlertCommand), never as the
worker's root when the job says `user = "nobody"`.

A command runs in a session and process group of its own, its stdout discarded and its
stderr in a temporary file of which only the end is read; when it exits or times out its
whole process group is killed: nothing it started outlives it, and a background child
holding its output open cannot hold up the worker."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from schedctl.core import errors
from schedctl.domain.alerts.model import COMMAND
from schedctl.storage.db.store import Store
from schedctl.storage.records import alerts as repo
from schedctl.storage.records.alerts import AlertRow

log = logging.getLogger("schedctl.alerts")

BATCH = 10  # alerts run per call
TIMEOUT_SECONDS = 60.0  # one alert command's deadline; then it is killed and retried
LEASE_SECONDS = TIMEOUT_SECONDS + 30.0
STDERR_TAIL_BYTES = 500  # of a failed command's stderr, kept in the alert's last error
REAP_SECONDS = 10.0  # the longest to wait for the killed command's leader to be reaped
POLL_EXIT_SECONDS = 0.01  # without pidfds (an old kernel): how often to look for the exit
_INHERITED = ("PATH", "LANG", "TZ", "HOME")


@dataclass(frozen=True)
class AlertCommand:
    """An alert command with the account it runs as (None: the worker's own), the variables
    over the inherited base and its working directory (None: the worker's)."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    user: int | None = None
    group: int | None = None
    extra_groups: Sequence[int] | None = None
    workdir: str | None = None


# the command of an alert on this host (an argv: run as the worker), or None when this host
# has none for it (a SchedError other than StoreUnavailable says why)
CommandFor = Callable[[AlertRow], Sequence[str] | AlertCommand | None]


def run_alert_commands(
    store: Store,
    *,
    tenant_id: str,
    queue: str,
    owner: str,
    command: Sequence[str] = (),
    command_for: CommandFor | None = None,
    timeout: float = TIMEOUT_SECONDS,
) -> int:
    """Run the alert command of each due command alert of (tenant, queue); returns how many
    were taken. Each alert's command is `command_for(alert)` when given, else (or when that
    is None) the fixed `command`; an alert this host has no command for, a non-zero exit,
    a timeout or a command that cannot start is retried later (with a backoff, and given up
    after alerts.MAX_ALERT_ATTEMPTS)."""
    if not command and command_for is None:
        return 0
    leased = repo.claim(
        store,
        (COMMAND,),
        f"{owner}:alerts",
        limit=BATCH,
        lease_seconds=max(LEASE_SECONDS, timeout + 30.0),
        destination=queue,
        tenant_id=tenant_id,
    )
    base = {name: os.environ[name] for name in _INHERITED if name in os.environ}
    for alert in leased:
        try:
            error = _run_one(alert, command, command_for, base, timeout)
        except errors.StoreUnavailable:
            raise  # the worker's outage handling; the lease runs out and it is due again
        except Exception as exc:  # this alert's attempt failed, not the others'
            log.exception("alerts: the command alert %d failed", alert.id)
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            name = alert.body.get("job_name") if isinstance(alert.body, dict) else None
            log.warning(
                "alerts: command alert of job %s failed: %s",
                repr(name) if isinstance(name, str) and name else alert.job_id,
                error,
            )
        repo.finish(store, f"{owner}:alerts", alert, error)
    return len(leased)


def _run_one(
    alert: AlertRow,
    command: Sequence[str],
    command_for: CommandFor | None,
    base: dict[str, str],
    timeout: float,
) -> str | None:
    """Run `alert`'s command: None when it succeeded, else why not."""
    found, error = _command(alert, command, command_for)
    if found is None:
        return error
    env = {**base, **found.env, "SCHED_ALERT": alert.kind, "SCHED_JOB_ID": alert.job_id}
    data = json.dumps(alert.body, sort_keys=True).encode()
    return run_command(
        found.argv,
        data,
        env,
        timeout,
        user=found.user,
        group=found.group,
        extra_groups=found.extra_groups,
        cwd=found.workdir,
    )


def _command(
    alert: AlertRow, command: Sequence[str], command_for: CommandFor | None
) -> tuple[AlertCommand | None, str | None]:
    """The command to run for `alert`, or (None, why there is none)."""
    found: Sequence[str] | AlertCommand | None = None
    if command_for is not None:
        try:
            found = command_for(alert)
        except errors.StoreUnavailable:
            raise  # the worker's outage handling; the lease runs out and it is due again
        except errors.SchedError as exc:
            return None, f"no alert command on this host: {exc}"
        except Exception as exc:  # a bug must not leave the alert leased or stop the worker
            log.exception("alerts: finding the command of job %s's alert failed", alert.job_id)
            return None, f"no alert command on this host: {type(exc).__name__}: {exc}"
    if isinstance(found, AlertCommand):
        if found.argv:
            return found, None
        found = None
    argv = list(found) if found else list(command)
    if not argv:
        return None, f"no alert command on this host for job {alert.job_id}"
    return AlertCommand(argv), None


def run_command(
    argv: Sequence[str],
    stdin: bytes,
    env: dict[str, str],
    timeout: float,
    *,
    user: int | None = None,
    group: int | None = None,
    extra_groups: Sequence[int] | None = None,
    cwd: str | None = None,
) -> str | None:
    """Run one alert command with `stdin` and exactly `env` (as `user`, `group` and
    `extra_groups` when given, in `cwd`): None when it exits 0, else the error (exit code
    and the end of its stderr, the timeout, or why it could not start)."""
    try:
        with tempfile.TemporaryFile() as given, tempfile.TemporaryFile() as stderr:
            given.write(stdin)
            given.seek(0)
            try:
                process = subprocess.Popen(
                    list(argv),
                    stdin=given,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    env=env,
                    user=user,
                    group=group,
                    extra_groups=extra_groups,
                    cwd=cwd,
                    # its own process group: killed whole, and the worker's signals do not
                    # reach it
                    start_new_session=True,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                return f"alert command could not start: {exc}"
            try:
                exited = _wait_exit(process.pid, timeout)
            finally:
                # timed out: the command and all it started; exited: whatever it left
                # running. Before reaping: the unreaped leader keeps the group's id its own
                _kill_group(process.pid)
                _reap(process)
            if not exited:
                return f"alert command timed out after {timeout:g} s"
            code = process.returncode
            if code is None:
                return "alert command does not die after SIGKILL"
            if code == 0:
                return None
            how = f"killed by signal {-code}" if code < 0 else f"exited with {code}"
            return f"alert command {how}: {_tail(stderr)}"
    except OSError as exc:  # no temporary file
        return f"alert command could not start: {exc}"


def _wait_exit(pid: int, timeout: float) -> bool:
    """Whether the child `pid` exits within `timeout` seconds; it is left unreaped."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            poller = select.poll()  # not select.select: a worker's descriptors pass 1024
            poller.register(pidfd, select.POLLIN)
            return bool(poller.poll(max(0, int(timeout * 1000))))
        finally:
            os.close(pidfd)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True  # reaped already
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_EXIT_SECONDS)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing of the group is left (or beyond reach)


def _reap(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(REAP_SECONDS)
    except subprocess.TimeoutExpired:  # stuck in the kernel: reaped later by Popen
        log.error("alerts: alert command %d does not die after SIGKILL", process.pid)


def _tail(stream: IO[bytes]) -> str:
    """The last STDERR_TAIL_BYTES of what the command wrote to `stream`."""
    size = stream.seek(0, os.SEEK_END)
    stream.seek(max(0, size - STDERR_TAIL_BYTES))
    return stream.read(STDERR_TAIL_BYTES).decode(errors="replace")
