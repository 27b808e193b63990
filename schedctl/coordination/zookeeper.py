"""The ZooKeeper coordinator: cluster membership, partition ownership and fencing epochs.

Layout under `root` (inside the connection string's chroot, if any):

    members/{node}       ephemeral, JSON {"host", "pid"}: the member list assignment uses
    owners/{partition}   ephemeral, data = node name: the partition's current owner

With credentials (`zkaccess`), every one of these nodes (the root and the two parents
included) is created with the ACL "our digest identity: ALL", and at start the root and the
two parents are set to it if they exist with another ACL (a tree made before auth was
turned on), so no client without the credentials can add a member, take or free a
partition, or change who owns one.

Every member computes the same assignment from the member list (rendezvous hashing, see
`assignment`). A member owns a partition once it has created the partition's owner node
AND written that node's creation zxid (czxid) to the partitions table as the fencing
epoch. A czxid only grows: a new owner can create its node only after the old one is
gone, so its zxid is later. A claim made under an older epoch commits nothing.

Threads: kazoo's connection thread calls `_on_state` and kazoo's callback thread calls the
watch callbacks; both only record what happened and wake the coordinator's own worker
thread, which does every ZooKeeper and database round trip, with timeouts (kazoo's plain
calls block forever without quorum). The one exception is "stop claiming": when the
connection is suspended or lost, `_on_state` empties `owned()` itself, at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NodeExistsError, NoNodeError
from kazoo.hosts import collect_hosts
from kazoo.protocol.states import KazooState
from kazoo.retry import KazooRetry

from schedctl.coordination.assignment import partitions_for
from schedctl.coordination.zkaccess import ZooKeeperAccess, denied_hint
from schedctl.core import errors, retrying
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.partitions import PartitionRepo

log = logging.getLogger(__name__)

# Re-read the members and re-check every partition this often even when no watch fires:
# a safety net for a missed watch, not the normal path (watches make changes immediate).
RESYNC_SECONDS = 5.0
# One batch of ZooKeeper operations (hundreds of pipelined creates) must finish in this.
OP_TIMEOUT_SECONDS = 10.0
# How long stop() waits for the worker thread, and then for the deletes to be answered.
STOP_TIMEOUT_SECONDS = 10.0
_SLICE_SECONDS = 0.25

_EMPTY: Mapping[int, int] = MappingProxyType({})
K = TypeVar("K")


@dataclass(frozen=True)
class _Stat:
    """What the coordinator needs from a kazoo ZnodeStat."""

    czxid: int
    ephemeral_owner: int


def _stat(raw: Any) -> _Stat:
    return _Stat(czxid=int(raw.czxid), ephemeral_owner=int(raw.ephemeralOwner))


@dataclass(frozen=True)
class _CallAnswer:
    """The answer to one asynchronous ZooKeeper call: a value, an error, or no answer yet."""

    value: Any = None
    error: BaseException | None = None
    answered: bool = True


_NO_ANSWER = _CallAnswer(answered=False)


def check_hosts(hosts: str) -> None:
    """ConfigError unless `hosts` is a usable kazoo connection string (host:port,...[/chroot])."""
    if not hosts or not hosts.strip():
        raise errors.ConfigError("empty ZooKeeper connection string", field="zookeeper")
    try:
        servers, chroot = collect_hosts(hosts)
    except ValueError as exc:
        raise errors.ConfigError(
            f"bad ZooKeeper connection string {hosts!r}: {exc}", field="zookeeper"
        ) from exc
    for host, port in servers:
        if not host or not 0 < int(port) < 65536:
            raise errors.ConfigError(
                f"bad ZooKeeper server {host}:{port} in {hosts!r}", field="zookeeper"
            )
    if chroot is not None and (chroot.endswith("/") or "//" in chroot):
        raise errors.ConfigError(f"bad ZooKeeper chroot {chroot!r}", field="zookeeper")


class ZooKeeperCoordinator:
    """Owns the partitions the member list assigns to `node_name`, fenced by owner-node czxids.

    `owned()` is empty while the session is suspended or lost, and never contains a partition
    whose epoch has not been written to the partitions table. `on_change` is called (from
    the coordinator's thread, never under a lock) after `owned()` changes.
    """

    def __init__(
        self,
        store: Store,
        hosts: str,
        *,
        node_name: str,
        root: str = "/scheduled",
        partition_count: int | None = None,
        session_timeout: float = 10.0,
        on_change: Callable[[], None] | None = None,
        access: ZooKeeperAccess | None = None,
    ) -> None:
        check_hosts(hosts)
        if not node_name or "/" in node_name:
            raise errors.ConfigError(f"bad node name {node_name!r}", field="node_name")
        if not root.startswith("/") or root.endswith("/"):
            raise errors.ConfigError(f"bad ZooKeeper root {root!r}", field="zookeeper_root")
        if session_timeout <= 0:
            raise errors.ConfigError("the session timeout must be positive")
        self.store = store
        self.hosts = hosts
        self.node_name = node_name
        self.root = root
        self.partition_count = (
            partition_count if partition_count is not None else store.partition_count
        )
        self.session_timeout = session_timeout
        self.on_change = on_change
        self.access = access or ZooKeeperAccess()
        self._repo = PartitionRepo(store)
        self._members_path = f"{root}/members"
        self._owners_path = f"{root}/owners"
        self._member_data = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        self._client: Any = None
        self._worker: threading.Thread | None = None
        self._stop_requested = threading.Event()
        self._wake = threading.Event()

        # Shared with kazoo's threads and callers; guarded by _lock, never held during I/O.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._owned: Mapping[int, int] = _EMPTY
        self._connected = False
        self._stopping = False
        self._gen = 0  # bumped on every connection state change: ownership is in doubt
        self._events = 0  # bumped on every state change and watch: the view may be stale
        self._suspended_gen = 0  # gen of the last suspension; nodes need re-checking after it
        self._stable = False
        self._rounds = 0
        self._refused: errors.SchedError | None = None  # the last round's NoAuth, if any
        self._members: tuple[str, ...] = ()
        self._assigned: frozenset[int] = frozenset()

        # The worker thread's own state (stop() reads it only after joining the worker).
        self._session: int | None = None
        self._verified_gen = 0
        self._registered = False
        self._paths_ok = False
        self._members_stale = True
        self._members_read_at = float("-inf")
        self._nodes: dict[int, int] = {}  # our owner nodes in this session: partition -> czxid
        self._confirmed: set[int] = set()  # of those, the ones whose epoch is in the database
        self._uncertain: set[int] = set()  # creates whose outcome we never heard
        self._notified: Mapping[int, int] = _EMPTY
        self._assignment_cache: tuple[tuple[str, ...], frozenset[int]] | None = None

    # -- the Coordinator protocol -------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Connect, register as a member and make the first round of acquisitions."""
        if self._client is not None or self._stopping:
            raise errors.SchedError("a ZooKeeper coordinator starts once")
        deadline = time.monotonic() + timeout
        client = KazooClient(
            hosts=self.hosts,
            timeout=self.session_timeout,
            # reconnect forever, never more than a second apart: a restarted server or a new
            # leader is found quickly (kazoo's default backoff grows to an hour)
            connection_retry=KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=1.0),
            command_retry=KazooRetry(max_tries=3, delay=0.1, backoff=2, max_delay=1.0),
            **self.access.client_kwargs(),
        )
        client.add_listener(self._on_state)
        self._client = client
        # start_async + wait instead of start(): start() makes a blocking call afterwards
        client.start_async().wait(timeout)
        if not client.connected:
            self._close_client()
            raise errors.SchedError(
                f"cannot reach ZooKeeper at {self.hosts} within {timeout:g} s", field="zookeeper"
            )
        try:
            self._ensure_paths(deadline)
        except errors.SchedError:
            self._close_client()
            raise
        self._worker = threading.Thread(
            target=self._run, name=f"zk-coordinator-{self.node_name}", daemon=True
        )
        self._worker.start()
        self._wake.set()
        with self._cond:
            for _ in range(int(timeout / _SLICE_SECONDS) + 2):
                remaining = deadline - time.monotonic()
                if self._rounds > 0 or remaining <= 0:
                    break
                self._cond.wait(min(remaining, _SLICE_SECONDS))
            started = self._rounds > 0
            refused = self._refused
        if refused is not None:
            # wrong or missing credentials do not heal by retrying: say so now
            self.stop()
            raise refused
        if not started:
            self.stop()
            raise errors.SchedError(
                f"ZooKeeper at {self.hosts} did not answer within {timeout:g} s", field="zookeeper"
            )
        log.info(
            "joined the cluster as %s: %d partitions owned, %d members",
            self.node_name,
            len(self._owned),
            len(self._members),
        )

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        """Stop claiming, then delete our owner and member nodes so the others take over at
        once (not after our session times out), then close the session."""
        with self._cond:
            if self._client is None or self._stopping:
                return
            self._stopping = True
            self._owned = _EMPTY
            self._events += 1
            self._cond.notify_all()
        self._notify_change()
        self._stop_requested.set()
        self._wake.set()
        if self._worker is not None:
            self._worker.join(timeout)
            if self._worker.is_alive():
                log.warning("the coordinator thread did not stop within %.0f s", timeout)
        nodes = dict(self._nodes)
        deadline = time.monotonic() + timeout
        if self._client.connected:
            # owners first: when the others see the member leave, the partitions are free
            pending = {p: self._client.delete_async(self._owner_path(p)) for p in nodes}
            member = self._client.delete_async(self._member_path())
            outcomes = self._gather(pending, deadline, interruptible=False)
            self._await(member, deadline, interruptible=False)
            left = [p for p, o in outcomes.items() if not o.answered or o.error is not None]
            if left:
                log.info("%d owner nodes left to the session close", len(left))
        if nodes:
            try:  # only for `schedctl status`: the next owner overwrites it anyway
                self._repo.release(nodes.keys(), self.node_name)
            except errors.SchedError as exc:
                log.warning("could not mark partitions released: %s", exc)
        # closing the session removes whatever ephemeral node is left
        self._close_client()
        log.info("left the cluster, released %d partitions", len(nodes))

    def owned(self) -> Mapping[int, int]:
        return self._owned

    # -- extras --------------------------------------------------------------------------

    def members(self) -> list[str]:
        """The member list as last read from ZooKeeper."""
        with self._lock:
            return sorted(self._members)

    def assigned(self) -> set[int]:
        """The partitions this node should own according to that member list."""
        with self._lock:
            return set(self._assigned)

    def wait_until_stable(self, timeout: float) -> bool:
        """True once every partition assigned to this node per the current member list is
        owned (and nothing else), with no event pending; False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            for _ in range(int(timeout / _SLICE_SECONDS) + 2):
                if self._is_stable():
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, _SLICE_SECONDS))
            return self._is_stable()

    def _is_stable(self) -> bool:
        return (
            self._stable
            and self._connected
            and not self._stopping
            and self._owned.keys() == self._assigned
        )

    # -- kazoo callbacks (never block) ----------------------------------------------------

    def _on_state(self, state: Any) -> None:
        with self._cond:
            self._gen += 1
            self._events += 1
            self._stable = False
            self._connected = state == KazooState.CONNECTED
            if not self._connected:
                # the session may expire on the server any moment now, and another member
                # take our partitions: stop claiming at once
                self._owned = _EMPTY
                self._suspended_gen = self._gen
            self._cond.notify_all()
        self._wake.set()

    def _on_watch(self, event: Any) -> None:
        del event
        with self._cond:
            self._events += 1
            self._stable = False
        self._wake.set()

    def _on_members_watch(self, event: Any) -> None:
        self._members_stale = True
        self._on_watch(event)

    # -- the worker thread -----------------------------------------------------------------

    def _run(self) -> None:
        # while not stable (a partition still held by its old owner, a failed operation),
        # rounds are retried after a growing wait; the owner node's watch usually wakes us
        backoff = retrying.Backoff(retrying.ZOOKEEPER_ROUND)
        while not self._stop_requested.is_set():
            stable = False
            refused = None
            with self._lock:
                events = self._events
            try:
                stable = self._reconcile()
            except errors.SchedError as exc:
                if exc.field == "zookeeper_auth_file":
                    refused = exc
                log.warning("coordination round failed, retrying: %s", exc)
            except Exception:
                log.exception("coordination round failed, retrying")
            with self._cond:
                self._stable = stable and self._events == events
                self._refused = refused
                self._rounds += 1
                self._cond.notify_all()
            self._notify_change()
            if stable:
                backoff.reset()
                self._wake.wait(RESYNC_SECONDS)
            else:
                backoff.wait(self._wake)  # stop() sets _wake: a stop never waits it out
            self._wake.clear()

    def _notify_change(self) -> None:
        current = self._owned
        if current is self._notified:
            return
        self._notified = current
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                log.exception("the on_change hook failed")

    def _reconcile(self) -> bool:
        """One round: bring our owner nodes in line with the assignment; True when nothing
        is left to do."""
        with self._lock:
            gen, connected, suspended_gen = self._gen, self._connected, self._suspended_gen
        client = self._client
        client_id = client.client_id if client is not None else None
        if not connected or client_id is None:
            return False
        session = int(client_id[0])
        if session != self._session:
            if self._session is not None:
                log.warning("new ZooKeeper session %x: joining again", session)
            # the old session's ephemeral nodes are gone with it: start over
            self._session = session
            self._nodes.clear()
            self._confirmed.clear()
            self._uncertain.clear()
            self._registered = False
            self._members_stale = True
            self._verified_gen = gen
        deadline = time.monotonic() + OP_TIMEOUT_SECONDS
        if not self._paths_ok:
            self._ensure_paths(deadline)
        if not self._registered:
            self._register(session, deadline)
        if self._members_stale or time.monotonic() - self._members_read_at > RESYNC_SECONDS:
            self._read_members(deadline)
        if suspended_gen > self._verified_gen:
            self._verify_nodes(session, deadline)
            self._verified_gen = gen
        settled = self._resolve_uncertain(session, deadline)

        members = self._members
        if self._registered and self.node_name not in members:
            members = (*members, self.node_name)
        desired = self._desired(members)
        with self._lock:
            self._assigned = desired

        giving = set(self._nodes) - desired
        if giving:
            # stop claiming them first, then free them for their new owner
            self._publish(gen, desired)
            settled &= self._release(giving, deadline)
        settled &= self._acquire(
            set(desired) - set(self._nodes) - self._uncertain, session, deadline
        )
        settled &= self._confirm(desired)
        published = self._publish(gen, desired)
        return settled and published and self._owned.keys() == desired

    def _desired(self, members: tuple[str, ...]) -> frozenset[int]:
        key = tuple(sorted(set(members)))
        if self._assignment_cache is None or self._assignment_cache[0] != key:
            assigned = frozenset(partitions_for(self.node_name, key, self.partition_count))
            self._assignment_cache = (key, assigned)
        return self._assignment_cache[1]

    def _publish(self, gen: int, desired: frozenset[int]) -> bool:
        owned = {p: self._nodes[p] for p in self._confirmed if p in desired and p in self._nodes}
        with self._cond:
            if self._gen == gen and self._connected and not self._stopping:
                if owned != self._owned:
                    self._owned = MappingProxyType(owned)
                    self._cond.notify_all()
                return True
            # the connection changed since this round began: ownership may only shrink
            current = self._owned
            shrunk = {p: e for p, e in current.items() if owned.get(p) == e}
            if len(shrunk) != len(current):
                self._owned = MappingProxyType(shrunk)
            return False

    # -- ZooKeeper operations (worker thread) -----------------------------------------------

    def _member_path(self) -> str:
        return f"{self._members_path}/{self.node_name}"

    def _owner_path(self, partition: int) -> str:
        return f"{self._owners_path}/{partition}"

    def _ensure_paths(self, deadline: float) -> None:
        # ensure_path creates missing parents with the client's default ACL (ours)
        for path in (self._members_path, self._owners_path):
            outcome = self._await(self._client.ensure_path_async(path), deadline)
            if isinstance(outcome.error, NoAuthError):
                raise errors.SchedError(
                    f"ZooKeeper at {self.hosts} refused to create {path} (NoAuth): "
                    f"{denied_hint(self.access)}",
                    field="zookeeper_auth_file",
                )
            if not outcome.answered or outcome.error is not None:
                raise errors.SchedError(
                    f"cannot create {path} in ZooKeeper at {self.hosts}: "
                    f"{outcome.error or 'no answer'} (does the chroot exist?)",
                    field="zookeeper",
                )
        if self.access.acl is not None:
            self._restrict(self.access.acl, deadline)
        self._paths_ok = True

    def _restrict(self, acl: list[Any], deadline: float) -> None:
        """The root and its two parents get our ACL if they have another one (made before
        credentials were configured, or by someone else): an open parent would let anyone
        create member or owner nodes."""
        paths = (self.root, self._members_path, self._owners_path)
        found = self._gather({p: self._client.get_acls_async(p) for p in paths}, deadline)
        wanted = set(acl)
        for path, outcome in found.items():
            if isinstance(outcome.error, NoAuthError):
                raise errors.SchedError(
                    f"ZooKeeper at {self.hosts} refused to show the ACL of {path} (NoAuth): "
                    f"{denied_hint(self.access)}",
                    field="zookeeper_auth_file",
                )
            if not outcome.answered or outcome.error is not None:
                raise errors.SchedError(
                    f"cannot read the ACL of {path}: {outcome.error or 'no answer'}",
                    field="zookeeper",
                )
            if set(outcome.value[0]) == wanted:
                continue
            changed = self._await(self._client.set_acls_async(path, acl), deadline)
            if isinstance(changed.error, NoAuthError):
                raise errors.SchedError(
                    f"{path} in ZooKeeper at {self.hosts} has an ACL that does not let "
                    f"{self.access.user!r} administer it (NoAuth): {denied_hint(self.access)}",
                    field="zookeeper_auth_file",
                )
            if not changed.answered or changed.error is not None:
                raise errors.SchedError(
                    f"cannot set the ACL of {path}: {changed.error or 'no answer'}",
                    field="zookeeper",
                )
            log.warning("%s had another ACL: now only %r may use it", path, self.access.user)

    def _register(self, session: int, deadline: float) -> None:
        path = self._member_path()
        for _ in range(2):  # a leftover node of our own name is deleted, then we try again
            created = self._await(
                self._client.create_async(path, self._member_data, ephemeral=True), deadline
            )
            if created.answered and created.error is None:
                self._registered = True
                return
            if isinstance(created.error, NoAuthError):
                self._paths_ok = False  # look at the parents' ACL again next round
                raise errors.SchedError(
                    f"ZooKeeper refused to register {path} (NoAuth): {denied_hint(self.access)}",
                    field="zookeeper_auth_file",
                )
            if not isinstance(created.error, NodeExistsError):
                raise errors.SchedError(f"cannot register {path}: {created.error or 'no answer'}")
            found = self._await(self._client.exists_async(path), deadline)
            if found.answered and found.error is None and found.value is not None:
                if _stat(found.value).ephemeral_owner == session:
                    self._registered = True  # our own create whose answer was lost
                    return
                # a previous incarnation of this node (killed, or paused and about to be
                # fenced): its session has not expired yet; take its place now
                log.warning("replacing a leftover member node %s of another session", path)
                self._await(self._client.delete_async(path), deadline)
        raise errors.SchedError(f"cannot register {path}: it keeps coming back")

    def _read_members(self, deadline: float) -> None:
        # stale again if the watch fires while this read is on its way
        self._members_stale = False
        outcome = self._await(
            self._client.get_children_async(self._members_path, watch=self._on_members_watch),
            deadline,
        )
        if not outcome.answered or outcome.error is not None:
            self._members_stale = True
            raise errors.SchedError(f"cannot read the members: {outcome.error or 'no answer'}")
        members = tuple(sorted(str(child) for child in outcome.value))
        self._members_read_at = time.monotonic()
        if self._registered and self.node_name not in members:
            # someone deleted our member node (another process of our name?): register again
            log.warning("our member node %s is gone: registering again", self._member_path())
            self._registered = False
            self._members_stale = True
        with self._lock:
            if members != self._members:
                log.info("members: %s", ", ".join(members))
            self._members = members

    def _verify_nodes(self, session: int, deadline: float) -> None:
        """After a reconnection: keep only the owner nodes that still exist and are ours."""
        pending = {p: self._client.exists_async(self._owner_path(p)) for p in self._nodes}
        outcomes = self._gather(pending, deadline)
        for p, outcome in outcomes.items():
            if not outcome.answered or outcome.error is not None:
                raise errors.SchedError(f"cannot check owner node {p}: {outcome.error}")
        lost = {
            p
            for p, outcome in outcomes.items()
            if outcome.value is None or _stat(outcome.value).ephemeral_owner != session
        }
        for p in lost:
            del self._nodes[p]
            self._confirmed.discard(p)
        log.info("reconnected: %d owner nodes still ours, %d lost", len(self._nodes), len(lost))

    def _resolve_uncertain(self, session: int, deadline: float) -> bool:
        """Creates we never heard back from: the node exists and is ours, or it does not."""
        if not self._uncertain:
            return True
        pending = {p: self._client.exists_async(self._owner_path(p)) for p in self._uncertain}
        settled = True
        for p, outcome in self._gather(pending, deadline).items():
            if not outcome.answered or outcome.error is not None:
                settled = False
                continue
            self._uncertain.discard(p)
            if outcome.value is not None:
                stat = _stat(outcome.value)
                if stat.ephemeral_owner == session:
                    self._nodes[p] = stat.czxid  # ours; _confirm writes the epoch
        return settled

    def _release(self, partitions: set[int], deadline: float) -> bool:
        pending = {p: self._client.delete_async(self._owner_path(p)) for p in partitions}
        settled = True
        for p, outcome in self._gather(pending, deadline).items():
            if outcome.answered and (
                outcome.error is None or isinstance(outcome.error, NoNodeError)
            ):
                self._nodes.pop(p, None)
                self._confirmed.discard(p)
            else:
                settled = False  # still ours: deleted next round
        if settled:
            log.info("released %d partitions", len(partitions))
        return settled

    def _acquire(self, partitions: set[int], session: int, deadline: float) -> bool:
        """Create owner nodes for the partitions; watch those someone else still holds."""
        if not partitions:
            return True
        pending = {
            p: self._client.create_async(
                self._owner_path(p), self.node_name.encode(), ephemeral=True, include_data=True
            )
            for p in partitions
        }
        settled = True
        taken: list[int] = []
        for p, outcome in self._gather(pending, deadline).items():
            if outcome.answered and outcome.error is None:
                self._nodes[p] = _stat(outcome.value[1]).czxid
            elif isinstance(outcome.error, NodeExistsError):
                taken.append(p)
            elif isinstance(outcome.error, NoNodeError | NoAuthError):
                # someone deleted our tree, or its ACL is not ours: _ensure_paths says which
                self._paths_ok = False
                settled = False
            else:
                self._uncertain.add(p)  # connection trouble: it may have been created
                settled = False
        if taken:
            settled = False
            self._watch_owners(taken, session, deadline)
        return settled

    def _watch_owners(self, partitions: list[int], session: int, deadline: float) -> None:
        """Watch owner nodes someone else holds, so we retry as soon as they are deleted."""
        pending = {
            p: self._client.get_async(self._owner_path(p), watch=self._on_watch) for p in partitions
        }
        stale: dict[int, Any] = {}
        for p, outcome in self._gather(pending, deadline).items():
            if not outcome.answered or outcome.error is not None:
                self._wake.set()  # gone already (NoNode) or unknown: look again soon
                continue
            data, raw = outcome.value
            stat = _stat(raw)
            if stat.ephemeral_owner == session:
                self._nodes[p] = stat.czxid  # ours after all (a create answer we lost)
            elif bytes(data) == self.node_name.encode():
                # our name, another session: a previous incarnation of this node; it is
                # fenced by the epoch anyway, so free the partition now instead of waiting
                stale[p] = self._client.delete_async(self._owner_path(p))
        if stale:
            log.warning("deleting %d owner nodes left by a previous session", len(stale))
            self._gather(stale, deadline)
            self._wake.set()

    def _confirm(self, desired: frozenset[int]) -> bool:
        """Write the epochs of newly created owner nodes to the partitions table (one
        statement per 500); a partition whose stored epoch is newer is not ours."""
        pending = {
            p: epoch
            for p, epoch in self._nodes.items()
            if p in desired and p not in self._confirmed
        }
        if not pending:
            return True
        acquired = self._repo.acquire_each(pending, self.node_name)
        self._confirmed |= acquired
        refused = set(pending) - acquired
        if refused:
            # only possible if the ensemble was wiped (zxids restart small) or someone wrote
            # epochs by hand: nobody can own these until an operator fixes the table
            log.error(
                "partitions %s have a stored epoch newer than our owner node's zxid: not "
                "owning them (was the ZooKeeper ensemble wiped?)",
                sorted(refused)[:20],
            )
            self._release(refused, time.monotonic() + OP_TIMEOUT_SECONDS)
            return False
        log.info("acquired %d partitions", len(acquired))
        return True

    # -- waiting on kazoo's asynchronous results -------------------------------------------

    def _await(self, result: Any, deadline: float, *, interruptible: bool = True) -> _CallAnswer:
        """The outcome of one async call, waiting at most until `deadline` (and no longer
        than until stop() is called, unless `interruptible` is False)."""
        for _ in range(int(max(0.0, deadline - time.monotonic()) / _SLICE_SECONDS) + 2):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (interruptible and self._stop_requested.is_set()):
                break
            if result.wait(min(remaining, _SLICE_SECONDS)):
                break
        if not result.ready():
            return _NO_ANSWER
        try:
            return _CallAnswer(value=result.get(block=False))
        except Exception as exc:
            return _CallAnswer(error=exc)

    def _gather(
        self, pending: Mapping[K, Any], deadline: float, *, interruptible: bool = True
    ) -> dict[K, _CallAnswer]:
        # the calls are already on the wire, pipelined: waiting for them one by one costs
        # one round trip in all, not one each
        return {
            key: self._await(result, deadline, interruptible=interruptible)
            for key, result in pending.items()
        }

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        client.remove_listener(self._on_state)
        try:
            client.stop()
        except Exception as exc:  # a writer that would not stop: nothing more to do
            log.warning("closing the ZooKeeper client: %s", exc)
        client.close()
        with self._cond:
            self._connected = False
            self._owned = _EMPTY
            self._cond.notify_all()
