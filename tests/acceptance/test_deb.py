"""`make deb`: the scheduled Debian package, built once per session (without a network, from
the wheelhouse), checked by lintian (no errors), then installed, upgraded, removed and
purged by the real dpkg with its real maintainer scripts (adduser, chgrp, the rolling
restart) -- on this machine, but inside a private mount namespace whose /etc, /usr, /var and
/opt are overlays on directories below tmp_path and whose /run is a fresh tmpfs. Every write
(dpkg's database, /etc/passwd, the venv, /usr/bin) lands in the overlays and vanishes with
the namespace; the script stops before dpkg unless all four overlays are in place, and the
test asserts that the machine's own paths (dpkg's status, /etc/passwd, /opt/scheduled, ...)
did not change.

(`dpkg --root=DIR` would need a whole Debian system below DIR for its chroot -- /bin/sh,
adduser, perl, python3 -- which the test machine cannot make offline; `dpkg -x` would not
run the maintainer scripts at all.)

The test machine runs no systemd, so /run/systemd/system is made in the namespace's /run and
`systemctl` is a test double in /usr/local/sbin (inside the /usr overlay) that records its
calls and answers list-units and is-active from a state directory: that checks what the
maintainer scripts ask of systemd and in which order (the rolling restart waits for each
unit to be active again before the next); the units themselves are verified by
test_systemd_service.py.

The upgrade package is the session's package rebuilt with a higher version and a changed
shipped configuration (dpkg-deb -R, edit, dpkg-deb --build: the same tree, so the session
pays for one venv build, not two): installing it over an operator-edited
/etc/scheduled/scheduled.toml with --force-confold, as a fleet's unattended apt does, keeps
the operator's file and puts the new one beside it as .dpkg-dist."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from schedctl import __version__

REPO = Path(__file__).resolve().parents[2]
UNITS = sorted(p.name for p in (REPO / "systemd").glob("*.service"))
UPGRADE_VERSION = f"{__version__}+upgrade1"
ADDED_TO_SHIPPED_CONFIG = "# added by the upgrade test: the next release's example\n"
OPERATOR_CONFIG = 'log_level = "WARNING"\n'
# what only this package would change on the real machine; none of it may change while the
# test runs (dpkg's status and /etc/passwd are checked by content: other programs on a shared
# machine may change them meanwhile)
LIVE_PATHS = [
    Path("/var/lib/dpkg/info/scheduled.list"),
    Path("/opt/scheduled"),
    Path("/usr/bin/schedctl"),
    Path("/usr/bin/scheduled-d"),
    Path("/etc/scheduled"),
    Path("/var/lib/scheduled"),
    Path("/lib/systemd/system/scheduled-d-all.service"),
    Path("/run/systemd/system"),
]

pytestmark = pytest.mark.slow


def clean_env() -> dict[str, str]:
    # under `make test` MAKEFLAGS carries the outer make's jobserver and variables
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    for name in ("DESTDIR", "DEB_VERSION", "DEB_FILE"):
        env.pop(name, None)
    return env


def live_state() -> dict[str, object]:
    state: dict[str, object] = {
        str(p): (p.lstat().st_mtime if p.exists() or p.is_symlink() else None) for p in LIVE_PATHS
    }
    state["dpkg knows scheduled"] = (
        subprocess.run(["dpkg-query", "-W", "scheduled"], capture_output=True).returncode == 0
    )
    state["user scheduled"] = (
        subprocess.run(["getent", "passwd", "scheduled"], capture_output=True).returncode == 0
    )
    return state


def can_unshare(*namespace: str) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", *namespace, "true"], capture_output=True, timeout=60)
    return probe.returncode == 0


def rebuild_as_upgrade(first: Path, out: Path) -> Path:
    """``first`` rebuilt as UPGRADE_VERSION with ADDED_TO_SHIPPED_CONFIG in its example
    configuration, in ``out``."""
    tree = out / "upgrade-tree"
    subprocess.run(["dpkg-deb", "-R", str(first), str(tree)], check=True, timeout=300)
    control = tree / "DEBIAN/control"
    control.write_text(
        "".join(
            f"Version: {UPGRADE_VERSION}\n" if line.startswith("Version:") else line
            for line in control.read_text().splitlines(keepends=True)
        )
    )
    shipped = tree / "etc/scheduled/scheduled.toml"
    shipped.write_text(shipped.read_text() + ADDED_TO_SHIPPED_CONFIG)
    sums = tree / "DEBIAN/md5sums"
    lines = []
    for line in sums.read_text().splitlines():
        name = line.split("  ", 1)[1]
        if name == "etc/scheduled/scheduled.toml":
            line = f"{hashlib.md5(shipped.read_bytes()).hexdigest()}  {name}"
        lines.append(line + "\n")
    sums.write_text("".join(lines))
    second = out / f"scheduled_{UPGRADE_VERSION}_amd64.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Znone", "--build", str(tree), str(second)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    shutil.rmtree(tree)
    return second


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The session's package (`make deb`) and its rebuild as UPGRADE_VERSION."""
    if shutil.which("dpkg-deb") is None or shutil.which("dpkg-shlibdeps") is None:
        pytest.skip("needs dpkg-deb and dpkg-shlibdeps (make system-deps)")
    out = tmp_path_factory.mktemp("deb")
    first = out / f"scheduled_{__version__}_amd64.deb"
    make = ["make", "--no-print-directory", "-C", str(REPO)]
    # the wheels, once per pyproject.toml (from the local cache or the index); then the
    # package without a network where a network namespace can be made: offline
    filled = subprocess.run(
        [*make, "wheelhouse"], capture_output=True, text=True, timeout=1200, env=clean_env()
    )
    assert filled.returncode == 0, filled.stdout[-4000:] + filled.stderr[-4000:]
    offline = ["unshare", "--net"] if can_unshare("--net") else []
    built = subprocess.run(
        [*offline, *make, "deb", f"DEB_FILE={first}"],
        capture_output=True,
        text=True,
        timeout=1500,
        env=clean_env(),
    )
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]

    return first, rebuild_as_upgrade(first, out)


def test_the_package_has_the_files_and_the_control_data(packages: tuple[Path, Path]) -> None:
    deb = packages[0]
    fields = subprocess.run(
        ["dpkg-deb", "--show", "--showformat=${Package} ${Version} ${Architecture}\n${Depends}",
         str(deb)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert fields[0] == f"scheduled {__version__} amd64"
    depends = [d.strip() for d in fields[1].split(",")]
    assert "python3 (>= 3.11)" in depends and "python3 (<< 3.12)" in depends
    assert "adduser" in depends
    assert any(d.startswith("libc6 (>= ") for d in depends), depends
    conffiles = subprocess.run(
        ["dpkg-deb", "-I", str(deb), "conffiles"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert conffiles.split() == ["/etc/scheduled/scheduled.toml"]
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    # "MODE OWNER SIZE DATE TIME ./PATH[ -> TARGET]"
    entries = {
        line.split(maxsplit=5)[5].split(" -> ")[0].removeprefix(".").rstrip("/"): line
        for line in listing.splitlines()
    }
    for unit in UNITS:
        assert f"/lib/systemd/system/{unit}" in entries
    for page in ("man1/schedctl.1.gz", "man8/scheduled-d.8.gz", "man5/scheduled-d.toml.5.gz"):
        assert f"/usr/share/man/{page}" in entries
    assert entries["/usr/bin/schedctl"].startswith("-rwxr-xr-x root/root")
    assert entries["/etc/scheduled/scheduled.toml"].startswith("-rw-r----- root/root")
    assert "/opt/scheduled/bin/python" in entries
    helper = [n for n in entries if n.endswith("/site-packages/scheduled_d/native/_vspawn.so")]
    assert len(helper) == 1 and entries[helper[0]].startswith("-rw-r--r-- root/root")
    assert "/usr/share/doc/scheduled/copyright" in entries
    # created by postinst (owned by the scheduled user), so remove cannot take it
    assert not any(name.startswith("/var/") for name in entries)
    # no pip in a dpkg-owned tree, no build paths anywhere
    assert not any("/site-packages/pip/" in name for name in entries)
    # the product alone: the benchmarks are a distribution of their own (schedctl-bench)
    assert any(name.endswith("/site-packages/schedctl/cli/app.py") for name in entries)
    assert not any("schedctl_bench" in name or "/schedctl/bench/" in name for name in entries)
    assert "build/deb" not in listing


def test_lintian_reports_no_errors(packages: tuple[Path, Path]) -> None:
    if shutil.which("lintian") is None:
        pytest.skip("needs lintian (make system-deps)")
    checked = subprocess.run(
        ["lintian", "--fail-on", "error", "--no-tag-display-limit", str(packages[0])],
        capture_output=True,
        text=True,
        timeout=900,
    )
    errors = [line for line in checked.stdout.splitlines() if line.startswith("E:")]
    assert checked.returncode == 0 and not errors, checked.stdout[-4000:] + checked.stderr


# systemctl's test double: records each call; list-units prints the units named in
# $state/active; try-restart makes the next is-active answer "inactive" once (the script
# must wait for it) and fails for a unit named in $state/broken.
FAKE_SYSTEMCTL = r"""#!/bin/bash
state=@STATE@
echo "$*" >>"$state/calls"
last="${*: -1}"
case "$1" in
list-units)
    while read -r unit; do echo "$unit loaded active running test unit"; done <"$state/active"
    ;;
try-restart)
    if grep -qx "$last" "$state/broken"; then exit 1; fi
    touch "$state/restarting.$last"
    ;;
is-active)
    if [ -e "$state/restarting.$last" ]; then rm "$state/restarting.$last"; exit 3; fi
    grep -qx "$last" "$state/active" || exit 3
    ;;
esac
exit 0
"""

NAMESPACE_SCRIPT = r"""
set -euo pipefail
work="$1" first="$2" second="$3"
for dir in etc usr var opt; do
    mkdir -p "$work/$dir/up" "$work/$dir/work"
    mount -t overlay overlay \
        -o "lowerdir=/$dir,upperdir=$work/$dir/up,workdir=$work/$dir/work" "/$dir" || exit 97
    [ "$(findmnt -no FSTYPE --mountpoint "/$dir")" = overlay ] || exit 97
done
mount -t tmpfs tmpfs /run || exit 97
[ "$(findmnt -no FSTYPE --mountpoint /run)" = tmpfs ] || exit 97
mkdir -p /run/systemd/system /run/lock
state="$work/systemd"
mkdir -p "$state"
: >"$state/calls"; : >"$state/active"; : >"$state/broken"
sed "s|@STATE@|$state|" "$work/fake-systemctl" >/usr/local/sbin/systemctl
chmod 0755 /usr/local/sbin/systemctl
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export DEBIAN_FRONTEND=noninteractive
seconds() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(seconds)" 'BEGIN { printf "%.1f", b - a }'; }

echo "== install"
t0=$(seconds)
dpkg -i "$first" >"$work/install.log" 2>&1
echo "install_seconds $(elapsed "$t0")" >>"$work/figures"
dpkg-query -W -f='${Status} ${Version}\n' scheduled
getent passwd scheduled | cut -d: -f1,6,7
stat -c '%U:%G %a %n' /var/lib/scheduled /etc/scheduled/scheduled.toml /etc/scheduled/jobs.d
runuser -u scheduled -- scheduled-d --version
runuser -u scheduled -- scheduled-d check-config --no-bind /etc/scheduled/scheduled.toml
schedctl --version
runuser -u scheduled -- /opt/scheduled/bin/python -c '
import cryptography.hazmat.bindings._rust, orjson, pydantic_core, uvloop
import sqlalchemy.util._collections_cy
import psycopg
print("psycopg", psycopg.pq.__impl__)'
runuser -u scheduled -- /opt/scheduled/bin/python -c '
from scheduled_d import spawn
print("start path", "native" if spawn.native else spawn.native_reason)'
man -w schedctl
grep -h '^ExecStart=' /lib/systemd/system/scheduled-d-all.service
dpkg --verify scheduled && echo "verified"
cat "$state/calls"

echo "== upgrade"
cp -a /etc/scheduled/scheduled.toml "$work/shipped.toml"
printf '%s' "$OPERATOR_CONFIG" >/etc/scheduled/scheduled.toml
echo 'data' >/var/lib/scheduled/scheduled.db
echo '# a job file' >/etc/scheduled/jobs.d/backup.toml
printf '%s\n' scheduled-d-dispatcher.service scheduled-d-worker@backups.service >"$state/active"
: >"$state/calls"
t0=$(seconds)
dpkg -i --force-confdef --force-confold "$second" >"$work/upgrade.log" 2>&1
echo "upgrade_seconds $(elapsed "$t0")" >>"$work/figures"
dpkg-query -W -f='${Status} ${Version}\n' scheduled
cat /etc/scheduled/scheduled.toml
cp /etc/scheduled/scheduled.toml.dpkg-dist "$work/dpkg-dist.toml"
stat -c '%U:%G %a %n' /etc/scheduled/scheduled.toml
cat /var/lib/scheduled/scheduled.db
cat "$state/calls"

echo "== failed restart"
# a unit that does not come back: the rollout stops there, dpkg reports the failure
echo scheduled-d-dispatcher.service >"$state/broken"
: >"$state/calls"
if dpkg -i --force-confdef --force-confold "$second" >"$work/reinstall.log" 2>&1; then
    echo "reinstall succeeded"
else
    echo "reinstall failed"
fi
dpkg-query -W -f='${Status}\n' scheduled
cat "$state/calls"

echo "== configure again"
# fixed: the operator's `dpkg --configure -a` finishes the rollout
: >"$state/broken"
: >"$state/calls"
dpkg --configure -a >"$work/configure.log" 2>&1
dpkg-query -W -f='${Status}\n' scheduled
cat "$state/calls"

echo "== remove"
: >"$state/calls"
dpkg -r scheduled >"$work/remove.log" 2>&1
dpkg-query -W -f='${Status}\n' scheduled
for path in /opt/scheduled /usr/bin/schedctl /usr/bin/scheduled-d \
        /lib/systemd/system/scheduled-d-all.service /usr/share/man/man1/schedctl.1.gz; do
    [ ! -e "$path" ] || echo "left: $path"
done
cat /etc/scheduled/scheduled.toml /etc/scheduled/jobs.d/backup.toml /var/lib/scheduled/scheduled.db
getent passwd scheduled | cut -d: -f1
cat "$state/calls"

echo "== purge"
: >"$state/calls"
mkdir -p /etc/systemd/system/multi-user.target.wants
ln -s /lib/systemd/system/scheduled-d-all.service \
    /etc/systemd/system/multi-user.target.wants/scheduled-d-all.service
dpkg -P scheduled >"$work/purge.log" 2>&1
dpkg-query -W -f='${Status}\n' scheduled 2>/dev/null || echo "not known to dpkg"
for path in /etc/scheduled /var/lib/scheduled \
        /etc/systemd/system/multi-user.target.wants/scheduled-d-all.service; do
    [ ! -e "$path" ] && [ ! -L "$path" ] || echo "left: $path"
done
getent passwd scheduled | cut -d: -f1
cat "$state/calls"
"""


@pytest.mark.timeout(1500)
def test_install_upgrade_remove_and_purge_with_dpkg(
    packages: tuple[Path, Path], tmp_path: Path
) -> None:
    if shutil.which("runuser") is None or not can_unshare(
        "--mount", "--propagation", "private", "--fork"
    ):
        pytest.skip("needs root, runuser and a mount namespace")
    if subprocess.run(["getent", "passwd", "scheduled"], capture_output=True).returncode == 0:
        pytest.skip("this machine has a scheduled user already: the first install would not add it")
    (tmp_path / "fake-systemctl").write_text(FAKE_SYSTEMCTL)
    before = live_state()
    env = clean_env() | {"OPERATOR_CONFIG": OPERATOR_CONFIG}
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--fork",
         "bash", "-c", NAMESPACE_SCRIPT, "deb", str(tmp_path), str(packages[0]),
         str(packages[1])],
        capture_output=True,
        text=True,
        timeout=1400,
        env=env,
    )  # fmt: skip
    if result.returncode == 97:
        pytest.skip(f"no overlay mounts here: {result.stderr.strip()}")
    logs = "".join(
        f"--- {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("*.log")) if p.exists()
    )
    assert result.returncode == 0, result.stdout + result.stderr + logs[-6000:]
    figures = (tmp_path / "figures").read_text()
    print(figures)  # the install and upgrade times, for the report (-s shows them)
    sections = dict(
        (part.split("\n", 1)[0], part.split("\n", 1)[1].splitlines())
        for part in result.stdout.split("== ")[1:]
    )  # fmt: skip

    install = sections["install"]
    man_page = next(line for line in install if line.endswith("schedctl.1.gz"))
    assert install == [
        f"install ok installed {__version__}",
        "scheduled:/var/lib/scheduled:/usr/sbin/nologin",
        "scheduled:scheduled 750 /var/lib/scheduled",
        "root:scheduled 640 /etc/scheduled/scheduled.toml",
        "root:root 755 /etc/scheduled/jobs.d",
        f"scheduled-d {__version__}",
        "/etc/scheduled/scheduled.toml: ok (0 [[worker]] table(s))",
        f"schedctl {__version__}",
        "psycopg binary",
        "start path native",  # the helper built, stripped and loadable as installed
        man_page,
        "ExecStart=/usr/bin/scheduled-d all",
        "verified",
        # a first install: systemd reads the new units, nothing is started or restarted
        "daemon-reload",
    ], result.stderr + logs[-4000:]
    assert man_page == "/usr/share/man/man1/schedctl.1.gz"

    upgrade = sections["upgrade"]
    restarts = upgrade[upgrade.index("daemon-reload") :]
    assert upgrade[: upgrade.index("daemon-reload")] == [
        f"install ok installed {UPGRADE_VERSION}",
        # the operator's configuration, kept; the new example beside it
        *OPERATOR_CONFIG.splitlines(),
        "root:scheduled 640 /etc/scheduled/scheduled.toml",
        "data",
    ], result.stderr + logs[-4000:]
    new_example = (tmp_path / "dpkg-dist.toml").read_text()
    assert new_example == (tmp_path / "shipped.toml").read_text() + ADDED_TO_SHIPPED_CONFIG
    # the running units restarted one after the other, each active again before the next
    # (the first is-active after a restart answers inactive: the script asked again)
    assert restarts[0] == "daemon-reload"
    assert restarts[1].startswith("list-units ") and "--state=active" in restarts[1]
    assert restarts[2:] == [
        "try-restart scheduled-d-dispatcher.service",
        "is-active --quiet scheduled-d-dispatcher.service",
        "is-active --quiet scheduled-d-dispatcher.service",
        "try-restart scheduled-d-worker@backups.service",
        "is-active --quiet scheduled-d-worker@backups.service",
        "is-active --quiet scheduled-d-worker@backups.service",
    ], upgrade

    list_active = restarts[1]
    assert sections["failed restart"] == [
        "reinstall failed",
        "install ok half-configured",
        "daemon-reload",
        list_active,
        # the first unit failed: the second one keeps running its old process
        "try-restart scheduled-d-dispatcher.service",
    ], result.stdout
    assert sections["configure again"] == ["install ok installed", *restarts], result.stdout

    remove = sections["remove"]
    assert remove[:5] == [
        "deinstall ok config-files",
        *OPERATOR_CONFIG.splitlines(),
        "# a job file",
        "data",
        "scheduled",
    ], result.stdout
    # the units stopped before their program went, then systemd forgot them
    assert remove[5].startswith("list-units ")
    assert remove[6:] == [
        "stop scheduled-d-dispatcher.service scheduled-d-worker@backups.service",
        "daemon-reload",
    ], remove

    assert sections["purge"] == [
        "not known to dpkg",
        # kept on purge: see postrm
        "scheduled",
        "daemon-reload",
    ], result.stdout
    assert live_state() == before
