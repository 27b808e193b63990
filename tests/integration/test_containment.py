"""Run containment with real processes (issue 32 item 2), on SQLite and Postgres: a run's
`setsid` child is gone after a timeout and after a cancel, a replaced run's command is
stopped, tasks_max holds where the pids controller is there, the run cgroups are removed,
and where no cgroup can be had the worker (and check-config) say so."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from schedctl.domain.runpolicy import Overlap, RunLimits, RunPolicy
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.queue import QueueRepo
from scheduled_d import cgroups
from scheduled_d.spawn import Child, spawn
from tests.factories import make_tenant
from tests.integration.queue_support import (
    queue_job,
    queue_worker,
    queued_run,
    run_row,
    running_loop,
    trigger,
    wait_for,
)
from tests.services.ports import pid_alive

# a child that leaves the run's process group and session, as in the issue: its pid first
SETSID = "setsid sh -c 'echo $$ > {pid}; exec sleep 300' & sleep 100"


@pytest.fixture
def store(store: Store) -> Store:
    make_tenant(store)
    return store


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    """Nothing a test starts outlives it: its sleeps killed, dead workers' subtrees gone."""
    yield
    here = cgroups.containment()
    if here.subtree is not None:
        here.trim()
        here._sweep()
        mount = cgroups.find_v2_mount(Path("/proc/self/mountinfo").read_text())
        if mount is not None:
            cgroups._sweep_dead(mount)


def _kill(pid_file: Path) -> None:
    with contextlib.suppress(ValueError, OSError):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _run_cgroups() -> list[Path]:
    subtree = cgroups.containment().subtree
    return sorted(subtree.glob("run-*")) if subtree is not None else []


def test_a_setsid_child_is_gone_after_the_timeout(store: Store, tmp_path: Path) -> None:
    job, at = queued_run(store, max_attempts=1, timeout=3)
    pid_file = tmp_path / "pid"
    w = queue_worker(store, ["sh", "-c", SETSID.format(pid=pid_file)], lease_seconds=10.0)
    try:
        with running_loop(w.run, "worker"):
            wait_for(lambda: run_row(store, job, at)["status"] == "dead", "the timeout")
        assert run_row(store, job, at)["error"] == "timed out after 3s"
        pid = int(pid_file.read_text())
        # out of the process group, but in the run's cgroup: killed with it
        wait_for(lambda: not pid_alive(pid), "the setsid child to be gone")
        wait_for(lambda: _run_cgroups() == [] or _sweep_done(), "the run's cgroup removed")
    finally:
        _kill(pid_file)


def _sweep_done() -> bool:
    cgroups.containment().trim()  # (the empty ones kept for reuse)
    cgroups.containment()._sweep()
    return _run_cgroups() == []


def test_a_setsid_child_is_gone_after_a_cancel(store: Store, tmp_path: Path) -> None:
    job, at = queued_run(store, max_attempts=1)
    pid_file = tmp_path / "pid"
    w = queue_worker(store, ["sh", "-c", SETSID.format(pid=pid_file)], lease_seconds=10.0)
    try:
        with running_loop(w.run, "worker"):
            wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), "the child")
            JobRepo(store).cancel(job, actor="test")
            wait_for(lambda: run_row(store, job, at)["status"] == "failed", "the stop")
        pid = int(pid_file.read_text())
        wait_for(lambda: not pid_alive(pid), "the setsid child to be gone")
    finally:
        _kill(pid_file)


def test_replace_stops_the_running_command_and_runs_the_new_one(
    store: Store, tmp_path: Path
) -> None:
    job = queue_job(store, max_attempts=1, run=RunPolicy(overlap=Overlap.REPLACE))
    first = trigger(store, job)
    QueueRepo(store).move_outbox()
    pid_file, marker = tmp_path / "pid", tmp_path / "first"
    # the first run stays (with a setsid child); any later one ends at once
    script = f"[ -e {marker} ] && exit 0; touch {marker}; " + SETSID.format(pid=pid_file)
    w = queue_worker(store, ["sh", "-c", script], lease_seconds=10.0)
    try:
        with running_loop(w.run, "worker"):
            wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), "the first")
            second = trigger(store, job)
            QueueRepo(store).move_outbox()
            wait_for(lambda: run_row(store, job, second)["status"] == "succeeded", "the new run")
        old = run_row(store, job, first)
        assert old["status"] == "failed"
        assert old["error"].startswith("replaced by the run of ")
        pid = int(pid_file.read_text())
        wait_for(lambda: not pid_alive(pid), "the replaced run's processes to be gone")
    finally:
        _kill(pid_file)


def test_tasks_max_is_enforced_where_the_pids_controller_is(store: Store, tmp_path: Path) -> None:
    here = cgroups.containment()
    if here.subtree is None or "pids" not in here.controllers:
        pytest.skip(f"no pids controller for the runs here: {here.describe()}")
    job = queue_job(store, max_attempts=1, run=RunPolicy(tasks_max=3))
    at = trigger(store, job)
    QueueRepo(store).move_outbox()
    out = tmp_path / "out"
    # ten background sleeps: forks beyond the limit fail
    script = f"n=0; for i in 1 2 3 4 5 6 7 8 9 10; do sleep 5 & n=$((n+1)); done; echo $n > {out}"
    w = queue_worker(store, ["sh", "-c", script], lease_seconds=10.0)
    with running_loop(w.run, "worker"):
        wait_for(lambda: run_row(store, job, at)["status"] in {"succeeded", "dead"}, "the run")
    assert "fork" in (run_row(store, job, at)["output_tail"] or "").lower()


def test_limits_are_written_where_the_controllers_are(tmp_path: Path) -> None:
    here = cgroups.containment()
    if here.subtree is None:
        pytest.skip(here.describe())
    run = here.new_run(RunLimits(memory_max=64 << 20, cpu_weight=50, tasks_max=7))
    assert run is not None
    try:
        files = {"memory": "memory.max", "cpu": "cpu.weight", "pids": "pids.max"}
        for controller, name in files.items():
            if controller in here.controllers:
                assert (run.path / name).read_text().strip() in {str(64 << 20), "50", "7"}
            else:
                assert not (run.path / name).exists()
    finally:
        run.release()
    assert not run.path.exists()


def test_without_a_cgroup_the_process_group_still_contains_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(cgroups.MODE_ENV, "process-group")
    fallback = cgroups.set_up()
    assert fallback.subtree is None and fallback.new_run() is None
    assert "process group only" in fallback.describe()
    assert "process group only" in cgroups.describe_probe()


def test_the_probe_reads_the_mount_and_the_own_cgroup() -> None:
    v1_only = "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd\n"
    mount, own, why = cgroups.probe(v1_only, "1:name=systemd:/\n")
    assert (mount, own) == (None, None) and why == "no cgroup v2 hierarchy is mounted"
    unified = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
    assert cgroups.find_v2_mount(v1_only + unified) == Path("/sys/fs/cgroup/unified")
    assert cgroups.own_path("1:cpu:/\n0::/system.slice/x.service\n") == "/system.slice/x.service"
    _, own, why = cgroups.probe(unified, "1:cpu:/\n")
    assert own is None and "no cgroup v2" in why


def test_a_worker_thread_count_of_runs_leave_no_cgroup_behind(store: Store) -> None:
    if cgroups.containment().subtree is None:
        pytest.skip(cgroups.containment().describe())
    jobs = [queue_job(store, max_attempts=1) for _ in range(5)]
    runs = [(job, trigger(store, job)) for job in jobs]
    QueueRepo(store).move_outbox()
    w = queue_worker(store, ["true"], concurrency=4)
    stop = threading.Event()
    with running_loop(w.run, "worker"):
        wait_for(
            lambda: all(run_row(store, j, at)["status"] == "succeeded" for j, at in runs),
            "the runs",
        )
    stop.set()
    wait_for(_sweep_done, "every run's cgroup removed")


def test_check_config_says_how_runs_are_contained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduled_d.checks import check_configuration

    config = tmp_path / "scheduled.toml"
    config.write_text(
        f'database_url = "sqlite:///{tmp_path}/db"\n[[worker]]\nqueue = "q"\ncommand = ["true"]\n'
    )
    monkeypatch.setenv(cgroups.MODE_ENV, "process-group")
    summary = check_configuration(str(config), bind=False)
    assert summary.splitlines()[1] == (
        "run containment: runs contained by process group only: turned off "
        f"({cgroups.MODE_ENV}=process-group)"
    )
    monkeypatch.delenv(cgroups.MODE_ENV)
    line = check_configuration(str(config), bind=False).splitlines()[1]
    assert line == f"run containment: {cgroups.describe_probe()}"


def test_skip_never_runs_two_at_once_with_real_commands(store: Store, tmp_path: Path) -> None:
    job = queue_job(store, max_attempts=1, run=RunPolicy(overlap=Overlap.SKIP))
    log, started = tmp_path / "log", tmp_path / "started"
    script = f"echo start >> {log}; touch {started}; sleep 1; echo end >> {log}"
    first = trigger(store, job)
    QueueRepo(store).move_outbox()
    w = queue_worker(store, ["sh", "-c", script], concurrency=4, lease_seconds=10.0)
    with running_loop(w.run, "worker"):
        wait_for(started.exists, "the first run")
        later = [trigger(store, job) for _ in range(3)]
        QueueRepo(store).move_outbox()
        wait_for(lambda: run_row(store, job, first)["status"] == "succeeded", "the first run")
    for at in later:
        row = run_row(store, job, at)
        assert (row["status"], row["error"]) == ("skipped", "previous run still running")
    assert log.read_text().split() == ["start", "end"]


def _output(child: Child) -> str:
    """All a command wrote to stdout, once it has exited (and nothing else holds the pipe)."""
    child.wait()
    # blocking: a background child may hold the pipe a moment longer (until its redirection)
    os.set_blocking(child.stdout, True)
    out = b""
    while chunk := os.read(child.stdout, 4096):
        out += chunk
    return out.decode()


def test_an_emptied_run_cgroup_is_reused_and_one_with_a_process_left_is_not() -> None:
    here = cgroups.containment()
    if here.subtree is None:
        pytest.skip(here.describe())
    here.trim()
    env = {"PATH": "/usr/bin:/bin"}
    first = here.new_run()
    assert first is not None
    spawn(["true"], env, cgroup=first).wait()
    first.release()
    first.release()  # once only: it is not kept twice
    second, third = here.new_run(), here.new_run()
    assert second is not None and third is not None
    assert second.path == first.path and third.path != first.path
    third.release()
    left = 0
    try:
        # a command that exits by itself keeps its background child (as under cron)
        script = "cat /proc/self/cgroup; sleep 300 >/dev/null 2>&1 & echo $!"
        child = spawn(["sh", "-c", script], env, cgroup=second)
        text = _output(child)
        assert f"/{second.path.name}\n" in text  # the reused cgroup still holds the command
        left = int(text.split()[-1])
        child.release(kill=False)
        assert pid_alive(left) and second.path.exists()
        fourth = here.new_run()
        assert fourth is not None and fourth.path != second.path
        fourth.release()
    finally:
        if left:
            os.kill(left, signal.SIGKILL)
    # a run with limits gets a cgroup of its own, removed after it
    limited = here.new_run(RunLimits(tasks_max=50))
    assert limited is not None and limited.path != third.path
    limited.release()
    assert not limited.path.exists()
    wait_for(_sweep_done, "every run's cgroup removed")
