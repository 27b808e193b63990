"""Owns one throwaway PostgreSQL cluster for tests: initdb, start, stop, kill, restart, cleanup.

The cluster lives in its own directory (by default ``/var/tmp/schedctl-pg-<id>``), listens
only on 127.0.0.1 on a free non-default port, keeps its Unix socket in that directory, and
trades durability for speed (fsync off). Postgres refuses to run as root, so when this
process is root every server command runs as the ``postgres`` user via ``runuser`` from
``cwd=/``; the directory is owned by that user and sits under a world-traversable parent.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psycopg

from tests.services.ports import ServiceError, child_pids, free_port, pid_alive, tail
from tests.services.process import Service, failure, kill_and_reap, serve_until_enter

SERVER_USER = "postgres"
_START_TIMEOUT_S = 60
_STOP_TIMEOUT_S = 60
_COMMAND_TIMEOUT_S = 120
_PORT_RETRIES = 3
_INSTALL_HINT = (
    "PostgreSQL server binaries not found (looked at `pg_config --bindir` and "
    "/usr/lib/postgresql/*/bin). `make test` (or `make deps`) installs them "
    "with `apt-get install -y postgresql`."
)


def find_bindir() -> Path:
    """The directory holding ``initdb``, ``pg_ctl``, ``postgres`` and ``psql``."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.strip()
            if out:
                candidates.append(Path(out))

    def version_key(path: str) -> tuple[int, str]:
        version = Path(path).parent.name
        return (int(version) if version.isdigit() else -1, version)

    for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version_key, reverse=True):
        candidates.append(Path(found))
    for bindir in candidates:
        if all((bindir / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres", "psql")):
            return bindir
    raise ServiceError(_INSTALL_HINT)


def quote_ident(name: str) -> str:
    """``name`` as a double-quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """``value`` as a single-quoted SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def _clean_env() -> dict[str, str]:
    """The environment for Postgres tools: no PG* settings leaking in from the caller."""
    env = {key: val for key, val in os.environ.items() if not key.startswith("PG")}
    env["LC_ALL"] = "C.UTF-8"
    env["LANG"] = "C.UTF-8"
    return env


class PostgresServer(Service):
    """One throwaway PostgreSQL cluster on 127.0.0.1.

    ``start()`` runs initdb on first use, then starts the server; ``stop()``, ``kill()``
    and ``restart()`` keep the data directory and port, so a restarted server is the same
    database. ``cleanup()`` stops it and deletes the directory.

    By default commits are asynchronous (``synchronous_commit=off``): fast, but a commit
    acknowledged less than about 0.6 s before ``kill()`` can be lost, exactly as the
    Postgres docs say. ``crash_safe=True`` keeps ``synchronous_commit=on`` so every
    acknowledged commit survives ``kill()``; fsync stays off either way, because a killed
    process does not lose what it already wrote to the kernel's page cache.
    """

    def __init__(
        self,
        base_dir: Path | None = None,
        port: int | None = None,
        *,
        crash_safe: bool = False,
        settings: Sequence[str] = (),
    ) -> None:
        self.crash_safe = crash_safe
        # more `-c name=value` server settings (ssl=on and its files, for the TLS tests)
        self.settings = tuple(settings)
        self._owns_base_dir = base_dir is None
        self.base_dir = (
            base_dir
            if base_dir is not None
            else Path("/var/tmp") / f"schedctl-pg-{uuid.uuid4().hex[:12]}"
        )
        self._port_fixed = port is not None
        self.port = port if port is not None else free_port()
        self.host = "127.0.0.1"
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "sock"
        self.log_path = self.base_dir / "postgres.log"
        self.bindir = find_bindir()
        self._as_server_user = os.geteuid() == 0
        self._atexit_registered = False
        self._admin_conn: psycopg.Connection[tuple[object, ...]] | None = None

    def __repr__(self) -> str:
        return (
            f"PostgresServer(port={self.port}, base_dir={str(self.base_dir)!r}, "
            f"crash_safe={self.crash_safe})"
        )

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Create the cluster if needed and start the server; return once it accepts connections."""
        if self.is_running():
            return
        self._prepare_dirs()
        if not (self.data_dir / "PG_VERSION").is_file():
            self._initdb()
        if not self._atexit_registered:
            atexit.register(self._at_exit)
            self._atexit_registered = True
        for attempt in range(_PORT_RETRIES):
            try:
                self._pg_ctl_start()
                return
            except ServiceError:
                log = self.log_tail(20)
                port_taken = "could not bind" in log or "Address already in use" in log
                if self._port_fixed or not port_taken or attempt == _PORT_RETRIES - 1:
                    raise
                self.port = free_port()  # someone took our port between check and bind
        raise AssertionError("unreachable")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server with ``pg_ctl stop -m mode`` (smart, fast or immediate)."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown pg_ctl stop mode {mode!r}")
        self._close_admin()  # a smart stop waits for every client, this one too
        if not self.is_running():
            return
        result = self._pg(
            "pg_ctl",
            *("-D", str(self.data_dir)),
            *("-m", mode, "-w", "-t", str(_STOP_TIMEOUT_S)),
            "stop",
            timeout=_STOP_TIMEOUT_S + 30,
        )
        if result.returncode != 0 and self.is_running():
            self.kill()
            raise failure(
                f"pg_ctl stop -m {mode} failed (rc={result.returncode}); server was killed\n"
                f"{result.stdout}{result.stderr}",
                self.logs(),
            )

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend it has (a crash, for chaos tests).

        Returns once all of them are gone, so ``start()`` can run crash recovery at once.
        """
        self._close_admin()
        pid = self.postmaster_pid()
        if pid is None or not pid_alive(pid):
            return
        shmid = self._lock_shmid()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)  # freeze it so it forks no new backend meanwhile
        kill_and_reap([pid, *child_pids(pid)])
        self._remove_stale_lock(shmid)

    def restart(self, mode: str = "fast") -> None:
        """Stop (if running) and start again on the same data directory and port."""
        self.stop(mode)
        self.start()

    def is_running(self) -> bool:
        """True if the postmaster recorded in ``postmaster.pid`` is alive."""
        pid = self.postmaster_pid()
        return pid is not None and pid_alive(pid)

    def postmaster_pid(self) -> int | None:
        """The postmaster's PID from ``postmaster.pid``, or None if there is none."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        except OSError:
            return None
        return int(first) if first.isdigit() else None

    def cleanup(self) -> None:
        """Stop the server (killing it if a clean stop fails) and delete its directory."""
        try:
            self.stop()
        except ServiceError:
            pass  # stop() already killed it
        finally:
            if self.is_running():
                self.kill()
            shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- use -------------------------------------------------------------------------

    def url(self, dbname: str = "postgres", user: str = "postgres") -> str:
        """The SQLAlchemy URL of database ``dbname`` as ``user`` (psycopg 3 driver, no
        password: the cluster trusts loopback)."""
        return f"postgresql+psycopg://{user}@{self.host}:{self.port}/{dbname}"

    def ensure_role(self, name: str) -> None:
        """Create the login role ``name`` (no rights of its own) unless it exists; roles are
        the cluster's, shared by every database in it."""
        if not self.admin(f"SELECT 1 FROM pg_roles WHERE rolname = {quote_literal(name)}"):
            with contextlib.suppress(ServiceError):  # made meanwhile by another session
                self.admin(f"CREATE ROLE {quote_ident(name)} LOGIN")

    def dsn(self, dbname: str = "postgres") -> str:
        """The libpq connection string of database ``dbname``."""
        return f"host={self.host} port={self.port} user=postgres dbname={dbname}"

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        """Run ``sql`` with psql (unaligned, tuples only) and return its stdout."""
        result = self._pg(
            "psql",
            *("-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"),
            *("-h", self.host, "-p", str(self.port), "-U", "postgres", "-d", dbname),
            *("-c", sql),
            as_server_user=False,
        )
        if result.returncode != 0:
            raise ServiceError(
                f"psql failed (rc={result.returncode}) on {dbname}: {sql}\n{result.stderr}"
            )
        return result.stdout

    def admin(self, sql: str) -> list[tuple[object, ...]]:
        """Run ``sql`` on the ``postgres`` database over one kept connection (autocommit) and
        return its rows: the per-test database copies, without a psql process for each."""
        for attempt in range(2):
            conn = self._admin_conn
            try:
                if conn is None or conn.closed:
                    conn = self._admin_conn = psycopg.connect(
                        self.dsn(), autocommit=True, connect_timeout=30
                    )
                cursor = conn.execute(sql.encode())
                return cursor.fetchall() if cursor.description else []
            except psycopg.Error as exc:
                # a connection the server dropped (a test restarted it) is made again once;
                # an error of the statement itself is the caller's
                if conn is not None and not conn.broken and not conn.closed:
                    raise ServiceError(f"{exc} (in: {sql})") from exc
                self._close_admin()
                if attempt == 1:
                    raise ServiceError(f"{exc} (in: {sql})") from exc
        raise AssertionError("unreachable")

    def _close_admin(self) -> None:
        conn, self._admin_conn = self._admin_conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def database_exists(self, name: str) -> bool:
        """True if database ``name`` exists."""
        rows = self.admin(f"SELECT 1 FROM pg_database WHERE datname = {quote_literal(name)}")
        return bool(rows)

    def terminate_backends(self, dbname: str) -> None:
        """Terminate every session connected to ``dbname`` (other than our own)."""
        self.admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = {quote_literal(dbname)} AND pid <> pg_backend_pid()"
        )

    def create_database(self, name: str, template: str | None = None) -> None:
        """Create database ``name``, optionally as a copy of ``template``.

        Postgres refuses to copy a template that has sessions (after waiting 5 s for them to
        go), so they are terminated first, and the copy retried if new ones slipped in. The
        copy is a file copy: with fsync off its checkpoints cost little, and it is about three
        times faster than the WAL-logged copy for a small template.
        """
        sql = f"CREATE DATABASE {quote_ident(name)}"
        if template is not None:
            self.terminate_backends(template)
            sql += f" TEMPLATE {quote_ident(template)}"
            if self._admin_conn is not None and self._admin_conn.info.server_version >= 150000:
                sql += " STRATEGY FILE_COPY"  # the option is new in Postgres 15
        last_error: ServiceError | None = None
        for _ in range(5):
            try:
                self.admin(sql)
                return
            except ServiceError as exc:
                if template is None or "is being accessed by other users" not in str(exc):
                    raise
                last_error = exc
                self.terminate_backends(template)
                time.sleep(0.1)
        assert last_error is not None
        raise last_error

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists; FORCE terminates its sessions first."""
        self.admin(f"DROP DATABASE IF EXISTS {quote_ident(name)} WITH (FORCE)")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log."""
        return tail(self.log_path, lines)

    def logs(self, lines: int = 40) -> dict[str, str]:
        """The server log's tail, titled, for failure reports."""
        return {f"postgres log ({self.log_path})": self.log_tail(lines)}

    # -- internals -------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        self.base_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.socket_dir.mkdir(mode=0o700, exist_ok=True)
        self.log_path.touch(exist_ok=True)
        if self._as_server_user:
            try:
                user = pwd.getpwnam(SERVER_USER)
            except KeyError:
                raise ServiceError(
                    f"running as root but there is no {SERVER_USER!r} user; "
                    "`make deps` installs postgresql, which creates it"
                ) from None
            for path in (self.base_dir, self.socket_dir, self.log_path):
                os.chown(path, user.pw_uid, user.pw_gid)
            probe = self._run(
                ["test", "-w", str(self.base_dir)], as_server_user=True, timeout=30, check=False
            )
            if probe.returncode != 0:
                raise ServiceError(
                    f"user {SERVER_USER!r} cannot write {self.base_dir}: a parent directory "
                    "is probably not traversable by it (use a base_dir under /var/tmp)"
                )

    def _initdb(self) -> None:
        result = self._pg(
            "initdb",
            *("-D", str(self.data_dir)),
            *("-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C.UTF-8"),
        )
        if result.returncode != 0:
            raise ServiceError(
                f"initdb failed (rc={result.returncode}) in {self.data_dir}\n"
                f"{result.stdout}{result.stderr}"
            )

    def _server_options(self) -> str:
        options = [
            f"-p {self.port}",
            f"-c listen_addresses={self.host}",
            f"-k {self.socket_dir}",
            "-c fsync=off",
            f"-c synchronous_commit={'on' if self.crash_safe else 'off'}",
            "-c full_page_writes=off",
            "-c max_connections=300",
            "-c log_line_prefix='%m [%p] %d '",
            *(f"-c {setting}" for setting in self.settings),
        ]
        return " ".join(options)

    def _pg_ctl_start(self) -> None:
        result = self._pg(
            "pg_ctl",
            *("-D", str(self.data_dir), "-l", str(self.log_path)),
            *("-w", "-t", str(_START_TIMEOUT_S), "-o", self._server_options()),
            "start",
            timeout=_START_TIMEOUT_S + 30,
        )
        if result.returncode != 0 or not self.is_running():
            if self.is_running():
                self.kill()
            raise failure(
                f"pg_ctl start failed (rc={result.returncode}) on port {self.port}\n"
                f"{result.stdout}{result.stderr}",
                self.logs(),
            )

    def _pg(
        self,
        tool: str,
        *args: str,
        as_server_user: bool = True,
        timeout: float = _COMMAND_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        """Run the server's program `tool` (pg_ctl, initdb, psql) with `args`; the caller
        reads its return code."""
        cmd = [str(self.bindir / tool), *args]
        return self._run(cmd, as_server_user=as_server_user, timeout=timeout, check=False)

    def _run(
        self,
        cmd: Sequence[str],
        *,
        as_server_user: bool,
        timeout: float,
        check: bool,
    ) -> subprocess.CompletedProcess[str]:
        full = list(cmd)
        if as_server_user and self._as_server_user:
            full = ["runuser", "-u", SERVER_USER, "--", *full]
        # Output goes to anonymous temporary files rather than pipes: the postmaster that
        # pg_ctl leaves behind must never hold a pipe we wait on.
        try:
            with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
                completed = subprocess.run(
                    full,
                    cwd="/",
                    env=_clean_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    timeout=timeout,
                    check=False,
                )
                out.seek(0)
                err.seek(0)
                stdout, stderr = out.read(), err.read()
        except subprocess.TimeoutExpired as exc:
            raise ServiceError(f"timed out after {timeout}s: {' '.join(full)}") from exc
        except FileNotFoundError as exc:
            raise ServiceError(f"cannot run {full[0]}: {exc}") from exc
        if check and completed.returncode != 0:
            raise ServiceError(f"command failed (rc={completed.returncode}): {' '.join(full)}")
        return subprocess.CompletedProcess(full, completed.returncode, stdout, stderr)

    def _lock_shmid(self) -> int | None:
        """The SysV shared memory id recorded in ``postmaster.pid`` (line 7: key, id)."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return None
        fields = lines[6].split() if len(lines) > 6 else []
        return int(fields[1]) if len(fields) == 2 and fields[1].isdigit() else None

    def _remove_stale_lock(self, shmid: int | None) -> None:
        """After a crash: drop the dead postmaster's lock files and shared memory segment.

        Every server process is dead by now, but until init reaps the zombie postmaster
        ``kill(pid, 0)`` still succeeds and a new postmaster would refuse the lock file
        (reaping takes 1-2 s on some machines). Crash recovery is driven by pg_control,
        not by the lock file, so removing it is safe; the old segment has no attachments
        left and would otherwise leak, since only the next postmaster would remove it.
        """
        for lock in [self.data_dir / "postmaster.pid", *self.socket_dir.glob(".s.PGSQL.*.lock")]:
            with contextlib.suppress(OSError):
                lock.unlink()
        if shmid is not None and shutil.which("ipcrm"):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    ["ipcrm", "-m", str(shmid)],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=30,
                    check=False,
                )

    def _at_exit(self) -> None:
        """Last resort at interpreter exit: never leave a server running."""
        with contextlib.suppress(Exception):
            if self.is_running():
                self.kill()
            if self._owns_base_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)


if __name__ == "__main__":
    # ``python -m tests.services.postgres``: run a throwaway server until Enter is pressed
    raise SystemExit(serve_until_enter("postgres", PostgresServer()))
