"""Gathering `schedctl status` on SQLite and a real Postgres, with the local coordinator and
with real ZooKeeper members: ownership and epochs per member, owners that are no members,
unowned partitions, lag of the oldest due run, outbox, queue and dead-letter depths, and a
ZooKeeper that does not answer (reported, not fatal)."""

from __future__ import annotations

import json

import pytest

from schedctl.app.cluster_status import ClusterStatus, gather_status, read_members
from schedctl.coordination.local import LocalCoordinator
from schedctl.coordination.zookeeper import ZooKeeperCoordinator
from schedctl.domain.config import Config
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.claim import Claimer
from schedctl.storage.pipeline.partitions import PartitionRepo
from schedctl.storage.pipeline.queue import QueueRepo
from tests.factories import ago, ahead, bulk_once_jobs, make_tenant
from tests.services.ports import free_port

P = 16  # small: the numbers are what is checked, not the scale


@pytest.fixture
def store(store: Store) -> Store:
    store.ensure_settings(P)
    return store


@pytest.fixture
def pg_store(pg_store: Store) -> Store:
    pg_store.ensure_settings(P)
    return pg_store


def snapshot(store: Store, zookeeper: str | None = None) -> ClusterStatus:
    config = Config(database_url=str(store.engine.url), zookeeper=zookeeper)
    status = gather_status(store, config, zookeeper_timeout=3.0)
    # the JSON form is what scripts read: it must always serialize
    json.dumps(status.to_dict())
    return status


def add_dead_letter(store: Store, tenant: str) -> None:
    now = store.now()
    with store.tx() as connection:
        for replayed in (None, now):
            connection.execute(
                schema.dead_letters.insert().values(
                    job_id="j",
                    scheduled_at=now,
                    tenant_id=tenant,
                    target_type="queue",
                    target="q",
                    attempts=3,
                    last_error="exit code 1",
                    created_at=now,
                    replayed_at=replayed,
                )
            )


def test_an_empty_database(store: Store) -> None:
    status = snapshot(store)
    assert status.coordinator == "local" and status.zookeeper is None
    assert status.partition_count == P
    assert status.members == () and status.unowned == tuple(range(P))
    assert status.moving is None
    assert (status.lag.oldest_due_at, status.lag.seconds, status.lag.due) == (None, 0.0, 0)
    assert status.outbox.depth == 0 and status.queues == ()
    assert (status.dead_letters, status.dead_letters_total) == (0, 0)


def test_local_owner_lag_outbox_queues_and_dead_letters(store: Store) -> None:
    coordinator = LocalCoordinator(store, "solo")
    coordinator.start()
    tenant = make_tenant(store)
    oldest = ago(30)
    due = bulk_once_jobs(store, tenant, [oldest, ago(10)], queue="q1")
    bulk_once_jobs(store, tenant, [ahead(3600)], queue="q1")
    add_dead_letter(store, tenant)

    status = snapshot(store)
    (member,) = status.members
    epoch = coordinator.owned()[0]
    assert (member.name, member.live, member.partitions) == ("solo", None, tuple(range(P)))
    assert member.epoch_min == member.epoch_max == epoch
    assert status.unowned == ()
    assert status.lag.oldest_due_at == oldest and status.lag.due == 2
    # the lag is measured on the database's clock, from the oldest due run
    assert status.lag.seconds == pytest.approx((status.at - oldest).total_seconds(), abs=1e-3)
    assert status.lag.seconds >= 30
    assert (status.dead_letters, status.dead_letters_total) == (1, 2)

    # claim the oldest: the lag moves to the next one, the claim queued its run itself
    claimer = Claimer(store, "solo")
    first = [d for d in claimer.load_due(range(P), store.now()) if d.job_id == due[0]]
    claimed = claimer.claim(first, coordinator.owned(), store.now())
    assert len(claimed.dispatched) == 1
    status = snapshot(store)
    assert status.lag.due == 1 and status.lag.oldest_due_at is not None
    assert status.lag.oldest_due_at > oldest
    assert status.outbox.depth == 0
    assert [(q.queue, q.depth.total) for q in status.queues] == [("q1", 1)]

    # a manual run goes through the outbox: it holds its row until a relay moves it
    JobRepo(store).trigger(due[0], actor="test")
    status = snapshot(store)
    assert (status.outbox.depth, status.outbox.ready, status.outbox.waiting) == (1, 1, 0)
    assert status.outbox.oldest_ready_at is not None and status.outbox.age_seconds >= 0

    # relayed into the built-in queue: the outbox is empty, the queue holds both
    assert QueueRepo(store).move_outbox() == 1
    status = snapshot(store)
    assert status.outbox.depth == 0 and status.outbox.age_seconds == 0
    (queue,) = status.queues
    assert (queue.tenant_id, queue.queue, queue.depth.total, queue.depth.ready) == (
        tenant,
        "q1",
        2,
        2,
    )
    name = queue.tenant

    data = status.to_dict()
    assert data["members"][0]["partition_count"] == P
    assert data["partitions"]["owned"] == P and data["partitions"]["unowned"] == []
    (listed,) = data["queues"]
    assert 0 <= listed.pop("oldest_ready_age_seconds") < 600
    assert listed == {
        "tenant": name,
        "tenant_id": tenant,
        "queue": "q1",
        "ready": 2,
        "delayed": 0,
        "leased": 0,
        "total": 2,
        "live_workers": [],  # nobody reads q1 (tests/integration/test_worker_presence.py)
        "unserved": True,
    }
    assert data["dead_letters"] == {"pending": 1, "total": 2}
    assert data["lag"]["due"] == 1 and data["at"].endswith("Z")


def test_released_partitions_are_unowned_and_keep_their_epoch(store: Store) -> None:
    coordinator = LocalCoordinator(store, "solo")
    coordinator.start()
    epoch = coordinator.owned()[0]
    coordinator.stop()
    status = snapshot(store)
    assert status.members == () and status.unowned == tuple(range(P))
    assert {p.epoch for p in status.partitions} == {epoch}


@pytest.mark.zookeeper
def test_zookeeper_members_with_their_partitions_and_epochs(pg_store: Store, zk_hosts: str) -> None:
    made = [
        ZooKeeperCoordinator(pg_store, zk_hosts, node_name=name, partition_count=P)
        for name in ("a", "b")
    ]
    try:
        for coordinator in made:
            coordinator.start(timeout=30)
        for _ in range(300):  # bounded: until both agree on the split
            if all(c.members() == ["a", "b"] and c.wait_until_stable(0.1) for c in made):
                break
        status = snapshot(pg_store, zk_hosts)
        assert status.coordinator == "zookeeper" and status.zookeeper_error is None
        assert [m.name for m in status.members] == ["a", "b"]
        assert all(m.live is True and m.pid is not None and m.host for m in status.members)
        for member, coordinator in zip(status.members, made, strict=True):
            owned = coordinator.owned()
            assert set(member.partitions) == set(owned)
            assert (member.epoch_min, member.epoch_max) == (
                min(owned.values()),
                max(owned.values()),
            )
        assert status.unowned == () and status.moving == 0 and status.notes == ()

        # both leave (their partitions become unowned), and the table keeps a row of a
        # member that died without a word
        for coordinator in made:
            coordinator.stop()
        ghost_epoch = PartitionRepo(pg_store).max_epoch() + 1
        assert PartitionRepo(pg_store).acquire_each({0: ghost_epoch}, "ghost") == {0}
        status = snapshot(pg_store, zk_hosts)
        assert [(m.name, m.live) for m in status.members] == [("ghost", False)]
        assert status.members[0].partitions == (0,)
        assert status.unowned == tuple(range(1, P))
        assert status.moving == 0  # nobody live: no assignment to move towards
        assert any("no dispatcher is registered" in n for n in status.notes)
        assert any("ghost" in n for n in status.notes)
    finally:
        for coordinator in made:
            coordinator.stop()


@pytest.mark.zookeeper
def test_an_owner_that_is_no_member_and_partitions_on_the_move(
    pg_store: Store, zk_hosts: str
) -> None:
    a = ZooKeeperCoordinator(pg_store, zk_hosts, node_name="a", partition_count=P)
    try:
        a.start(timeout=30)
        assert a.wait_until_stable(30) and len(a.owned()) == P
        # a killed member's rows stay in the table until someone else owns them again
        ghost_epoch = max(a.owned().values()) + 1
        moved = PartitionRepo(pg_store).acquire_each({3: ghost_epoch}, "ghost")
        assert moved == {3}
        status = snapshot(pg_store, zk_hosts)
        assert [(m.name, m.live) for m in status.members] == [("a", True), ("ghost", False)]
        assert status.moving == 1  # partition 3 should be a's
        assert any("no members" in n and "ghost" in n for n in status.notes)
    finally:
        a.stop()


def test_a_zookeeper_that_does_not_answer_is_reported(store: Store) -> None:
    LocalCoordinator(store, "solo").start()
    nobody = f"127.0.0.1:{free_port()}"
    status = gather_status(store, Config(zookeeper=nobody), zookeeper_timeout=1.0)
    assert status.zookeeper_error is not None and nobody in status.zookeeper_error
    # members fall back to the owners in the table, liveness unknown
    assert [(m.name, m.live) for m in status.members] == [("solo", None)]
    assert status.moving is None
    assert status.notes and status.notes[0].startswith("members unknown")
    assert status.to_dict()["coordinator"]["error"] == status.zookeeper_error


@pytest.mark.zookeeper
def test_read_members_of_a_root_nobody_registered_in(zk_hosts: str) -> None:
    assert read_members(zk_hosts, "/nobody-here", timeout=5.0) == {}


def test_status_lag_ignores_paused_and_future_jobs(store: Store) -> None:
    tenant = make_tenant(store)
    (paused,) = bulk_once_jobs(store, tenant, [ago(60)])
    with store.tx() as connection:
        connection.execute(
            schema.jobs.update()
            .where(schema.jobs.c.job_id == paused)
            .values(status="paused", next_fire_at=None)
        )
    bulk_once_jobs(store, tenant, [ahead(60)])
    status = snapshot(store)
    assert status.lag.due == 0 and status.lag.oldest_due_at is None and status.lag.seconds == 0
