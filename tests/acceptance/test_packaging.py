"""Packaging and layering: the wheel carries both packages, the migrations and the web
console's templates and static files, and the library never imports the daemon."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_both_packages_and_the_migrations(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("schedctl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    migrations = sorted(
        n for n in names if n.startswith("schedctl/storage/db/migrations/versions/")
    )
    expected = sorted(
        f"schedctl/storage/db/migrations/versions/{p.name}"
        for p in (ROOT / "schedctl/storage/db/migrations/versions").glob("*.py")
    )
    assert migrations == expected
    assert "schedctl/storage/db/migrations/env.py" in names
    assert "scheduled_d/__main__.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    # the web console's templates and its own script and stylesheet (no CDN at run time)
    ui = ROOT / "daemon/scheduled_d/api/ui"
    shipped = sorted(
        f"scheduled_d/api/ui/{p.relative_to(ui)}"
        for folder in ("templates", "static")
        for p in (ui / folder).iterdir()
    )
    assert shipped and set(shipped) <= names


def test_schedctl_never_imports_scheduled_d() -> None:
    offenders = []
    for path in (ROOT / "schedctl").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            if any(m == "scheduled_d" or m.startswith("scheduled_d.") for m in modules):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
