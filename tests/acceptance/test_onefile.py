"""`make onefile`: dist/scheduled.pyz, copied into an empty directory away from the source
tree and run by a plain python3 (no venv, no PYTHONPATH): --version under each name, and
the whole demo (`scheduled.pyz demo`, whose schedctl and scheduled-d are the same file)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from schedctl import __version__

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def plain_python() -> Path:
    """A python3 of this version without the project installed: Debian's, else the one
    this venv was made from (the wheels inside the file are for this version)."""
    wanted = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (Path("/usr/bin/python3"), Path(sys.base_prefix, "bin/python3")):
        if candidate.is_file():
            found = subprocess.run(
                [str(candidate), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if found.stdout.strip() == wanted:
                return candidate
    pytest.skip(f"no plain python{wanted} outside the venv")


@pytest.fixture(scope="module")
def onefile() -> Path:
    # `make` rebuilds only when a source changed since the last build
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    built = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), "onefile"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return REPO / "dist/scheduled.pyz"


@pytest.mark.timeout(1200)
def test_the_one_file_runs_the_demo_without_the_source_tree(onefile: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    pyz = work / "scheduled.pyz"
    shutil.copy(onefile, pyz)
    # the product alone: the benchmarks are a distribution of their own (schedctl-bench)
    names = zipfile.ZipFile(pyz).namelist()
    assert any(name.endswith("/schedctl/cli/app.py") for name in names)
    assert not any("schedctl_bench" in name or "/schedctl/bench/" in name for name in names)
    python = plain_python()
    env = {
        "HOME": str(home),  # shiv unpacks into ~/.shiv
        "TMPDIR": str(tmp_path),  # the demo's database and log
        "PATH": f"{python.parent}:/usr/bin:/bin",  # its #! is `/usr/bin/env python3`
        "LANG": "C.UTF-8",
    }

    def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, cwd=work, env=env
        )

    # this interpreter cannot import the project: whatever runs comes from the file
    assert run(str(python), "-c", "import schedctl").returncode != 0

    version = run(str(pyz), "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"scheduled.pyz {__version__} (schedctl, scheduled-d)"
    for tool in ("schedctl", "scheduled-d"):
        (work / tool).symlink_to("scheduled.pyz")
        by_name = run(str(work / tool), "--version")
        assert by_name.stdout.strip() == f"{tool} {__version__}", by_name.stderr
        by_argument = run(str(pyz), tool, "--version")
        assert by_argument.stdout.strip() == f"{tool} {__version__}", by_argument.stderr
    unknown = run(str(pyz), "cron")
    assert unknown.returncode == 2 and "unknown command 'cron'" in unknown.stderr

    demo = run(str(pyz), "demo", timeout=600)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    assert "Demo complete" in demo.stdout
    # the file unpacked its dependencies (compiled parts included) below HOME
    assert (home / ".shiv").is_dir()
