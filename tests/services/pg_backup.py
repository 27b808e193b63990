"""Owns the backup tools of a test Postgres, from the server's own binaries (`pg_config
--bindir`, the same version as the server), as docs/operations.md (Backups) runs them:
pg_dump and pg_restore, and a server that archives its WAL, its base backup and a
point-in-time recovery from the two.

pg_dump and pg_restore are client programs: they connect over TCP to 127.0.0.1 as the
database role `postgres`, like the harness's psql, so they read and write files of the test
process. pg_basebackup runs as the server's user: a server starts on the files it writes.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
import time
from datetime import datetime
from pathlib import Path

from tests.services.ports import ServiceError
from tests.services.postgres import SERVER_USER, PostgresServer

COMMAND_TIMEOUT_SECONDS = 120.0

# What docs/operations.md says to restore with, into a new empty database: all or nothing, owned by
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


class ArchivingPostgres(PostgresServer):
    """A test Postgres that archives its WAL (`archive_mode=on`, `cp` into `archive_dir`),
    for base backups and point-in-time recovery as docs/operations.md describes them."""

    @property
    def archive_dir(self) -> Path:
        return self.base_dir / "archive"

    def _server_options(self) -> str:
        return (
            f"{super()._server_options()} -c wal_level=replica -c archive_mode=on "
            f"-c archive_command='test ! -f {self.archive_dir}/%f && cp %p {self.archive_dir}/%f'"
        )

    def start(self) -> None:
        self.base_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.archive_dir.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() == 0:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(self.archive_dir, user.pw_uid, user.pw_gid)
        super().start()

    def base_backup(self, target: Path) -> None:
        """`pg_basebackup -D target -X stream -c fast` as the server's user (the files must
        be its own for a server to start on them); `target`'s parent must be writable by it."""
        command = [str(self.bindir / "pg_basebackup"), "-D", str(target), "-X", "stream"]
        command += ["-c", "fast", "-h", self.host, "-p", str(self.port), "-U", "postgres"]
        _as_server_user(command)

    def archive_current_wal(self, timeout: float = 60.0) -> None:
        """Switch to a new WAL file and wait until the one just finished is archived: what
        was committed so far can be recovered from the archive."""
        finished = str(self.admin("SELECT pg_walfile_name(pg_switch_wal())")[0][0])
        deadline = time.monotonic() + timeout
        for _ in range(int(timeout / 0.1) + 1):
            rows = self.admin("SELECT last_archived_wal, last_failed_wal FROM pg_stat_archiver")
            archived = rows[0][0]
            if isinstance(archived, str) and archived >= finished:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        raise ServiceError(f"WAL file {finished} not archived in {timeout:g} s: {rows}")


def recovered_server(backup: Path, archive: Path, target: datetime) -> PostgresServer:
    """A server (not started) on the base backup at `backup`, set to replay the WAL in
    `archive` up to the commits at `target` and then open for writes (promote)."""
    server = PostgresServer(base_dir=backup.parent)
    if server.data_dir != backup:
        raise ValueError(f"the base backup must be at {server.data_dir}")
    with (backup / "postgresql.auto.conf").open("a") as conf:
        conf.write(
            f"restore_command = 'cp {archive}/%f %p'\n"
            f"recovery_target_time = '{target.isoformat()}'\n"
            "recovery_target_action = 'promote'\n"
        )
    (backup / "recovery.signal").touch()
    if os.geteuid() == 0:
        user = pwd.getpwnam(SERVER_USER)
        os.chown(backup / "recovery.signal", user.pw_uid, user.pw_gid)
    return server


def wait_writable(server: PostgresServer, timeout: float = 60.0) -> None:
    """Until recovery has ended and the server takes writes (promoted)."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.1) + 1):
        with contextlib.suppress(ServiceError):
            if server.admin("SELECT pg_is_in_recovery()")[0][0] is False:
                return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    raise ServiceError(f"still in recovery after {timeout:g} s:\n{server.log_tail(30)}")


def _as_server_user(command: list[str]) -> None:
    full = ["runuser", "-u", SERVER_USER, "--", *command] if os.geteuid() == 0 else command
    try:
        done = subprocess.run(
            full,
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(f"{command[0]} did not finish in {COMMAND_TIMEOUT_SECONDS:g} s") from exc
    if done.returncode != 0:
        raise ServiceError(f"{' '.join(full)} failed (rc={done.returncode}):\n{done.stderr}")
