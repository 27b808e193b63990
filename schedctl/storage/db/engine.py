"""Database engines: URL normalisation (libpq's multi-host URL and key=value forms included),
the keyword arguments a Postgres session is opened with (for connections made outside the
pool: LISTEN), SQLite pragmas (WAL, immediate transactions), the SQLite file's mode (0600
for the owner alone)."""

from __future__ import annotations

import logging
import os
import re
import stat
import time
import weakref
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError, SQLAlchemyError

from schedctl.core import errors

IDLE_IN_TRANSACTION_MS = 5000
# A pooled connection idle longer than this is pinged when checked out; one in steady use
# is not (a pre-ping on every checkout was a round trip per transaction of a busy worker).
PING_AFTER_IDLE_SECONDS = 1.0
# the embedded database holds payloads, token digests and signing secrets: its owner's alone
SQLITE_FILE_MODE = 0o600

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """Accept postgres://, postgresql:// and plain paths; always drive Postgres with psycopg 3.
    libpq's own multi-host forms, which SQLAlchemy cannot parse, become its comma lists:
    `postgresql://h1:p1,h2:p2/db?...` and a key=value DSN (`host=h1,h2 port=p1,p2
    dbname=db ...`). SQLAlchemy's repeated `?host=h1:p1&host=h2:p2` passes as it is."""
    url = url.strip()
    if not url:
        raise errors.ConfigError("the database URL is empty", field="database_url")
    if "://" not in url:
        if _KEYWORD_DSN.match(url):
            return _keyword_dsn_url(url)
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    for prefix in ("postgres://", "postgresql://", "postgresql+psycopg://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + _host_list_to_query(url[len(prefix) :])
    return url


# a libpq key=value connection string starts with one of its keywords (a SQLite path never
# starts so: `host=...` as a file name would be odd, and a path with a slash is not one)
_KEYWORD_DSN = re.compile(r"^(host|hostaddr|port|dbname|user|service)\s*=", re.IGNORECASE)


def _keyword_dsn_url(dsn: str) -> str:
    """libpq's `key=value ...` form as a postgresql+psycopg URL with every key in the query."""
    from psycopg.conninfo import conninfo_to_dict  # here: only a Postgres URL needs psycopg

    try:
        parts = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    except Exception as exc:  # psycopg.ProgrammingError; never repeat the DSN (a password)
        raise errors.ConfigError(
            "not a libpq connection string (host=... port=... dbname=... user=...)",
            field="database_url",
        ) from exc
    user = quote(parts.pop("user", ""), safe="")
    password = parts.pop("password", None)
    userinfo = user + (":" + quote(password, safe="") if password is not None else "")
    database = quote(parts.pop("dbname", ""), safe="")
    query = "&".join(f"{quote(k, safe='')}={quote(v, safe=',')}" for k, v in parts.items())
    return f"postgresql+psycopg://{userinfo}{'@' if userinfo else ''}/{database}" + (
        f"?{query}" if query else ""
    )


def _host_list_to_query(rest: str) -> str:
    """`[userinfo@]h1:p1,h2:p2[/db][?query]` with the host list moved into the query as
    libpq's comma lists (host=h1,h2&port=p1,p2); anything else unchanged."""
    authority, slash, tail = rest.partition("/")
    if not slash:
        authority, question, query = rest.partition("?")
        tail = ("?" + query) if question else ""
    userinfo, at, hosts = authority.rpartition("@")
    if "," not in hosts:
        return rest
    names: list[str] = []
    ports: list[str] = []
    for each in hosts.split(","):
        if each.startswith("["):  # [IPv6]:port
            name, _, after = each[1:].partition("]")
            port = after[1:] if after.startswith(":") else ""
        else:
            name, _, port = each.partition(":")
        names.append(unquote(name))
        ports.append(port)
    database, question, query = tail.partition("?")
    lists = f"host={quote(','.join(names), safe=',:')}"
    if any(ports):
        lists += f"&port={','.join(ports)}"
    return f"{userinfo}{at}/{database}?{lists}" + (f"&{query}" if question and query else "")


def sets_itself_up(url: str) -> bool:
    """The embedded SQLite default migrates itself when opened; a shared Postgres is
    upgraded on purpose (`schedctl db upgrade`)."""
    return normalize_url(url).startswith("sqlite")


def has_roles(url: str) -> bool:
    """Whether the database at `url` has roles and grants (Postgres), not a file's owner
    and mode (SQLite)."""
    try:
        return make_url(normalize_url(url)).get_backend_name() == "postgresql"
    except ArgumentError:
        return False


# libpq takes a password as a query parameter too (?password=...)
_SECRET_PARAMETERS = ("password", "sslpassword")


def redact(url: str) -> str:
    """The URL as logs and messages may show it: passwords hidden, in the user part and in
    libpq's query parameters."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return "<unparseable URL>"
    hidden = {key: "***" for key in parsed.query if key.lower() in _SECRET_PARAMETERS}
    if hidden:
        parsed = parsed.update_query_dict(hidden)
    return parsed.render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def is_database_url(url: str) -> bool:
    """Whether SQLAlchemy can parse `url` (already normalized) as a database URL."""
    try:
        make_url(url)
    except ArgumentError:
        return False
    return True


def database_of(url: str) -> str | None:
    """The database part of a parsed URL: a SQLite file's path, a Postgres database name."""
    return make_url(url).database


# who a session is in pg_stat_activity, unless the process says (scheduled-d: its mode)
APPLICATION_NAME = "schedctl"


def make_engine(url: str, *, application_name: str = APPLICATION_NAME, **kwargs: Any) -> Engine:
    """An engine for `url`; on Postgres its sessions carry `application_name` (the
    process's role, as pg_stat_activity shows it) unless the URL names one."""
    url = normalize_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        # not repeated: an unparseable URL may still hold a password
        raise errors.ConfigError(
            "not a database URL (postgresql://USER@HOST/DB or sqlite:///PATH)",
            field="database_url",
        ) from exc
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(url, parsed.database, **kwargs)
    if parsed.get_backend_name() != "postgresql":
        raise errors.ConfigError(
            f"unsupported database {parsed.get_backend_name()!r}: use postgresql or sqlite",
            field="database_url",
        )
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    ping_idle = "pool_pre_ping" not in kwargs  # else the caller's choice, as given
    # exception messages must never carry parameters: they hold payloads
    kwargs.setdefault("hide_parameters", True)
    kwargs.setdefault(
        "connect_args",
        {
            "connect_timeout": 5,
            # a process paused inside a transaction (SIGSTOP, a long GC) must not hold its
            # locks forever: a claim's FOR SHARE on a partition row would block the new
            # owner's epoch write until the paused one woke up
            "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}",
        }
        # the URL's own ?application_name= wins: connect_args would override it
        | ({} if "application_name" in parsed.query else {"application_name": application_name}),
    )
    engine = create_engine(url, **kwargs)
    _CONNECT_ARGS[engine] = dict(kwargs["connect_args"])
    if ping_idle:
        _ping_idle_connections(engine)
    return engine


# the connect_args each Postgres engine of make_engine was made with
_CONNECT_ARGS: weakref.WeakKeyDictionary[Engine, dict[str, Any]] = weakref.WeakKeyDictionary()


def session_kwargs(engine: Engine, **overrides: Any) -> dict[str, Any]:
    """psycopg.connect's keyword arguments for a session like the pool's own, opened outside
    the pool (a LISTEN connection): what the dialect makes of the URL (every multi-host
    form as libpq's comma lists, target_session_attrs, TLS parameters) plus the engine's
    connect_args (application_name, timeouts), then `overrides`."""
    _, from_url = engine.dialect.create_connect_args(engine.url)
    return dict(from_url) | _CONNECT_ARGS.get(engine, {}) | overrides


def _ping_idle_connections(engine: Engine) -> None:
    """Pessimistic disconnect handling for connections that sat in the pool: a checkout
    after PING_AFTER_IDLE_SECONDS pings the server first, and a dead connection is
    replaced (DisconnectionError makes the pool connect anew) before any statement of the
    caller's transaction runs. A connection that dies while in steady use fails its
    transaction as StoreUnavailable and is invalidated, so the next checkout reconnects."""

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["checked_in"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("checked_in")
        if since is None or time.monotonic() - since < PING_AFTER_IDLE_SECONDS:
            return  # new, or returned a moment ago
        try:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("SELECT 1")
            finally:
                cursor.close()
            if not dbapi_connection.autocommit:
                dbapi_connection.rollback()  # the ping's implicit transaction
        except Exception as exc:
            raise DisconnectionError(f"pooled connection is dead: {exc}") from exc


# the execution option of Store.read's connections
READ_ONLY_OPTION = "schedctl_read_only"


def _sqlite_engine(url: str, database: str | None, **kwargs: Any) -> Engine:
    if database and database != ":memory:":
        private_sqlite_file(Path(database))
    kwargs.setdefault("hide_parameters", True)
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # take transaction control from pysqlite so that BEGIN below is ours
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # IMMEDIATE takes the write lock up front: a deferred transaction that reads and
        # then writes fails with SQLITE_BUSY at once instead of waiting for the lock. A
        # read (Store.read) takes none: under WAL it reads a snapshot beside the writer.
        # Straight on the driver's connection: through exec_driver_sql, SQLAlchemy's
        # execution machinery cost as much as a statement of the transaction's own.
        begin = (
            "BEGIN DEFERRED"
            if connection.get_execution_options().get(READ_ONLY_OPTION)
            else "BEGIN IMMEDIATE"
        )
        connection.connection.driver_connection.execute(begin)

    return engine


def private_sqlite_file(path: Path) -> None:
    """Make sure the SQLite database at `path` is readable by its owner alone, whatever the
    umask: a new one is created here with mode 0600 before SQLite opens it (SQLite gives its
    -wal and -shm files the database file's mode); an existing one (and its -wal and -shm)
    readable or writable by group or others is tightened to the owner's bits, with a
    warning, as a file left by an older release or copied in with a loose mode would be."""
    # a new directory is the owner's alone too: its files' names and sizes say something
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, SQLITE_FILE_MODE)
    except FileExistsError:
        pass
    else:
        os.close(fd)  # empty: SQLite takes a file of no bytes as a new database
        return
    for each in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            mode = stat.S_IMODE(each.stat().st_mode)
        except OSError:
            continue  # no -wal or -shm (yet): made with the database file's mode
        if not mode & 0o077:
            continue
        try:
            os.chmod(each, mode & 0o700)
        except OSError as exc:
            log.warning(
                "the SQLite file %s is readable by group or others (mode %04o) and could "
                "not be tightened (%s): chmod 600 it",
                each,
                mode,
                exc.strerror,
            )
        else:
            log.warning(
                "the SQLite file %s was readable by group or others (mode %04o): tightened to %04o",
                each,
                mode,
                mode & 0o700,
            )


def check_connection(engine: Engine) -> None:
    """Raise StoreUnavailable with a readable reason when the database cannot be reached."""
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        raise errors.StoreUnavailable(
            f"cannot reach the database at {redact(str(engine.url))}: {first_line(exc)}"
        ) from exc


def first_line(exc: BaseException) -> str:
    original = getattr(exc, "orig", None) or exc
    lines = str(original).strip().splitlines()
    return lines[0] if lines else type(original).__name__


def is_database_error(exc: BaseException) -> bool:
    """An error from the database layer, whose message may carry a statement and its
    parameters: log `first_line(exc)` of it, never the whole."""
    return isinstance(exc, SQLAlchemyError)
