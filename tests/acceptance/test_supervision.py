"""Nothing stops silently: a component loop that raises is logged and started again (the
dispatcher survives a poisoned row), and a component thread that dies anyway makes
/healthz unhealthy and the real `scheduled-d all` process exit non-zero."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests
from sqlalchemy import select, update

from schedctl.coordination.local import LocalCoordinator
from schedctl.domain.config import Config
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from scheduled_d.runtime import make_dispatcher
from scheduled_d.supervise import Supervisor
from tests.factories import create_job, make_tenant, once_at
from tests.services.ports import free_port

BIN = Path(sys.executable).parent
WAIT_SECONDS = 120.0  # bound of every wait; they normally end in seconds


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


def test_a_loop_that_raises_is_restarted_and_one_that_returns_unasked_is_a_death() -> None:
    supervisor = Supervisor()
    stop = threading.Event()
    calls: list[int] = []

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("unexpected")
        stop.wait()

    thread = supervisor.start("flaky", flaky, stop)
    _until(lambda: len(calls) == 2, "the restart")
    assert supervisor.healthy() and thread.is_alive()
    stop.set()
    thread.join(WAIT_SECONDS)
    assert supervisor.healthy()  # asked to stop: not a death

    quits = supervisor.start("quits", lambda: None, threading.Event())
    quits.join(WAIT_SECONDS)
    assert supervisor.died.is_set() and supervisor.failures() == ["quits"]
    assert not supervisor.healthy()


def test_the_dispatcher_survives_an_unexpected_exception(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A job row whose schedule cannot be decoded makes the dispatcher's load raise (not a
    database outage); the dispatcher logs the traceback and starts again, and once the row
    is repaired the job's run is claimed by the same, still running, thread."""
    store = Store.open(db_url)
    stop = threading.Event()
    try:
        tenant = make_tenant(store)
        job_id = create_job(store, tenant, once_at(datetime.now(UTC) + timedelta(seconds=1)))
        with store.tx() as connection:
            good = connection.execute(
                select(schema.jobs.c.schedule).where(schema.jobs.c.job_id == job_id)
            ).scalar_one()
            connection.execute(
                update(schema.jobs)
                .where(schema.jobs.c.job_id == job_id)
                .values(schedule=json.dumps({"kind": "poison"}))
            )
        coordinator = LocalCoordinator(store, "d1")
        coordinator.start()
        config = Config(database_url=db_url, node_name="d1", poll_interval_seconds=0.1)
        supervisor = Supervisor()
        caplog.set_level(logging.ERROR, logger="scheduled_d.supervise")
        thread = supervisor.start(
            "dispatcher", lambda: make_dispatcher(store, config, coordinator).run(stop), stop
        )
        _until(
            lambda: any("dispatcher failed unexpectedly" in r.message for r in caplog.records),
            "the dispatcher's failure to be logged",
        )
        record = next(r for r in caplog.records if "dispatcher failed" in r.message)
        assert record.exc_info is not None  # with its traceback
        with store.tx() as connection:
            connection.execute(
                update(schema.jobs).where(schema.jobs.c.job_id == job_id).values(schedule=good)
            )

        def claimed() -> bool:
            with store.read() as connection:
                return bool(
                    connection.execute(
                        select(schema.runs.c.job_id).where(schema.runs.c.job_id == job_id)
                    ).all()
                )

        _until(claimed, "the repaired job's run to be claimed")
        assert thread.is_alive() and supervisor.healthy()
        stop.set()
        thread.join(WAIT_SECONDS)
        assert not thread.is_alive() and supervisor.healthy()
        coordinator.stop()
    finally:
        stop.set()
        store.close()


def test_a_component_that_dies_makes_healthz_unhealthy_and_the_process_exit_non_zero(
    tmp_path: Path, sqlite_url: str
) -> None:
    """`scheduled-d all` with its maintenance thread made to end (SCHEDULED_D_FAULTS) while
    the worker runs a command that waits for a file: the process stays up (the worker
    finishes what it holds), so /healthz can be seen answering 503; then it exits 1."""
    started, release, trigger = tmp_path / "started", tmp_path / "release", tmp_path / "die"
    script = f"touch {started}; while [ ! -e {release} ]; do sleep 0.05; done; cat >/dev/null"
    port = free_port()
    config = tmp_path / "scheduled.toml"
    config.write_text(
        "poll_interval_seconds = 0.1\n"
        f'metrics_listen = "127.0.0.1:{port}"\n'
        "[[worker]]\n"
        'queue = "q"\n'
        f"command = {json.dumps(['/bin/sh', '-c', script])}\n"
        "lease_seconds = 30\n"
    )
    store = Store.open(sqlite_url)
    log_path = tmp_path / "daemon.log"
    process = None
    try:
        tenant = make_tenant(store)
        create_job(store, tenant, once_at(datetime.now(UTC) + timedelta(seconds=1)))
        with log_path.open("w") as log:
            process = subprocess.Popen(
                [BIN / "scheduled-d", "all", "--db", sqlite_url, "--config", config],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SCHEDULED_D_FAULTS": f"maintenance:exit-when:{trigger}"},
            )
        healthz = f"http://127.0.0.1:{port}/healthz"

        def status() -> int | None:
            try:
                return requests.get(healthz, timeout=10).status_code
            except requests.ConnectionError:
                return None

        _until(started.exists, "the worker to start the command")
        assert status() == 200, log_path.read_text()
        trigger.touch()  # the maintenance thread ends now
        _until(lambda: status() == 503, "/healthz to turn unhealthy")
        assert process.poll() is None  # still finishing the command it holds
        release.touch()
        assert process.wait(WAIT_SECONDS) == 1
        text = log_path.read_text()
        assert "maintenance died" in text
        assert "maintenance ended unexpectedly" in text
        with store.read() as connection:
            statuses = [r[0] for r in connection.execute(select(schema.runs.c.status))]
        assert statuses == ["succeeded"]  # the command it held was finished and recorded
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(30)
        store.close()
