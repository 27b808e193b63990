"""Owns the backup tools of a test Postgres: pg_dump and pg_restore from the server's own
binaries (`pg_config --bindir`, the same version as the server), as the README's backup
section runs them.

They are client programs: they connect over TCP to 127.0.0.1 as the database role
`postgres`, like the harness's psql, so they read and write files of the test process.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.services.ports import ServiceError
from tests.services.postgres import PostgresServer

COMMAND_TIMEOUT_SECONDS = 120.0

# What the README says to restore with, into a new empty database: all or nothing, owned by
# whoever restores (roles are not in a pg_dump; `pg_dumpall --globals-only` keeps them).
# Not --clean over the old database: Postgres 15's pg_restore then fails on the partitioned
# runs table ("cannot drop inherited constraint runs_default_pkey of relation runs_default").
RESTORE_OPTIONS = ("--no-owner", "--single-transaction", "--exit-on-error")


def _connection(server: PostgresServer, dbname: str) -> list[str]:
    return ["-h", server.host, "-p", str(server.port), "-U", "postgres", "-d", dbname]


def _run(server: PostgresServer, tool: str, args: list[str]) -> str:
    command = [str(server.bindir / tool), *args]
    try:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(f"{tool} did not finish in {COMMAND_TIMEOUT_SECONDS:g} s") from exc
    if done.returncode != 0:
        raise ServiceError(f"{' '.join(command)} failed (rc={done.returncode}):\n{done.stderr}")
    return done.stderr


def pg_dump(server: PostgresServer, dbname: str, path: Path) -> None:
    """`pg_dump -Fc` of database `dbname` (one consistent snapshot, taken live) to `path`."""
    _run(server, "pg_dump", ["-Fc", "-f", str(path), *_connection(server, dbname)])


def recreate_database(server: PostgresServer, dbname: str) -> None:
    """`dropdb --force` and `createdb`: the empty database a dump is restored into."""
    server.drop_database(dbname)
    server.create_database(dbname)


def pg_restore(server: PostgresServer, dbname: str, path: Path) -> str:
    """Restore the custom-format dump at `path` into the empty database `dbname` with
    RESTORE_OPTIONS; returns what pg_restore wrote to stderr (nothing when all went well)."""
    return _run(server, "pg_restore", [*RESTORE_OPTIONS, *_connection(server, dbname), str(path)])
