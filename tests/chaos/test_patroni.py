"""Owns the Postgres failover chaos tests: a 2-node Patroni cluster (tests/services/
patroni.py; the scheduler's own ZooKeeper as its DCS, synchronous replication) under about
50 runs a second, with a dispatcher, a relay and a direct worker as real `scheduled-d`
processes whose database URL is a multi-host URL with target_session_attrs=read-write:

- kill -9 of the primary's postmaster (Patroni promotes the synchronous standby);
- a planned switchover (`POST /switchover` on the leader's REST API).

The two scenarios use different URL forms (SQLAlchemy's repeated `host=h:p`; libpq's comma
lists); `test_every_url_form_follows_the_primary` checks every form on the cluster with the
standby listed first.

What is proven, from the run history and the daemons: nothing lost and nothing run twice
(tests/chaos/checker.py: every occurrence due by the cutoff claimed once, no run with two
succeeded attempts; every consumed run due by the cutoff succeeded); the stall (the longest
gap between consecutive run starts from WARMUP before the fault to the cutoff) within
STALL_LIMIT_SECONDS; no daemon exited or was restarted (the PIDs of the start are the ones
stopped at the end); every daemon LISTENs again on the new primary; no worker reported a
recorded outcome as lost. Times are printed (the stall and the failover itself).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import select, text

from schedctl.scheduling.misfire import MisfirePolicy
from schedctl.storage.db import schema
from schedctl.storage.db.migrate import upgrade
from schedctl.storage.db.store import Store
from schedctl_bench.consumers import worker_accepts_tenant
from tests.chaos.checker import check, load_history
from tests.chaos.cluster import Cluster, wait_until
from tests.chaos.conftest import PARTITIONS, SESSION_TIMEOUT_SECONDS
from tests.chaos.test_chaos import Figures, lateness, pending
from tests.factories import create_job, every, make_tenant
from tests.integration.test_multihost_urls import FORMS
from tests.services.patroni import PatroniCluster, PatroniNode
from tests.services.zookeeper import ZooKeeperEnsemble

TENANT = "failover"
CONSUMED_QUEUE = "failover-consumed"  # the worker runs /bin/true for each of these
IDLE_QUEUE = "failover-idle"  # left in the queue: its rows keep the claim's xmin (fencing)
CONSUMED_JOBS = 100
IDLE_JOBS = 10
EVERY_SECONDS = 2  # (100 + 10) / 2 = 55 runs due a second, 50 of them executed
WARMUP_SECONDS = 10.0
AFTER_SECONDS = 15.0
WAIT_SECONDS = 60.0
SETTLE_SECONDS = 90.0
STALL_LIMIT_SECONDS = 15.0
DAEMONS = ["d1", "relay", "worker"]
LOST_OUTCOME = "outcome not recorded"


@pytest.fixture(scope="module")
def patroni_zk() -> Iterator[ZooKeeperEnsemble]:
    """The ZooKeeper both Patroni (its DCS) and the scheduler use."""
    ensemble = ZooKeeperEnsemble(size=1)
    try:
        ensemble.start(timeout=60)
        yield ensemble
    finally:
        ensemble.cleanup()


@pytest.fixture(scope="module")
def patroni(patroni_zk: ZooKeeperEnsemble) -> Iterator[PatroniCluster]:
    cluster = PatroniCluster(patroni_zk.hosts)
    try:
        cluster.start(timeout=180)
        yield cluster
    finally:
        cluster.cleanup()


def _direct_url(node: PatroniNode, database: str) -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:{node.pg_port}/{database}"


def _ready(patroni: PatroniCluster) -> PatroniNode:
    """The primary, once the standby streams synchronously from it (a previous test's
    fault healed)."""
    assert patroni.wait_replicated(WAIT_SECONDS), patroni.log_tails()
    primary = patroni.primary()
    assert primary is not None
    return primary


@pytest.fixture
def failover_db(patroni: PatroniCluster) -> Iterator[str]:
    """A fresh migrated database on the cluster (its name); dropped at the end."""
    primary = _ready(patroni)
    name = f"failover_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(_direct_url(primary, "postgres").replace("+psycopg", ""),
                         autocommit=True) as connection:  # fmt: skip
        connection.execute(f'CREATE DATABASE "{name}"')
    url = _direct_url(primary, name)
    upgrade(url)
    store = Store.open(url)
    try:
        store.ensure_settings(PARTITIONS)
    finally:
        store.close()
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):
            now_primary = _ready(patroni)
            with psycopg.connect(
                _direct_url(now_primary, "postgres").replace("+psycopg", ""), autocommit=True
            ) as connection:
                connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def url_in_form(form: str, patroni: PatroniCluster, database: str) -> str:
    """The cluster's URL in `form`, the standby first: only a client that skips a
    read-only server reaches the primary."""
    primary = patroni.primary()
    hosts = sorted(patroni.hosts(), key=lambda h: primary is not None and h[1] == primary.pg_port)
    return FORMS[form](hosts, database)


@pytest.mark.chaos
@pytest.mark.postgres
@pytest.mark.zookeeper
@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_url_form_follows_the_primary(
    patroni: PatroniCluster, failover_db: str, form: str
) -> None:
    url = url_in_form(form, patroni, failover_db)
    primary = patroni.primary()
    assert primary is not None
    with contextlib.closing(Store.open(url, application_name="scheduled-d relay")) as store:
        with store.tx() as connection:
            port = connection.execute(text("SELECT inet_server_port()")).scalar_one()
            assert not connection.execute(text("SELECT pg_is_in_recovery()")).scalar_one()
        assert port == primary.pg_port
        feed = store.dialect.ready_feed(store.engine, "word")
        assert feed is not None
        try:
            assert feed.wait(5.0)  # connected (to the primary: NOTIFY is heard there only)
            with store.tx() as connection:
                store.dialect.notify_ready(connection, ["word"])
            heard, _ = wait_until(lambda: feed.wait(0.5), 30)
            assert heard
        finally:
            feed.close()


@pytest.fixture
def failover_cluster(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    patroni: PatroniCluster,
    patroni_zk: ZooKeeperEnsemble,
    failover_db: str,
) -> Iterator[Cluster]:
    """The daemons' harness over the cluster's URL in the test's `form`."""
    made = Cluster(
        tmp_path / "daemons",
        db_url=url_in_form(request.node.callspec.params["form"], patroni, failover_db),
        zookeeper=patroni_zk.hosts,
        zookeeper_root=f"/failover_{uuid.uuid4().hex[:12]}",
        partition_count=PARTITIONS,
        session_timeout=SESSION_TIMEOUT_SECONDS,
    )
    try:
        yield made
    finally:
        made.close()


def create_load(store: Store) -> None:
    """Recurring jobs, their first times staggered over one period: a steady rate."""
    tenant = make_tenant(store, TENANT)
    anchor = store.now().replace(microsecond=0) + timedelta(seconds=3)
    total = CONSUMED_JOBS + IDLE_JOBS
    step = timedelta(seconds=EVERY_SECONDS) / total
    for i in range(total):
        create_job(
            store,
            tenant,
            every(
                EVERY_SECONDS,
                anchor + i * step,
                queue=IDLE_QUEUE if i % (total // IDLE_JOBS) == 0 else CONSUMED_QUEUE,
                misfire=MisfirePolicy.run_all,
                name=f"load-{i}",
            ),
        )


def starts(store: Store, since: datetime) -> list[datetime]:
    """When each attempt started since `since` (the worker's clock: this machine's)."""
    a = schema.run_attempts
    with store.read() as connection:
        rows = connection.execute(
            select(a.c.started_at).where(a.c.started_at >= since).order_by(a.c.started_at)
        ).all()
    return [row[0] for row in rows if row[0] is not None]


def unexecuted(store: Store, cutoff: datetime) -> int:
    """Consumed runs due by `cutoff` that have not succeeded (yet)."""
    r, j = schema.runs, schema.jobs
    with store.read() as connection:
        return int(
            connection.execute(
                select(text("count(*)"))
                .select_from(r.join(j, j.c.job_id == r.c.job_id))
                .where(
                    r.c.scheduled_at <= cutoff,
                    j.c.target == CONSUMED_QUEUE,
                    r.c.status != "succeeded",
                )
            ).scalar_one()
        )


def listening(store: Store) -> set[str]:
    """The application_names of the sessions LISTENing on the primary now."""
    with store.read() as connection:
        return {
            str(name)
            for (name,) in connection.execute(
                text(
                    "SELECT application_name FROM pg_stat_activity "
                    "WHERE datname = current_database() AND query LIKE 'LISTEN%'"
                )
            )
        }


WANTED_LISTENERS = {"scheduled-d dispatcher", "scheduled-d relay", "scheduled-d worker"}


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.zookeeper
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("fault", "form"), [("kill -9", "repeated host"), ("switchover", "comma lists")]
)
def test_postgres_failover_loses_nothing_and_runs_nothing_twice(
    failover_cluster: Cluster,
    patroni: PatroniCluster,
    failover_db: str,
    fault: str,
    form: str,
) -> None:
    began = time.monotonic()
    cluster = failover_cluster
    store = cluster.store
    figures = Figures()
    figures.note(
        f"\n== Postgres failover ({fault}): 2-node Patroni, synchronous mode, URL form "
        f"{form!r}; {CONSUMED_JOBS + IDLE_JOBS} jobs every {EVERY_SECONDS} s "
        f"({(CONSUMED_JOBS + IDLE_JOBS) / EVERY_SECONDS:g} runs/s, "
        f"{CONSUMED_JOBS / EVERY_SECONDS:g} executed)"
    )
    create_load(store)
    cluster.start("relay", "relay")
    cluster.start_worker(
        "worker", CONSUMED_QUEUE, tenant=TENANT if worker_accepts_tenant() else None
    )
    cluster.start("d1")
    figures.seconds("dispatcher owns its partitions", cluster.wait_balanced(["d1"], WAIT_SECONDS))
    pids = {name: d.pid for name, d in cluster.daemons.items()}
    heard, _ = wait_until(lambda: listening(store) >= WANTED_LISTENERS, WAIT_SECONDS)
    assert heard, f"not every daemon LISTENs: {listening(store)}"
    time.sleep(WARMUP_SECONDS)
    watch_from = datetime.now(UTC) - timedelta(seconds=WARMUP_SECONDS / 2)
    assert starts(store, watch_from), "nothing ran before the fault"

    old = patroni.primary()
    assert old is not None
    figures.fault(fault)
    fault_at = datetime.now(UTC)
    faulted = time.monotonic()
    if fault == "kill -9":
        patroni.kill_primary_postmaster()
    else:
        candidate = next(n for n in patroni.nodes if n is not old)
        figures.note(f"switchover: {patroni.switchover(old, candidate)}")
    new = patroni.wait_primary(WAIT_SECONDS, other_than=old)
    assert new is not None, patroni.log_tails()
    figures.note(
        f"{old.name} -> {new.name}: new primary seen after {time.monotonic() - faulted:.3f} s"
    )
    resumed, _ = wait_until(lambda: starts(store, datetime.now(UTC) - timedelta(seconds=0.5)),
                            WAIT_SECONDS)  # fmt: skip
    figures.note(f"fault -> runs start again: {time.monotonic() - faulted:.3f} s")
    relistened, _ = wait_until(lambda: listening(store) >= WANTED_LISTENERS, WAIT_SECONDS)
    figures.note(f"every daemon LISTENs on the new primary: {sorted(listening(store))}")
    cluster.check_alive(DAEMONS)
    time.sleep(AFTER_SECONDS)

    cutoff = store.now()
    settled, took = wait_until(lambda: pending(store, cutoff).settled, SETTLE_SECONDS, 0.2)
    figures.note("claimed by the cutoff after " + (f"{took:.3f} s" if settled else "NOT"))
    executed, took = wait_until(lambda: unexecuted(store, cutoff) == 0, SETTLE_SECONDS, 0.2)
    figures.note("consumed runs all succeeded after " + (f"{took:.3f} s" if executed else "NOT"))
    dead = cluster.dead()
    started_pids = {name: d.pid for name, d in cluster.daemons.items()}
    restarts = {name: d.starts for name, d in cluster.daemons.items()}
    lost_outcomes = cluster.count_in_logs(LOST_OUTCOME)
    listen_failures = cluster.count_in_logs("LISTEN")
    exits = {name: cluster.terminate(name) for name in DAEMONS}

    history = load_history(store, cutoff, figures.faults)
    report = check(history)
    started = [t for t in starts(store, watch_from) if t <= cutoff]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(started)]
    stall = max(gaps, default=float("inf"))
    worst = gaps.index(stall) if gaps else 0
    figures.note(
        f"STALL ({fault}): longest gap between run starts {stall:.3f} s, from "
        f"{(started[worst] - fault_at).total_seconds():+.3f} s after the fault"
        if gaps
        else "no run starts"
    )
    figures.note(f"claim lateness, all runs: {lateness(history.runs)}")
    figures.note(f"log lines about LISTEN: {listen_failures}; '{LOST_OUTCOME}': {lost_outcomes}")
    figures.note("checker:\n" + report.summary())
    figures.note(f"daemons stopped with SIGTERM, exit codes: {exits}")
    figures.note(f"failover run ({fault}) took {time.monotonic() - began:.1f} s")

    assert resumed, "runs did not start again after the failover"
    assert relistened, f"not every daemon LISTENs on the new primary: {listening(store)}"
    assert report.ok, report.summary()
    assert settled and executed, "runs due by the cutoff were not all claimed and executed"
    assert stall <= STALL_LIMIT_SECONDS, f"stall {stall:.3f} s"
    assert not dead, f"daemons exited by themselves: {dead}"
    assert restarts == dict.fromkeys(restarts, 1) and started_pids == pids, (
        f"a daemon was restarted: {restarts}"
    )
    assert sum(lost_outcomes.values()) == 0, f"outcomes reported lost: {lost_outcomes}"
    assert exits == dict.fromkeys(exits, 0), f"a daemon did not stop cleanly: {exits}"
