"""The layers keep their direction and their seams. LAYERS below is the one table of the
layers (docs/architecture.md describes it, and a test keeps its list the same): every import
in schedctl/ and daemon/scheduled_d/, at any depth (inside functions and under TYPE_CHECKING
too), goes to the importer's own layer or to a layer on a lower level, and two layers on one
level never import each other (storage stores and delivery decides: the value types both need
live in the domain and the core). And Postgres differs from SQLite in one place,
storage/backend/ and the storage modules that hold both backends' statements side by side,
so no other module branches on the backend."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# -- the layers ------------------------------------------------------------------------------

# From the bottom up, one level a line: a module may import its own layer and any layer on a
# level below its own. A layer is the packages listed for it (with their sub-packages).
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    # the signing and client modules at the package's top are public paths users' code imports,
    # kept as small modules re-exporting the core's verify and the clients' ApiClient (a line
    # naming one ends with "the public path": scripts that rewrite module paths leave it)
    {"core": ("schedctl.core", "schedctl.signing")},  # the public path
    {"scheduling": ("schedctl.scheduling",)},
    {"domain": ("schedctl.domain",)},
    {"storage": ("schedctl.storage",), "delivery": ("schedctl.delivery",)},
    {"coordination": ("schedctl.coordination",)},
    {"app": ("schedctl.app",)},
    {"clients": ("schedctl.clients", "schedctl.client")},  # the public path
    {"cli": ("schedctl.cli",), "daemon": ("scheduled_d",)},
)
# The package's own __init__ holds only __version__: it counts as the core.
ROOT_PACKAGE = ("schedctl", "core")

# Imports allowed against the table (importing module, imported module), each with its reason.
EXEMPT: dict[tuple[str, str], str] = {
    ("scheduled_d.onefile", "schedctl.cli.app"): (
        "the one-file executable (dist/scheduled.pyz) is both programs: it runs schedctl's main"
    ),
    ("scheduled_d.__main__", "schedctl.cli.version"): (
        "`--version` of both programs is one typer option, written once with the CLI's options"
    ),
}

TOPS = (ROOT / "schedctl", ROOT / "daemon" / "scheduled_d")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "daemon":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    """module name -> file, for every module of schedctl and scheduled_d."""
    return {module_name(p): p for top in TOPS for p in sorted(top.rglob("*.py"))}


def layer_of(module: str) -> tuple[int, str] | None:
    """(level, layer) of a module by its longest listed package; None if it has none."""
    if module == ROOT_PACKAGE[0]:
        return 0, ROOT_PACKAGE[1]
    best: tuple[int, int, str] | None = None
    for level, layers in enumerate(LAYERS):
        for layer, packages in layers.items():
            for package in packages:
                if module == package or module.startswith(package + "."):
                    if best is None or len(package) > best[0]:
                        best = (len(package), level, layer)
    return None if best is None else (best[1], best[2])


@functools.cache
def parsed(path: Path) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(path.read_text(), filename=str(path))))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Every schedctl or scheduled_d module a file imports, at any depth: `import x`, and
    `from x import y` as x.y when y is a module, else as x; relative imports resolved."""
    found: set[str] = set()
    here = module.split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in parsed(path):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in known else base)
    return {m for m in found if m.split(".")[0] in ("schedctl", "scheduled_d")}


def layer_violations(files: dict[str, Path]) -> list[str]:
    known = set(files)
    wrong: list[str] = []
    for module, path in sorted(files.items()):
        mine = layer_of(module)
        assert mine is not None, f"{module} is in no layer: add its package to LAYERS"
        for target in sorted(imports_of(module, path, known)):
            theirs = layer_of(target)
            assert theirs is not None, f"{module} imports {target}, which is in no layer"
            if theirs[1] == mine[1] or theirs[0] < mine[0] or (module, target) in EXEMPT:
                continue
            wrong.append(f"{module} ({mine[1]}) imports {target} ({theirs[1]})")
    return wrong


def test_every_import_goes_down_the_layers() -> None:
    assert layer_violations(source_files()) == []


def test_the_layer_table_names_real_packages_and_exemptions() -> None:
    files = source_files()
    listed = [p for layers in LAYERS for packages in layers.values() for p in packages]
    assert [p for p in listed if p not in files] == []
    assert len(set(listed)) == len(listed)
    names = [name for layers in LAYERS for name in layers]
    assert len(set(names)) == len(names)
    for module, target in EXEMPT:
        assert target in imports_of(module, files[module], set(files)), f"stale: {module}"


def test_the_check_sees_imports() -> None:
    # a guard against a check that passes because it finds nothing at all
    files = source_files()
    known = set(files)

    def imports(module: str) -> set[str]:
        return imports_of(module, files[module], known)

    assert "schedctl.domain.models" in imports("schedctl.app.service")
    # `from schedctl.core import errors` is the module, not the package
    assert "schedctl.core.errors" in imports("schedctl.app.service")
    # inside a function, and under TYPE_CHECKING
    assert "schedctl.core.ssrf" in imports("schedctl.app.service")
    assert "schedctl.domain.host_scope" in imports("schedctl.app.jobfiles_apply")
    assert layer_of("schedctl.storage.db.store") == (3, "storage")
    assert layer_of("scheduled_d.api.app") == (7, "daemon")
    assert layer_of("schedctl") == (0, "core")


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """Planted upward imports (the domain importing storage under TYPE_CHECKING and the app
    inside a function), a sibling's (storage importing delivery) and the daemon's import of
    the CLI are each reported."""
    domain = tmp_path / "domain.py"
    domain.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from schedctl.storage.db.store import Store\n"
        "def f() -> None:\n"
        "    from schedctl.app import service\n"
    )
    storage = tmp_path / "storage.py"
    storage.write_text("import schedctl.delivery.http\n")
    daemon = tmp_path / "daemon.py"
    # a relative import resolves (to scheduled_d.sdnotify, the daemon's own)
    daemon.write_text("from ..sdnotify import notify\nfrom schedctl.cli import jobs\n")
    planted = {
        "schedctl.domain._planted": domain,
        "schedctl.storage._planted": storage,
        "scheduled_d.api._planted": daemon,
    }
    wrong = layer_violations(source_files() | planted)
    assert wrong == [
        "schedctl.domain._planted (domain) imports schedctl.app.service (app)",
        "schedctl.domain._planted (domain) imports schedctl.storage.db.store (storage)",
        "schedctl.storage._planted (storage) imports schedctl.delivery.http (delivery)",
        "scheduled_d.api._planted (daemon) imports schedctl.cli.jobs (cli)",
    ]


def test_the_public_paths_still_import() -> None:
    """A tenant's receiver and a Python client of the API import these paths (the docs and
    `--help` name them): they stay, as the same objects the layers hold."""
    from schedctl.client import ApiClient  # the public path
    from schedctl.clients.client import ApiClient as Moved
    from schedctl.core.signing import verify as moved_verify
    from schedctl.signing import SignatureError, verify  # the public path

    assert ApiClient is Moved
    assert verify is moved_verify
    assert SignatureError.__module__ == "schedctl.core.errors"


ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYER_ROW = re.compile(r"^\| (\d+) \| (\w+) \| ([^|]*) \|", re.MULTILINE)


def test_the_architecture_doc_lists_the_layers() -> None:
    """docs/architecture.md's table lists LAYERS: each row's level, layer and packages."""
    rows = [
        (int(level), layer, tuple(re.findall(r"`([\w.]+)`", packages)))
        for level, layer, packages in LAYER_ROW.findall(ARCHITECTURE.read_text())
    ]
    table = [
        (level, layer, packages)
        for level, layers in enumerate(LAYERS)
        for layer, packages in layers.items()
    ]
    assert rows == table


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
