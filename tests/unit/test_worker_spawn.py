"""Starting a worker's command (scheduled_d.spawn) and batching its backend calls
(scheduled_d.batching.Batcher): the pipes the command gets and the worker keeps, and what
a batch holds. No database."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable

import pytest

from scheduled_d.batching import Batcher
from scheduled_d.spawn import Child, spawn

# every test on both start paths (tests/conftest.py: start_path)
pytestmark = pytest.mark.usefixtures("start_path")

WAIT_SECONDS = 30.0  # only a bound on a hang: nothing here is timed


def _read_all(fd: int) -> bytes:
    data = b""
    while True:
        select.select([fd], [], [], WAIT_SECONDS)
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            return data
        data += chunk


def _finish(child: Child) -> tuple[bytes, bytes, int]:
    out, err = _read_all(child.stdout), _read_all(child.stderr)
    code = child.wait()
    for fd in (child.stdout, child.stderr):
        child.close(fd)
    child.close_stdin()
    return out, err, code


def test_the_command_gets_only_its_three_pipes_and_its_own_session() -> None:
    child = spawn(["/bin/sh", "-c", "cat; ls /proc/self/fd >&2"], {"PATH": "/usr/bin:/bin"})
    # cat waits for its stdin: the command is alive, the leader of its own process group
    assert os.getpgid(child.pid) == child.pid
    assert child.stdin is not None
    os.write(child.stdin, b"payload")
    child.close_stdin()  # EOF for cat: the worker's end was the only writer
    out, err, code = _finish(child)
    assert code == 0
    assert out == b"payload"
    # 0, 1 and 2, and the one ls opened to list them: no descriptor of the worker leaks
    assert sorted(int(x) for x in err.split()) == [0, 1, 2, 3]


def test_stdout_and_stderr_stay_apart_and_end_when_the_command_exits() -> None:
    child = spawn(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], {})
    child.close_stdin()
    out, err, code = _finish(child)
    assert (out, err, code) == (b"out\n", b"err\n", 3)


def test_a_command_that_cannot_start_leaves_no_descriptor_open() -> None:
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        spawn(["/nonexistent/command"], {})
    assert set(os.listdir("/proc/self/fd")) == before


def _collector() -> tuple[list[list[int]], threading.Event, Callable[[list[int]], None]]:
    calls: list[list[int]] = []
    called = threading.Event()

    def call(items: list[int]) -> None:
        calls.append(items)
        called.set()

    return calls, called, call


def test_a_batch_gathers_until_it_has_enough() -> None:
    calls, called, call = _collector()
    batcher: Batcher[int] = Batcher(call, "test-batch", gather=3, linger=3600.0)
    batcher.submit([1])
    batcher.submit([2, 3])
    assert called.wait(WAIT_SECONDS)
    batcher.close()
    assert calls == [[1, 2, 3]]


def test_closing_hands_on_a_short_batch_without_waiting_out_its_linger() -> None:
    calls, _called, call = _collector()
    batcher: Batcher[int] = Batcher(call, "test-batch", gather=10, linger=3600.0)
    batcher.submit([1, 2])
    batcher.close()  # joins the thread: the two were handed on before it ended
    assert calls == [[1, 2]]


def test_a_short_batch_goes_once_its_linger_is_over() -> None:
    calls, called, call = _collector()
    batcher: Batcher[int] = Batcher(call, "test-batch", gather=10, linger=0.01)
    batcher.submit([7])
    assert called.wait(WAIT_SECONDS)
    batcher.close()
    assert calls == [[7]]
