"""The host worker with real subprocesses, a real database and real `scheduled-d worker`
processes: a run names a job ({job_file, job}) and the command, user, group, workdir and
environment come from the host's own files; a payload naming anything else fails the run
without running anything; changed files are followed on SIGHUP and by the periodic rescan
while a run in flight keeps the command it started with; @reboot jobs run once per start;
a dead letter of an applied job runs that job's own alert_command on its host."""

from __future__ import annotations

import dataclasses
import grp
import json
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from schedctl.app import jobfiles_apply as applying
from schedctl.app.service import Scheduler
from schedctl.domain import jobfiles
from schedctl.domain.alerts.model import parse_alerts
from schedctl.domain.config import HostConfig
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.pipeline.workers import WorkerRepo
from schedctl.storage.records import alerts as alerts_repo
from scheduled_d import signals
from scheduled_d.host_worker import HostWorker
from tests.factories import make_tenant
from tests.integration.queue_support import attempts, queued_run, run_row, trigger, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs jobs as other users: root")
BIN = Path(sys.executable).parent
HOST = "h1"
QUEUE = f"host:{HOST}"


@pytest.fixture
def store(store: Store) -> Store:
    make_tenant(store)
    return store


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user can write (the job's outputs, as nobody too)."""
    path = Path(tempfile.mkdtemp(prefix="hostworker-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def jobs_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "jobs.d"
    directory.mkdir()
    directory.chmod(0o755)
    return directory


def job_file(directory: Path, name: str, body: str) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(body)
    path.chmod(0o644)
    return path


def shell_job(name: str, line: str, extra: str = "") -> str:
    head = f'[[job]]\nname = {json.dumps(name)}\ncron = "0 3 * * *"\n'
    return f"{head}shell = {json.dumps(line)}\n{extra}"


def ref(path: Path, name: str, **more: Any) -> dict[str, Any]:
    return {"job_file": str(path), "job": name, "host": HOST, **more}


def serve_until_idle(store: Store, directory: Path, **options: Any) -> int:
    worker = HostWorker(
        store,
        HostConfig(
            name=HOST,
            jobs_dir=str(directory),
            **{"state_dir": str(directory.parent / "state"), **options},
        ),
        lease_seconds=3.0,
        heartbeat_seconds=0.5,
        poll_seconds=0.1,
    )
    return worker.run(threading.Event(), idle_exit=True)


def read_env(path: Path) -> dict[str, str]:
    entries = [e for e in path.read_bytes().decode().split("\0") if e]
    return dict(e.split("=", 1) for e in entries)


def test_a_run_runs_the_command_of_the_host_s_file(
    store: Store, tmp_path: Path, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCHEDULED_API_TOKEN", "sk-not-for-the-command")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-the-command")
    directory = jobs_dir(tmp_path)
    out = shared / "out"
    path = job_file(
        directory,
        "dump",
        "[[job]]\n"
        'name = "dump"\n'
        'cron = "0 3 * * *"\n'
        f'command = ["/bin/sh", "-c", "env -0 > {out}.env; cat > {out}.stdin; pwd > {out}.pwd"]\n'
        f'workdir = "{shared}"\n'
        '[job.env]\nGREETING = "hello"\nPATH = "/usr/bin:/bin"\n',
    )
    payload = ref(path, "dump", digest="abc")
    job, at = queued_run(store, queue=QUEUE, payload=payload, max_attempts=1)
    assert serve_until_idle(store, directory) == 1
    assert run_row(store, job, at)["status"] == "succeeded"
    env = read_env(Path(f"{out}.env"))
    assert (env["GREETING"], env["PATH"]) == ("hello", "/usr/bin:/bin")  # over the base
    assert env["SCHED_JOB_ID"] == job
    assert not [n for n in env if n.startswith("SCHEDULED_")]
    assert "AWS_SECRET_ACCESS_KEY" not in env
    # no stdin text: the file's own reference, never the central payload (the API can
    # change that)
    assert json.loads(Path(f"{out}.stdin").read_text()) == {"job_file": str(path), "job": "dump"}
    assert Path(f"{out}.pwd").read_text().strip() == str(shared)


def test_a_job_runs_as_its_user_and_group_with_its_stdin(
    store: Store, tmp_path: Path, shared: Path
) -> None:
    directory = jobs_dir(tmp_path)
    out = shared / "id"
    path = job_file(
        directory,
        "who",
        shell_job(
            "who",
            f'echo "$(id -u) $(id -g) $HOME $USER" > {out}; cat >> {out}',
            'user = "nobody"\ngroup = "daemon"\nstdin = "from the file"\n',
        ),
    )
    job, at = queued_run(store, queue=QUEUE, payload=ref(path, "who"), max_attempts=1)
    serve_until_idle(store, directory)
    assert run_row(store, job, at)["status"] == "succeeded"
    nobody = pwd.getpwnam("nobody")
    daemon_gid = grp.getgrnam("daemon").gr_gid
    assert out.read_text().splitlines() == [
        f"{nobody.pw_uid} {daemon_gid} {nobody.pw_dir} nobody",
        "from the file",
    ]
    assert out.stat().st_uid == nobody.pw_uid


def test_output_local_keeps_the_output_on_the_host(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`output = "local"`: the run's output goes to the daemon's log only; its central run
    record (and attempts, and heartbeats meanwhile) hold none of it, while a job without
    the key has its tail there as before."""
    directory = jobs_dir(tmp_path)
    # printed, then a pause long enough for heartbeats to carry output if any would
    line = 'echo "out-of-$0"; echo "err-of-$0" >&2; sleep 1.2'
    path = job_file(
        directory,
        "both",
        shell_job("loud", line.replace("$0", "loud"))
        + shell_job("quiet", line.replace("$0", "quiet"), 'output = "local"\n'),
    )
    loud = queued_run(store, queue=QUEUE, payload=ref(path, "loud"), max_attempts=1)
    quiet = queued_run(store, queue=QUEUE, payload=ref(path, "quiet"), max_attempts=1)
    with caplog.at_level(logging.INFO, logger="scheduled_d.output"):
        assert serve_until_idle(store, directory) == 2
    loud_row, quiet_row = run_row(store, *loud), run_row(store, *quiet)
    assert (loud_row["status"], quiet_row["status"]) == ("succeeded", "succeeded")
    assert "out-of-loud" in loud_row["output_tail"] and "err-of-loud" in loud_row["output_tail"]
    assert quiet_row["output_tail"] is None
    assert all(a["output_tail"] is None for a in attempts(store, *quiet))
    logged = caplog.text
    assert "out-of-quiet" in logged and "err-of-quiet" in logged  # the journal has it


def test_a_payload_naming_no_job_of_the_host_fails_and_runs_nothing(
    store: Store, tmp_path: Path, shared: Path
) -> None:
    directory = jobs_dir(tmp_path)
    marker = shared / "marker"
    path = job_file(directory, "real", shell_job("real", f"touch {marker}"))
    elsewhere = tmp_path / "evil.toml"
    elsewhere.write_text(shell_job("real", f"touch {marker}"))
    runs = [
        queued_run(
            store,
            queue=QUEUE,
            payload=ref(path, "other", command=["/bin/sh", "-c", f"touch {marker}"]),
            max_attempts=1,
        ),
        queued_run(store, queue=QUEUE, payload=ref(elsewhere, "real"), max_attempts=1),
        queued_run(store, queue=QUEUE, payload={"shell": f"touch {marker}"}, max_attempts=1),
    ]
    serve_until_idle(store, directory)
    errors = []
    for job, at in runs:
        row = run_row(store, job, at)
        assert row["status"] in ("failed", "dead"), row
        errors.append(row["error"])
    assert f"job 'other' of '{path}' is not defined on this host" in errors[0]
    assert f"job 'real' of '{elsewhere}' is not defined on this host" in errors[1]
    assert "names no job file and job" in errors[2]
    assert not marker.exists()


def test_a_reload_changes_new_runs_and_not_the_run_in_flight(
    store: Store, tmp_path: Path, shared: Path
) -> None:
    directory = jobs_dir(tmp_path)
    out, started, go = shared / "out", shared / "started", shared / "go"
    wait_go = f"touch {started}; while [ ! -e {go} ]; do sleep 0.05; done"
    path = job_file(directory, "step", shell_job("step", f"{wait_go}; echo v1 >> {out}"))
    added = shared / "added"
    worker = HostWorker(
        store,
        HostConfig(name=HOST, jobs_dir=str(directory), rescan_seconds=3600),
        lease_seconds=3.0,
        heartbeat_seconds=0.5,
        poll_seconds=0.1,
    )
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        # timeout bounds the command's wait, should the test fail before it creates `go`
        first = queued_run(store, queue=QUEUE, payload=ref(path, "step"), timeout=120)
        wait_for(started.exists, "the first run to start")
        path.write_text(shell_job("step", f"echo v2 >> {out}"))
        job_file(directory, "added", shell_job("added", f"touch {added}"))
        signals.handle_sighup()  # what SIGHUP runs: the listeners, in a thread
        wait_for(lambda: len(worker.files.jobs()) == 2, "the reload on SIGHUP")
        second = queued_run(store, queue=QUEUE, payload=ref(path, "step"))
        wait_for(lambda: out.exists(), "the second run")
        assert out.read_text() == "v2\n"
        third = queued_run(store, queue=QUEUE, payload=ref(directory / "added.toml", "added"))
        wait_for(added.exists, "the run of the added file")
        go.touch()
        for job, at in (first, second, third):
            wait_for(lambda j=job, a=at: run_row(store, j, a)["status"] == "succeeded", "runs")
        assert out.read_text() == "v2\nv1\n"  # the run in flight kept its command
        path.unlink()
        signals.handle_sighup()
        wait_for(lambda: len(worker.files.jobs()) == 1, "the removal on SIGHUP")
        gone = queued_run(store, queue=QUEUE, payload=ref(path, "step"), max_attempts=1)
        wait_for(lambda: run_row(store, *gone)["status"] in ("failed", "dead"), "the refusal")
        assert "is not defined on this host" in run_row(store, *gone)["error"]
    finally:
        go.touch()
        stop.set()
        thread.join(60)
    assert not thread.is_alive()


def test_boot_jobs_run_once_per_boot(store: Store, tmp_path: Path, shared: Path) -> None:
    directory = jobs_dir(tmp_path)
    booted = shared / "booted"
    job_file(
        directory,
        "boot",
        f'[[job]]\nname = "warm"\ncron = "@reboot"\nshell = "echo up >> {booted}; echo warm-out"\n'
        f'[[job]]\nname = "other-group"\ncron = "@reboot"\nshell = "echo no >> {booted}"\n'
        'run_on = "host-group:db"\n'
        '[[job]]\nname = "broken"\ncron = "@reboot"\nshell = "echo broken-out; exit 3"\n',
    )
    # applied: each boot job has a central job (a `boot` schedule) for its boot runs
    sched = Scheduler(store)
    plan = applying.plan(
        jobfiles.load_dir(directory),
        HOST,
        (),
        applying.read_central(sched, "acme"),
        directory=directory,
        now=store.now(),
    )
    applying.execute(sched, "acme", plan, actor="test")
    warm, broken = (sched.get_job_by_name(f"{n}@{HOST}", "acme") for n in ("warm", "broken"))

    def boot_runs(job: Any) -> list[Any]:
        return list(sched.runs(job.job_id, "acme", limit=10).items)

    state, boot_id = tmp_path / "state", tmp_path / "boot_id"
    boot_id.write_text("11111111-aaaa-4bbb-8ccc-000000000001\n")
    config = HostConfig(
        name=HOST, jobs_dir=str(directory), state_dir=str(state), boot_id_file=str(boot_id)
    )
    worker = HostWorker(store, config, poll_seconds=0.1)
    for _ in range(2):  # a supervised restart of the same worker does not boot again
        worker.run(threading.Event(), idle_exit=True)
    wait_for(booted.exists, "the boot job")
    wait_for(lambda: len(boot_runs(warm)) == 1 and len(boot_runs(broken)) == 1, "boot runs")
    (run,) = boot_runs(warm)
    assert (run.trigger.value, run.status.value, run.exit_code) == ("boot", "succeeded", 0)
    assert run.output_tail == "warm-out\n"
    (failed,) = boot_runs(broken)
    assert (failed.status.value, failed.exit_code, failed.error) == ("failed", 3, "exit code 3")
    assert failed.output_tail == "broken-out\n"
    record = state / "boot-runs.json"
    assert record.stat().st_mode & 0o777 == 0o600
    # a new worker process in the same boot (an upgrade, a restart): not again
    HostWorker(store, config).run(threading.Event(), idle_exit=True)
    assert booted.read_text() == "up\n"
    assert "warm" in json.loads(record.read_text())["jobs"]
    # the next boot: once more
    boot_id.write_text("11111111-aaaa-4bbb-8ccc-000000000002\n")
    HostWorker(store, config).run(threading.Event(), idle_exit=True)
    wait_for(lambda: booted.read_text().count("up") == 2, "the next boot's boot job")
    assert booted.read_text() == "up\nup\n"
    wait_for(lambda: len(boot_runs(warm)) == 2, "the next boot's boot run")
    # where no boot id can be read: once per start of the worker, as before
    unknown = dataclasses.replace(config, boot_id_file=str(tmp_path / "missing"))
    HostWorker(store, unknown).run(threading.Event(), idle_exit=True)
    wait_for(lambda: booted.read_text().count("up") == 3, "the boot job without a boot id")


def test_a_dead_letter_runs_the_alert_command_of_the_job_s_file_on_its_host(
    store: Store, tmp_path: Path, shared: Path
) -> None:
    """`alert_command` of a job file: applied as a command alert, run by the host worker
    serving the job's queue with the alert JSON on stdin. A job whose file has none (its
    command alert from the tenant's default) runs nothing: its alert fails saying why."""
    directory = jobs_dir(tmp_path)
    marker = shared / "alert.json"
    noisy_alert = f"cat >> {marker}; echo >> {marker}; env > {marker}.env"

    def failing(name: str) -> str:
        head = f'[[job]]\nname = "{name}"\ncron = "0 3 * * *"\ncommand = ["/bin/false"]\n'
        return head + "retry = { max_attempts = 1 }\n"

    job_file(
        directory,
        "fleet",
        failing("noisy")
        + f'alert_command = ["/bin/sh", "-c", "{noisy_alert}"]\n'
        + failing("silent")
        + failing("group")
        + 'run_on = "host-group:web"\n'
        + f'alert_command = ["/bin/sh", "-c", "cat > {marker}.group"]\n',
    )
    groups = ("web",)
    sched = Scheduler(store)
    plan = applying.plan(
        jobfiles.load_dir(directory),
        HOST,
        groups,
        applying.read_central(sched, "acme"),
        directory=directory,
        now=store.now(),
    )
    applying.execute(sched, "acme", plan, actor="test")
    # the silent job's command alert comes from the tenant's default: its file has no
    # alert_command, so the host has nothing to run for it
    alerts_repo.set_settings(store, "tenant-acme", "", parse_alerts({"command": True}))
    jobs = {j.name: j.job_id for j in sched.list_jobs("acme", limit=100).items}
    assert set(jobs) == {"noisy@h1", "silent@h1", "group"}
    runs = {name: (job_id, trigger(store, job_id)) for name, job_id in jobs.items()}
    QueueRepo(store).move_outbox()

    def alert_of(name: str) -> dict[str, Any]:
        (row,) = [a for a in alerts_repo.list_alerts(store) if a["job_id"] == jobs[name]]
        return row

    worker = HostWorker(
        store,
        HostConfig(name=HOST, jobs_dir=str(directory), groups=groups),
        lease_seconds=3.0,
        heartbeat_seconds=0.5,
        poll_seconds=0.1,
    )
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        for name in jobs:
            wait_for(lambda n=name: run_row(store, *runs[n])["status"] == "dead", "the dead letter")
        wait_for(lambda: alert_of("noisy@h1")["status"] == "delivered", "the alert command")
        wait_for(lambda: alert_of("group")["status"] == "delivered", "the group's alert command")
        wait_for(lambda: alert_of("silent@h1")["last_error"] is not None, "the refused alert")
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    (line,) = marker.read_text().splitlines()  # once: not for the silent job's alert too
    alert = json.loads(line)
    assert (alert["alert"], alert["job_id"]) == ("dead_letter", jobs["noisy@h1"])
    assert (alert["job_name"], alert["error"]) == ("noisy@h1", "exit code 1")
    env = dict(line.split("=", 1) for line in Path(f"{marker}.env").read_text().splitlines())
    assert (env["SCHED_ALERT"], env["SCHED_JOB_ID"]) == ("dead_letter", jobs["noisy@h1"])
    assert json.loads(Path(f"{marker}.group").read_text())["job_id"] == jobs["group"]
    assert (alert_of("noisy@h1")["destination"], alert_of("group")["destination"]) == (
        QUEUE,
        "group:web",
    )
    silent = alert_of("silent@h1")
    assert silent["status"] == "pending"  # retried later (with a backoff), then given up
    assert silent["lease_owner"] is None  # not left leased
    refusal = f"job 'silent' of '{directory / 'fleet.toml'}' has no alert_command on this host"
    assert refusal in silent["last_error"]
    assert sorted(p.name for p in shared.iterdir()) == [
        "alert.json",
        "alert.json.env",
        "alert.json.group",
    ]  # nothing ran for the silent job's alert


def test_an_alert_command_runs_as_the_job_s_user_and_group_with_its_environment(
    store: Store, tmp_path: Path, shared: Path
) -> None:
    """A job with `user = "nobody"` (and a group): its alert_command runs as nobody with
    that group, nobody's HOME and USER, the job's [job.env] and workdir, never as the
    worker's root."""
    directory = jobs_dir(tmp_path)
    out = shared / "alert-id"
    line = f'echo "$(id -u) $(id -g) $HOME $USER $GREETING $(pwd)" > {out}'
    job_file(
        directory,
        "who",
        '[[job]]\nname = "who"\ncron = "0 3 * * *"\ncommand = ["/bin/false"]\n'
        'retry = { max_attempts = 1 }\nuser = "nobody"\ngroup = "daemon"\n'
        f'workdir = "{shared}"\n'
        f"alert_command = {json.dumps(['/bin/sh', '-c', line])}\n"
        '[job.env]\nGREETING = "hello"\n',
    )
    sched = Scheduler(store)
    plan = applying.plan(
        jobfiles.load_dir(directory),
        HOST,
        (),
        applying.read_central(sched, "acme"),
        directory=directory,
        now=store.now(),
    )
    applying.execute(sched, "acme", plan, actor="test")
    (job,) = [j.job_id for j in sched.list_jobs("acme", limit=10).items]
    at = trigger(store, job)
    QueueRepo(store).move_outbox()
    worker = HostWorker(
        store,
        HostConfig(name=HOST, jobs_dir=str(directory)),
        lease_seconds=3.0,
        heartbeat_seconds=0.5,
        poll_seconds=0.1,
    )
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: run_row(store, job, at)["status"] == "dead", "the dead letter")
        wait_for(
            lambda: any(a["status"] == "delivered" for a in alerts_repo.list_alerts(store)),
            "the alert command",
        )
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    nobody = pwd.getpwnam("nobody")
    daemon_gid = grp.getgrnam("daemon").gr_gid
    assert out.read_text().split() == [
        str(nobody.pw_uid),
        str(daemon_gid),
        nobody.pw_dir,
        "nobody",
        "hello",
        str(shared),
    ]
    assert out.stat().st_uid == nobody.pw_uid


# -- the real daemon ---------------------------------------------------------------------------


class Daemon:
    """`scheduled-d worker --config FILE` as a child process, its log in a file."""

    def __init__(self, config: Path, db_url: str, log: Path) -> None:
        self.log = log
        environ = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"}
        with log.open("ab") as sink:
            self.process = subprocess.Popen(
                [BIN / "scheduled-d", "worker", "--config", str(config), "--db", db_url],
                env=environ,
                stdout=sink,
                stderr=sink,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(60)


@pytest.mark.parametrize("follow", ["sighup", "rescan"])
def test_the_daemon_follows_its_files_and_boots_once_per_boot(
    sqlite_url: str, tmp_path: Path, shared: Path, follow: str
) -> None:
    store = Store.open(sqlite_url)
    make_tenant(store)
    directory = jobs_dir(tmp_path)
    out, booted = shared / "out", shared / "booted"
    path = job_file(directory, "step", shell_job("step", f"echo v1 >> {out}"))
    job_file(
        directory,
        "boot",
        f'[[job]]\nname = "warm"\ncron = "@reboot"\nshell = "echo up >> {booted}"\n',
    )
    rescan = 3600 if follow == "sighup" else 0.2
    config = tmp_path / "scheduled.toml"
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("22222222-aaaa-4bbb-8ccc-000000000001\n")
    config.write_text(
        f'[host]\nname = "{HOST}"\njobs_dir = "{directory}"\nrescan_seconds = {rescan}\n'
        f'state_dir = "{tmp_path / "state"}"\nboot_id_file = "{boot_id}"\n'
    )
    log = tmp_path / "daemon.log"
    daemon = Daemon(config, sqlite_url, log)
    try:
        wait_for(lambda: "job files (start)" in daemon.text(), "the daemon to load its files")
        first = queued_run(store, queue=QUEUE, payload=ref(path, "step"))
        wait_for(lambda: run_row(store, *first)["status"] == "succeeded", "the first run")
        path.write_text(shell_job("step", f"echo v2 >> {out}"))
        if follow == "sighup":
            daemon.process.send_signal(signal.SIGHUP)
            wait_for(lambda: "job files (SIGHUP): 0 added, 1 changed" in daemon.text(), "reload")
        else:
            wait_for(lambda: "job files (rescan): 0 added, 1 changed" in daemon.text(), "rescan")
        second = queued_run(store, queue=QUEUE, payload=ref(path, "step"))
        wait_for(lambda: run_row(store, *second)["status"] == "succeeded", "the second run")
        assert out.read_text() == "v1\nv2\n"
        assert daemon.process.poll() is None  # SIGHUP did not stop it
        daemon.stop()
        assert daemon.process.returncode == 0, daemon.text()
        # the reload did not run the boot job again; nor does a restart in the same boot
        assert booted.read_text() == "up\n"
        daemon = Daemon(config, sqlite_url, log)
        wait_for(lambda: "already run in this boot" in daemon.text(), "the restart")
        daemon.stop()
        assert booted.read_text() == "up\n"
        # the next boot runs it again
        boot_id.write_text("22222222-aaaa-4bbb-8ccc-000000000002\n")
        daemon = Daemon(config, sqlite_url, log)
        wait_for(lambda: booted.read_text() == "up\nup\n", "the boot job of the next boot")
    finally:
        daemon.stop()
        store.close()
    assert log.read_text().count("boot job 'warm': succeeded") == 2


def test_worker_jobs_dir_flags_serve_the_group_queue(
    sqlite_url: str, tmp_path: Path, shared: Path
) -> None:
    store = Store.open(sqlite_url)
    try:
        make_tenant(store)
        directory = jobs_dir(tmp_path)
        out = shared / "out"
        path = job_file(
            directory, "web", shell_job("web", f"echo web > {out}", 'run_on = "host-group:web"\n')
        )
        job, at = queued_run(store, queue="group:web", payload=ref(path, "web"))
        result = subprocess.run(
            [
                *(BIN / "scheduled-d", "worker", "--jobs-dir", str(directory)),
                *("--host", HOST, "--group", "web", "--max-runs", "1", "--db", sqlite_url),
            ],
            env={"PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert run_row(store, job, at)["status"] == "succeeded"
        assert out.read_text() == "web\n"
        assert "queues host:h1, every:h1, group:web" in result.stderr
    finally:
        store.close()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((), "give --queue Q (and a command), or run the host worker"),
        (("--jobs-dir", "/tmp", "--queue", "q"), "--queue and --jobs-dir/--host/--group exclude"),
        (("--jobs-dir", "/tmp", "--", "/bin/true"), "runs the commands of its job files"),
        (("--host", "not a host"), "--host: host name 'not a host'"),
    ],
)
def test_worker_host_flags_errors(sqlite_url: str, args: tuple[str, ...], words: str) -> None:
    result = subprocess.run(
        [BIN / "scheduled-d", "worker", "--db", sqlite_url, *args],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert words in result.stderr


def test_all_runs_the_host_worker_of_its_host_table(
    sqlite_url: str, tmp_path: Path, shared: Path
) -> None:
    store = Store.open(sqlite_url)
    make_tenant(store)
    directory = jobs_dir(tmp_path)
    out, booted = shared / "out", shared / "booted"
    path = job_file(directory, "step", shell_job("step", f"echo ran >> {out}"))
    job_file(
        directory, "boot", f'[[job]]\nname = "b"\ncron = "@reboot"\nshell = "touch {booted}"\n'
    )
    config = tmp_path / "scheduled.toml"
    config.write_text(
        f'[host]\nname = "{HOST}"\njobs_dir = "{directory}"\nstate_dir = "{tmp_path / "state"}"\n'
    )
    process = subprocess.Popen(
        [BIN / "scheduled-d", "all", "--config", str(config), "--db", sqlite_url],
        env={"PATH": os.environ["PATH"]},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(booted.exists, "the boot job")
        run = queued_run(store, queue=QUEUE, payload=ref(path, "step"))
        wait_for(lambda: run_row(store, *run)["status"] == "succeeded", "the run")
        assert out.read_text() == "ran\n"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        store.close()
    assert process.returncode == 0


def test_a_run_from_a_queue_its_job_does_not_belong_on_fails_and_runs_nothing(
    sqlite_url: str, tmp_path: Path, shared: Path
) -> None:
    """Whoever can queue on this host's queues cannot run a job of its files elsewhere than
    `schedctl apply` places it: not a job for another group, not from another queue, not a
    @reboot job (those run only when the worker starts)."""
    store = Store.open(sqlite_url)
    try:
        tenant_id = make_tenant(store)
        # the host is live: its every-host run reaches every:h1 rather than being skipped
        WorkerRepo(store).seen(tenant_id, "every:h1", "h1:1:w")
        directory = jobs_dir(tmp_path)
        booted = shared / "booted"

        def marked(name: str, run_on: str | None, cron: str = "0 3 * * *") -> str:
            placed = f'run_on = "{run_on}"\n' if run_on else ""
            return (
                f'[[job]]\nname = "{name}"\ncron = "{cron}"\n'
                f'shell = "echo {name} >> {shared}/{name}"\n{placed}'
            )

        path = job_file(
            directory,
            "fleet",
            marked("every-db", "every-host:db")
            + marked("group-db", "host-group:db")
            + marked("mine", None)
            + marked("everyone", "every-host")
            + marked("web", "host-group:web")
            + f'[[job]]\nname = "boot"\ncron = "@reboot"\nshell = "echo up >> {booted}"\n',
        )
        refused = {
            "every-db": (QUEUE, "runs on every-host:db, not on this host"),
            "group-db": (QUEUE, "runs on host-group:db, not on this host"),
            "mine": ("group:web", "runs from queue 'host:h1', not 'group:web'"),
            "everyone": (QUEUE, "runs from queue 'every:h1', not 'host:h1'"),
            "boot": (QUEUE, "is a @reboot job"),
        }
        runs = {
            name: queued_run(store, queue=queue, payload=ref(path, name), max_attempts=1)
            for name, (queue, _) in refused.items()
        }
        good = {
            "mine": queued_run(store, queue=QUEUE, payload=ref(path, "mine"), max_attempts=1),
            "web": queued_run(store, queue="group:web", payload=ref(path, "web"), max_attempts=1),
            "everyone": queued_run(
                store, queue="every:h1", payload=ref(path, "everyone"), max_attempts=1
            ),
        }
        serve_until_idle(store, directory, groups=("web",))
        for name, (_, words) in refused.items():
            row = run_row(store, *runs[name])
            assert row["status"] in ("failed", "dead"), (name, row)
            assert f"job '{name}' of '{path}' " in row["error"], (name, row["error"])
            assert words in row["error"], (name, row["error"])
        for name in ("every-db", "group-db"):
            assert not (shared / name).exists(), name
        for name, run in good.items():
            assert run_row(store, *run)["status"] == "succeeded", name
        assert (shared / "mine").read_text() == "mine\n"  # once: from host:h1, not group:web
        assert (shared / "web").read_text() == "web\n"
        assert (shared / "everyone").read_text() == "everyone\n"
        assert booted.read_text() == "up\n"  # the start's boot run only, not the queued one
    finally:
        store.close()


def test_a_nul_in_the_job_file_fails_the_run_cleanly(
    sqlite_url: str, tmp_path: Path, shared: Path
) -> None:
    """Not an unexpected exception that abandons the lease (dead-lettered much later)."""
    store = Store.open(sqlite_url)
    try:
        make_tenant(store)
        directory = jobs_dir(tmp_path)
        marker = shared / "marker"
        path = job_file(directory, "real", shell_job("real", f"touch {marker}"))
        bad = {"job_file": f"{path}\u0000x", "job": "real"}
        job, at = queued_run(store, queue=QUEUE, payload=bad, max_attempts=1)
        serve_until_idle(store, directory)
        row = run_row(store, job, at)
        assert row["status"] in ("failed", "dead"), row
        assert "is not defined on this host" in row["error"]
        assert "lease" not in row["error"]
        assert not marker.exists()
    finally:
        store.close()


def test_the_worker_reports_drift_between_its_files_and_the_central_jobs(
    store: Store, tmp_path: Path
) -> None:
    from schedctl.app.cluster_status import gather_status
    from schedctl.domain.config import Config
    from scheduled_d.metrics import HOST_DRIFT

    directory = jobs_dir(tmp_path)
    path = job_file(directory, "step", shell_job("step", "echo v1"))
    worker = HostWorker(store, HostConfig(name=HOST, jobs_dir=str(directory)))
    # nothing applied yet: the job is to be created
    assert worker.check_drift() == [f"created step@{HOST}"]
    assert HOST_DRIFT._value.get() == 1
    sched = Scheduler(store)
    plan = applying.plan(
        jobfiles.load_dir(directory),
        HOST,
        (),
        applying.read_central(sched, "acme"),
        directory=directory,
        now=store.now(),
    )
    applying.execute(sched, "acme", plan, actor="test")
    assert worker.check_drift() == []
    assert HOST_DRIFT._value.get() == 0
    status = gather_status(store, Config())
    assert [(d.host, d.drift) for d in status.host_drift] == [(HOST, ())]
    assert not any("differ" in n for n in status.notes)
    # edited on the host, not applied: the drift shows in the status
    path.write_text(shell_job("step", "echo v2"))
    assert worker.check_drift() == [f"changed step@{HOST}"]
    status = gather_status(store, Config())
    assert any(f"host {HOST}: job files differ" in n and "changed step@" in n for n in status.notes)
    assert status.to_dict()["host_drift"][0]["drift"] == [f"changed step@{HOST}"]
    # a file the worker refuses is drift too, with its reason
    path.chmod(0o664)
    (drift,) = worker.check_drift()
    assert drift.startswith(f"refused {path}") and "writable" in drift
