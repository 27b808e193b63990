"""The host worker: serves this host's queues (its own and its groups', see
schedctl.domain.jobfiles.placement) with commands resolved per run from the host's own job files
(schedctl.domain.jobfiles.host), follows those files (SIGHUP and a periodic rescan) and runs the
@reboot jobs once at each start.

A run's payload only names a job ({job_file, job}); the command, user, group, environment,
working directory, stdin, timeout and max_concurrency come from the file as loaded when the
run starts, whatever the central job says (the file wins on the host: a central job changed
through the API cannot give the host's command other input, more time or more copies at
once), so a run in flight keeps the command it started with while the files change under it.

It leases through the database (DirectBackend) or, the fleet's setup, through the REST API
with a host token (`scheduled-d worker --api URL`, run_api_host_worker): no database
URL on the host, and the token reaches only this host's queues and jobs.

A command alert of a job of these queues (`"command": true`, what `schedctl apply` makes of
a job's `alert_command`) runs that job's alert_command from the host's files, found through
the central job's payload as a run's command is; never anything the alert says. Over the
API the alerts are leased and finished through it too (run_api_alerts).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schedctl.core import errors
from schedctl.domain import jobspec
from schedctl.domain.config import HostConfig
from schedctl.domain.jobfiles.host import FileChanges, HostFiles, run_as
from schedctl.domain.jobfiles.model import FileJob
from schedctl.domain.jobfiles.placement import central_name, host_queues
from schedctl.domain.leasing import LeaseBackend
from schedctl.domain.leasing import LeasedRun as Lease
from scheduled_d import sdnotify
from scheduled_d.boot_runs import BootRuns, read_boot_id
from scheduled_d.direct_backend import DirectBackend
from scheduled_d.signals import add_reload_listener, stop_on_signals
from scheduled_d.supervise import run_inline
from scheduled_d.worker import INHERITED_VARIABLES, RunSpec, Worker

if TYPE_CHECKING:
    from schedctl.app.alerts.command import AlertCommand
    from schedctl.clients.queue_client import ApiLeaseBackend
    from schedctl.storage.db.store import Store
    from schedctl.storage.records.alerts import AlertRow

log = logging.getLogger(__name__)

# a boot job's output lines go to the daemon's log; longer lines are cut in pieces
BOOT_LINE_BYTES = 4096
BOOT_JOIN_SECONDS = 5.0
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def run_spec(job: FileJob, payload: Any) -> RunSpec:
    """What running `job` executes: its argv, its stdin text (else `payload` as JSON), its
    environment (over HOME, USER and LOGNAME of its user when it has one of its own), its
    account, working directory and timeout. Raises a SchedError when its user cannot be
    used."""
    account = run_as(job)
    env: dict[str, str] = {}
    if account is not None:
        env.update(HOME=account.home, USER=account.user, LOGNAME=account.user)
    env.update(job.env)
    stdin = job.stdin.encode() if job.stdin is not None else json.dumps(payload).encode()
    return RunSpec(
        argv=job.argv(),
        stdin=stdin,
        env=env,
        user=account.uid if account else None,
        group=account.gid if account else None,
        extra_groups=list(account.groups) if account else None,
        workdir=job.workdir,
        keep_output=job.output == "local",  # the daemon's log (the journal) only
        timeout_seconds=_timeout_seconds(job),
    )


def file_reference(job: FileJob) -> dict[str, str]:
    """A run's stdin when its file gives no stdin text: the job's reference as the file
    has it, never the central payload (which the API can change)."""
    return {"job_file": str(job.path), "job": job.name}


def _file_limits(job: FileJob) -> tuple[int, int]:
    """(timeout seconds, max_concurrency) as the file sets them, with the central defaults
    for what it leaves out (0: none; max_concurrency 1 unless asked)."""
    body: dict[str, Any] = {
        "schedule": {"every": 3600},
        "target": {"type": "queue", "name": "boot"},
    }
    body.update({k: job.limits[k] for k in ("timeout", "max_concurrency") if k in job.limits})
    spec = jobspec.parse_job_request(body, now=_EPOCH)
    return spec.timeout_seconds, spec.max_concurrency


def _timeout_seconds(job: FileJob) -> int:
    """The job's timeout as its file sets it (0: none)."""
    return _file_limits(job)[0]


# how often the worker compares its files with the central jobs (apply --check's drift),
# besides at its start: a full read of the tenant's jobs, so not at every rescan
DRIFT_SECONDS = 300.0


def _fqdn_domain() -> str | None:
    """The mail domain `schedctl apply` assumes for local mailboxes (its --mail-domain)."""
    fqdn = socket.getfqdn()
    return fqdn if "." in fqdn and not fqdn.startswith("localhost") else None


class _Tail:
    """The last `most` bytes (about) of a boot job's output lines."""

    def __init__(self, most: int) -> None:
        self.most = max(0, most)
        self.lines: collections.deque[str] = collections.deque()
        self.size = 0

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line) + 1
        while self.size > self.most and self.lines:
            self.size -= len(self.lines.popleft()) + 1

    def text(self) -> str | None:
        return "\n".join(self.lines) + "\n" if self.lines else None


class HostWorker:
    """One Worker per queue of the host (each up to `host.concurrency` commands), each
    resolving its runs through `resolver(queue)` from the files of `host.jobs_dir`.

    - store: the Store (or a LeaseBackend) to lease from, for the tenant `host.tenant`.
    - reload(): rescan the files now (SIGHUP does it, and a rescan every
      `host.rescan_seconds`).
    """

    def __init__(
        self,
        store: Store | LeaseBackend,
        host: HostConfig,
        *,
        lease_seconds: float = 30.0,
        heartbeat_seconds: float = 5.0,
        poll_seconds: float = 0.5,
    ) -> None:
        self.store = store
        self.host = host
        self.files = HostFiles(Path(host.jobs_dir))
        self.queues = host_queues(host.name, host.groups)
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.poll_seconds = poll_seconds
        self._backend: LeaseBackend | None = store if isinstance(store, LeaseBackend) else None
        self._rescan = threading.Event()
        self._scan_lock = threading.Lock()
        self._booted = False  # once per start of the process, not per supervised restart
        # and once per boot of the machine, across restarts of the worker (boot-runs.json)
        self._boot_runs: BootRuns | None = None
        self._drift_due = 0.0  # monotonic time of the next drift check
        self._boot_processes: set[subprocess.Popen[bytes]] = set()
        self._boot_lock = threading.Lock()
        # runs of each job definition (file, name, digest) running here now: the file's
        # max_concurrency (a run started before its file changed keeps its own count)
        self._running: dict[tuple[str, str, str], int] = {}
        self._running_lock = threading.Lock()

    # -- the files ---------------------------------------------------------------------------

    def reload(self, why: str = "rescan") -> FileChanges:
        with self._scan_lock:
            changes = self.files.scan()
        if changes.any or why != "rescan":
            log.info(
                "job files (%s): %d added, %d changed, %d removed, %d refused; %d job(s) loaded",
                why,
                len(changes.added),
                len(changes.changed),
                len(changes.removed),
                len({p.path for p in changes.refused}),
                len(self.files.jobs()),
            )
        return changes

    def request_reload(self) -> None:
        """SIGHUP: rescan now (in the rescan thread)."""
        self._rescan.set()

    def resolve(self, lease: Lease, queue: str) -> RunSpec:
        """The command of a run taken from `queue`, from this host's files: only a job that
        runs on this host from that queue (see HostFiles.resolve)."""
        job = self.files.resolve(
            lease.payload, host=self.host.name, groups=self.host.groups, queue=queue
        )
        log.info("run %s: job %r of %s", lease.idempotency_key, job.name, job.path)
        spec = run_spec(job, file_reference(job))
        return dataclasses.replace(spec, on_end=self._admit(job))

    def _admit(self, job: FileJob) -> Callable[[], None]:
        """Count a run of `job` as running here; Conflict (the attempt fails, nothing
        runs) when the file's max_concurrency of them already run on this host, whatever
        the central job allows. Returns what ends the count."""
        limit = _file_limits(job)[1]
        key = (str(job.path), job.name, job.digest())
        with self._running_lock:
            running = self._running.get(key, 0)
            if limit and running >= limit:
                raise errors.Conflict(
                    f"job {job.name!r} of {str(job.path)!r}: {running} run(s) already running "
                    f"on this host, and its file's max_concurrency is {limit}",
                    field="max_concurrency",
                )
            self._running[key] = running + 1
        done = threading.Event()

        def end() -> None:
            if done.is_set():
                return
            done.set()
            with self._running_lock:
                left = self._running.get(key, 1) - 1
                if left > 0:
                    self._running[key] = left
                else:
                    self._running.pop(key, None)

        return end

    def resolver(self, queue: str) -> Callable[[Lease], RunSpec]:
        """The `resolve` of the Worker serving `queue`: the lease does not say which queue it
        came from, and a job must run only from its own."""

        def resolve(lease: Lease) -> RunSpec:
            return self.resolve(lease, queue)

        return resolve

    def alert_command(self, alert: AlertRow, queue: str, store: Store) -> AlertCommand:
        """The `alert_command` of the job a command alert of `queue` is about, run as that
        job's runs are (its user, group, environment and working directory: run_spec): the
        central job's payload names it ({job_file, job}), and it must be a job of this
        host's files that runs on this host from that queue (as for a run: HostFiles.resolve).
        NotFound when there is no such job or it has no alert_command."""
        from schedctl.storage.jobs.jobs import JobRepo

        central = JobRepo(store).get(alert.job_id, alert.tenant_id)
        return self._alert_command_of(central.payload, queue, alert.kind, alert.job_id)

    def _alert_command_of(self, payload: Any, queue: str, kind: str, job_id: str) -> AlertCommand:
        """alert_command's AlertCommand, from the central job's payload (the database's or
        the API's): the same resolution and account whichever way the alert came."""
        from schedctl.app.alerts.command import AlertCommand

        job = self.files.resolve(payload, host=self.host.name, groups=self.host.groups, queue=queue)
        if not job.alerts.command:
            raise errors.NotFound(
                f"job {job.name!r} of {str(job.path)!r} has no alert_command on this host",
                field="alert_command",
            )
        log.info("alert %s of job %s: the alert_command of job %r of %s", kind, job_id,
                 job.name, job.path)  # fmt: skip
        spec = run_spec(job, None)
        return AlertCommand(
            argv=list(job.alerts.command),
            env=spec.env,
            user=spec.user,
            group=spec.group,
            extra_groups=spec.extra_groups,
            workdir=spec.workdir,
        )

    def alert_resolver(self, queue: str, store: Store) -> Callable[[AlertRow], AlertCommand]:
        """The `alert_command_for` of the Worker serving `queue`."""

        def command_for(alert: AlertRow) -> AlertCommand:
            return self.alert_command(alert, queue, store)

        return command_for

    def _follow(self, stop: threading.Event) -> None:
        self._drift_logged()
        while not stop.is_set():
            if self._rescan.wait(self.host.rescan_seconds):
                self._rescan.clear()
                if stop.is_set():
                    return
                self._reload_logged("SIGHUP")
            else:
                self._reload_logged("rescan")
            if time.monotonic() >= self._drift_due:
                self._drift_logged()

    # -- drift between the files and the central jobs ----------------------------------------

    def check_drift(self) -> list[str]:
        """What `schedctl apply --check` would report on this host ("changed NAME", ...; a
        refused file as "refused FILE: KEY: why"), reported centrally (`schedctl status`)
        and as the gauge scheduled_host_jobs_drift."""
        from schedctl.app import jobfiles_apply as applying
        from schedctl.domain.jobfiles import JobFilesError, load_dir
        from scheduled_d.metrics import HOST_DRIFT  # here: it loads the database layer

        backend = self._make_backend()
        drift: list[str]
        try:
            files = load_dir(self.host.jobs_dir)
            jobs, tenant = self._central_jobs(backend)
            plan = applying.plan(
                files, self.host.name, self.host.groups, applying.read_central(jobs, tenant),
                directory=self.host.jobs_dir, now=datetime.now(UTC),
                mail_domain=_fqdn_domain(),
            )  # fmt: skip
            drift = [
                f"{e.action.value} {e.name}" for e in plan.entries if e.action.value != "unchanged"
            ]
        except JobFilesError as exc:
            drift = [f"refused {p.path}: {p.key}: {p.message}" for p in exc.problems]
        if isinstance(backend, DirectBackend):
            from schedctl.storage.jobs import host_drift

            host_drift.report(backend.store, backend.tenant_id, self.host.name, drift)
        else:
            report = getattr(backend, "report_drift", None)
            if report is not None:
                report(drift)
        HOST_DRIFT.set(len(drift))
        return drift

    def _central_jobs(self, backend: LeaseBackend) -> tuple[Any, str]:
        """The jobs reader apply uses and the tenant: the database's, or the API's with the
        host token (which sees this host's own jobs)."""
        if isinstance(backend, DirectBackend):
            from schedctl.app.service import Scheduler

            return Scheduler(backend.store), backend.tenant_id
        client = backend.jobs_client()  # type: ignore[attr-defined]
        return client, str(client.whoami()["name"])

    def _drift_logged(self) -> None:
        from scheduled_d.metrics import HOST_DRIFT  # here: it loads the database layer

        self._drift_due = time.monotonic() + DRIFT_SECONDS
        try:
            drift = self.check_drift()
        except Exception as exc:  # advisory: a failed check never stops the worker
            HOST_DRIFT.set(-1)
            log.warning("job files: the drift check failed: %s", exc)
            return
        if drift:
            log.warning("job files differ from the central jobs (run `schedctl apply`): %s",
                        "; ".join(drift[:10]))  # fmt: skip

    def _reload_logged(self, why: str) -> None:
        try:
            self.reload(why)
        except Exception:  # a scan that fails keeps the files loaded so far
            log.exception("job files: the %s failed; the files loaded before stay", why)

    def api_alert_lane(self, backend: LeaseBackend, queue: str) -> Callable[[], int] | None:
        """The Worker's alert lane for `queue` over the API (None with the database, whose
        lane is the Worker's own)."""
        from schedctl.clients.queue_client import ApiLeaseBackend

        if not isinstance(backend, ApiLeaseBackend):
            return None

        def lane() -> int:
            return self.run_api_alerts(backend, queue)

        return lane

    def run_api_alerts(self, backend: ApiLeaseBackend, queue: str) -> int:
        """Lease the due command alerts of `queue` through the API and run, for each, the
        alert_command of its job in this host's files (found as for a database worker:
        the central job's {job_file, job} resolved among the jobs that run here from
        `queue`), with the alert JSON on stdin; then report how it went. Returns how many
        were taken."""
        from schedctl.app.alerts.command import TIMEOUT_SECONDS, run_command

        taken = backend.lease_alerts(queue)
        for alert in taken:
            error: str | None
            try:
                found = self._alert_command_of(
                    backend.job_payload(alert.job_id), queue, alert.kind, alert.job_id
                )
            except errors.StoreUnavailable:
                raise  # the lease runs out and the alert is due again
            except errors.SchedError as exc:
                error = f"no alert command on this host: {exc}"
            except Exception as exc:  # this alert's attempt fails, not the worker
                log.exception("alerts: finding the command of job %s's alert failed", alert.job_id)
                error = f"no alert command on this host: {type(exc).__name__}: {exc}"
            else:
                env = {n: os.environ[n] for n in ("PATH", "LANG", "TZ", "HOME") if n in os.environ}
                env.update(found.env)
                env.update(SCHED_ALERT=alert.kind, SCHED_JOB_ID=alert.job_id)
                data = json.dumps(alert.body, sort_keys=True).encode()
                # as the job's runs: its user, group, environment and working directory
                error = run_command(
                    found.argv,
                    data,
                    env,
                    TIMEOUT_SECONDS,
                    user=found.user,
                    group=found.group,
                    extra_groups=found.extra_groups,
                    cwd=found.workdir,
                )
            if error is not None:
                log.warning("alerts: command alert of job %s failed: %s", alert.job_id, error)
            backend.finish_alert(alert, error)
        return len(taken)

    # -- @reboot -----------------------------------------------------------------------------

    def run_boot_jobs(self) -> list[threading.Thread]:
        """Start this host's @reboot jobs, each in a thread of its own: once per boot of
        the machine (the kernel's boot id, recorded in [host] state_dir), so a restarted
        worker does not run them again; once per process where no boot id can be read."""
        if self._booted:
            return []
        self._booted = True
        jobs = self.files.boot_jobs(self.host.name, self.host.groups)
        if jobs and self._boot_runs is None:
            self._boot_runs = BootRuns(self.host.state_dir, read_boot_id(self.host.boot_id_file))
        threads = []
        for job in jobs:
            assert self._boot_runs is not None
            if not self._boot_runs.claim(job.name):
                log.info("boot job %r: already run in this boot (%s)", job.name,
                         self._boot_runs.boot_id)  # fmt: skip
                continue
            thread = threading.Thread(
                target=self._boot, args=(job,), name=f"boot-{job.name}", daemon=True
            )
            thread.start()
            threads.append(thread)
        return threads

    def _boot(self, job: FileJob) -> None:
        try:
            spec = run_spec(job, {"job_file": str(job.path), "job": job.name, "boot": True})
            timeout = _timeout_seconds(job)
        except errors.SchedError as exc:
            log.error("boot job %r of %s: not run: %s", job.name, job.path, exc)
            self._record_boot(job, 0.0, None, f"not run: {exc}", None)
            return
        env = {n: os.environ[n] for n in INHERITED_VARIABLES if n in os.environ}
        env.update(spec.env)
        log.info("boot job %r of %s: starting", job.name, job.path)
        began = time.monotonic()
        try:
            process = subprocess.Popen(
                spec.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=spec.workdir,
                user=spec.user,
                group=spec.group,
                extra_groups=spec.extra_groups,
            )
        except OSError as exc:
            log.error("boot job %r: cannot start the command: %s", job.name, exc)
            self._record_boot(job, 0.0, None, f"cannot start the command: {exc}", None)
            return
        with self._boot_lock:
            self._boot_processes.add(process)
        timer = None
        if timeout > 0:
            timer = threading.Timer(timeout, _kill_group, args=(process,))
            timer.daemon = True
            timer.start()
        tail = _Tail(self.host.output_bytes)
        try:
            self._boot_io(job, process, spec.stdin, tail)
            code = process.wait()
        finally:
            if timer is not None:
                timer.cancel()
            with self._boot_lock:
                self._boot_processes.discard(process)
        seconds = time.monotonic() - began
        how = None
        if code == 0:
            log.info("boot job %r: succeeded", job.name)
        else:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            log.warning("boot job %r: failed: %s", job.name, how)
        # output = "local": the tail stays in this host's log, as for any run
        output = tail.text() if job.output != "local" else None
        self._record_boot(job, seconds, code if code >= 0 else None, how, output)

    def _record_boot(
        self, job: FileJob, seconds: float, code: int | None, error: str | None, output: str | None
    ) -> None:
        """The boot run in the run history of the job's central job (NAME@HOST, made by
        `schedctl apply`): over the API with the host token, or in the database. Not
        recorded (and said so) when the job was never applied or the store is away."""
        name = central_name(job, self.host.name)
        try:
            backend = self._make_backend()
            if isinstance(backend, DirectBackend):
                from schedctl.storage.jobs import boot_runs

                boot_runs.record(
                    backend.store, backend.tenant_id, name, seconds=seconds, exit_code=code,
                    error=error, output=output, worker=f"host:{self.host.name}",
                    actor=f"host:{self.host.name}",
                )  # fmt: skip
            else:
                record = getattr(backend, "record_boot_run", None)
                if record is None:
                    return
                record(name, seconds=seconds, exit_code=code, error=error, output=output)
        except errors.NotFound:
            log.warning("boot job %r: not in the run history: no central job %r (run "
                        "`schedctl apply`)", job.name, name)  # fmt: skip
        except errors.SchedError as exc:
            log.warning("boot job %r: not in the run history: %s", job.name, exc)

    @staticmethod
    def _boot_io(job: FileJob, process: subprocess.Popen[bytes], stdin: bytes, tail: _Tail) -> None:
        assert process.stdin is not None and process.stdout is not None
        writer = threading.Thread(target=_feed, args=(process.stdin, stdin), daemon=True)
        writer.start()
        # bounded: each readline at most BOOT_LINE_BYTES; ends at EOF (the group's last
        # writer gone, or killed by the timeout)
        for _ in iter(int, 1):
            line = process.stdout.readline(BOOT_LINE_BYTES)
            if not line:
                break
            text = line.decode("utf-8", errors="replace").rstrip("\n")
            log.info("boot job %r: %s", job.name, text)
            tail.add(text)
        process.stdout.close()
        writer.join(BOOT_JOIN_SECONDS)

    def _kill_boot_jobs(self) -> None:
        with self._boot_lock:
            processes = list(self._boot_processes)
        for process in processes:
            _kill_group(process)

    # -- the loop ----------------------------------------------------------------------------

    def _make_backend(self) -> LeaseBackend:
        if self._backend is None:
            from schedctl.storage.db.store import Store

            assert isinstance(self.store, Store)
            self._backend = DirectBackend(self.store, self.host.tenant)
        return self._backend

    def run(
        self,
        stop: threading.Event,
        *,
        force: threading.Event | None = None,
        max_runs: int | None = None,
        idle_exit: bool = False,
    ) -> int:
        """Serve until `stop` (warm: runs in flight finish), or `force` (they are killed);
        returns the runs taken. max_runs and idle_exit apply to each queue's Worker. When one
        of them returns, the others finish what they run and return too; but with idle_exit,
        each returns when its own queue is idle (one queue's worker being idle first had
        stopped another's before it leased what was ready there)."""
        force = force if force is not None else threading.Event()
        backend = self._make_backend()
        self.reload("start")
        boot_threads = self.run_boot_jobs()
        inner_stop = threading.Event()
        remove_listener = add_reload_listener(self.request_reload)
        follower = threading.Thread(
            target=self._follow, args=(inner_stop,), name="job-files", daemon=True
        )
        follower.start()
        workers = [
            Worker(
                backend,
                queue,
                (),
                concurrency=self.host.concurrency,
                lease_seconds=self.lease_seconds,
                heartbeat_seconds=self.heartbeat_seconds,
                poll_seconds=self.poll_seconds,
                output_tail_bytes=self.host.output_bytes,
                resolve=self.resolver(queue),
                alert_command_for=(
                    self.alert_resolver(queue, backend.store)
                    if isinstance(backend, DirectBackend)
                    else None
                ),
                alert_lane=self.api_alert_lane(backend, queue),
            )
            for queue in self.queues
        ]
        log.info(
            "host worker %s: queues %s, job files %s",
            self.host.name,
            ", ".join(self.queues),
            self.host.jobs_dir,
        )
        taken = [0] * len(workers)
        failures: list[BaseException] = []

        def serve(index: int) -> None:
            try:
                taken[index] = workers[index].run(
                    worker_stop, max_runs=max_runs, idle_exit=idle_exit, force=force
                )
            except BaseException as exc:  # re-raised in the caller's thread below
                failures.append(exc)

        worker_stop = threading.Event()
        threads = [
            threading.Thread(target=serve, args=(i,), name=f"host-{q}", daemon=True)
            for i, q in enumerate(self.queues)
        ]
        for thread in threads:
            thread.start()
        try:
            while any(t.is_alive() for t in threads):
                ended = not all(t.is_alive() for t in threads)
                if stop.is_set() or failures or (ended and not idle_exit):
                    worker_stop.set()
                for thread in threads:
                    thread.join(0.25)
        finally:
            inner_stop.set()
            self._rescan.set()
            remove_listener()
            follower.join(BOOT_JOIN_SECONDS)
            if force.is_set():
                self._kill_boot_jobs()
            for thread in boot_threads:
                thread.join(0 if force.is_set() else BOOT_JOIN_SECONDS)
        if failures:
            raise failures[0]
        return sum(taken)


def _feed(stream: Any, data: bytes) -> None:
    try:
        if data:
            stream.write(data)
    except OSError:
        pass  # the command does not read stdin: that is its right
    finally:
        try:
            stream.close()
        except OSError:
            pass


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_host_worker(
    store: Store | LeaseBackend,
    host: HostConfig,
    *,
    lease_seconds: float = 30.0,
    max_runs: int | None = None,
) -> None:
    """`scheduled-d worker` with a [host] table or --jobs-dir: the host worker in this
    process until SIGTERM/SIGINT (a second one kills the commands in flight), leasing from
    the database (a Store) or through a LeaseBackend (run_api_host_worker's)."""
    with stop_on_signals() as (stop, force):
        host_worker = HostWorker(
            store, host, lease_seconds=lease_seconds, heartbeat_seconds=min(5.0, lease_seconds / 3)
        )
        sdnotify.announce(
            f"host worker {host.name}: {', '.join(host_worker.queues)}", lambda: True, stop
        )
        run_inline(
            f"host-worker-{host.name}",
            lambda: host_worker.run(stop, force=force, max_runs=max_runs),
            stop,
        )


def run_api_host_worker(
    api_url: str,
    token: str,
    host: HostConfig,
    *,
    lease_seconds: float = 30.0,
    max_runs: int | None = None,
) -> None:
    """`scheduled-d worker --api URL` with a [host] table or --jobs-dir: the host worker
    leasing through the REST API with the host's token; no database URL, no database code.
    The token must be this host's (check_token_host)."""
    from schedctl.clients.queue_client import ApiLeaseBackend

    queues = host_queues(host.name, host.groups)
    backend = ApiLeaseBackend(
        api_url,
        token,
        timeout=max(1.0, min(10.0, lease_seconds / 3)),
        connections=host.concurrency * len(queues),
    )
    try:
        check_token_host(backend.whoami(), host)
        run_host_worker(backend, host, lease_seconds=lease_seconds, max_runs=max_runs)
    finally:
        backend.close()


def check_token_host(whoami: dict[str, Any], host: HostConfig) -> None:
    """The API's word on the token (GET /v1/tenant) against this host's configuration: a
    host token of another host, or without one of this host's groups, is a ConfigError at
    the start (not a 403 per lease); a tenant token works and is warned about."""
    token_host = whoami.get("host")
    tenant = (whoami.get("name"), whoami.get("tenant_id"))
    if host.tenant is not None and host.tenant not in tenant:
        raise errors.ConfigError(
            f"the API token is of tenant {tenant[0]!r}, not of host.tenant {host.tenant!r}",
            field="tenant",
        )
    if token_host is None:
        log.warning(
            "host worker %s: the API token is a tenant token, which reaches every queue and "
            "job of the tenant; give this host a host token: schedctl tenant token create "
            "TENANT --host %s",
            host.name,
            host.name,
        )
        return
    if token_host != host.name:
        raise errors.ConfigError(
            f"the API token is the host token of host {token_host!r}, and this host is "
            f"{host.name!r}: make one with `schedctl tenant token create TENANT --host "
            f"{host.name}`",
            field="host",
        )
    missing = sorted(set(host.groups) - set(whoami.get("groups") or ()))
    if missing:
        raise errors.ConfigError(
            f"the host token of {host.name!r} does not serve group(s) {', '.join(missing)}: "
            "make a token with every --group of this host",
            field="groups",
        )
