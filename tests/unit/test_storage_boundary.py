"""Owns the test that SQL lives only in schedctl/storage/ (and the benchmarks' own in
benchmarks/schedctl_bench/storage/): no module outside them imports SQLAlchemy or the table
definitions (schedctl.storage.db.schema), read from the source files themselves, imports
inside functions and TYPE_CHECKING blocks included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORAGE = (ROOT / "schedctl" / "storage", ROOT / "benchmarks" / "schedctl_bench" / "storage")
# the packages whose code runs in production, and the benchmarks (schedctl-bench); tests may
# build their own queries
SOURCES = (ROOT / "schedctl", ROOT / "daemon", ROOT / "benchmarks")
FORBIDDEN = ("sqlalchemy", "schedctl.storage.db.schema")
# the peers' drivers of `schedctl bench peers`: other systems' code run by their own venv's
# python (APScheduler's data store is SQLAlchemy), never imported by schedctl
FOREIGN = ROOT / "benchmarks" / "schedctl_bench" / "peer_scripts"


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from schedctl.storage.db import schema` names the module as an attribute
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def _forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN)


def _outside_storage() -> list[Path]:
    files = sorted(path for root in SOURCES for path in root.rglob("*.py"))
    return [
        path
        for path in files
        if not any(path.is_relative_to(folder) for folder in (*STORAGE, FOREIGN))
    ]


def test_the_scan_sees_the_sources() -> None:
    # a wrong root would make the boundary test pass over nothing
    names = {path.relative_to(ROOT).as_posix() for path in _outside_storage()}
    assert {"schedctl/app/service.py", "schedctl/app/cluster_status.py"} <= names
    assert "daemon/scheduled_d/dispatcher.py" in names
    assert "benchmarks/schedctl_bench/pipeline.py" in names
    assert not any(name.startswith("schedctl/storage/") for name in names)
    assert not any("/storage/" in name or "/peer_scripts/" in name for name in names)


def test_the_scan_finds_a_forbidden_import() -> None:
    source = (
        "from sqlalchemy import select\n"
        "def f():\n    import sqlalchemy.exc\n"
        "from schedctl.storage.db import schema\n"
    )
    modules = {m for _, m in _imported_modules(ast.parse(source)) if _forbidden(m)}
    assert {"sqlalchemy", "sqlalchemy.exc", "schedctl.storage.db.schema"} <= modules
    assert not _forbidden("schedctl.storage") and not _forbidden("sqlalchemyish")


def test_no_sql_outside_storage() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in _outside_storage()
        for line, module in _imported_modules(ast.parse(path.read_text(), str(path)))
        if _forbidden(module)
    ]
    assert offenders == [], "SQL belongs in schedctl/storage/:\n" + "\n".join(offenders)
