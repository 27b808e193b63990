"""`scheduled-d all` as a real process: it runs jobs end to end, stops cleanly on SIGTERM,
and after kill -9 and a restart no run is lost and none is claimed twice. On SQLite, and on
Postgres as the runtime role (tests/pg_roles.py: DML only, no DDL), as operators run it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests
from sqlalchemy import select

from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from scheduled_d.worker import RECORD_BACKLOG_DIVISOR
from tests.acceptance.process_support import wait_for
from tests.factories import bulk_once_jobs, create_job, every, make_tenant, once_at
from tests.services.ports import free_port

BIN = Path(sys.executable).parent


class Daemon:
    """One `scheduled-d all` process with a worker that logs each execution to a file."""

    def __init__(self, tmp_path: Path, db_url: str) -> None:
        self.db_url = db_url
        self.executions = tmp_path / "executions.log"
        self.log = tmp_path / "daemon.log"
        self.config = tmp_path / "scheduled.toml"
        script = (
            f'echo "$SCHED_IDEMPOTENCY_KEY $SCHED_ATTEMPT" >> {self.executions}; cat >/dev/null'
        )
        self.metrics_port = free_port()
        self.config.write_text(
            "poll_interval_seconds = 0.1\n"
            f'metrics_listen = "127.0.0.1:{self.metrics_port}"\n'
            "[[worker]]\n"
            'queue = "q"\n'
            f"command = {json.dumps(['/bin/sh', '-c', script])}\n"
            "concurrency = 4\n"
            "lease_seconds = 3\n"
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("a") as log:
            self.process = subprocess.Popen(
                [BIN / "scheduled-d", "all", "--db", self.db_url, "--config", self.config],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SCHEDULED_LOG_LEVEL": "DEBUG"},
            )

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout: float = 60) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres-runtime-role", marks=pytest.mark.postgres),
    ]
)
def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_runtime_url")
    d = Daemon(tmp_path, url)
    yield d
    d.stop()
    if request.param == "postgres":
        # the runtime role never tried what it may not do
        assert "permission denied" not in d.log.read_text()


def runs_by_status(store: Store) -> Counter[str]:
    with store.read() as connection:
        return Counter(r[0] for r in connection.execute(select(schema.runs.c.status)))


def test_all_runs_jobs_and_stops_cleanly_on_sigterm(daemon: Daemon) -> None:
    store = Store.open(daemon.db_url)
    try:
        tenant = make_tenant(store)
        create_job(store, tenant, once_at(datetime.now(UTC) + timedelta(seconds=1)))
        create_job(store, tenant, every(1, datetime.now(UTC)))
        daemon.start()
        assert wait_for(lambda: runs_by_status(store)["succeeded"] >= 3, poll=0.25), (
            daemon.log.read_text()
        )
        base = f"http://127.0.0.1:{daemon.metrics_port}"
        assert requests.get(f"{base}/healthz", timeout=10).status_code == 200
        scrape = requests.get(f"{base}/metrics", timeout=10).text
        assert "scheduled_claims_total" in scrape
        assert "scheduled_owned_partitions 1024.0" in scrape
        if store.is_postgres:
            # its maintenance ran without DDL and says the owner's partitions are missing
            assert wait_for(lambda: "schedctl db maintain" in daemon.log.read_text(), poll=0.25)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
        assert "stopped" in daemon.log.read_text()
        # the partitions were released for the next owner
        with store.read() as connection:
            owners = {r[0] for r in connection.execute(select(schema.partitions.c.owner))}
        assert owners == {None}
    finally:
        store.close()


def test_kill_9_and_restart_loses_no_run_and_claims_none_twice(daemon: Daemon) -> None:
    store = Store.open(daemon.db_url)
    try:
        tenant = make_tenant(store)
        start = datetime.now(UTC)
        # The recurring jobs first and their anchor 2-3 s ahead: a job created after its
        # anchor starts at the next second (at load 10 the 300 one-time jobs once took longer
        # than the 0-1 s the anchor was ahead, and the check below missed a first run)
        anchor = start.replace(microsecond=0) + timedelta(seconds=3)
        recurring = [
            create_job(store, tenant, every(1, anchor, misfire=MisfirePolicy.run_all))
            for _ in range(5)
        ]
        one_time = bulk_once_jobs(
            store, tenant, [start + timedelta(seconds=1 + i * 0.02) for i in range(300)]
        )
        daemon.start()
        assert wait_for(lambda: runs_by_status(store)["succeeded"] >= 50, poll=0.25), (
            daemon.log.read_text()
        )
        daemon.signal(signal.SIGKILL)
        daemon.wait(30)
        killed_at = datetime.now(UTC)
        time.sleep(1.5)  # down for a while: runs fall due meanwhile
        daemon.start()

        def caught_up() -> bool:
            with store.read() as connection:
                done = {
                    r[0]
                    for r in connection.execute(
                        select(schema.runs.c.job_id).where(schema.runs.c.status == "succeeded")
                    )
                }
                pending = connection.execute(select(schema.queue_messages.c.id)).first()
            return set(one_time) <= done and pending is None

        assert wait_for(caught_up, poll=0.25), daemon.log.read_text()[-3000:]
        restarted_until = datetime.now(UTC)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0

        with store.read() as connection:
            runs = connection.execute(
                select(schema.runs.c.job_id, schema.runs.c.scheduled_at, schema.runs.c.status)
            ).all()
            lost_attempts = {
                (r[0], r[1])
                for r in connection.execute(
                    select(schema.run_attempts.c.job_id, schema.run_attempts.c.scheduled_at).where(
                        schema.run_attempts.c.status == "lost"
                    )
                )
            }
        keys = Counter((job_id, at) for job_id, at, _ in runs)
        assert max(keys.values()) == 1  # one run row per (job_id, scheduled_at)
        # nothing lost: every one-time job ran; every recurring job ran at every second
        # from its anchor through the downtime up to the stop
        assert {job_id for job_id, _, s in runs if s == "succeeded"} >= set(one_time)
        for job_id in recurring:
            times = sorted(at for j, at, _ in runs if j == job_id)
            expected = int((killed_at - anchor).total_seconds())
            assert len(times) >= expected
            assert times == [anchor + timedelta(seconds=i) for i in range(len(times))]
            assert times[-1] <= restarted_until
        # executed once each, except those in flight at the kill: those were leased by
        # the dead worker, found lost when the lease expired, and executed again
        executions = Counter(
            line.split()[0] for line in daemon.executions.read_text().splitlines() if line
        )
        twice = {key for key, n in executions.items() if n > 1}
        lost_keys = {f"{j}:{at.isoformat().replace('+00:00', 'Z')}" for j, at in lost_attempts}
        assert twice <= lost_keys
        # at most the worker's concurrency (4) in flight plus its record backlog: outcomes
        # of finished runs handed to the settler and not recorded yet (worker/admission.py)
        assert len(twice) <= 4 + max(1, 4 // RECORD_BACKLOG_DIVISOR)
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["all", "dispatcher", "relay"])
def test_an_unreachable_database_is_a_message_not_a_traceback(mode: str) -> None:
    done = subprocess.run(
        [BIN / "scheduled-d", mode, "--db", "postgresql://postgres@127.0.0.1:1/nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 7, done.stderr
    assert "cannot reach the database" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_config_file_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('claim_batch_size = "many"\n')
    done = subprocess.run(
        [BIN / "scheduled-d", "all", "--config", config],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "claim_batch_size" in done.stderr and "Traceback" not in done.stderr


def test_a_clean_stop_checkpoints_sqlite_so_the_file_alone_holds_every_run(
    tmp_path: Path, sqlite_url: str
) -> None:
    """After SIGTERM the database file without its -wal holds every run (a copy of the file
    is a backup), while another connection (this test's) keeps SQLite from checkpointing
    on its own when the daemon's last connection closes."""
    daemon = Daemon(tmp_path, sqlite_url)
    store = Store.open(sqlite_url)
    try:
        tenant = make_tenant(store)
        create_job(store, tenant, every(1, datetime.now(UTC)))
        daemon.start()
        assert wait_for(lambda: runs_by_status(store)["succeeded"] >= 3, poll=0.25), (
            daemon.log.read_text()
        )
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, daemon.log.read_text()
        path = Path(sqlite_url.removeprefix("sqlite:///"))
        copy = tmp_path / "copy.db"
        shutil.copyfile(path, copy)  # the main file alone, without -wal and -shm
        with store.read() as connection:
            runs = sorted(
                tuple(map(str, row))
                for row in connection.execute(select(schema.runs.c.job_id, schema.runs.c.status))
            )
        assert len(runs) >= 3
        # immutable: read the copy as it is, making no -wal or -shm of its own
        alone = sqlite3.connect(f"file:{copy}?immutable=1", uri=True)
        try:
            copied = sorted(alone.execute("SELECT job_id, status FROM runs").fetchall())
        finally:
            alone.close()
        assert copied == runs
    finally:
        daemon.stop()
        store.close()
