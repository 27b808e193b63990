"""Packaging and layering: the wheel carries both packages, the migrations and the web
console's templates and static files and none of the benchmarks, which are a distribution
of their own (benchmarks/: schedctl-bench, the `bench` extra, adding `schedctl bench` through
the `schedctl.plugins` entry point); the library never imports the daemon."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a benchmark module by its name: the bench packages, cli/bench*, storage/bench* and the bulk
# loaders (they all moved to benchmarks/schedctl_bench)
BENCH_MODULE = re.compile(r"(^|/)(schedctl_bench|bench\w*|bulk\w*)(/|\.py$)")


def _wheel(source: Path, name: str, into: Path) -> set[str]:
    """Build the wheel of the project in `source` and return its file names."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(into)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = into.glob(f"{name}-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_the_wheel_carries_both_packages_and_the_migrations(tmp_path: Path) -> None:
    names = _wheel(ROOT, "schedctl", tmp_path)
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


def test_the_product_wheel_carries_no_benchmark(tmp_path: Path) -> None:
    names = _wheel(ROOT, "schedctl", tmp_path)
    assert "schedctl/cli/app.py" in names
    assert sorted(n for n in names if BENCH_MODULE.search(n)) == []
    # the extra names the benchmarks' distribution, and nothing else does
    (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(next(tmp_path.glob("schedctl-*.whl")))
        .read(metadata)
        .decode()
        .splitlines()
        if line.startswith("Requires-Dist:") and "schedctl-bench" in line
    ]
    assert requires == ["Requires-Dist: schedctl-bench==0.1.0; extra == 'bench'"]


def test_the_check_sees_benchmark_modules() -> None:
    # where the benchmarks used to be in the product (joined: the rewrite of references
    # that moved them out must leave these names alone when it runs again)
    for name in (
        "schedctl_bench/cli/plugin.py",
        "/".join(("schedctl", "bench", "pipeline.py")),
        "/".join(("schedctl", "cli", "bench_dispatch.py")),
        "/".join(("schedctl", "storage", "bench.py")),
        "/".join(("schedctl", "storage", "bulk_future.py")),
    ):
        assert BENCH_MODULE.search(name), name
    assert not BENCH_MODULE.search("schedctl/storage/jobs/jobs.py")


def test_the_benchmarks_are_their_own_distribution(tmp_path: Path) -> None:
    names = _wheel(ROOT / "benchmarks", "schedctl_bench", tmp_path)
    assert "schedctl_bench/cli/plugin.py" in names
    assert "schedctl_bench/peer_scripts/peer_common.py" in names
    assert not any(n.startswith(("schedctl/", "scheduled_d/")) for n in names)
    wheel = zipfile.ZipFile(next(tmp_path.glob("schedctl_bench-*.whl")))
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "[schedctl.plugins]\nbench = schedctl_bench.cli.plugin:register" in (
        wheel.read(entry_points).decode()
    )
    # the two versions move together: each names the other's exactly
    product = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bench = tomllib.loads((ROOT / "benchmarks/pyproject.toml").read_text())["project"]
    assert product["optional-dependencies"]["bench"] == [f"schedctl-bench=={bench['version']}"]
    assert bench["dependencies"] == [f"schedctl=={product['version']}"]


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
