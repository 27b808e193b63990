"""The Coordinator contract (schedctl/coordination/base.py), one suite run against every
implementation: the local coordinator of the embedded mode and the ZooKeeper coordinator on
a real ZooKeeper, each on SQLite and on a real Postgres.

What every coordinator promises: a lone member owns every partition, the partitions table
holds exactly the epochs it reports, a new owner's epochs are higher than any before, a
stop releases ownership at once (and twice is harmless), and a claim made under the epochs
of an owner that was replaced commits nothing. What only ZooKeeper does (several members
splitting the partitions, sessions, ensembles) is in test_zookeeper_coordinator.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import func, select

from schedctl.coordination.base import Coordinator
from schedctl.coordination.local import LocalCoordinator
from schedctl.coordination.zkaccess import ZooKeeperAccess
from schedctl.coordination.zookeeper import ZooKeeperCoordinator
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.claim import Claimer
from schedctl.storage.pipeline.partitions import PartitionRepo
from tests.factories import ago, bulk_once_jobs, make_tenant

P = 64  # the count does not matter to the contract; small keeps it quick
ALL = set(range(P))
WAIT = 60.0  # the longest a ZooKeeper member may take to settle; never a timing assertion

Make = Callable[[str], Coordinator]


@pytest.fixture
def store(store: Store) -> Store:
    store.ensure_settings(P)
    return store


@pytest.fixture(
    params=[
        pytest.param("local", id="local"),
        pytest.param("zookeeper", id="zookeeper", marks=pytest.mark.zookeeper),
        # with digest credentials: every node the members create carries their ACL
        pytest.param("zookeeper-auth", id="zookeeper-auth", marks=pytest.mark.zookeeper),
    ]
)
def make(request: pytest.FixtureRequest, store: Store) -> Iterator[Make]:
    """Starts coordinators of one kind (a member each, by name) and stops them all after."""
    made: list[Coordinator] = []

    def start(name: str) -> Coordinator:
        coordinator: Coordinator
        if request.param == "local":
            coordinator = LocalCoordinator(store, name)
            coordinator.start()
        else:
            hosts = request.getfixturevalue("zk_hosts")
            access = ZooKeeperAccess(user="contract", password="contract-secret")
            if request.param == "zookeeper":
                access = ZooKeeperAccess()
            zk = ZooKeeperCoordinator(
                store, hosts, node_name=name, partition_count=P, access=access
            )
            zk.start(timeout=30)
            # the contract speaks of a settled member; a ZooKeeper one settles in rounds
            assert zk.wait_until_stable(WAIT), f"{name} did not settle"
            coordinator = zk
        made.append(coordinator)
        return coordinator

    yield start
    for coordinator in made:
        coordinator.stop()


def test_a_lone_member_owns_every_partition_as_the_table_says(make: Make, store: Store) -> None:
    a = make("a")
    owned = dict(a.owned())
    assert set(owned) == ALL
    stored = PartitionRepo(store).epochs()
    assert {p: stored[p] for p in ALL} == {p: (epoch, "a") for p, epoch in owned.items()}


def test_stop_releases_ownership_at_once_and_twice_is_harmless(make: Make, store: Store) -> None:
    a = make("a")
    epochs = dict(a.owned())
    a.stop()
    assert dict(a.owned()) == {}
    stored = PartitionRepo(store).epochs()
    # unowned in the table, the epoch kept: the next owner must exceed it
    assert {p: stored[p] for p in ALL} == {p: (epoch, None) for p, epoch in epochs.items()}
    a.stop()
    assert dict(a.owned()) == {}


def test_epochs_grow_from_owner_to_owner(make: Make, store: Store) -> None:
    previous: dict[int, int] = {}
    for name in ("a", "b", "a-again"):
        member = make(name)
        owned = dict(member.owned())
        assert set(owned) == ALL
        assert all(owned[p] > previous[p] for p in previous), f"{name}: an epoch did not grow"
        assert all(PartitionRepo(store).epochs()[p] == (e, name) for p, e in owned.items())
        member.stop()
        previous = owned


def test_a_claim_under_a_replaced_owners_epochs_commits_nothing(make: Make, store: Store) -> None:
    tenant = make_tenant(store)
    bulk_once_jobs(store, tenant, [ago(5)] * 10)
    old = make("old")
    old_epochs = dict(old.owned())
    now = datetime.now(UTC)
    due = Claimer(store, "old").load_due(ALL, now)
    assert due
    old.stop()  # or lost, or paused: either way the partitions move on
    new = make("new")
    assert all(epoch > old_epochs[p] for p, epoch in new.owned().items())
    fenced = Claimer(store, "old").claim(due, old_epochs, now)
    assert fenced.dispatched == [] and fenced.fenced
    with store.read() as connection:
        assert connection.execute(select(func.count()).select_from(schema.runs)).scalar() == 0
    # nor can the old owner take a partition back under its old epoch
    assert PartitionRepo(store).acquire([0], old_epochs[0], "old") == set()
    claimed = Claimer(store, "new").claim(due, dict(new.owned()), now)
    assert len(claimed.dispatched) == 10
