"""A run's output, kept and shown: the worker keeps up to its output_bytes ([[worker]]
output_bytes, default 64 KiB, at most 1 MiB) in the run history, far more than the old 16 KiB;
each line also goes to the daemon's log tagged with job and run (JSON fields with
--log-format json), cut at 4 KiB and at most 1,000 lines a second per run; and the output
so far of a running command reaches the run's row with each heartbeat."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from schedctl.app.service import Scheduler
from schedctl.clients.queue_client import MAX_OUTPUT_JSON_BYTES, ApiLeaseBackend, fit_output
from schedctl.core import errors, limits
from schedctl.domain.config import load_config
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db.store import Store
from scheduled_d.api.server import ApiServer
from scheduled_d.logsetup import JsonFormatter
from scheduled_d.output_log import MAX_LINE_BYTES, RunOutputLog
from scheduled_d.worker import Worker
from tests.factories import make_tenant
from tests.integration.queue_support import attempts, queue_worker, queued_run, run_row, wait_for

BIN = Path(sys.executable).parent
HEARTBEAT = 0.3


@pytest.fixture
def store(store: Store) -> Store:
    make_tenant(store)
    return store


def worker(store: Store, command: list[str], **kwargs: object) -> Worker:
    return queue_worker(store, command, **{"heartbeat_seconds": HEARTBEAT, **kwargs})


def run_until(w: Worker, done: Callable[[], bool], what: str) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=lambda: w.run(stop), daemon=True)
    thread.start()
    try:
        wait_for(done, what)
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()


def finished(store: Store, job: str, at: datetime) -> Callable[[], bool]:
    return lambda: run_row(store, job, at)["status"] in {"succeeded", "dead", "failed"}


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


# -- kept in the run history -----------------------------------------------------------------


def test_output_beyond_the_old_16_kib_is_kept_up_to_output_bytes(store: Store) -> None:
    job, at = queued_run(store)
    code = "import sys\nsys.stdout.write('start' + 'x' * 100000 + 'END')\n"
    w = worker(store, python(code))  # the default: 64 KiB
    assert w.output_tail_bytes == limits.DEFAULT_OUTPUT_BYTES == 65536
    run_until(w, finished(store, job, at), "the run")
    tail = run_row(store, job, at)["output_tail"]
    assert len(tail) == 65536 and tail.endswith("END") and not tail.startswith("start")
    (attempt,) = attempts(store, job, at)
    assert attempt["output_tail"] == tail


def test_a_larger_output_bytes_keeps_the_whole_output(store: Store) -> None:
    job, at = queued_run(store)
    code = "import sys\nsys.stdout.write('start' + 'x' * 200000 + 'END')\n"
    run_until(
        worker(store, python(code), output_tail_bytes=300_000), finished(store, job, at), "run"
    )
    tail = run_row(store, job, at)["output_tail"]
    assert tail == "start" + "x" * 200000 + "END"


def test_output_bytes_is_bounded(store: Store, tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError) as raised:
        worker(store, ["/bin/true"], output_tail_bytes=limits.MAX_OUTPUT_BYTES + 1)
    assert raised.value.field == "output_tail_bytes"
    config = tmp_path / "scheduled.toml"
    table = '[[worker]]\nqueue = "q"\ncommand = ["/bin/true"]\n'
    config.write_text(table + "output_bytes = 2000000\n")
    with pytest.raises(errors.ConfigError) as refused:
        load_config(config, environ={})
    assert refused.value.field == "worker.output_bytes"
    assert "scheduled.toml:4:" in str(refused.value)
    config.write_text(table + "output_bytes = 1048576\n")
    (spec,) = load_config(config, environ={}).workers
    assert spec.output_bytes == limits.MAX_OUTPUT_BYTES
    config.write_text(table)
    (default,) = load_config(config, environ={}).workers
    assert default.output_bytes == 65536


# -- the output so far, with each heartbeat --------------------------------------------------


def test_a_running_command_s_output_so_far_reaches_its_run_row(
    store: Store, tmp_path: Path
) -> None:
    job, at = queued_run(store)
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "print('first part', flush=True)\n"
        "while not os.path.exists(sys.argv[1]):\n"
        "    time.sleep(0.05)\n"
        "print('second part')\n"
    )
    w = worker(store, python(code, str(go)))
    stop = threading.Event()
    thread = threading.Thread(target=lambda: w.run(stop), daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: (
                (row := run_row(store, job, at))["status"] == "running"
                and "first part" in (row["output_tail"] or "")
            ),
            "the output so far in the running run's row",
        )
        go.touch()
        wait_for(finished(store, job, at), "the run")
    finally:
        go.touch()
        stop.set()
        thread.join(60)
    assert run_row(store, job, at)["output_tail"] == "first part\nsecond part\n"


# -- each line to the daemon's log -------------------------------------------------------


def test_each_output_line_is_logged_tagged_with_job_and_run(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    job, at = queued_run(store)
    code = (
        "import sys\n"
        "print('hello'); print('world', flush=True)\n"
        "sys.stderr.write('oops\\n'); sys.stderr.write('no newline at the end')\n"
    )
    with caplog.at_level(logging.INFO, logger="scheduled_d.output"):
        run_until(worker(store, python(code)), finished(store, job, at), "the run")
    records = [r for r in caplog.records if r.name == "scheduled_d.output"]
    run = format_instant(at)
    messages = [r.getMessage() for r in records]
    assert f"job {job} run {run}: hello" in messages
    assert f"job {job} run {run}: world" in messages
    assert f"job {job} run {run} stderr: oops" in messages
    assert f"job {job} run {run} stderr: no newline at the end" in messages
    for record in records:
        assert (record.__dict__["job"], record.__dict__["run"]) == (job, run)
        assert record.__dict__["run_key"] == f"{job}:{run}"
    streams = {r.getMessage().rsplit(": ", 1)[1]: r.__dict__["stream"] for r in records}
    assert streams["hello"] == "stdout" and streams["oops"] == "stderr"
    # --log-format json: job and run are fields of the entry
    entry = json.loads(JsonFormatter().format(records[0]))
    assert (entry["job"], entry["run"], entry["level"]) == (job, run, "INFO")
    assert entry["stream"] in {"stdout", "stderr"}


class _Lease:
    job_id = "j1"
    scheduled_at = datetime.fromisoformat("2026-12-01T05:00:00+00:00")
    attempt = 1
    timeout_seconds = 0
    payload = None
    idempotency_key = "j1:2026-12-01T05:00:00Z"


def _output_log(
    caplog: pytest.LogCaptureFixture, clock: Callable[[], float]
) -> tuple[RunOutputLog, Callable[[], list[str]]]:
    logger = logging.getLogger("scheduled_d.output.test")
    logger.setLevel(logging.INFO)
    caplog.set_level(logging.INFO, logger="scheduled_d.output.test")
    out = RunOutputLog(_Lease(), logger=logger, clock=clock)

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == logger.name]

    return out, messages


def test_long_lines_are_cut(caplog: pytest.LogCaptureFixture) -> None:
    out, messages = _output_log(caplog, lambda: 0.0)
    # a line longer than the bound, in several chunks, then a short one
    out.feed("stdout", b"a" * 3000)
    out.feed("stdout", b"b" * 3000 + b"\nshort\n")
    out.close()
    long, short = messages()
    prefix = "job j1 run 2026-12-01T05:00:00Z: "
    assert long == prefix + "a" * 3000 + "b" * (MAX_LINE_BYTES - 3000) + " [cut at 4096 bytes]"
    assert short == prefix + "short"


def test_a_flood_of_lines_is_bounded_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    out, messages = _output_log(caplog, lambda: now[0])
    out.feed("stdout", b"line\n" * 1500)  # within one second of the clock
    assert len(messages()) == 1000
    now[0] += 1.5  # the next second: the dropped lines are said, and logging goes on
    out.feed("stderr", b"after\n")
    out.close()
    said = messages()[1000:]
    assert said == [
        "job j1 run 2026-12-01T05:00:00Z: 500 lines not logged (over 1000 lines/s)",
        "job j1 run 2026-12-01T05:00:00Z stderr: after",
    ]


# -- over the REST API (tenant workers) ------------------------------------------------------


def test_fit_output_keeps_the_request_under_the_api_limit() -> None:
    # control characters are 6 bytes of JSON each, surrogate pairs 12: the end that fits
    worst = "\x01" * limits.MAX_OUTPUT_BYTES
    fitted = fit_output(worst)
    assert fitted is not None and len(json.dumps(fitted)) <= MAX_OUTPUT_JSON_BYTES
    assert len(json.dumps(fitted + "\x01" * 2)) > MAX_OUTPUT_JSON_BYTES  # the longest end
    assert fit_output("x" * 500_000) == "x" * 500_000  # what fits is kept whole
    # plain text: all that fits the request (the quotes take 2 bytes)
    assert fit_output("x" * limits.MAX_OUTPUT_BYTES) == "x" * (MAX_OUTPUT_JSON_BYTES - 2)
    assert fit_output(None) is None and fit_output("short") == "short"


@pytest.fixture
def api(store: Store) -> Iterator[tuple[Scheduler, str, str]]:
    sched = Scheduler(store)
    token = sched.new_token("acme", actor="test")
    server = ApiServer(sched, "127.0.0.1:0", access_log=False)
    server.start()
    try:
        yield sched, server.url, token
    finally:
        server.stop()


def test_an_api_worker_keeps_its_output_bytes_and_sends_output_so_far(
    api: tuple[Scheduler, str, str], tmp_path: Path
) -> None:
    sched, url, token = api
    job, at = queued_run(sched.store)
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "sys.stdout.write('\\x01' * 400000 + 'so far\\n'); sys.stdout.flush()\n"
        "while not os.path.exists(sys.argv[1]):\n"
        "    time.sleep(0.05)\n"
        "sys.stdout.write('y' * 300000 + 'END')\n"
    )
    backend = ApiLeaseBackend(url, token, timeout=10)
    w = worker(sched.store, python(code, str(go)), output_tail_bytes=limits.MAX_OUTPUT_BYTES)
    w.backend = backend
    stop = threading.Event()
    thread = threading.Thread(target=lambda: w.run(stop), daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: "so far" in (run_row(sched.store, job, at)["output_tail"] or ""),
            "the output so far through the heartbeat route",
        )
        go.touch()
        wait_for(finished(sched.store, job, at), "the run")
    finally:
        go.touch()
        stop.set()
        thread.join(60)
        backend.close()
    row = run_row(sched.store, job, at)
    assert row["status"] == "succeeded"  # the ack fit the API's request limit
    # far more than the old 16 KiB; cut to what a request can carry
    assert len(row["output_tail"]) > 300_000 and row["output_tail"].endswith("y" * 1000 + "END")


def test_a_worker_process_logs_each_line_as_json_fields(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    job, at = queued_run(store)
    code = "import sys\nprint('from the command')\nsys.stderr.write('to stderr\\n')\n"
    config = tmp_path / "scheduled.toml"
    config.write_text('[[worker]]\nqueue = "q"\ncommand = ["/bin/true"]\noutput_bytes = 100\n')
    options = ["--queue", "q", "--max-runs", "1", "--log-format", "json", "--db", db_url]
    command = python(code + "sys.stdout.write('x' * 1000 + 'END')\n")
    process = subprocess.run(
        [BIN / "scheduled-d", "worker", *options, "--config", str(config), "--", *command],
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
        capture_output=True,
        timeout=120,
        text=True,
    )
    assert process.returncode == 0, process.stderr
    entries = [json.loads(line) for line in process.stderr.splitlines() if line.startswith("{")]
    lines = {e["message"]: e for e in entries if e.get("job") == job}
    run = format_instant(at)
    out = lines[f"job {job} run {run}: from the command"]
    err = lines[f"job {job} run {run} stderr: to stderr"]
    assert (out["run"], out["stream"], out["level"], out["attempt"]) == (run, "stdout", "INFO", 1)
    assert (err["run_key"], err["stream"]) == (f"{job}:{run}", "stderr")
    # the [[worker]] table's output_bytes holds for a command given after -- too
    assert len(run_row(store, job, at)["output_tail"].split("\n--- stderr ---\n")[0]) == 100
