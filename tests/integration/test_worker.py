"""The queue worker with real subprocesses on SQLite and a real Postgres: environment and
stdin, success and output tails, retries to dead letters, timeouts that kill the process
group, never a command from the message, kill -9 recovery, per-job max concurrency, warm
and forced shutdown, and the relay feeding it."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from schedctl.core import errors
from schedctl.domain.leasing import LeasedRun, Settlement
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import LOST_ERROR, QueueRepo
from scheduled_d.direct_backend import DirectBackend
from scheduled_d.relay import Relay
from scheduled_d.worker import TailBuffer, Worker
from tests.factories import make_tenant
from tests.integration.queue_support import (
    WORKER_LEASE_SECONDS,
    attempts,
    dead_letters,
    end_processes,
    kill_when_started,
    messages,
    queue_job,
    queued_run,
    run_row,
    running_loop,
    trigger,
    wait_for,
)
from tests.integration.queue_support import queue_worker as worker
from tests.services.ports import pid_alive
from tests.services.postgres import PostgresServer

ROOT = Path(__file__).resolve().parents[2]
LEASE = WORKER_LEASE_SECONDS
HEARTBEAT = 0.5


@pytest.fixture
def store(store: Store) -> Store:
    make_tenant(store)  # the workers' tenant
    return store


def run_until(w: Worker, done: Callable[[], bool], what: str, **run_kwargs: object) -> int:
    """Run the worker in a thread until `done()`, then stop it warmly; returns runs taken."""
    taken: list[int] = []

    def run(stop: threading.Event) -> None:
        taken.append(w.run(stop, **run_kwargs))  # type: ignore[arg-type]

    with running_loop(run, "worker"):
        wait_for(done, what)
    return taken[0]


def finished(store: Store, job: str, at: datetime) -> Callable[[], bool]:
    def check() -> bool:
        return run_row(store, job, at)["status"] in {"succeeded", "dead"}

    return check


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


# -- what the command gets -----------------------------------------------------------------


def test_command_gets_env_and_payload_on_stdin(store: Store, tmp_path: Path) -> None:
    payload = {"db": "orders", "items": [1, 2, 3], "note": "ünïcode"}
    job, at = queued_run(store, payload=payload)
    out = tmp_path / "seen.json"
    code = (
        "import json, os, sys\n"
        "env = {k: v for k, v in os.environ.items() if k.startswith('SCHED_')}\n"
        "json.dump({'env': env, 'stdin': sys.stdin.read()}, open(sys.argv[1], 'w'))\n"
    )
    run_until(worker(store, python(code, str(out))), finished(store, job, at), "the run")
    seen = json.loads(out.read_text())
    assert seen["env"] == {
        "SCHED_JOB_ID": job,
        "SCHED_SCHEDULED_AT": format_instant(at),
        "SCHED_ATTEMPT": "1",
        "SCHED_IDEMPOTENCY_KEY": f"{job}:{format_instant(at)}",
    }
    assert json.loads(seen["stdin"]) == payload
    assert run_row(store, job, at)["status"] == "succeeded"


def test_success_records_exit_code_output_tail_and_timings(store: Store) -> None:
    job, at = queued_run(store)
    # far more output than the tail keeps, on both streams
    code = (
        "import sys\n"
        "sys.stdout.write('x' * 300000 + 'END-OF-STDOUT')\n"
        "sys.stderr.write('y' * 300000 + 'END-OF-STDERR')\n"
    )
    w = worker(store, python(code), output_tail_bytes=1000)
    run_until(w, finished(store, job, at), "the run")
    run = run_row(store, job, at)
    assert (run["status"], run["exit_code"], run["error"]) == ("succeeded", 0, None)
    tail = run["output_tail"]
    assert tail.endswith("END-OF-STDERR")
    assert "END-OF-STDOUT" in tail
    assert len(tail) < 2100
    assert run["started_at"] <= run["finished_at"]
    (attempt,) = attempts(store, job, at)
    assert (attempt["status"], attempt["exit_code"], attempt["worker"]) == (
        "succeeded",
        0,
        w.owner,
    )
    assert attempt["output_tail"] == tail
    assert messages(store) == []


def test_binary_output_is_recorded(store: Store) -> None:
    job, at = queued_run(store)
    # NUL and invalid UTF-8: Postgres text cannot hold NUL, and the outcome must still land
    command = ["sh", "-c", r"printf 'a\000b\377c'"]
    run_until(worker(store, command), finished(store, job, at), "the run")
    run = run_row(store, job, at)
    assert run["status"] == "succeeded"
    assert run["output_tail"] == "a\ufffdb\ufffdc"


def test_nonzero_exit_retries_then_dead_letters(store: Store) -> None:
    job, at = queued_run(store, max_attempts=3)
    command = ["sh", "-c", 'echo "attempt $SCHED_ATTEMPT failing" >&2; exit 3']
    taken = run_until(worker(store, command), finished(store, job, at), "the dead letter")
    assert taken == 3
    run = run_row(store, job, at)
    assert (run["status"], run["attempt"], run["exit_code"]) == ("dead", 3, 3)
    assert run["error"] == "exit code 3"
    history = attempts(store, job, at)
    assert [(a["attempt"], a["status"], a["exit_code"]) for a in history] == [
        (1, "failed", 3),
        (2, "failed", 3),
        (3, "failed", 3),
    ]
    assert [a["output_tail"].strip() for a in history] == [
        f"attempt {n} failing" for n in (1, 2, 3)
    ]
    (letter,) = dead_letters(store)
    assert (letter["attempts"], letter["last_error"], letter["target"]) == (3, "exit code 3", "q")


def test_a_missing_command_is_a_failed_attempt(store: Store, tmp_path: Path) -> None:
    job, at = queued_run(store, max_attempts=1)
    missing = str(tmp_path / "no-such-command")
    run_until(worker(store, [missing]), finished(store, job, at), "the dead letter")
    run = run_row(store, job, at)
    assert run["status"] == "dead"
    assert run["error"].startswith("cannot start the command")


def test_timeout_kills_the_whole_process_group(store: Store, tmp_path: Path) -> None:
    job, at = queued_run(store, max_attempts=1, timeout=1)
    pids = tmp_path / "pids"
    # the child ignores SIGTERM: only the SIGKILL after the grace ends it
    script = f"sh -c \"trap '' TERM; exec sleep 1000\" & echo $$ $! > {pids}; wait"
    # the attempt lasts the timeout plus the grace, as long as the test's usual lease: a
    # longer lease keeps a heartbeat stalled by a loaded disk from ending it first
    w = worker(store, ["sh", "-c", script], lease_seconds=10.0)
    run_until(w, finished(store, job, at), "the timeout")
    run = run_row(store, job, at)
    assert (run["status"], run["error"]) == ("dead", "timed out after 1s")
    shell, child = (int(p) for p in pids.read_text().split())
    wait_for(lambda: not pid_alive(shell) and not pid_alive(child), "the process group to die")
    (attempt,) = attempts(store, job, at)
    assert attempt["error"] == "timed out after 1s"


def test_the_worker_never_runs_a_command_from_the_message(store: Store, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    payload = {
        "command": f"touch {pwned}",
        "cmd": ["touch", str(pwned)],
        "argv": ["sh", "-c", f"touch {pwned}"],
        "shell": f"$(touch {pwned})",
    }
    job, at = queued_run(store, payload=payload)
    received = tmp_path / "received.json"
    command = ["sh", "-c", 'cat > "$1"', "sh", str(received)]
    run_until(worker(store, command), finished(store, job, at), "the run")
    assert run_row(store, job, at)["status"] == "succeeded"
    assert json.loads(received.read_text()) == payload  # delivered as data, verbatim
    assert not pwned.exists()


# -- crashes and concurrency ---------------------------------------------------------------


def test_a_worker_killed_mid_run_is_recovered_by_another(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    job, at = queued_run(store, max_attempts=3)
    started = tmp_path / "started"
    ran = tmp_path / "ran"
    # the first attempt hangs (its worker dies under it); later attempts succeed
    script = (
        f'if [ "$SCHED_ATTEMPT" = 1 ]; then echo $$ > {started}; exec sleep 1000; fi; '
        f'echo "$SCHED_ATTEMPT" >> {ran}'
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "daemon"), str(ROOT)])}
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.queue_support",
            db_url,
            "q",
            "doomed-worker",
            str(LEASE),
            str(HEARTBEAT),
            "--",
            "sh",
            "-c",
            script,
        ],
        cwd=ROOT,
        env=env,
    )
    orphan: int | None = None
    try:
        orphan = kill_when_started(child, started)
        (message,) = messages(store)
        assert message["lease_owner"] == "doomed-worker"
        assert message["leased_until"] is not None, "the dead worker's lease is still held"
        # the killed worker's command lives on in its own session (as a real one would
        # under kill -9 without a cgroup); end it so it cannot mask anything below
        os.killpg(orphan, signal.SIGKILL)
        w = worker(store, ["sh", "-c", script], owner="rescuer")
        run_until(w, finished(store, job, at), "the redelivered run")
    finally:
        end_processes([child], orphan)
    run = run_row(store, job, at)
    assert (run["status"], run["attempt"]) == ("succeeded", 2)
    history = attempts(store, job, at)
    assert [(a["attempt"], a["status"], a["worker"]) for a in history] == [
        (1, "lost", "doomed-worker"),
        (2, "succeeded", "rescuer"),
    ]
    assert history[0]["error"] == LOST_ERROR
    assert ran.read_text().split() == ["2"]


def test_max_concurrency_one_never_overlaps(store: Store, tmp_path: Path) -> None:
    jobs = [queue_job(store, max_concurrency=1) for _ in range(2)]
    runs = [(job, trigger(store, job)) for job in jobs for _ in range(4)]
    QueueRepo(store).move_outbox()
    log = tmp_path / "intervals"
    code = (
        "import os, sys, time\n"
        "start = time.time(); time.sleep(0.3); end = time.time()\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write(f\"{os.environ['SCHED_JOB_ID']} {start} {end}\\n\")\n"
    )

    def all_done() -> bool:
        return all(run_row(store, j, at)["status"] == "succeeded" for j, at in runs)

    run_until(worker(store, python(code, str(log)), concurrency=4), all_done, "all runs")
    intervals: dict[str, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines():
        job_id, began, ended = line.split()
        intervals.setdefault(job_id, []).append((float(began), float(ended)))
    assert sorted(intervals) == sorted(jobs)
    for job_id, spans in intervals.items():
        spans.sort()
        assert len(spans) == 4
        for (_, first_end), (second_start, _) in itertools.pairwise(spans):
            assert second_start >= first_end, f"two runs of job {job_id} overlapped"


# -- shutdown ------------------------------------------------------------------------------


def test_stop_lets_the_run_in_flight_finish(store: Store, tmp_path: Path) -> None:
    job, at = queued_run(store)
    started = tmp_path / "started"
    stop = threading.Event()
    w = worker(store, ["sh", "-c", f"touch {started}; sleep 1; echo finished"])
    thread = threading.Thread(target=w.run, args=(stop,), daemon=True)
    thread.start()
    wait_for(started.exists, "the run to start")
    stop.set()
    thread.join(60)
    assert not thread.is_alive()
    run = run_row(store, job, at)
    assert (run["status"], run["output_tail"].strip()) == ("succeeded", "finished")


def test_force_kills_the_run_in_flight(store: Store, tmp_path: Path) -> None:
    job, at = queued_run(store, max_attempts=2)
    pid_file = tmp_path / "pid"
    stop, force = threading.Event(), threading.Event()
    w = worker(store, ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 1000"])
    thread = threading.Thread(
        target=lambda: w.run(stop, force=force),
        daemon=True,
    )
    thread.start()
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip() != "", "the run")
    stop.set()
    force.set()
    thread.join(60)
    assert not thread.is_alive()
    wait_for(lambda: not pid_alive(int(pid_file.read_text())), "the command to die")
    run = run_row(store, job, at)
    assert (run["status"], run["error"]) == ("failed", "killed: the worker was forced to stop")
    (message,) = messages(store)
    assert message["attempt"] == 2 and message["leased_until"] is None


class _HeldSettles(DirectBackend):
    """The real database backend whose outcome recording waits until `open` is set."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.open = threading.Event()

    def settle_many(
        self, items: Sequence[tuple[LeasedRun, Settlement]]
    ) -> list[bool | errors.StoreUnavailable]:
        self.open.wait(60)
        return super().settle_many(items)


def test_a_slot_frees_when_its_command_ends_and_leasing_waits_for_the_record_backlog(
    store: Store, tmp_path: Path
) -> None:
    # concurrency 1 with a record backlog of 1: while recording is held, the run after the
    # first starts (its slot freed when the command ended), the third waits for a record
    job = queue_job(store, max_concurrency=5)
    for _ in range(3):
        trigger(store, job)
    QueueRepo(store).move_outbox()
    ran = tmp_path / "ran"
    backend = _HeldSettles(store)
    w = worker(backend, ["sh", "-c", f"echo x >> {ran}"], concurrency=1)  # type: ignore[arg-type]

    def lines() -> int:
        return len(ran.read_text().splitlines()) if ran.exists() else 0

    def run(stop: threading.Event) -> None:
        w.run(stop)

    with running_loop(run, "worker"):
        wait_for(lambda: lines() == 2, "two commands while their outcomes wait")
        # the third is not leased while two outcomes wait (a bound, not a race: the
        # lease loop polls every 0.05 s, so half a second is ten looks)
        time.sleep(0.5)
        assert lines() == 2
        assert [m["leased_until"] is not None for m in messages(store)].count(True) == 2
        backend.open.set()
        wait_for(lambda: lines() == 3 and messages(store) == [], "the third run and every record")
    with store.read() as connection:
        statuses = connection.execute(
            select(schema.runs.c.status).where(schema.runs.c.job_id == job)
        ).scalars()
        assert sorted(statuses) == ["succeeded"] * 3


def test_max_runs_and_idle_exit(store: Store) -> None:
    job = queue_job(store, max_concurrency=5)
    for _ in range(3):
        trigger(store, job)
    QueueRepo(store).move_outbox()
    w = worker(store, ["true"])
    assert w.run(threading.Event(), max_runs=2) == 2
    assert w.run(threading.Event(), idle_exit=True) == 1
    assert messages(store) == []


def test_relay_feeds_the_worker(store: Store) -> None:
    job = queue_job(store)
    relay = Relay(store, poll_seconds=0.05)
    relay_stop = threading.Event()
    relay_thread = threading.Thread(target=relay.run, args=(relay_stop,), daemon=True)
    relay_thread.start()
    try:
        at = trigger(store, job)
        relay.wake()
        run_until(worker(store, ["sh", "-c", "echo hi"]), finished(store, job, at), "the run")
    finally:
        relay_stop.set()
        relay_thread.join(60)
    assert not relay_thread.is_alive()
    assert relay.moved == 1
    assert run_row(store, job, at)["status"] == "succeeded"


# -- construction and helpers ----------------------------------------------------------------


def test_worker_rejects_bad_settings(sqlite_url: str) -> None:
    store = Store.open(sqlite_url)
    try:
        with pytest.raises(errors.ConfigError):
            Worker(store, "q", [])
        with pytest.raises(errors.ConfigError):
            Worker(store, "q", ["true"], lease_seconds=5, heartbeat_seconds=5)
        with pytest.raises(errors.ConfigError):
            Worker(store, "q", ["true"], concurrency=0)
    finally:
        store.close()


def test_tail_buffer_keeps_only_the_end() -> None:
    tail = TailBuffer(10)
    for chunk in (b"abc", b"defghij", b"klm", b"n" * 3):
        tail.write(chunk)
    assert tail.text() == "ghijklmnnn"
    tail.write(b"0123456789ABCDEF")
    assert tail.text() == "6789ABCDEF"
    assert tail.total == 32


# -- database outages ------------------------------------------------------------------------


def test_relay_and_worker_ride_out_a_postgres_restart(
    pg_server: PostgresServer, pg_url: str, tmp_path: Path
) -> None:
    store = Store.open(pg_url)
    make_tenant(store)
    job = queue_job(store, max_concurrency=2)
    go = tmp_path / "go"
    started = tmp_path / "started"
    # the first run is in flight across the outage; it ends when the test says so
    script = f"touch {started}; while [ ! -f {go} ]; do sleep 0.05; done; echo done"
    relay = Relay(store, poll_seconds=0.05)
    # a lease much longer than the outage: the run in flight keeps it throughout
    w = worker(store, ["sh", "-c", script], lease_seconds=60.0, concurrency=2)
    stop = threading.Event()
    threads = [
        threading.Thread(target=relay.run, args=(stop,), daemon=True),
        threading.Thread(target=w.run, args=(stop,), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        first = trigger(store, job)
        wait_for(started.exists, "the first run to start")
        pg_server.stop()
        try:
            wait_for(
                lambda: relay.store_errors > 0 and w.store_errors > 0,
                "the relay and the worker to notice the outage",
            )
            assert all(t.is_alive() for t in threads)
        finally:
            pg_server.start()
        go.touch()
        second = trigger(store, job)
        wait_for(finished(store, job, first), "the run in flight to be recorded")
        wait_for(finished(store, job, second), "a run created after the outage")
        assert run_row(store, job, first)["status"] == "succeeded"
        assert run_row(store, job, second)["status"] == "succeeded"
        assert [a["status"] for a in attempts(store, job, first)] == ["succeeded"]
    finally:
        go.touch()
        stop.set()
        for t in threads:
            t.join(60)
        store.close()
    assert not any(t.is_alive() for t in threads)
