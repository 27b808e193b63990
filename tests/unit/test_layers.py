"""The layers keep their direction: storage stores and delivery decides, so no storage module
imports schedctl.delivery (the value types both need live in schedctl.models and
schedctl.backoff)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_storage_module_imports_delivery() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imported_modules(path) if m.startswith("schedctl.delivery")
        )
        for path in sorted((ROOT / "schedctl" / "storage").rglob("*.py"))
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_the_check_sees_imports() -> None:
    # a guard against a check that passes because it finds nothing at all
    assert "schedctl.models" in imported_modules(ROOT / "schedctl" / "storage" / "outbox.py")
