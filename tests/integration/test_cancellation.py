"""A cancel reaches work already under way, on SQLite and a real Postgres: a running worker
command is stopped at its next heartbeat (SIGTERM, then SIGKILL after the grace period,
the whole process group), queued messages of a cancelled job never run, and HTTP runs not
yet sent -- due, or waiting out a retry backoff -- are never sent."""

from __future__ import annotations

import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.queue import CANCELLED_ERROR, CANCELLED_RUNNING_ERROR, QueueRepo
from scheduled_d.relay import Relay
from scheduled_d.worker import Worker
from tests.factories import make_tenant
from tests.integration.queue_support import (
    Received,
    add_dispatched_run,
    attempts,
    dead_letters,
    existing_tenant,
    hook_server,
    http_job,
    messages,
    outbox_count,
    queue_job,
    queue_worker,
    queued_run,
    run_row,
    running_relay,
    set_allow_list,
    trigger,
    wait_for,
)
from tests.services.ports import pid_alive

HEARTBEAT = 0.5
GRACE = 1.0


@pytest.fixture
def store(store: Store) -> Store:
    make_tenant(store)  # the workers' tenant
    return store


def _worker(store: Store, command: list[str]) -> Worker:
    return queue_worker(
        store, command, lease_seconds=3.0, heartbeat_seconds=HEARTBEAT, kill_grace_seconds=GRACE
    )


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


# a command that records its pid and its child's, then sleeps; with "ignore" it also
# ignores SIGTERM (so only SIGKILL ends it)
COMMAND = """
import os, signal, subprocess, sys, time
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
time.sleep(120)
"""


@pytest.mark.parametrize(("mode", "signal_name"), [("obey", "SIGTERM"), ("ignore", "SIGKILL")])
def test_a_running_command_is_stopped_after_its_job_is_cancelled(
    store: Store, tmp_path: Path, mode: str, signal_name: str
) -> None:
    job, at = queued_run(store)
    pids = tmp_path / "pids"
    worker = _worker(store, _python(COMMAND, str(pids), mode))
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: pids.exists() and pids.read_text().count(" ") == 1, "the command")
        command_pid, child_pid = (int(p) for p in pids.read_text().split())
        assert run_row(store, job, at)["status"] == "running"
        cancelled = time.monotonic()
        JobRepo(store).cancel(job, actor="test")
        wait_for(lambda: run_row(store, job, at)["status"] == "failed", "the stop recorded")
        stopped = time.monotonic() - cancelled
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    print(
        f"\ncancel -> command stopped by {signal_name} and recorded in {stopped:.2f} s "
        f"(heartbeat {HEARTBEAT} s, grace {GRACE} s)"
    )
    run = run_row(store, job, at)
    assert run["error"] == f"{CANCELLED_RUNNING_ERROR} (killed by {signal_name})"
    assert run["exit_code"] is None
    # the whole process group is gone, the command's own child included
    wait_for(lambda: not pid_alive(command_pid) and not pid_alive(child_pid), "the group gone")
    (attempt,) = attempts(store, job, at)
    assert attempt["status"] == "failed" and attempt["error"] == run["error"]
    # no retry, no dead letter: the cancel asked for exactly this
    assert messages(store) == [] and dead_letters(store) == []


def test_queued_messages_of_a_cancelled_job_are_not_run(store: Store, tmp_path: Path) -> None:
    job = queue_job(store)
    other = queue_job(store)
    runs = [trigger(store, job), trigger(store, job)]
    kept = trigger(store, other)
    assert QueueRepo(store).move_outbox() == 3
    JobRepo(store).cancel(job, actor="test")
    ran = tmp_path / "ran"
    code = "import os, sys; open(sys.argv[1], 'a').write(os.environ['SCHED_JOB_ID'] + '\\n')"
    taken = _worker(store, _python(code, str(ran))).run(threading.Event(), idle_exit=True)
    assert taken == 1
    assert ran.read_text().split() == [other]
    for at in runs:
        run = run_row(store, job, at)
        assert (run["status"], run["error"]) == ("skipped", CANCELLED_ERROR)
    assert run_row(store, other, kept)["status"] == "succeeded"
    assert messages(store) == []


def test_http_runs_not_yet_sent_are_never_sent(store: Store) -> None:
    """One run is due, one waits out a retry backoff; the job is cancelled; neither is sent
    (again)."""
    set_allow_list(store, existing_tenant(store), ["127.0.0.1"])

    def busy(received: Received, _number: int) -> tuple[int, dict[str, str], bytes]:
        return 503, {"Retry-After": "3"}, b"later"

    with hook_server(busy) as server:
        job = http_job(store, server.url(), max_attempts=5)
        waiting = trigger(store, job)
        relay = Relay(store, poll_seconds=0.05, settings_seconds=0.2)
        with running_relay(relay):
            wait_for(lambda: server.count() == 1, "the first attempt")
            wait_for(lambda: len(attempts(store, job, waiting)) == 1, "it recorded")
            JobRepo(store).cancel(job, actor="test")
            due = _trigger_after_cancel(store, job)
            wait_for(lambda: outbox_count(store) == 0, "the outbox emptied", 30)
            wait_for(relay.idle, "the relay idle")
        assert server.count() == 1
    for at in [waiting, *due]:
        run = run_row(store, job, at)
        assert (run["status"], run["error"]) == ("skipped", CANCELLED_ERROR)
    assert dead_letters(store) == []


def _trigger_after_cancel(store: Store, job: str) -> list[datetime]:
    """A run claimed just before the cancel committed: an outbox row already due."""
    from datetime import UTC

    now = datetime.now(UTC)
    tenant = existing_tenant(store)
    with store.tx() as connection:
        add_dispatched_run(
            connection,
            job,
            now,
            tenant,
            trigger="schedule",
            target=("http", "http://127.0.0.1:9/never"),
            dispatched_at=now,
        )
    return [now]
