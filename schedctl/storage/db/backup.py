"""Backup and restore of the scheduler's database: SQLite through its online backup API (a
consistent copy while daemons run), Postgres through pg_dump / pg_restore in the custom
format. A backup file holds token digests, signing secrets and payloads: it is made 0600.

Restoring replaces every job, run and tenant: it refuses while a dispatcher holds
partitions (stop the daemons first) unless forced, and refuses a file that is not a backup
of this scheduler, before anything is changed."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import inspect, select
from sqlalchemy.engine import URL, make_url

from schedctl.core import errors
from schedctl.storage.db import schema
from schedctl.storage.db.engine import (
    SQLITE_FILE_MODE,
    check_connection,
    database_of,
    make_engine,
    normalize_url,
    private_sqlite_file,
    redact,
)

# pg_dump / pg_restore get no more than this to finish (a database of millions of runs
# takes minutes; a hung connection must not hang the command forever)
PG_TOOL_TIMEOUT_SECONDS = 6 * 3600
# the part of a failing tool's stderr shown in the error
_STDERR_LINES = 5


@dataclass(frozen=True)
class BackupResult:
    file: str
    database: str  # redacted
    backend: str  # sqlite | postgresql
    bytes: int


def _is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _refuse_existing(target: Path, force: bool) -> None:
    if target.exists() and not force:
        raise errors.Conflict(f"{target} already exists: give --force to replace it", field="FILE")


def _private_temp(directory: Path, name: str) -> Path:
    """An empty 0600 file beside the target (same filesystem: the rename is atomic)."""
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    os.chmod(temp, SQLITE_FILE_MODE)
    return Path(temp)


def backup(url: str, file: str | Path, *, force: bool = False) -> BackupResult:
    """Write a backup of the database at `url` to `file` (0600); an existing `file` only
    with `force`. The file appears whole or not at all (written beside it, then renamed)."""
    url = normalize_url(url)
    target = Path(file).expanduser()
    if target.is_dir():
        raise errors.ValidationError(f"{target} is a directory, not a file", field="FILE")
    _refuse_existing(target, force)
    if not target.parent.is_dir():
        raise errors.ValidationError(f"{target.parent} is not a directory", field="FILE")
    temp = _private_temp(target.parent, target.name)
    try:
        if _is_sqlite(url):
            _sqlite_backup(url, temp)
        else:
            _pg_dump(url, temp)
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return BackupResult(
        file=str(target),
        database=redact(url),
        backend="sqlite" if _is_sqlite(url) else "postgresql",
        bytes=target.stat().st_size,
    )


def _sqlite_path(url: str) -> Path:
    path = database_of(url)
    if not path or path == ":memory:":
        raise errors.ValidationError("an in-memory database has nothing to back up", field="--db")
    return Path(path)


def _sqlite_backup(url: str, temp: Path) -> None:
    source_path = _sqlite_path(url)
    if not source_path.is_file() or source_path.stat().st_size == 0:
        raise errors.NotFound(f"no database at {source_path}", field="database_url")
    # read-only: a backup never creates or changes the source
    with (
        contextlib.closing(
            sqlite3.connect(f"file:{source_path}?mode=ro", uri=True, timeout=30)
        ) as source,
        contextlib.closing(sqlite3.connect(temp)) as copy,
    ):
        try:
            source.backup(copy)  # online: a consistent snapshot while daemons write
            # a backup is one file: no -wal beside it
            copy.execute("PRAGMA journal_mode=DELETE")
        except sqlite3.Error as exc:
            raise errors.StoreUnavailable(f"backup of {source_path} failed: {exc}") from exc


def restore(url: str, file: str | Path, *, force: bool = False) -> BackupResult:
    """Replace the contents of the database at `url` with the backup `file`. Refused,
    with nothing changed: a missing, unreadable or foreign file; a database that already
    holds a scheduler, without `force`; one whose partitions a dispatcher holds, without
    `force` (stop the daemons first)."""
    url = normalize_url(url)
    source = Path(file).expanduser()
    if not source.exists():
        raise errors.ValidationError(f"{source} does not exist", field="FILE")
    if not source.is_file():
        raise errors.ValidationError(f"{source} is not a file", field="FILE")
    try:
        with source.open("rb") as handle:
            head = handle.read(16)
    except OSError as exc:
        raise errors.ValidationError(f"cannot read {source}: {exc.strerror}", field="FILE") from exc
    if _is_sqlite(url):
        if head != b"SQLite format 3\x00":
            raise errors.ValidationError(
                f"{source} is not a SQLite backup (made by `schedctl db backup` of a SQLite "
                "database)",
                field="FILE",
            )
        _check_sqlite_backup(source)
        _check_target(url, force)
        _sqlite_restore(url, source)
    else:
        if not head.startswith(b"PGDMP"):
            raise errors.ValidationError(
                f"{source} is not a pg_dump custom-format backup (made by `schedctl db "
                "backup` of a Postgres database)",
                field="FILE",
            )
        tables = _pg_list(source)  # readable by this pg_restore, before anything is dropped
        _check_target(url, force)
        _pg_restore(url, source, tables)
    return BackupResult(
        file=str(source),
        database=redact(url),
        backend="sqlite" if _is_sqlite(url) else "postgresql",
        bytes=source.stat().st_size,
    )


def _check_sqlite_backup(source: Path) -> None:
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{source}?mode=ro&immutable=1", uri=True)
        ) as copy:
            ok = copy.execute("PRAGMA quick_check").fetchone()
            tables = {
                row[0]
                for row in copy.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
    except sqlite3.Error as exc:
        raise errors.ValidationError(
            f"{source} cannot be read as a database: {exc}", field="FILE"
        ) from exc
    if not ok or ok[0] != "ok":
        raise errors.ValidationError(f"{source} is damaged ({ok[0] if ok else '?'})", field="FILE")
    if not {"alembic_version", "jobs", "runs"} <= tables:
        raise errors.ValidationError(
            f"{source} is a SQLite file but not a scheduler database", field="FILE"
        )


def _check_target(url: str, force: bool) -> None:
    """The database to be replaced: refuse (nothing changed) one in use by a dispatcher,
    or holding a scheduler already, unless `force`."""

    if _is_sqlite(url):
        path = _sqlite_path(url)
        if not path.exists() or path.stat().st_size == 0:
            return  # a new file: nothing to replace
    engine = make_engine(url)
    try:
        check_connection(engine)
        with engine.connect() as connection:
            tables = set(inspect(connection).get_table_names())
            owners = []
            if "partitions" in tables:
                owners = [
                    row[0]
                    for row in connection.execute(
                        select(schema.partitions.c.owner)
                        .where(schema.partitions.c.owner.is_not(None))
                        .distinct()
                        .limit(3)
                    )
                ]
    finally:
        engine.dispose()
    if force:
        return
    if owners:
        raise errors.Conflict(
            f"dispatchers hold this database's partitions ({', '.join(owners)}): stop the "
            "daemons first (a killed one's claim stays until --force)",
            field="--force",
        )
    if "alembic_version" in tables:
        raise errors.Conflict(
            f"{redact(url)} already holds a scheduler database: give --force to replace "
            "all of its jobs, runs and tenants with the backup's",
            field="--force",
        )


def _sqlite_restore(url: str, source: Path) -> None:
    """Through the backup API into the target: one transaction of SQLite's, so readers see
    the old database or the new one, and the -wal file is handled by SQLite itself."""
    path = _sqlite_path(url)
    private_sqlite_file(path)  # 0600, made before SQLite opens it
    with (
        contextlib.closing(sqlite3.connect(f"file:{source}?mode=ro&immutable=1", uri=True)) as copy,
        contextlib.closing(sqlite3.connect(path, timeout=30)) as target,
    ):
        try:
            copy.backup(target)
            target.execute("PRAGMA journal_mode=WAL")
            target.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            raise errors.StoreUnavailable(f"restore into {path} failed: {exc}") from exc


# -- Postgres ----------------------------------------------------------------------------


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise errors.ConfigError(
            f"{name} is not on PATH: install the PostgreSQL client tools of the server's "
            "major version (Debian: postgresql-client-NN)",
            field=name,
        )
    return found


def _conninfo_value(value: str) -> str:
    """A libpq connection-string value, quoted when it needs to be."""
    if value and not any(c in value for c in " '\\=\t\n"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def libpq_target(url: str) -> tuple[str, dict[str, str]]:
    """The libpq connection string of a Postgres URL without its password, and the
    environment variables that carry the password (PGPASSWORD): argv is visible to every
    user of the machine (ps), the environment only to the process's owner."""
    parsed: URL = make_url(normalize_url(url))
    parts: dict[str, str] = {}
    if parsed.host:
        parts["host"] = parsed.host
    if parsed.port:
        parts["port"] = str(parsed.port)
    if parsed.username:
        parts["user"] = parsed.username
    if parsed.database:
        parts["dbname"] = parsed.database
    env: dict[str, str] = {}
    for key, value in parsed.query.items():
        text = value if isinstance(value, str) else ",".join(value)
        if key.lower() == "password":
            env["PGPASSWORD"] = text
        elif key.lower() == "sslpassword":
            # not an environment variable of libpq's; a key passphrase stays out of argv
            raise errors.ConfigError(
                "sslpassword cannot be handed to pg_dump without showing it in the "
                "process list: use an unencrypted client key for backups",
                field="database_url",
            )
        else:
            parts[key] = text
    if parsed.password:
        env["PGPASSWORD"] = str(parsed.password)
    conninfo = " ".join(f"{key}={_conninfo_value(value)}" for key, value in parts.items())
    return conninfo, env


def _run_pg_tool(argv: list[str], env_extra: dict[str, str], what: str) -> str:
    env = {**os.environ, **env_extra}
    try:
        done = subprocess.run(
            argv,
            env=env,
            capture_output=True,
            text=True,
            timeout=PG_TOOL_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise errors.StoreUnavailable(
            f"{what} did not finish within {PG_TOOL_TIMEOUT_SECONDS} s"
        ) from exc
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        message = "; ".join(lines[:_STDERR_LINES]) or f"exit status {done.returncode}"
        hint = ""
        if "version mismatch" in message or "unsupported version" in message:
            hint = (
                f" (use the {Path(argv[0]).name} of the server's major version or newer: "
                "Debian's postgresql-client-NN)"
            )
        raise errors.StoreUnavailable(f"{what} failed: {message}{hint}")
    return done.stdout


def _pg_dump(url: str, temp: Path) -> None:
    conninfo, env = libpq_target(url)
    _run_pg_tool(
        [_tool("pg_dump"), "--format=custom", f"--file={temp}", f"--dbname={conninfo}"],
        env,
        "pg_dump",
    )
    os.chmod(temp, SQLITE_FILE_MODE)  # pg_dump makes its file by the umask


def _pg_list(source: Path) -> list[tuple[str, str, str]]:
    """The (kind, schema, name) of the tables and functions the backup holds (the functions:
    those of job_names' triggers, 0023); a ValidationError naming FILE when this pg_restore
    cannot read it (not a dump, or from a newer pg_dump)."""
    try:
        listing = _run_pg_tool(
            [_tool("pg_restore"), "--list", str(source)], {}, "pg_restore --list"
        )
    except errors.StoreUnavailable as exc:
        raise errors.ValidationError(
            f"{source} cannot be read by pg_restore: {exc}", field="FILE"
        ) from exc
    found = []
    for line in listing.splitlines():
        # "215; 1259 16390 TABLE public runs owner" (TABLE DATA and the rest are not tables),
        # "220; 1255 16400 FUNCTION public job_names_inserted() owner"
        words = line.split()
        if line.startswith(";") or len(words) < 6 or words[3] not in ("TABLE", "FUNCTION"):
            continue
        if words[4] != "DATA":
            found.append((words[3], words[4], words[5].split("(")[0]))
    if ("TABLE", "alembic_version") not in {(kind, name) for kind, _schema, name in found}:
        raise errors.ValidationError(
            f"{source} is a pg_dump backup but not of a scheduler database", field="FILE"
        )
    return found


def _pg_restore(url: str, source: Path, tables: list[tuple[str, str, str]]) -> None:
    """Into the configured database as its owner, all or nothing: pg_restore writes the
    backup as SQL (--no-owner: this URL's role owns everything; --no-privileges: grants
    left out, as roles are the cluster's, not the database's: re-run `schedctl db grant
    ROLE --apply`), and psql runs DROP TABLE of the backup's tables (then DROP FUNCTION of
    its functions, which the SQL creates again) and then that SQL in one transaction that
    stops at the first error (pg_restore's own --clean cannot drop a partitioned table's
    partitions' constraints). The SQL is written to a private file first: a pg_restore
    that fails half-way must not have its half committed."""
    conninfo, env = libpq_target(url)
    drops = "".join(
        f"DROP {kind} IF EXISTS "
        + ".".join('"' + part.replace('"', '""') + '"' for part in (schema_name, name))
        + " CASCADE;\n"
        # the tables first: a function goes after the triggers that use it
        for kind, schema_name, name in sorted(tables, key=lambda entry: entry[0] != "TABLE")
    )
    with tempfile.TemporaryDirectory(prefix="schedctl-restore-") as scratch:
        drop_file, script = Path(scratch) / "drop.sql", Path(scratch) / "restore.sql"
        drop_file.write_text(drops)
        _run_pg_tool(
            [
                _tool("pg_restore"),
                "--no-owner",
                "--no-privileges",
                f"--file={script}",
                str(source),
            ],
            {},
            "pg_restore",
        )
        os.chmod(script, SQLITE_FILE_MODE)  # the backup's rows, in plain text
        _run_pg_tool(
            [
                _tool("psql"),
                "--no-psqlrc",
                "--quiet",
                "--single-transaction",
                "--set=ON_ERROR_STOP=1",
                f"--file={drop_file}",
                f"--file={script}",
                f"--dbname={conninfo}",
            ],
            env,
            "psql (the restore)",
        )
