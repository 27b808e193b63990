"""How the worker runs a command, with real worker processes and real subprocesses on SQLite
and a real Postgres: the command's environment is built, never inherited (no SCHEDULED_*
secret of the worker reaches it; [worker.env] and --env do), and after a timeout, a cancel or
a lost lease the command's whole process group is SIGKILLed even when its leader has already
exited -- a child that ignores SIGTERM does not outlive the attempt. A command that exits
normally leaves its background children alone, and one holding the output pipes open does
not hold up the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import update

from schedctl.core.crypto import PayloadCipher
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.queue import CANCELLED_RUNNING_ERROR
from scheduled_d.worker import Worker
from tests.factories import make_tenant
from tests.integration.queue_support import (
    attempts,
    messages,
    queue_worker,
    queued_run,
    run_row,
    wait_for,
)
from tests.services.ports import pid_alive

BIN = Path(sys.executable).parent
SECRETS = {
    "SCHEDULED_DATABASE_URL": "",  # the test's database, filled in per test
    "SCHEDULED_PAYLOAD_KEYS": PayloadCipher.generate_key(),
    "SCHEDULED_API_TOKEN": "sk-worker-secret-token",
}
# a shell exports its working directory (bash also SHLVL and _): the shell adds them, not
# the worker
SHELL_ADDS = {"PWD", "SHLVL", "_"}
# the command dumps its environment (NUL-separated) and its stdin to the files $1 and $2
DUMP = ["/bin/sh", "-c", 'env -0 > "$1"; cat > "$2"', "sh"]
LEASE = 3.0


@pytest.fixture
def store(store: Store) -> Store:
    make_tenant(store)  # the workers' tenant
    return store


def read_env(path: Path) -> dict[str, str]:
    entries = [e for e in path.read_bytes().decode().split("\0") if e]
    return dict(e.split("=", 1) for e in entries)


def worker_environ(db_url: str, tmp_path: Path) -> dict[str, str]:
    """The worker process's own environment: its secrets, the four variables passed on, and
    a few more of the kind a service manager or a login shell leaves around."""
    environ = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "LANG": "C.UTF-8",
        "TZ": "Europe/Berlin",
        "AWS_SECRET_ACCESS_KEY": "not-for-the-command",
        "SCHEDULED_LOG_LEVEL": "DEBUG",
        **SECRETS,
    }
    environ["SCHEDULED_DATABASE_URL"] = db_url
    return environ


def ready_run(store: Store, payload: object) -> tuple[str, datetime]:
    job, at = queued_run(store, payload=payload, max_attempts=1)
    return job, at


def test_a_worker_process_passes_none_of_its_secrets_to_the_command(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    payload = {"report": "daily"}
    job, at = ready_run(store, payload)
    env_file, stdin_file = tmp_path / "env", tmp_path / "stdin"
    # the database URL comes from SCHEDULED_DATABASE_URL only: the worker really uses it
    process = subprocess.run(
        [
            BIN / "scheduled-d",
            "worker",
            "--queue",
            "q",
            "--max-runs",
            "1",
            "--env",
            "REPORT_DIR=/srv/reports",
            "--env",
            "GREETING=hello = world",
            "--env",
            "TZ=UTC",  # the configured value wins over the worker's own
            "--",
            *DUMP,
            str(env_file),
            str(stdin_file),
        ],
        env=worker_environ(db_url, tmp_path),
        capture_output=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr.decode()
    assert run_row(store, job, at)["status"] == "succeeded"
    env = read_env(env_file)
    assert not [name for name in env if name.startswith("SCHEDULED_")]
    assert not set(SECRETS.values()) & set(env.values())
    assert set(env) - SHELL_ADDS == {
        "PATH",
        "HOME",
        "LANG",
        "TZ",
        "REPORT_DIR",
        "GREETING",
        "SCHED_JOB_ID",
        "SCHED_SCHEDULED_AT",
        "SCHED_ATTEMPT",
        "SCHED_IDEMPOTENCY_KEY",
    }
    assert (env["PATH"], env["HOME"], env["LANG"], env["TZ"]) == (
        os.environ["PATH"],
        str(tmp_path / "home"),
        "C.UTF-8",
        "UTC",
    )
    assert (env["REPORT_DIR"], env["GREETING"]) == ("/srv/reports", "hello = world")
    assert (env["SCHED_JOB_ID"], env["SCHED_ATTEMPT"]) == (job, "1")
    assert json.loads(stdin_file.read_text()) == payload


def test_only_the_variables_that_are_set_are_passed_on(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    job, at = ready_run(store, None)
    env_file, stdin_file = tmp_path / "env", tmp_path / "stdin"
    environ = worker_environ(db_url, tmp_path)
    del environ["LANG"], environ["TZ"], environ["HOME"]
    process = subprocess.run(
        [
            BIN / "scheduled-d",
            *("worker", "--queue", "q", "--max-runs", "1", "--"),
            *(*DUMP, str(env_file), str(stdin_file)),
        ],
        env=environ,
        capture_output=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr.decode()
    assert run_row(store, job, at)["status"] == "succeeded"
    assert set(read_env(env_file)) - SHELL_ADDS == {
        "PATH",
        "SCHED_JOB_ID",
        "SCHED_SCHEDULED_AT",
        "SCHED_ATTEMPT",
        "SCHED_IDEMPOTENCY_KEY",
    }


def test_a_configured_worker_gets_its_worker_env_table(sqlite_url: str, tmp_path: Path) -> None:
    store = Store.open(sqlite_url)
    try:
        make_tenant(store)
        job, at = ready_run(store, {"n": 1})
        env_file, stdin_file = tmp_path / "env", tmp_path / "stdin"
        config = tmp_path / "scheduled.toml"
        config.write_text(
            "poll_interval_seconds = 0.1\n"
            "[[worker]]\n"
            'queue = "q"\n'
            f"command = {json.dumps([*DUMP, str(env_file), str(stdin_file)])}\n"
            "lease_seconds = 3\n"
            "[worker.env]\n"
            'REPORT_DIR = "/srv/reports"\n'
            'PATH = "/usr/bin:/bin"\n'
        )
        daemon = subprocess.Popen(
            [BIN / "scheduled-d", "all", "--config", config],
            env=worker_environ(sqlite_url, tmp_path),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_for(lambda: run_row(store, job, at)["status"] == "succeeded", "the run")
        finally:
            daemon.send_signal(signal.SIGTERM)
            _out, err = daemon.communicate(timeout=60)
        assert daemon.returncode == 0, err.decode()
        env = read_env(env_file)
        assert set(env) - SHELL_ADDS == {
            "PATH",
            "HOME",
            "LANG",
            "TZ",
            "REPORT_DIR",
            "SCHED_JOB_ID",
            "SCHED_SCHEDULED_AT",
            "SCHED_ATTEMPT",
            "SCHED_IDEMPOTENCY_KEY",
        }
        assert (env["PATH"], env["REPORT_DIR"]) == ("/usr/bin:/bin", "/srv/reports")
    finally:
        store.close()


# -- the process group after a timeout, a cancel or a lost lease --------------------------

# The leader starts a child that ignores SIGTERM and does not hold the output pipes, writes
# the child's pid to $1, and waits: SIGTERM ends the leader at once, and only the group's
# SIGKILL after the grace period can end the child.
STUBBORN_CHILD = [
    "/bin/sh",
    "-c",
    """(trap '' TERM; exec sleep 1000) >/dev/null 2>&1 </dev/null &
echo $! > "$1.tmp" && mv "$1.tmp" "$1"
wait""",
    "sh",
]


def exec_worker(store: Store, command: list[str], **kwargs: object) -> Worker:
    return queue_worker(store, command, **{"lease_seconds": LEASE, **kwargs})


class Running:
    """Worker.run in a thread, taking one lease; stops warmly at the end and kills any
    leftover pid."""

    def __init__(self, worker: Worker) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=lambda: worker.run(self.stop, max_runs=1), daemon=True
        )
        self.leftovers: list[int] = []

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        for pid in self.leftovers:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        assert not self.thread.is_alive()


def child_pid(pids: Path, running: Running) -> int:
    wait_for(pids.exists, "the command to start its child")
    pid = int(pids.read_text())
    running.leftovers.append(pid)
    return pid


def test_a_timeout_kills_a_child_that_ignores_sigterm_after_its_leader_exited(
    store: Store, tmp_path: Path
) -> None:
    job, at = queued_run(store, max_attempts=1, timeout=1)
    pids = tmp_path / "child.pid"
    with Running(exec_worker(store, [*STUBBORN_CHILD, str(pids)])) as running:
        child = child_pid(pids, running)
        wait_for(lambda: run_row(store, job, at)["status"] == "dead", "the timeout")
        wait_for(lambda: not pid_alive(child), "the child that ignores SIGTERM to be killed")
    run = run_row(store, job, at)
    assert run["error"] == "timed out after 1s"
    (attempt,) = attempts(store, job, at)
    assert attempt["error"] == "timed out after 1s"


def test_a_cancel_kills_a_child_that_ignores_sigterm_after_its_leader_exited(
    store: Store, tmp_path: Path
) -> None:
    job, at = queued_run(store)
    pids = tmp_path / "child.pid"
    with Running(exec_worker(store, [*STUBBORN_CHILD, str(pids)])) as running:
        child = child_pid(pids, running)
        JobRepo(store).cancel(job, actor="test")
        wait_for(lambda: run_row(store, job, at)["status"] == "failed", "the stop recorded")
        wait_for(lambda: not pid_alive(child), "the child that ignores SIGTERM to be killed")
    # the leader itself ended on the SIGTERM; its child needed the group's SIGKILL
    assert run_row(store, job, at)["error"] == f"{CANCELLED_RUNNING_ERROR} (killed by SIGTERM)"
    assert messages(store) == []


def test_a_lost_lease_kills_a_child_that_ignores_sigterm_after_its_leader_exited(
    store: Store, tmp_path: Path
) -> None:
    job, at = queued_run(store)
    pids = tmp_path / "child.pid"
    with Running(exec_worker(store, [*STUBBORN_CHILD, str(pids)])) as running:
        child = child_pid(pids, running)
        # another worker holds the message now (as after the reaper redelivered it): the
        # next heartbeat finds the lease lost
        with store.tx() as connection:
            connection.execute(update(schema.queue_messages).values(lease_owner="another"))
        wait_for(lambda: not pid_alive(child), "the child that ignores SIGTERM to be killed")
    # the run is the other worker's: this one recorded nothing
    (message,) = messages(store)
    assert message["lease_owner"] == "another"
    assert attempts(store, job, at) == []


def test_a_background_child_holding_the_output_open_does_not_hold_up_the_run(
    store: Store, tmp_path: Path
) -> None:
    job, at = queued_run(store, max_attempts=1)
    pids = tmp_path / "child.pid"
    # the command exits at once; its background child keeps stdout and stderr open
    command = [
        "/bin/sh",
        "-c",
        'sleep 1000 & echo $! > "$1.tmp" && mv "$1.tmp" "$1"; echo finished',
        "sh",
        str(pids),
    ]
    with Running(exec_worker(store, command)) as running:
        child = child_pid(pids, running)
        wait_for(lambda: run_row(store, job, at)["status"] == "succeeded", "the run recorded")
        # a normal exit leaves the command's background children alone
        assert pid_alive(child)
    run = run_row(store, job, at)
    assert (run["exit_code"], run["output_tail"].strip()) == (0, "finished")
