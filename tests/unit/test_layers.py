"""The layers keep their direction and their seams: storage stores and delivery decides, so
no storage module imports schedctl.delivery (the value types both need live in
schedctl.domain.models and schedctl.core.backoff); and Postgres differs from SQLite in one place,
storage/backend/dialect*.py, so no other module branches on the backend."""

from __future__ import annotations

import ast
import re
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
    assert "schedctl.domain.models" in imported_modules(
        ROOT / "schedctl/storage/pipeline/outbox.py"
    )


# -- one dialect seam ------------------------------------------------------------------------

# What marks code that behaves differently per backend: a branch on its name, or SQL only
# one backend has (row locks, its clock, advisory locks, notifications).
BACKEND_BRANCH = re.compile(
    r'is_postgres|dialect\.name|== "postgresql"|sqlite'
    r"|with_for_update|clock_timestamp|pg_advisory|pg_notify"
)

# Where a backend may be named, and why.
BACKEND_FILES = {
    # the seam itself: the interface, the choice, one file per backend
    "schedctl/storage/backend/dialect.py",
    "schedctl/storage/backend/dialect_postgres.py",
    "schedctl/storage/backend/dialect_sqlite.py",
    # each hot path's statements, Postgres's beside SQLite's, in the module of its path
    "schedctl/storage/pipeline/claim_statements.py",
    "schedctl/storage/pipeline/lease_statements.py",
    "schedctl/storage/pipeline/outbox_statements.py",
    "schedctl/storage/pipeline/settle_statements.py",
    "schedctl/storage/jobs/create_statements.py",
    "schedctl/storage/records/status_statements.py",
    # the day partitions of runs: Postgres's capability
    "schedctl/storage/records/run_partitions.py",
    # the benchmarks' own statements (database settings, sizes, vacuum, generated rows):
    # they leave the Dialect and go with the benchmarks
    "benchmarks/schedctl_bench/storage/bench.py",
    "benchmarks/schedctl_bench/storage/bench_sizes.py",
    # the Store creates its dialect (and keeps is_postgres for reports and tests)
    "schedctl/storage/db/store.py",
    # URL normalisation and engine creation are per backend by nature
    "schedctl/storage/db/engine.py",
    # column types ask the dialect by SQLAlchemy's name for it
    "schedctl/storage/db/types.py",
    # declarative DDL: SQLAlchemy's per-backend type variants and partial-index options
    "schedctl/storage/db/schema.py",
    # the default database URL, the demo's, and help texts naming the URL forms
    "schedctl/domain/config.py",
    "schedctl/domain/config_doc.py",
    "schedctl/cli/app.py",
    "daemon/scheduled_d/demo.py",
    "daemon/scheduled_d/checks.py",
    # the migration runner sets Postgres's lock timeout around each step (an SQLite file has
    # no lock to wait for)
    "schedctl/storage/db/migrate.py",
    # PENDING the dialect: the console's lateness percentiles are computed by Postgres,
    # in Python on SQLite
    "schedctl/storage/records/console.py",
    # backup and restore use each backend's own tool (SQLite's backup API, pg_dump), and
    # the restore's report says what else Postgres needs (its grants)
    "schedctl/storage/db/backup.py",
    "schedctl/cli/db.py",
}
# Migrations are history: each revision stays as it ran, so it names backends itself.
BACKEND_DIRS = ("schedctl/storage/db/migrations/",)
# Queries another change is moving into storage repositories; they go through the dialect
# there (then leave this list).
PENDING: set[str] = set()


def test_backends_differ_only_behind_the_dialect() -> None:
    stray: dict[str, list[str]] = {}
    for top in ("schedctl", "daemon"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name in BACKEND_FILES | PENDING or name.startswith(BACKEND_DIRS):
                continue
            hits = [
                f"{number}: {line.strip()}"
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if BACKEND_BRANCH.search(line)
            ]
            if hits:
                stray[name] = hits
    assert stray == {}, "backend branches outside storage/backend/dialect*.py"


def test_the_dialect_check_sees_branches() -> None:
    text = (ROOT / "schedctl/storage/db/store.py").read_text()
    assert BACKEND_BRANCH.search(text)
    assert all((ROOT / name).exists() for name in BACKEND_FILES | PENDING)
