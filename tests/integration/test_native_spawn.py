"""The two start paths of scheduled_d.spawn with real processes: the native helper
(native/vspawn.c: vfork, the run's cgroup, exec) and the fallback (Popen, /bin/sh entering
the cgroup). A command run as another user has exactly that user's ids and groups, inside
its run's cgroup; a program that is missing, not executable or in a missing directory fails
with the fallback's very error; no descriptor of the worker reaches the command; the
command starts with every signal at its default and none blocked; check-config names the
path. No database."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduled_d import cgroups
from scheduled_d import spawn as spawning
from scheduled_d.cgroups import RunCgroup
from scheduled_d.spawn import Child, spawn

ENV = {"PATH": "/usr/bin:/bin"}
# ids no account of this machine has: nothing but the helper can have given them
UID, GID, GROUPS = 43210, 43211, [43212, 43213]


def _finish(child: Child) -> tuple[str, str, int]:
    """stdout, stderr and the exit code, once the command has exited."""
    child.close_stdin()
    code = child.wait()
    texts = []
    for fd in (child.stdout, child.stderr):
        os.set_blocking(fd, True)
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        child.close(fd)
        texts.append(data.decode())
    child.release()
    return texts[0], texts[1], code


def _status(text: str) -> dict[str, str]:
    """/proc/PID/status as a mapping."""
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


@pytest.fixture
def run_cgroup() -> Iterator[RunCgroup | None]:
    """A run cgroup of this process's containment (None where there is none)."""
    here = cgroups.containment()
    cgroup = here.new_run()
    yield cgroup
    if cgroup is not None:
        cgroup.release()
    here.trim()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_a_command_run_as_another_user_has_exactly_its_ids_and_groups(
    start_path: str, run_cgroup: RunCgroup | None
) -> None:
    script = "cat /proc/self/status; cat /proc/self/cgroup >&2"
    child = spawn(
        ["sh", "-c", script], ENV, user=UID, group=GID, extra_groups=GROUPS, cgroup=run_cgroup
    )
    out, err, code = _finish(child)
    assert code == 0, err
    status = _status(out)
    assert status["Uid"].split() == [str(UID)] * 4  # real, effective, saved, filesystem
    assert status["Gid"].split() == [str(GID)] * 4
    assert sorted(status["Groups"].split()) == [str(g) for g in GROUPS]
    assert status["CapEff"] == "0000000000000000"  # no root capability kept
    if run_cgroup is not None:  # entered through the worker's descriptor, as another user
        assert err.strip().endswith(f"/{run_cgroup.path.name}")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_the_supplementary_groups_are_emptied_when_the_run_has_none(start_path: str) -> None:
    before = os.getgroups()
    os.setgroups([GROUPS[0]])  # a group of the worker's that the run must not keep
    try:
        child = spawn(["cat", "/proc/self/status"], ENV, user=UID, group=GID, extra_groups=[])
    finally:
        os.setgroups(before)
    out, err, code = _finish(child)
    assert code == 0, err
    assert _status(out)["Groups"].strip() == ""


PYTHON = "/usr/bin/python3"  # (the venv's interpreter may be below a home only root may enter)
FAIL_CLOSED = """
import sys
from scheduled_d.spawn import spawn
try:
    spawn(["touch", sys.argv[1]], {"PATH": "/usr/bin:/bin"}, user=0, group=%d)
except OSError as exc:
    print(type(exc).__name__, exc.errno, exc.filename)
else:
    print("started")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
@pytest.mark.skipif(not os.access(PYTHON, os.X_OK), reason=f"needs {PYTHON}")
def test_a_user_switch_the_worker_may_not_make_fails_closed(
    start_path: str, tmp_path: Path
) -> None:
    # a worker that is not root asks for root: refused in the child, nothing executed
    tmp_path.chmod(0o777)
    marker = tmp_path / "ran"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(spawning.__file__).parents[1])}
    if start_path == "sh":
        env[spawning.SPAWN_ENV] = "sh"
    done = subprocess.run(
        [PYTHON, "-c", FAIL_CLOSED % GID, str(marker)], env=env, user=UID, group=GID,
        extra_groups=[], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["PermissionError", str(errno.EPERM), "None"]
    assert not marker.exists()


def _error(
    argv: list[str], workdir: str | None, cgroup: RunCgroup | None
) -> tuple[type[OSError], int | None, str | None, object]:
    with pytest.raises(OSError) as raised:
        spawn(argv, ENV, workdir=workdir, cgroup=cgroup)
    exc = raised.value
    return type(exc), exc.errno, exc.strerror, exc.filename


@pytest.mark.parametrize("in_cgroup", [True, False], ids=["cgroup", "no-cgroup"])
def test_a_program_that_cannot_start_fails_as_on_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_cgroup: bool
) -> None:
    if spawning.native is None:
        pytest.skip(f"no native start path: {spawning.native_reason}")
    not_executable = tmp_path / "script"
    not_executable.write_text("#!/bin/sh\ntrue\n")
    not_executable.chmod(stat.S_IRUSR | stat.S_IWUSR)
    cases = [
        (["no-such-program-here"], None),
        ([str(tmp_path / "missing")], None),
        ([str(not_executable)], None),
        (["true"], str(tmp_path / "no-such-dir")),  # the working directory
    ]
    here = cgroups.containment()
    native = spawning.native
    for argv, workdir in cases:
        seen = []
        for helper in (native, None):
            monkeypatch.setattr(spawning, "native", helper)
            cgroup = here.new_run() if in_cgroup else None
            try:
                seen.append(_error(argv, workdir, cgroup))
            finally:
                if cgroup is not None:
                    cgroup.release()
        assert seen[0] == seen[1], argv
        assert issubclass(seen[0][0], FileNotFoundError | PermissionError)
    here.trim()


def test_no_descriptor_of_the_worker_reaches_the_command(
    start_path: str, run_cgroup: RunCgroup | None, tmp_path: Path
) -> None:
    # descriptors the worker might hold without close-on-exec: an inheritable file, a pipe
    leaky = os.open(tmp_path / "file", os.O_CREAT | os.O_RDWR)
    os.set_inheritable(leaky, True)
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    try:
        out, err, code = _finish(spawn(["ls", "/proc/self/fd"], ENV, cgroup=run_cgroup))
    finally:
        for fd in (leaky, read_end, write_end):
            os.close(fd)
    assert code == 0, err
    # 0, 1 and 2 (its pipes), and the one ls opened to list them
    assert sorted(int(x) for x in out.split()) == [0, 1, 2, 3]


def _mask(text: str, field: str) -> int:
    return int(_status(text)[field], 16)


def _bit(number: int) -> int:
    """A signal's bit in /proc's SigIgn/SigBlk/SigCgt masks."""
    return 1 << (number - 1)


# Signals 32 and 33 are glibc's own: sigaction refuses them (and so does Python), so an
# ignore of one that the test process inherited (seen under the full suite) stays on both
# start paths, and glibc installs its handler in any program that needs one
GLIBC_OWN = _bit(32) | _bit(33)


def test_the_command_starts_with_default_signals_and_an_empty_mask(
    start_path: str, run_cgroup: RunCgroup | None
) -> None:
    # as a worker is: Python ignores SIGPIPE and SIGXFSZ, and has handlers of its own
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
    out, err, code = _finish(spawn(["cat", "/proc/self/status"], ENV, cgroup=run_cgroup))
    assert code == 0, err
    ignored = _mask(out, "SigIgn") & ~GLIBC_OWN
    if start_path == "sh":
        # Popen restores only what Python itself ignores; an ignore the test process
        # inherited from its parents stays (the native path resets those too: below)
        ignored &= _bit(signal.SIGPIPE) | _bit(signal.SIGXFSZ)
    assert (ignored, _mask(out, "SigBlk"), _mask(out, "SigCgt")) == (0, 0, 0)


def test_the_native_helper_resets_every_signal_and_the_mask_of_the_starting_thread(
    run_cgroup: RunCgroup | None,
) -> None:
    if spawning.native is None:
        pytest.skip(f"no native start path: {spawning.native_reason}")
    # (Popen keeps an ignored signal ignored, and the starting thread's mask: native only)
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGHUP})
    try:
        child = spawn(["cat", "/proc/self/status"], ENV, cgroup=run_cgroup)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGHUP})
        signal.signal(signal.SIGUSR2, before)
    out, err, code = _finish(child)
    assert code == 0, err
    ignored = _mask(out, "SigIgn") & ~GLIBC_OWN
    assert (ignored, _mask(out, "SigBlk"), _mask(out, "SigCgt")) == (0, 0, 0)


def test_a_command_killed_by_a_signal_has_a_negative_exit_code(start_path: str) -> None:
    child = spawn(["sh", "-c", "kill -KILL $$"], ENV)
    assert _finish(child)[2] == -signal.SIGKILL
    assert child.reap() == -signal.SIGKILL


def test_check_config_names_the_start_path(start_path: str, tmp_path: Path) -> None:
    from scheduled_d.checks import check_configuration

    config = tmp_path / "scheduled.toml"
    config.write_text(
        f'database_url = "sqlite:///{tmp_path}/db"\n[[worker]]\nqueue = "q"\ncommand = ["true"]\n'
    )
    line = check_configuration(str(config), bind=False).splitlines()[2]
    if start_path == "native":
        assert line == f"run start: commands started by the native helper {spawning.HELPER} " \
            "(vfork, cgroup, exec)"  # fmt: skip
    else:
        assert line.startswith("run start: commands started by subprocess, a run cgroup "
                               "entered through /bin/sh")  # fmt: skip
        assert line.endswith("turned off by the test")
