"""Job files opened once (schedctl.domain.jobfiles.opening): each refusal reason of the walk from /
and of the opened file's own fstat, the same refusal from the worker's scan and from the
loader `schedctl apply` and check-config use, and a race: a thread flips a symlink on the
path between trusted and foreign content while the scanner loads, and the foreign content
is never loaded. Tests run as root: files are chown-ed to `nobody` to stand for another
user."""

from __future__ import annotations

import os
import pwd
import threading
import time
from pathlib import Path

import pytest

from schedctl.domain.jobfiles import load_dir, load_file
from schedctl.domain.jobfiles.host import HostFiles, permission_problem
from schedctl.domain.jobfiles.model import JobFile, JobFilesError
from schedctl.domain.jobfiles.opening import open_dir

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files")
JOB = '[[job]]\nname = "{name}"\ncron = "0 3 * * *"\ncommand = ["/bin/echo", "{name}"]\n'
NOBODY = pwd.getpwnam("nobody")


def directory(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


def write(path: Path, name: str, mode: int = 0o644) -> Path:
    path.write_text(JOB.format(name=name))
    path.chmod(mode)
    return path


def refusals(jobs: Path, name: str) -> tuple[str, str, str]:
    """The reason the worker's scan, `schedctl apply`'s loader (load_dir) and load_file give
    for the file `name` of `jobs`: all three must refuse it, for the same reason."""
    files = HostFiles(jobs)
    changes = files.scan()
    assert files.jobs() == []
    scanned = [p.message for p in changes.refused if Path(p.path).name == name]
    with pytest.raises(JobFilesError) as applied:
        load_dir(jobs)
    with pytest.raises(JobFilesError) as single:
        load_file(jobs / name)
    (scan,) = scanned
    (apply,) = [p.message for p in applied.value.problems if Path(p.path).name == name]
    (one,) = [p.message for p in single.value.problems]
    assert scan == apply == one
    return scan, applied.value.problems[0].key, str(applied.value)


def test_a_trusted_file_loads_through_every_path(tmp_path: Path) -> None:
    jobs = directory(tmp_path / "jobs.d")
    write(jobs / "a.toml", "a")
    files = HostFiles(jobs)
    assert files.scan().added == (str(jobs / "a.toml"),)
    assert [j.name for j in files.jobs()] == ["a"]
    assert [j.name for f in load_dir(jobs) for j in f.jobs] == ["a"]
    assert permission_problem(jobs / "a.toml") is None


def test_a_symlink_as_the_job_file_is_refused(tmp_path: Path) -> None:
    """Even to a trusted file of a trusted directory: the final component is never
    followed (O_NOFOLLOW)."""
    jobs = directory(tmp_path / "jobs.d")
    target = write(directory(tmp_path / "elsewhere") / "real.toml", "real")
    (jobs / "link.toml").symlink_to(target)
    reason, key, _ = refusals(jobs, "link.toml")
    assert key == "file"
    assert reason == (
        f"refused: {jobs / 'link.toml'} is a symbolic link: job files are opened without "
        "following links (put the file itself in the directory)"
    )


def test_a_group_writable_file_is_refused(tmp_path: Path) -> None:
    jobs = directory(tmp_path / "jobs.d")
    write(jobs / "a.toml", "a", mode=0o664)
    reason, _, _ = refusals(jobs, "a.toml")
    assert reason == (
        f"refused: file {jobs / 'a.toml'} is writable by group or others (mode 0664; chmod go-w)"
    )


def test_a_group_writable_directory_on_the_path_is_refused_unless_sticky(tmp_path: Path) -> None:
    outer = directory(tmp_path / "srv", 0o775)
    jobs = directory(outer / "jobs.d")
    write(jobs / "a.toml", "a")
    reason, _, _ = refusals(jobs, "a.toml")
    assert reason == (
        f"refused: directory {outer} is writable by group or others (mode 0775; chmod go-w)"
    )
    outer.chmod(0o1775)  # sticky above the jobs directory: nobody else can rename jobs.d
    assert [j.name for f in load_dir(jobs) for j in f.jobs] == ["a"]
    jobs.chmod(0o1775)  # but not the jobs directory itself: anyone could add a file
    reason, _, _ = refusals(jobs, "a.toml")
    assert f"directory {jobs} is writable by group or others (mode 1775" in reason


@ROOT_ONLY
def test_a_file_of_another_owner_is_refused(tmp_path: Path) -> None:
    jobs = directory(tmp_path / "jobs.d")
    path = write(jobs / "a.toml", "a")
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    reason, _, _ = refusals(jobs, "a.toml")
    assert reason == (
        f"refused: file {path} is owned by nobody, not by root or the worker's user (root)"
    )
    # the worker's own user is trusted as root is
    assert [j.name for f in load_dir(jobs, uid=NOBODY.pw_uid) for j in f.jobs] == ["a"]


@ROOT_ONLY
def test_a_directory_of_another_owner_on_the_path_is_refused(tmp_path: Path) -> None:
    outer = directory(tmp_path / "srv")
    jobs = directory(outer / "jobs.d")
    write(jobs / "a.toml", "a")
    os.chown(outer, NOBODY.pw_uid, NOBODY.pw_gid)
    reason, _, _ = refusals(jobs, "a.toml")
    assert reason.startswith(f"refused: directory {outer} is owned by nobody, not by root")


@ROOT_ONLY
def test_a_symlinked_directory_is_followed_only_through_trusted_ground(tmp_path: Path) -> None:
    """A link among the directories is followed from a judged directory, when root or the
    worker's user owns it; every directory it leads through is judged too."""
    real = directory(tmp_path / "real" / "jobs.d")
    write(real / "a.toml", "a")
    alias = tmp_path / "alias.d"
    alias.symlink_to(real)
    files = HostFiles(alias)
    files.scan()
    assert [j.name for j in files.jobs()] == ["a"]
    with open_dir(alias) as opened:
        assert opened.path == str(real)

    # a link owned by another user: its owner could point it anywhere
    foreign_link = tmp_path / "foreign.d"
    foreign_link.symlink_to(real)
    os.lchown(foreign_link, NOBODY.pw_uid, NOBODY.pw_gid)
    reason, _, _ = refusals(foreign_link, "a.toml")
    assert f"symbolic link {foreign_link} is owned by nobody" in reason

    # a trusted link leading through a directory another user owns
    theirs = directory(tmp_path / "theirs")
    their_jobs = directory(theirs / "jobs.d")
    write(their_jobs / "a.toml", "a")
    os.chown(theirs, NOBODY.pw_uid, NOBODY.pw_gid)
    through = tmp_path / "through.d"
    through.symlink_to(their_jobs)
    reason, _, _ = refusals(through, "a.toml")
    assert f"directory {theirs} is owned by nobody" in reason


def test_a_fifo_named_like_a_job_file_is_refused_without_blocking(tmp_path: Path) -> None:
    jobs = directory(tmp_path / "jobs.d")
    os.mkfifo(jobs / "pipe.toml", 0o644)
    reason, _, _ = refusals(jobs, "pipe.toml")
    assert reason == f"refused: {jobs / 'pipe.toml'} is not a regular file"


def test_a_missing_directory_names_the_jobs_dir(tmp_path: Path) -> None:
    with pytest.raises(JobFilesError) as caught:
        load_dir(tmp_path / "missing")
    assert caught.value.field == "jobs_dir"
    assert "is not a directory" in str(caught.value)
    assert HostFiles(tmp_path / "missing").scan().added == ()


# -- the race ---------------------------------------------------------------------------------

SCANS = 3000
RACE_SECONDS = 60.0


@ROOT_ONLY
@pytest.mark.parametrize("flip", ["directory", "file", "rename"])
def test_a_symlink_flipped_while_scanning_never_loads_the_foreign_content(
    tmp_path: Path, flip: str
) -> None:
    """A thread flips a symlink between a trusted place and one another user controls (a
    directory nobody owns, holding content of its own), while the worker scans thousands
    of times: what was judged is what is read, so the foreign job is never loaded.
    `directory`: the jobs directory is the link (trusted content loads when it points to
    the trusted place). `file`: the job file is the link (never loaded: a job file is
    never a link). `rename`: no link, the two directories take turns at the jobs
    directory's name."""
    good = directory(tmp_path / "good")
    evil = directory(tmp_path / "evil")
    write(good / "a.toml", "trusted")
    write(evil / "a.toml", "foreign")  # root-owned: only its directory is not trusted
    os.chown(evil, NOBODY.pw_uid, NOBODY.pw_gid)
    if flip == "directory":
        link, targets, jobs = tmp_path / "jobs.d", ("good", "evil"), tmp_path / "jobs.d"
    elif flip == "file":
        jobs = directory(tmp_path / "jobs.d")
        link, targets = jobs / "a.toml", (str(good / "a.toml"), str(evil / "a.toml"))
    else:
        link, targets, jobs = tmp_path / "jobs.d", ("good", "evil"), tmp_path / "jobs.d"
    if flip == "rename":
        good.rename(jobs)
    else:
        link.symlink_to(targets[0])
    stop = threading.Event()
    flips = [0]

    def flipper() -> None:
        deadline = time.monotonic() + RACE_SECONDS
        fresh = link.with_name(".flip")
        while not stop.is_set() and time.monotonic() < deadline and flips[0] < 10_000_000:
            if flip == "rename":
                # the one at jobs.d goes back to its own name, the other takes jobs.d
                away, come = targets[flips[0] % 2], targets[(flips[0] + 1) % 2]
                os.rename(jobs, tmp_path / away)
                os.rename(tmp_path / come, jobs)
            else:
                fresh.symlink_to(targets[flips[0] % 2])
                os.replace(fresh, link)
            flips[0] += 1

    loaded: list[str] = []
    files = HostFiles(jobs)
    thread = threading.Thread(target=flipper, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + RACE_SECONDS
        for _ in range(SCANS):
            if time.monotonic() > deadline:
                break
            # one long-lived scanner (reloads what changed) and a fresh one (loads all)
            files.scan()
            loaded.extend(j.name for j in files.jobs())
            fresh = HostFiles(jobs)
            fresh.scan()
            loaded.extend(j.name for j in fresh.jobs())
            loaded.extend(j.name for f in _load_dir_quietly(jobs) for j in f.jobs)
    finally:
        stop.set()
        thread.join(RACE_SECONDS)
    assert not thread.is_alive()
    assert flips[0] > 0
    assert "foreign" not in loaded
    # and the trusted content does load once the flipping stops on it
    if flip == "rename":
        if flips[0] % 2:  # evil is at jobs.d
            os.rename(jobs, tmp_path / "evil")
            os.rename(tmp_path / "good", jobs)
    else:
        os.replace(link, link.with_name(".old"))
        link.symlink_to(targets[0])
    files.scan()
    assert [j.name for j in files.jobs()] == ([] if flip == "file" else ["trusted"])


def _load_dir_quietly(jobs: Path) -> list[JobFile]:
    try:
        return list(load_dir(jobs))
    except JobFilesError:
        return []
