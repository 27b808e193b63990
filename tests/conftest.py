"""Owns the shared pytest fixtures: real Postgres and ZooKeeper, and fresh migrated databases.

- ``pg_server`` / ``zk_ensemble``: one real server (one-node ensemble) per session, started
  only when a test asks for it, stopped and deleted at session end.
- ``db_url`` (parametrized ``sqlite`` / ``postgres``), ``sqlite_url``, ``pg_url``: a fresh,
  fully migrated, empty database per test, copied from a template migrated once per session.
- ``pg_runtime_url``: ``pg_url``'s database as the daemons' runtime role (no DDL); the
  template is granted with `schedctl db grant --apply`'s code, so every copy is too.
- ``empty_sqlite_url`` / ``empty_pg_url``: a fresh database with no migrations at all.
- ``zk_hosts``: the session ensemble's connection string under a fresh chroot per test.
- ``smtp``: a loopback SMTP server per test, as (inbox, port) (tests/smtp_support.py).

Every ``SCHEDULED_*`` environment variable (and COLUMNS, LINES) is removed at import, so a
developer's own settings never leak into tests. Tests that use the servers get the ``postgres`` /
``zookeeper`` markers automatically, and a failing one gets the server log tails attached.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.failure_logs import attach_log_tails
from tests.pg_roles import grant_runtime_role, runtime_url
from tests.services.postgres import PostgresServer
from tests.services.rabbitmq import RabbitMQServer
from tests.services.zookeeper import ZooKeeperEnsemble
from tests.smtp_support import Inbox, smtp_server

for _name in [name for name in os.environ if name.startswith("SCHEDULED_")]:
    del os.environ[_name]
# nor a terminal's size: the CLI's tables are as wide as a pipe's unless a test says otherwise
# (an xdist worker starts with COLUMNS=80 in its environment)
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

PG_TEMPLATE_DB = "schedctl_template"
_LOG_TAIL_LINES = 40
# The session's servers once started, so a failing test's report can show their logs.
_SESSION_SERVICES: dict[str, PostgresServer | ZooKeeperEnsemble] = {}


@pytest.fixture(autouse=True)
def _root_log_handlers_restored() -> Iterator[None]:
    """A test that runs a daemon's entry point in this process leaves no handler behind:
    logsetup.setup gives the root logger a StreamHandler on that moment's sys.stderr (a
    CliRunner's, closed once its invoke ends), and a later test's log record written there
    prints a "Logging error" traceback into that test's output."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


def _migrate(url: str) -> None:
    """Bring the database at ``url`` to the newest schema (the project's own migrations)."""
    from schedctl.storage.db.migrate import upgrade

    upgrade(url)


def _sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def _unique_db_name() -> str:
    return f"test_{uuid.uuid4().hex[:16]}"


# -- servers ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """A real Postgres on 127.0.0.1, started once per session on first use."""
    server = PostgresServer()
    try:
        server.start()
        _SESSION_SERVICES["postgres"] = server
        yield server
    finally:
        _SESSION_SERVICES.pop("postgres", None)
        server.cleanup()


@pytest.fixture(scope="session")
def zk_ensemble() -> Iterator[ZooKeeperEnsemble]:
    """A real one-server ZooKeeper on 127.0.0.1, started once per session on first use."""
    ensemble = ZooKeeperEnsemble(size=1)
    try:
        ensemble.start(timeout=60)
        _SESSION_SERVICES["zookeeper"] = ensemble
        yield ensemble
    finally:
        _SESSION_SERVICES.pop("zookeeper", None)
        ensemble.cleanup()


@pytest.fixture
def smtp() -> Iterator[tuple[Inbox, int]]:
    with smtp_server() as server:
        yield server


@pytest.fixture
def zk_hosts(zk_ensemble: ZooKeeperEnsemble) -> str:
    """The session ZooKeeper's connection string under a fresh, existing chroot node."""
    from kazoo.client import KazooClient

    chroot = f"/test_{uuid.uuid4().hex[:16]}"
    client = KazooClient(hosts=zk_ensemble.hosts, timeout=10.0)
    try:
        client.start(timeout=15)
        client.ensure_path(chroot)
    finally:
        client.stop()
        client.close()
    return zk_ensemble.hosts + chroot


# -- migrated templates (once per session) ---------------------------------------------


@pytest.fixture(scope="session")
def _pg_template(pg_server: PostgresServer) -> str:
    """The name of a migrated Postgres database that per-test databases are copied from."""
    pg_server.drop_database(PG_TEMPLATE_DB)
    pg_server.create_database(PG_TEMPLATE_DB)
    _migrate(pg_server.url(PG_TEMPLATE_DB))
    # the daemons' runtime role's rights, copied with the template into every test database
    grant_runtime_role(pg_server, PG_TEMPLATE_DB)
    # Nobody may connect to it any more: a session on a template blocks copying it.
    pg_server.terminate_backends(PG_TEMPLATE_DB)
    pg_server.psql(f'ALTER DATABASE "{PG_TEMPLATE_DB}" WITH ALLOW_CONNECTIONS false')
    return PG_TEMPLATE_DB


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file that per-test databases are copied from."""
    path = tmp_path_factory.mktemp("sqlite-template") / "schedctl.db"
    _migrate(_sqlite_url(path))
    # Fold any write-ahead log into the main file, so copying that one file is enough.
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


# -- per-test databases ------------------------------------------------------------------


def _drop_test_database(server: PostgresServer, name: str) -> None:
    if not server.is_running():
        server.start()  # a test stopped the shared server: bring it back for the others
    server.drop_database(name)


@pytest.fixture
def pg_url(pg_server: PostgresServer, _pg_template: str) -> Iterator[str]:
    """A fresh, fully migrated, empty Postgres database for this test."""
    name = _unique_db_name()
    pg_server.create_database(name, template=_pg_template)
    try:
        yield pg_server.url(name)
    finally:
        _drop_test_database(pg_server, name)


@pytest.fixture
def pg_runtime_url(pg_server: PostgresServer, pg_url: str) -> str:
    """``pg_url``'s database as the daemons' runtime role (tests/pg_roles.py): DML on the
    scheduler's tables, no DDL. ``pg_url`` itself is the owner's."""
    return runtime_url(pg_server, pg_url.rsplit("/", 1)[1])


@pytest.fixture
def sqlite_url(_sqlite_template: Path, tmp_path: Path) -> str:
    """A fresh, fully migrated, empty SQLite database file for this test."""
    path = tmp_path / "schedctl.db"
    shutil.copyfile(_sqlite_template, path)
    return _sqlite_url(path)


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def db_url(request: pytest.FixtureRequest) -> str:
    """A fresh, fully migrated, empty database for this test, once per backend."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url = request.getfixturevalue(fixture)
    assert isinstance(url, str)
    return url


@pytest.fixture
def empty_pg_url(pg_server: PostgresServer) -> Iterator[str]:
    """A fresh Postgres database with no schema at all (for migration tests)."""
    name = _unique_db_name()
    pg_server.create_database(name)
    try:
        yield pg_server.url(name)
    finally:
        _drop_test_database(pg_server, name)


@pytest.fixture
def empty_sqlite_url(tmp_path: Path) -> str:
    """A SQLite URL whose file does not exist yet (for migration tests)."""
    return _sqlite_url(tmp_path / "empty.db")


# -- markers and failure reports -----------------------------------------------------


# Under pytest-xdist (`make test` runs two workers), what runs on one worker, one after the
# other: every file's tests together, so a module's fixtures are made once; the soak and chaos
# files (each CPU-bound for minutes, and timing-aware) one after the other, never beside each
# other; and the tests that build in the source tree (dist/, make install) one at a time.
# (xdist's own --dist loadgroup cannot be used: it renames items in a way pytest 9 ignores.)
_SERIAL_GROUPS = {
    "tests/soak/": "heavy",
    "tests/chaos/": "heavy",
    "tests/acceptance/test_onefile.py": "source-tree",
    "tests/acceptance/test_install.py": "source-tree",
    "tests/acceptance/test_packaging.py": "source-tree",
    "tests/acceptance/test_deb.py": "source-tree",
}


def _work_unit(nodeid: str) -> str:
    """The group of tests that one worker runs, one after the other, for ``nodeid``."""
    path = nodeid.split("::", 1)[0]
    for prefix, group in _SERIAL_GROUPS.items():
        if path.startswith(prefix):
            return group
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scheduler by scope, with the scopes of `_work_unit`, in collection order (the
    slow acceptance files and the heavy group start first, the quick unit files fill in)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False
    return WorkUnitScheduling(config, log)  # type: ignore[arg-type]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests that use the real servers, so ``-m 'not postgres'`` and such work."""
    del config
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "pg_server" in fixtures and item.get_closest_marker("postgres") is None:
            item.add_marker(pytest.mark.postgres)
        if "zk_ensemble" in fixtures and item.get_closest_marker("zookeeper") is None:
            item.add_marker(pytest.mark.zookeeper)


def _log_sections(item: pytest.Item) -> list[tuple[str, str]]:
    services: list[PostgresServer | ZooKeeperEnsemble | RabbitMQServer] = []
    if item.get_closest_marker("postgres") is not None and "postgres" in _SESSION_SERVICES:
        services.append(_SESSION_SERVICES["postgres"])
    if item.get_closest_marker("zookeeper") is not None and "zookeeper" in _SESSION_SERVICES:
        services.append(_SESSION_SERVICES["zookeeper"])
    funcargs: dict[str, object] = getattr(item, "funcargs", {})
    for value in funcargs.values():
        if (
            isinstance(value, PostgresServer | ZooKeeperEnsemble | RabbitMQServer)
            and value not in services
        ):
            services.append(value)
    return [
        (f"{title} tail", text)
        for service in services
        for title, text in service.logs(_LOG_TAIL_LINES).items()
    ]


# the servers' log tails, on the report of a failing test that used them
pytest_runtest_makereport = attach_log_tails(_log_sections)
