"""`make install` and `make uninstall`, staged below a temporary DESTDIR: the files and their
modes, the final paths inside them, the installed commands running, and what uninstall
removes and keeps. The machine itself is never touched (asserted)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from schedctl import __version__

REPO = Path(__file__).resolve().parents[2]
PREFIX = "/usr/local"
VENV = "/opt/scheduled"
UNITS = sorted(
    p.name for pattern in ("*.service", "*.timer") for p in (REPO / "systemd").glob(pattern)
)
MAN_PAGES = sorted(p.name for p in (REPO / "man").iterdir())
# what a live install would create; none of it may change while the test runs
LIVE_PATHS = [
    Path(VENV),
    Path(PREFIX, "bin/schedctl"),
    Path(PREFIX, "bin/scheduled-d"),
    Path("/etc/scheduled"),
    Path("/var/lib/scheduled"),
    Path("/etc/systemd/system/scheduled-d-all.service"),
    Path(PREFIX, "share/man/man1/schedctl.1"),
]

pytestmark = pytest.mark.slow


def make(target: str, destdir: Path) -> subprocess.CompletedProcess[str]:
    # a clean make environment: under `make test` MAKEFLAGS carries the outer make's
    # jobserver and variables, and DESTDIR must come from this command line only
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.pop("DESTDIR", None)
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), target, f"DESTDIR={destdir}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def live_state() -> dict[str, float | None]:
    return {
        str(p): (p.lstat().st_mtime if p.exists() or p.is_symlink() else None) for p in LIVE_PATHS
    }


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


@pytest.mark.timeout(900)
def test_install_reinstall_and_uninstall_into_destdir(tmp_path: Path) -> None:
    root = tmp_path / "root"
    before = live_state()

    installed = make("install", root)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    config = root / "etc/scheduled/scheduled.toml"
    assert config.read_text() == (REPO / "config/scheduled.toml").read_text()
    assert mode(config) == 0o640
    python = root / VENV.lstrip("/") / "bin/python"
    scheduled_d = root / PREFIX.lstrip("/") / "bin/scheduled-d"
    # the installed daemon accepts the file it was installed with
    checked = subprocess.run(
        [str(python), str(scheduled_d), "check-config", "--no-bind", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # the operator's configuration survives a second install (an upgrade)
    config.write_text('log_level = "WARNING"\n')
    installed = make("install", root)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "keeping the existing" in installed.stdout
    assert config.read_text() == 'log_level = "WARNING"\n'

    # the commands: small scripts run by the venv's python, named by their final paths
    for tool in ("schedctl", "scheduled-d"):
        script = root / PREFIX.lstrip("/") / "bin" / tool
        assert mode(script) == 0o755
        assert script.read_text().splitlines()[0] == f"#!{VENV}/bin/python"
        # the kernel would run `VENV/bin/python SCRIPT` once the tree is copied to /
        version = subprocess.run(
            [str(python), str(script), "--version"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        assert version.returncode == 0, version.stderr
        assert version.stdout.strip() == f"{tool} {__version__}"
    venv = root / VENV.lstrip("/")
    # the product alone: the benchmarks are a distribution of their own (schedctl-bench)
    assert not list(venv.glob("lib/python*/site-packages/schedctl_bench*"))
    shown = subprocess.run(
        [str(python), str(root / PREFIX.lstrip("/") / "bin/schedctl"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"COLUMNS": "120"},
    )
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    assert " job " in shown.stdout and " bench " not in shown.stdout
    assert f"{root}" not in (venv / "pyvenv.cfg").read_text()
    assert f"{root}" not in (venv / "bin/pip").read_text().splitlines()[0]
    # installed, not editable: the venv does not read this checkout
    assert not list(venv.glob("lib/python*/site-packages/*schedctl*.pth"))

    # man pages where man looks for them
    man_dir = root / PREFIX.lstrip("/") / "share/man"
    for page in MAN_PAGES:
        assert (man_dir / f"man{page.rsplit('.', 1)[1]}" / page).read_text() == (
            REPO / "man" / page
        ).read_text()
    if shutil.which("man"):
        found = subprocess.run(
            ["man", "-M", str(man_dir), "-w", "schedctl"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert found.stdout.strip() == str(man_dir / "man1/schedctl.1"), found.stderr

    # units whose ExecStart= is the installed scheduled-d (the owner's maintenance:
    # schedctl), and the maintenance timer
    unit_dir = root / "etc/systemd/system"
    assert sorted(p.name for p in unit_dir.iterdir()) == UNITS
    for unit in UNITS:
        assert mode(unit_dir / unit) == 0o644
        if unit.endswith(".timer"):
            continue
        program = "schedctl" if unit == "scheduled-d-maintain.service" else "scheduled-d"
        exec_start = next(
            line for line in (unit_dir / unit).read_text().splitlines()
            if line.startswith("ExecStart=")
        )  # fmt: skip
        binary = exec_start.removeprefix("ExecStart=").split()[0]
        assert binary == f"{PREFIX}/bin/{program}", unit
        assert (root / binary.lstrip("/")).is_file()

    # an empty jobs.d, the state directory
    jobs = root / "etc/scheduled/jobs.d"
    assert jobs.is_dir() and not list(jobs.iterdir())
    assert mode(jobs) == 0o755
    state = root / "var/lib/scheduled"
    assert state.is_dir() and mode(state) == 0o750

    # uninstall: the programs go, the data stays
    removed = make("uninstall", root)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert not venv.exists()
    assert not (root / PREFIX.lstrip("/") / "bin/schedctl").exists()
    assert not scheduled_d.exists()
    assert not any(man_dir.rglob("*.[158]"))
    assert not list(unit_dir.iterdir())
    assert config.read_text() == 'log_level = "WARNING"\n'
    assert jobs.is_dir() and state.is_dir()

    assert live_state() == before


def test_uninstall_leaves_a_directory_that_install_did_not_make(tmp_path: Path) -> None:
    # INSTALL_VENV pointing at someone else's directory: uninstall must not delete it
    root = tmp_path / "root"
    other = root / VENV.lstrip("/")
    other.mkdir(parents=True)
    (other / "precious").write_text("x")
    removed = make("uninstall", root)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert (other / "precious").read_text() == "x"


# The live install (no DESTDIR: the user, chown, mandb, runuser) inside a private mount
# namespace whose /etc, /usr/local, /var and /opt are overlays on directories below
# tmp_path: every write lands there. The script stops before `make` unless all four are
# overlays in that namespace, so a failed mount cannot let it reach the machine.
LIVE_SCRIPT = r"""
set -euo pipefail
upper="$1"
for dir in etc usr/local var opt; do
    name="${dir//\//_}"
    mkdir -p "$upper/$name/up" "$upper/$name/work"
    mount -t overlay overlay \
        -o "lowerdir=/$dir,upperdir=$upper/$name/up,workdir=$upper/$name/work" "/$dir" \
        || exit 97
    [ "$(findmnt -no FSTYPE --mountpoint "/$dir")" = overlay ] || exit 97
done
cd "$2"
make --no-print-directory install >"$upper/install.log" 2>&1
getent passwd scheduled | cut -d: -f1,6,7
stat -c '%U:%G %a %n' /var/lib/scheduled /etc/scheduled/scheduled.toml /etc/scheduled/jobs.d
runuser -u scheduled -- scheduled-d --version
runuser -u scheduled -- scheduled-d check-config --no-bind /etc/scheduled/scheduled.toml
schedctl --version
man -w schedctl
make --no-print-directory uninstall >"$upper/uninstall.log" 2>&1
for path in /opt/scheduled /usr/local/bin/schedctl /usr/local/bin/scheduled-d \
        /etc/systemd/system/scheduled-d-all.service; do
    [ ! -e "$path" ] || echo "left: $path"
done
man -w schedctl 2>/dev/null || echo "no man page"
stat -c 'kept %n' /etc/scheduled/scheduled.toml /var/lib/scheduled
getent passwd scheduled | cut -d: -f1
"""


@pytest.mark.timeout(900)
def test_live_install_in_a_private_mount_namespace(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("runuser") is None:
        pytest.skip("needs root, unshare and runuser")
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--fork", "true"],
        capture_output=True,
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip("cannot make a mount namespace here")
    before = live_state()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.pop("DESTDIR", None)
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--fork",
         "bash", "-c", LIVE_SCRIPT, "live", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=800,
        env=env,
    )  # fmt: skip
    if result.returncode == 97:
        pytest.skip(f"no overlay mounts here: {result.stderr.strip()}")
    logs = "".join(
        p.read_text() for p in (tmp_path / "install.log", tmp_path / "uninstall.log") if p.exists()
    )
    assert result.returncode == 0, result.stdout + result.stderr + logs[-4000:]
    assert result.stdout.splitlines() == [
        "scheduled:/var/lib/scheduled:/usr/sbin/nologin",
        "scheduled:scheduled 750 /var/lib/scheduled",
        "root:scheduled 640 /etc/scheduled/scheduled.toml",
        "root:root 755 /etc/scheduled/jobs.d",
        f"scheduled-d {__version__}",
        "/etc/scheduled/scheduled.toml: ok (0 [[worker]] table(s))",
        f"schedctl {__version__}",
        next(line for line in result.stdout.splitlines() if line.endswith("/man1/schedctl.1")),
        "no man page",
        "kept /etc/scheduled/scheduled.toml",
        "kept /var/lib/scheduled",
        "scheduled",
    ], result.stderr
    assert live_state() == before
