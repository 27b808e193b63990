"""The harness's process helper: readiness probes are bounded, a dead server is reported
with its log, and stop/kill leave no process behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.services.ports import ServiceError, pid_alive
from tests.services.process import ServerProcess, poll_ready

# a server stand-in: says something, then sleeps until signalled
SLEEPER = [sys.executable, "-c", "import time; print('sleeper up', flush=True); time.sleep(600)"]


def test_a_probe_that_never_answers_gives_up_with_the_logs() -> None:
    probes: list[float] = []

    def never(timeout: float) -> None:
        probes.append(timeout)

    with pytest.raises(ServiceError, match="not ready") as info:
        poll_ready(
            never,
            what="nothing",
            timeout=0.3,
            probe_timeout=0.1,
            interval=0.01,
            logs=lambda: {"the log": "last words"},
        )
    assert "last words" in str(info.value)
    assert probes and all(t <= 0.1 for t in probes), "a probe got more than its own timeout"


def test_the_first_answer_is_returned() -> None:
    answers = iter([None, None, "leader"])
    found = poll_ready(lambda t: next(answers), what="x", timeout=30, probe_timeout=1)
    assert found == "leader"


def test_a_server_that_dies_is_reported_with_its_log(tmp_path: Path) -> None:
    process = ServerProcess(
        "quitter",
        [sys.executable, "-c", "print('bad config, bye'); raise SystemExit(3)"],
        log_path=tmp_path / "quitter.log",
    )
    process.start()
    with pytest.raises(ServiceError, match="exited with code 3") as info:
        poll_ready(
            lambda t: None,
            what="quitter",
            timeout=60,
            probe_timeout=1,
            check_alive=process.check_alive,
        )
    assert "bad config, bye" in str(info.value)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_stop_and_kill_leave_nothing_running(tmp_path: Path, how: str) -> None:
    process = ServerProcess("sleeper", SLEEPER, log_path=tmp_path / "sleeper.log")
    process.start(banner="starting")
    pid = process.pid
    assert pid is not None and process.is_running()
    poll_ready(
        lambda t: True if "sleeper up" in process.log_tail() else None,
        what="sleeper",
        timeout=60,
        probe_timeout=1,
        check_alive=process.check_alive,
    )
    if how == "stop":
        process.stop(timeout=10, whole_tree=True)
    else:
        process.kill(whole_tree=True)
    assert not process.is_running() and process.pid is None
    assert not pid_alive(pid)
    assert "===== starting =====" in process.log_tail()
