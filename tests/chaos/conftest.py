"""Owns the chaos suite's fixtures: a crash-safe Postgres of its own (the tests restart it),
private ZooKeeper servers (a standalone one or a 3-server ensemble, restarted by the tests),
a fresh database with a small partition count (used by the daemons as the runtime role,
tests/pg_roles.py), and the cluster harness that kills every
daemon it started at the end. A failing test's report gets the daemons' log tails.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from schedctl.storage.db.migrate import upgrade
from schedctl.storage.db.store import Store
from tests.chaos.cluster import Cluster
from tests.failure_logs import attach_log_tails
from tests.pg_roles import grant_runtime_role
from tests.services.ports import free_port
from tests.services.postgres import PostgresServer
from tests.services.zookeeper import ZooKeeperEnsemble

# Small, so that a rebalance moves few owner nodes and the suite stays quick; the count
# does not change what is proven.
PARTITIONS = 64
# Short, so a dead or paused dispatcher's partitions move within seconds.
SESSION_TIMEOUT_SECONDS = 4.0
_LOG_TAIL_LINES = 60


@pytest.fixture(scope="module")
def chaos_pg() -> Iterator[PostgresServer]:
    """A Postgres for this module only (the tests restart it), on a fixed port so that a
    restart never moves it, with synchronous commits so no acknowledged commit is lost."""
    server = PostgresServer(port=free_port(), crash_safe=True)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def chaos_db_url(chaos_pg: PostgresServer) -> Iterator[str]:
    """A fresh, migrated database with PARTITIONS partitions, written before any daemon
    starts (the daemons read the count from the settings table)."""
    if not chaos_pg.is_running():
        chaos_pg.start()  # a previous test failed while the server was stopped
    name = f"chaos_{uuid.uuid4().hex[:12]}"
    chaos_pg.create_database(name)
    url = chaos_pg.url(name)
    upgrade(url)
    store = Store.open(url)
    try:
        store.ensure_settings(PARTITIONS)
        assert store.partition_count == PARTITIONS
    finally:
        store.close()
    try:
        # the daemons (and the checker) run as the runtime role: no DDL, as deployed
        yield grant_runtime_role(chaos_pg, name)
    finally:
        with contextlib.suppress(Exception):
            if not chaos_pg.is_running():
                chaos_pg.start()
            chaos_pg.drop_database(name)


@pytest.fixture(params=[1, 3], ids=["zk-standalone", "zk-ensemble3"])
def chaos_zk(request: pytest.FixtureRequest) -> Iterator[ZooKeeperEnsemble]:
    """Private ZooKeeper servers the test may restart: standalone, or a 3-server ensemble."""
    ensemble = ZooKeeperEnsemble(size=int(request.param))
    try:
        ensemble.start(timeout=60)
        yield ensemble
    finally:
        ensemble.cleanup()


@pytest.fixture
def cluster(tmp_path: Path, chaos_db_url: str, chaos_zk: ZooKeeperEnsemble) -> Iterator[Cluster]:
    """The harness over real `scheduled-d` processes; kills whatever is left at the end."""
    made = Cluster(
        tmp_path / "daemons",
        db_url=chaos_db_url,
        zookeeper=chaos_zk.hosts,
        zookeeper_root=f"/chaos_{uuid.uuid4().hex[:12]}",
        partition_count=PARTITIONS,
        session_timeout=SESSION_TIMEOUT_SECONDS,
    )
    try:
        yield made
    finally:
        made.close()


def _daemon_log_sections(item: pytest.Item) -> list[tuple[str, str]]:
    funcargs: dict[str, object] = getattr(item, "funcargs", {})
    return [
        (f"{name} log tail", text)
        for value in funcargs.values()
        if isinstance(value, Cluster)
        for name, text in value.log_tails(_LOG_TAIL_LINES).items()
    ]


# every daemon's log tail, on the report of a failing chaos test
pytest_runtest_makereport = attach_log_tails(_daemon_log_sections)
