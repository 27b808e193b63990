"""The ZooKeeper coordinator on a real ZooKeeper and a real database: partitions split and
rebalance, hand over on stop, are re-owned after kill -9, fence off a paused process, stop
being claimed while the connection is suspended, and survive the loss of a leader.

Re-own times are measured and printed (visible with -s) so they can be quoted; the bounds
asserted are the design's promises with generous margins, never tight timings.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from schedctl.coordination.zookeeper import ZooKeeperCoordinator
from schedctl.core import errors
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.partitions import PartitionRepo
from tests.factories import ago, bulk_once_jobs, make_tenant
from tests.services.ports import free_port
from tests.services.zookeeper import ZooKeeperEnsemble

pytestmark = pytest.mark.zookeeper

P = 64  # the count does not matter to these tests; small keeps them quick
ALL = set(range(P))
PROC_SCRIPT = Path(__file__).with_name("zk_coordinator_proc.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT = 60.0  # generous upper bound of every wait; the real times are printed


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> float:
    """Poll until `condition` holds; returns the seconds it took. Fails after `timeout`."""
    start = time.monotonic()
    for _ in range(int(timeout / 0.02) + 1):
        if condition():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            break
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout:.0f} s waiting until {what}")


@pytest.fixture
def store(pg_store: Store) -> Store:
    pg_store.ensure_settings(P)
    return pg_store


class Coordinators:
    """Makes coordinators for a test and stops every one of them at the end."""

    def __init__(self, store: Store, hosts: str) -> None:
        self.store = store
        self.hosts = hosts
        self.made: list[ZooKeeperCoordinator] = []

    def start(self, name: str, **kwargs: Any) -> ZooKeeperCoordinator:
        kwargs.setdefault("partition_count", P)
        kwargs.setdefault("session_timeout", 10.0)
        hosts = kwargs.pop("hosts", self.hosts)
        coordinator = ZooKeeperCoordinator(self.store, hosts, node_name=name, **kwargs)
        self.made.append(coordinator)
        coordinator.start(timeout=30)
        return coordinator

    def stop_all(self) -> None:
        for coordinator in self.made:
            coordinator.stop()


@pytest.fixture
def coordinators(store: Store, zk_hosts: str) -> Iterator[Coordinators]:
    made = Coordinators(store, zk_hosts)
    yield made
    made.stop_all()


def settle(*nodes: ZooKeeperCoordinator, timeout: float = WAIT) -> float:
    """Wait until every node sees the same members (all of `nodes`) and is stable."""
    names = sorted(n.node_name for n in nodes)

    def settled() -> bool:
        return all(n.members() == names and n.wait_until_stable(0) for n in nodes)

    return wait_for(settled, f"{names} agree and are stable", timeout)


def assert_split(store: Store, owned: Mapping[str, Mapping[int, int]]) -> None:
    """Disjoint, complete, and the database holds exactly the epochs each node reports."""
    sets = [set(o) for o in owned.values()]
    assert sum(len(s) for s in sets) == P, "a partition owned twice"
    assert set().union(*sets) == ALL, "a partition owned by nobody"
    stored = PartitionRepo(store).epochs()
    for name, partitions in owned.items():
        for p, epoch in partitions.items():
            assert stored[p] == (epoch, name), f"partition {p}"


# -- in-process coordinators -------------------------------------------------------------


def test_bad_connection_strings_and_unreachable_servers_are_clear_errors(
    sqlite_url: str,
) -> None:
    store = Store.open(sqlite_url)
    try:
        for bad in ["", "   ", "127.0.0.1:notaport", "127.0.0.1:99999", "host:1//x"]:
            with pytest.raises(errors.ConfigError):
                ZooKeeperCoordinator(store, bad, node_name="n", partition_count=P)
        nobody = f"127.0.0.1:{free_port()}"
        coordinator = ZooKeeperCoordinator(store, nobody, node_name="n", partition_count=P)
        with pytest.raises(errors.SchedError, match="cannot reach ZooKeeper"):
            coordinator.start(timeout=2)
        assert coordinator.owned() == {}
    finally:
        store.close()


def test_two_coordinators_split_the_partitions(db_url: str, zk_hosts: str) -> None:
    store = Store.open(db_url)
    made = Coordinators(store, zk_hosts)
    try:
        a = made.start("a")  # alone it owns everything: test_coordinator_contract.py
        b = made.start("b")
        settle(a, b)
        assert a.owned() and b.owned()
        assert_split(store, {"a": a.owned(), "b": b.owned()})
        assert set(a.owned()) == a.assigned() and set(b.owned()) == b.assigned()
    finally:
        made.stop_all()
        store.close()


def test_a_third_member_rebalances_with_higher_epochs(
    coordinators: Coordinators, store: Store
) -> None:
    changes = threading.Semaphore(0)
    a = coordinators.start("a", on_change=changes.release)
    b = coordinators.start("b")
    settle(a, b)
    before = {p: e for node in (a, b) for p, e in node.owned().items()}
    owner_before = {p: n.node_name for n in (a, b) for p in n.owned()}

    started = time.monotonic()
    c = coordinators.start("c")
    settle(a, b, c)
    print(f"\nrebalance to 3 members: stable {time.monotonic() - started:.3f} s after c started")
    owned = {"a": a.owned(), "b": b.owned(), "c": c.owned()}
    assert_split(store, owned)
    assert all(owned.values())
    moved = set(c.owned())
    assert all(owner_before[p] != "c" for p in moved)
    for p in moved:
        assert c.owned()[p] > before[p], f"partition {p}: epoch did not grow"
    for node in (a, b):  # minimal movement: what a node kept keeps its epoch
        for p, epoch in node.owned().items():
            assert epoch == before[p]
    assert changes.acquire(timeout=WAIT), "on_change was never called"


def test_stop_hands_partitions_over_at_once(coordinators: Coordinators, store: Store) -> None:
    # a long session: only an explicit hand-over can beat it
    a = coordinators.start("a", session_timeout=30.0)
    b = coordinators.start("b", session_timeout=30.0)
    settle(a, b)
    b_partitions = dict(b.owned())
    started = time.monotonic()
    b.stop()
    assert b.owned() == {}
    wait_for(lambda: set(a.owned()) == ALL, "a owns every partition")
    took = time.monotonic() - started
    print(f"\nstop() hand-over: {len(b_partitions)} partitions re-owned in {took:.3f} s")
    assert took < 15.0, "re-owned only after the session timeout"
    assert all(a.owned()[p] > e for p, e in b_partitions.items())
    assert_split(store, {"a": a.owned()})
    assert a.members() == ["a"]


# -- a coordinator in another process ----------------------------------------------------


class Proc:
    """zk_coordinator_proc.py running as a child process, talked to over stdin/stdout."""

    def __init__(self, hosts: str, db_url: str, name: str, session_timeout: float, log: Path):
        self.log = log
        self._log_file = log.open("wb")
        self.popen = subprocess.Popen(
            [
                sys.executable,
                str(PROC_SCRIPT),
                "--hosts",
                hosts,
                "--db",
                db_url,
                "--name",
                name,
                "--partitions",
                str(P),
                "--session-timeout",
                str(session_timeout),
            ],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def expect(self, event: str, timeout: float = WAIT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for _ in range(1000):
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            message: dict[str, Any] = json.loads(line)
            if message["event"] == event:
                return message
        pytest.fail(f"no {event!r} from the child; its log:\n{self.log.read_text()[-4000:]}")

    def send(self, command: str, reply: str, timeout: float = WAIT) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        return self.expect(reply, timeout)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()
        self._log_file.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []

    def start(hosts: str, db_url: str, name: str, session_timeout: float = 4.0) -> Proc:
        proc = Proc(hosts, db_url, name, session_timeout, tmp_path / f"{name}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.popen.poll() is None:
            os.kill(proc.popen.pid, signal.SIGCONT)  # a stopped child cannot die cleanly
        proc.close()


def epochs_of(message: dict[str, Any]) -> dict[int, int]:
    return {int(p): int(e) for p, e in message["owned"].items()}


def test_kill_9_partitions_are_owned_again_within_the_session_timeout(
    coordinators: Coordinators, store: Store, spawn: Callable[..., Proc], pg_url: str
) -> None:
    session = 4.0
    child = spawn(coordinators.hosts, pg_url, "child", session)
    child.expect("started")
    a = coordinators.start("a", session_timeout=session)
    wait_for(lambda: a.members() == ["a", "child"] and a.wait_until_stable(0), "a is stable")
    child_owned = epochs_of(child.send("owned", "owned"))
    assert child_owned and set(child_owned).isdisjoint(a.owned())
    assert set(child_owned) | set(a.owned()) == ALL

    os.kill(child.popen.pid, signal.SIGKILL)
    started = time.monotonic()
    wait_for(lambda: set(a.owned()) == ALL, "a owns every partition")
    took = time.monotonic() - started
    print(
        f"\nkill -9: {len(child_owned)} partitions re-owned in {took:.3f} s (session {session} s)"
    )
    assert took <= session + 5.0
    assert all(a.owned()[p] > e for p, e in child_owned.items())
    assert_split(store, {"a": a.owned()})


def test_a_paused_process_is_fenced_when_it_wakes_up(
    coordinators: Coordinators, store: Store, spawn: Callable[..., Proc], pg_url: str
) -> None:
    tenant = make_tenant(store)
    job_ids = bulk_once_jobs(store, tenant, [ago(5)] * 32)
    session = 4.0
    child = spawn(coordinators.hosts, pg_url, "child", session)
    child.expect("started")
    a = coordinators.start("a", session_timeout=session)
    wait_for(lambda: a.members() == ["a", "child"] and a.wait_until_stable(0), "a is stable")
    loaded = child.send("load", "loaded")
    remembered = epochs_of(loaded)
    due_partitions = {int(p) for _, p in loaded["due"]}
    assert loaded["due"] and due_partitions <= set(remembered)

    os.kill(child.popen.pid, signal.SIGSTOP)
    started = time.monotonic()
    wait_for(lambda: set(a.owned()) == ALL, "a owns every partition")
    took = time.monotonic() - started
    print(f"\nSIGSTOP: {len(remembered)} partitions re-owned in {took:.3f} s (session {session} s)")
    stored = PartitionRepo(store).epochs()
    assert all(stored[p][0] > e for p, e in remembered.items())

    os.kill(child.popen.pid, signal.SIGCONT)
    claimed = child.send("claim", "claimed")
    print(f"woken process claimed with its old epochs: {claimed}")
    assert claimed["dispatched"] == []
    assert set(claimed["fenced"]) == due_partitions
    with store.read() as connection:
        assert connection.execute(select(func.count()).select_from(schema.runs)).scalar() == 0
        assert connection.execute(select(func.count()).select_from(schema.outbox)).scalar() == 0
        versions = connection.execute(
            select(schema.jobs.c.version).where(schema.jobs.c.job_id.in_(job_ids))
        ).scalars()
        assert set(versions) == {1}, "a job advanced: the claim committed something"

    # the woken process rejoins with a new session, and new, higher epochs
    wait_for(lambda: a.members() == ["a", "child"] and a.wait_until_stable(0), "a is stable")
    rejoined = epochs_of(child.send("owned", "owned"))
    assert rejoined and all(e > max(remembered.values()) for e in rejoined.values())
    assert_split(store, {"a": a.owned(), "child": rejoined})


# -- our own ZooKeeper servers -------------------------------------------------------------


@pytest.fixture
def own_zk() -> Iterator[Callable[[int], ZooKeeperEnsemble]]:
    """Private ZooKeeper servers a test may stop and kill, deleted afterwards."""
    made: list[ZooKeeperEnsemble] = []

    def start(size: int) -> ZooKeeperEnsemble:
        ensemble = ZooKeeperEnsemble(size)
        made.append(ensemble)
        ensemble.start(timeout=60)
        return ensemble

    yield start
    for ensemble in made:
        ensemble.cleanup()


def test_a_suspended_connection_stops_claiming_at_once(
    own_zk: Callable[[int], ZooKeeperEnsemble], store: Store
) -> None:
    zk = own_zk(1)
    made = Coordinators(store, zk.hosts)
    session = 4.0
    try:
        a = made.start("a", session_timeout=session)
        assert a.wait_until_stable(WAIT) and set(a.owned()) == ALL

        # a server that goes silent (the connection stays open, nothing answers): only
        # the client's own heartbeat timeout can tell
        before = dict(a.owned())
        pid = zk.pid(0)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            took = wait_for(lambda: a.owned() == {}, "owned() is empty", timeout=session + 5)
            print(f"\nZooKeeper silent (SIGSTOP): owned() empty after {took:.3f} s")
        finally:
            os.kill(pid, signal.SIGCONT)
        took = wait_for(lambda: set(a.owned()) == ALL and a.wait_until_stable(0), "owned again")
        print(f"ZooKeeper continued: all owned again after {took:.3f} s ({describe(a, before)})")
        assert_split(store, {"a": a.owned()})

        # a server that goes away (connection closed)
        before = dict(a.owned())
        started = time.monotonic()
        zk.stop_server(0)
        wait_for(lambda: a.owned() == {}, "owned() is empty", timeout=session + 5)
        print(f"ZooKeeper stopped: owned() empty {time.monotonic() - started:.3f} s after SIGTERM")
        started = time.monotonic()
        zk.start_server(0)
        zk.wait_server_ready(0, 60)
        wait_for(lambda: set(a.owned()) == ALL and a.wait_until_stable(0), "owned again")
        took = time.monotonic() - started
        print(f"ZooKeeper restarted: all owned again {took:.3f} s later ({describe(a, before)})")
        assert_split(store, {"a": a.owned()})
    finally:
        made.stop_all()


def describe(node: ZooKeeperCoordinator, before: Mapping[int, int]) -> str:
    """Whether the session survived (same epochs) or a new one took over (higher epochs)."""
    if dict(node.owned()) == before:
        return "same session, same epochs"
    assert all(node.owned()[p] > e for p, e in before.items())
    return "new session, higher epochs"


def test_losing_the_leader_of_a_3_server_ensemble(
    own_zk: Callable[[int], ZooKeeperEnsemble], store: Store
) -> None:
    zk = own_zk(3)
    made = Coordinators(store, zk.hosts)
    try:
        a = made.start("a", session_timeout=6.0)
        b = made.start("b", session_timeout=6.0)
        settle(a, b)
        assert_split(store, {"a": a.owned(), "b": b.owned()})
        leader = zk.leader()
        assert leader is not None

        # Every follower drops its clients when the leader goes, so both members see their
        # connection change. Recovery is judged only after both have seen it and a new leader
        # serves: checked earlier, it passes at once on the view from before the kill.
        changes_before = {"a": a._gen, "b": b._gen}
        zk.kill_server(leader)
        started = time.monotonic()
        overlaps: list[set[int]] = []
        emptied: set[str] = set()

        def recovered() -> bool:
            owned_a, owned_b = a.owned(), b.owned()
            emptied.update(n for n, o in (("a", owned_a), ("b", owned_b)) if not o)
            both = set(owned_a) & set(owned_b)
            if both:
                overlaps.append(both)
            if a._gen == changes_before["a"] or b._gen == changes_before["b"]:
                return False
            if zk.leader() in (None, leader):
                return False
            return (
                set(a.owned()) | set(b.owned()) == ALL
                and a.wait_until_stable(0)
                and b.wait_until_stable(0)
            )

        wait_for(recovered, "both own their partitions again")
        took = time.monotonic() - started
        print(
            f"\nleader {leader} killed: partitions owned again after {took:.3f} s "
            f"(stopped claiming meanwhile: {sorted(emptied) or 'none'})"
        )
        assert overlaps == [], "two members owned the same partition at once"
        assert_split(store, {"a": a.owned(), "b": b.owned()})
    finally:
        made.stop_all()


def test_1024_partitions_are_acquired_and_handed_over_quickly(
    coordinators: Coordinators, store: Store
) -> None:
    count = 1024
    started = time.monotonic()
    a = coordinators.start("a", partition_count=count)
    assert a.wait_until_stable(WAIT) and len(a.owned()) == count
    alone = time.monotonic() - started
    started = time.monotonic()
    b = coordinators.start("b", partition_count=count)
    settle(a, b)
    joined = time.monotonic() - started
    assert set(a.owned()).isdisjoint(b.owned())
    assert len(a.owned()) + len(b.owned()) == count
    stored = PartitionRepo(store).epochs()
    assert all(stored[p] == (e, "b") for p, e in b.owned().items())
    moved = len(b.owned())
    started = time.monotonic()
    b.stop()
    wait_for(lambda: len(a.owned()) == count, "a owns all 1024 partitions")
    handed = time.monotonic() - started
    print(
        f"\n{count} partitions: one member owns all in {alone:.3f} s; a second joins and "
        f"{moved} move in {joined:.3f} s; stop() hands them back in {handed:.3f} s"
    )
