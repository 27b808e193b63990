"""Owns the tests of the test harness itself: real Postgres and ZooKeeper from tests/services."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
import pytest
import sqlalchemy as sa
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError
from kazoo.handlers.threading import KazooTimeoutError

from tests.services.ports import _candidate_range, free_ports
from tests.services.postgres import PostgresServer
from tests.services.zookeeper import ZooKeeperEnsemble, four_letter_word

T = TypeVar("T")


def _scalar(url: str, sql: str) -> Any:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()
    finally:
        engine.dispose()


def _until(action: Callable[[], T], timeout: float = 20.0, interval: float = 0.2) -> T:
    """Retry a ZooKeeper ``action`` until it works, bounded in time and in tries."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    for _ in range(int(timeout / interval) + 10):
        try:
            return action()
        except (KazooException, KazooTimeoutError) as exc:
            last = exc
        if time.monotonic() > deadline:
            break
        time.sleep(interval)
    raise AssertionError(f"ZooKeeper action still failing after {timeout}s: {last!r}")


@pytest.fixture
def kazoo_factory() -> Iterator[Callable[[str], Any]]:
    """Started kazoo clients, stopped and closed at the end of the test."""
    clients: list[Any] = []

    def make(hosts: str) -> Any:
        client = KazooClient(hosts=hosts, timeout=5.0)
        clients.append(client)
        client.start(timeout=10)
        return client

    yield make
    for client in clients:
        client.stop()
        client.close()


# -- ports -----------------------------------------------------------------------------


def test_free_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    ports = free_ports(20)
    low, high = _candidate_range()
    assert len(set(ports)) == 20
    assert all(low <= port <= high for port in ports)


def test_four_letter_word_on_a_closed_port_is_none_and_quick() -> None:
    (port,) = free_ports(1)
    started = time.monotonic()
    assert four_letter_word(port, "srvr", timeout=1.0) is None
    assert time.monotonic() - started < 2.0


# -- Postgres --------------------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_accepts_sqlalchemy_connections(pg_server: PostgresServer) -> None:
    assert pg_server.is_running()
    assert pg_server.url() == f"postgresql+psycopg://postgres@127.0.0.1:{pg_server.port}/postgres"
    assert _scalar(pg_server.url(), "SELECT 1") == 1
    assert _scalar(pg_server.url(), "SHOW max_connections") == "300"
    assert _scalar(pg_server.url(), "SHOW fsync") == "off"
    assert pg_server.psql("SELECT 40 + 2").strip() == "42"


@pytest.mark.postgres
def test_postgres_restart_and_kill_keep_port_and_data() -> None:
    with PostgresServer(crash_safe=True) as server:
        port = server.port
        assert server.base_dir.parent.as_posix() == "/var/tmp"
        server.psql("CREATE TABLE kept (x int); INSERT INTO kept VALUES (1)")

        server.restart()
        assert server.port == port
        assert _scalar(server.url(), "SELECT count(*) FROM kept") == 1

        # A crash: the commit right before it must survive (crash_safe keeps sync commit).
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("INSERT INTO kept VALUES (2)")
            server.kill()
        assert not server.is_running()
        server.start()
        assert server.port == port
        assert _scalar(server.url(), "SELECT count(*) FROM kept") == 2

        server.stop()
        assert not server.is_running()
        server.stop()  # idempotent
    assert not server.base_dir.exists()


@pytest.mark.postgres
def test_postgres_database_from_template_even_while_template_is_in_use(
    pg_server: PostgresServer,
) -> None:
    template, copy = f"tmpl_{uuid.uuid4().hex[:8]}", f"copy_{uuid.uuid4().hex[:8]}"
    pg_server.create_database(template)
    try:
        pg_server.psql("CREATE TABLE jobs (name text); INSERT INTO jobs VALUES ('a')", template)
        # An open session on the template would make a plain CREATE DATABASE fail.
        holder = psycopg.connect(pg_server.dsn(template))
        try:
            pg_server.create_database(copy, template=template)
        finally:
            holder.close()
        assert _scalar(pg_server.url(copy), "SELECT name FROM jobs") == "a"
        engine = sa.create_engine(pg_server.url(copy))
        try:
            with engine.connect() as conn:  # an open session does not block dropping
                conn.execute(sa.text("SELECT 1"))
                pg_server.drop_database(copy)
        except sa.exc.OperationalError:
            pass  # our session was terminated by the drop, as intended
        finally:
            engine.dispose()
        assert not pg_server.database_exists(copy)
    finally:
        pg_server.drop_database(copy)
        pg_server.drop_database(template)


@pytest.mark.postgres
def test_empty_pg_url_is_a_fresh_database_with_no_tables(empty_pg_url: str) -> None:
    assert "/test_" in empty_pg_url
    count = _scalar(
        empty_pg_url, "SELECT count(*) FROM information_schema.tables WHERE table_schema='public'"
    )
    assert count == 0


def test_empty_sqlite_url_has_no_file_yet(empty_sqlite_url: str) -> None:
    assert empty_sqlite_url.startswith("sqlite:////")
    assert _scalar(empty_sqlite_url, "SELECT count(*) FROM sqlite_master") == 0


# -- ZooKeeper -------------------------------------------------------------------------


@pytest.mark.zookeeper
def test_zookeeper_standalone_serves_ephemeral_nodes(
    zk_ensemble: ZooKeeperEnsemble, kazoo_factory: Callable[[str], Any]
) -> None:
    assert zk_ensemble.mode(0) == "standalone"
    assert zk_ensemble.hosts == f"127.0.0.1:{zk_ensemble.client_ports[0]}"
    path = f"/harness/{uuid.uuid4().hex}"
    client = kazoo_factory(zk_ensemble.hosts)
    client.create(path, b"hello", ephemeral=True, makepath=True)
    value, stat = client.get(path)
    assert value == b"hello"
    assert stat.ephemeralOwner == client.client_id[0]
    client.stop()
    other = kazoo_factory(zk_ensemble.hosts)
    assert other.exists(path) is None  # the session ended, so its ephemeral node went


@pytest.mark.zookeeper
def test_zk_hosts_is_an_existing_private_chroot(
    zk_hosts: str, kazoo_factory: Callable[[str], Any]
) -> None:
    assert zk_hosts.count("/") == 1
    client = kazoo_factory(zk_hosts)
    client.create("/a/b", b"x", makepath=True)
    assert client.get_children("/") == ["a"]


@pytest.mark.zookeeper
@pytest.mark.slow
def test_zookeeper_ensemble_survives_a_killed_leader_which_rejoins(
    kazoo_factory: Callable[[str], Any],
) -> None:
    with ZooKeeperEnsemble(size=3) as ensemble:
        modes = ensemble.wait_ready(timeout=60)
        assert sorted(modes.values()) == ["follower", "follower", "leader"]
        assert ensemble.hosts.count(",") == 2
        client = kazoo_factory(ensemble.hosts)
        client.create("/before", b"1")

        leader = ensemble.leader()
        assert leader is not None
        ensemble.kill_server(leader)
        assert not ensemble.is_running(leader)

        def write_after() -> None:
            try:
                client.create_async("/after", b"2").get(timeout=3)
            except NodeExistsError:
                pass  # an earlier try worked but its reply was lost

        _until(write_after)
        survivors = ensemble.wait_ready(timeout=30)
        assert leader not in survivors
        assert "leader" in survivors.values()

        ensemble.start_server(leader)
        assert ensemble.wait_server_ready(leader, timeout=30) in ("leader", "follower")
        rejoined = kazoo_factory(ensemble.host(leader))

        def read_after() -> bytes:
            rejoined.sync_async("/after").get(timeout=3)
            value: bytes = rejoined.get_async("/after").get(timeout=3)[0]
            return value

        assert _until(read_after) == b"2"
        assert rejoined.get("/before")[0] == b"1"
    assert all(not ensemble.is_running(i) for i in range(3))
    assert not ensemble.base_dir.exists()
