"""Owns gathering `schedctl status`: members, partitions per owner and their epochs, lag, and
the outbox, queue and dead-letter depths, as one read-only snapshot of the cluster.

Members come from ZooKeeper when it is configured (the ephemeral nodes under
`{zookeeper_root}/members`, read by a short-lived client with timeouts: the status of a
cluster whose ZooKeeper is down must still print), else from the owners recorded in the
partitions table. Ownership and epochs always come from the partitions table: that is
what claims are fenced against. An owner that is not a live member (a dispatcher killed a
moment ago, whose partitions are not owned again yet) is shown as such.

Lag is the age of the oldest due and unclaimed run: min(next_fire_at) of active jobs that
is at or before the database's now. On Postgres it is read per partition from the due
index (one index probe each), never by scanning the jobs table.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from schedctl.coordination.assignment import assignment
from schedctl.core import errors
from schedctl.domain.config import Config
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db.store import Store
from schedctl.storage.jobs import host_drift
from schedctl.storage.jobs.host_drift import HostDrift
from schedctl.storage.pipeline.queue import QueueRepo, QueueStat
from schedctl.storage.pipeline.workers import WorkerRepo
from schedctl.storage.records.status import (
    LagStatus,
    OutboxStatus,
    PartitionStatus,
    read_database_status,
)

if TYPE_CHECKING:
    from schedctl.coordination.zkaccess import ZooKeeperAccess

# One bound for the whole ZooKeeper read (connect, list, read each member).
ZOOKEEPER_TIMEOUT_SECONDS = 5.0

# kazoo logs every failed connection attempt; a CLI must print one line, not a stream
_quiet = logging.getLogger("schedctl.cluster_status.kazoo")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False


@dataclass(frozen=True)
class MemberInfo:
    """What a dispatcher wrote into its ZooKeeper member node."""

    name: str
    host: str | None = None
    pid: int | None = None


@dataclass(frozen=True)
class MemberStatus:
    name: str
    # True: registered in ZooKeeper; False: owns partitions in the table but is no member
    # (dead or paused, not replaced yet); None: unknown (no ZooKeeper, or it did not answer)
    live: bool | None
    host: str | None
    pid: int | None
    partitions: tuple[int, ...]
    epoch_min: int | None
    epoch_max: int | None


@dataclass(frozen=True)
class ClusterStatus:
    at: datetime  # the database's clock
    coordinator: str  # "zookeeper" or "local"
    zookeeper: str | None
    zookeeper_root: str | None
    zookeeper_error: str | None  # why members could not be read
    partition_count: int
    members: tuple[MemberStatus, ...]
    partitions: tuple[PartitionStatus, ...]
    unowned: tuple[int, ...]
    # owned partitions whose owner is not the one the live members' assignment names
    # (a rebalance in progress); None when the live members are unknown
    moving: int | None
    lag: LagStatus
    outbox: OutboxStatus
    queues: Sequence[QueueStat]  # per tenant and queue, by tenant name then queue
    dead_letters: int  # not replayed
    dead_letters_total: int
    notes: tuple[str, ...] = field(default=())
    # live workers' names by (tenant_id, queue) (storage/pipeline/workers.py)
    workers: Mapping[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    # each cron host's job-file drift at its worker's last check (storage/jobs/host_drift.py)
    host_drift: tuple[HostDrift, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`schedctl status --output json`); instants in RFC 3339 UTC."""
        return {
            "at": format_instant(self.at),
            "host_drift": [
                {
                    "tenant_id": d.tenant_id,
                    "host": d.host,
                    "drift": list(d.drift),
                    "checked_at": _instant(d.checked_at),
                }
                for d in self.host_drift
            ],
            "coordinator": {
                "kind": self.coordinator,
                "zookeeper": self.zookeeper,
                "root": self.zookeeper_root,
                "error": self.zookeeper_error,
            },
            "members": [
                {
                    "name": m.name,
                    "live": m.live,
                    "host": m.host,
                    "pid": m.pid,
                    "partition_count": len(m.partitions),
                    "partitions": list(m.partitions),
                    "epoch_min": m.epoch_min,
                    "epoch_max": m.epoch_max,
                }
                for m in self.members
            ],
            "partitions": {
                "count": self.partition_count,
                "owned": self.partition_count - len(self.unowned),
                "unowned": list(self.unowned),
                "moving": self.moving,
                "table": [
                    {
                        "partition": p.partition,
                        "owner": p.owner,
                        "epoch": p.epoch,
                        "updated_at": _instant(p.updated_at),
                    }
                    for p in self.partitions
                ],
            },
            "lag": {
                "oldest_due_at": _instant(self.lag.oldest_due_at),
                "seconds": round(self.lag.seconds, 3),
                "due": self.lag.due,
            },
            "outbox": {
                "depth": self.outbox.depth,
                "ready": self.outbox.ready,
                "delivering": self.outbox.delivering,
                "waiting": self.outbox.waiting,
                "oldest_ready_at": _instant(self.outbox.oldest_ready_at),
                "age_seconds": round(self.outbox.age_seconds, 3),
            },
            "queues": [
                {
                    "tenant": q.tenant,
                    "tenant_id": q.tenant_id,
                    "queue": q.queue,
                    "ready": q.depth.ready,
                    "delayed": q.depth.delayed,
                    "leased": q.depth.leased,
                    "total": q.depth.total,
                    "oldest_ready_age_seconds": round(q.oldest_ready_seconds, 3),
                    "live_workers": list(self.live_workers(q)),
                    "unserved": self.unserved(q),
                }
                for q in self.queues
            ],
            "dead_letters": {"pending": self.dead_letters, "total": self.dead_letters_total},
            "notes": list(self.notes),
        }

    def live_workers(self, queue: QueueStat) -> tuple[str, ...]:
        return self.workers.get((queue.tenant_id, queue.queue), ())

    def unserved(self, queue: QueueStat) -> bool:
        """Ready runs and no live worker: they wait until someone starts one."""
        return queue.depth.ready > 0 and not self.live_workers(queue)


def _unserved_notes(queues: Sequence[QueueStat], workers: Mapping[Any, Any]) -> tuple[str, ...]:
    return tuple(
        f"queue {q.queue!r} of tenant {q.tenant} has {q.depth.ready} ready run(s), the oldest "
        f"waiting {q.oldest_ready_seconds:.0f} s, and no live worker"
        for q in queues
        if q.depth.ready > 0 and not workers.get((q.tenant_id, q.queue))
    )


def _instant(value: datetime | None) -> str | None:
    return format_instant(value) if value is not None else None


# -- ZooKeeper -------------------------------------------------------------------------------


def read_members(
    hosts: str,
    root: str,
    *,
    timeout: float = ZOOKEEPER_TIMEOUT_SECONDS,
    access: ZooKeeperAccess | None = None,
) -> dict[str, MemberInfo]:
    """The registered members under `{root}/members`, read by a client that lives for this
    call only, with the daemons' credentials and TLS (`access`); every step bounded by
    `timeout` in all. SchedError when ZooKeeper does not answer in time (kazoo's plain
    calls would block forever without a quorum) or refuses the read."""
    from kazoo.client import KazooClient
    from kazoo.exceptions import KazooException, NoAuthError, NoNodeError
    from kazoo.handlers.threading import KazooTimeoutError
    from kazoo.retry import KazooRetry

    from schedctl.coordination.zkaccess import ZooKeeperAccess, denied_hint
    from schedctl.coordination.zookeeper import check_hosts

    check_hosts(hosts)
    access = access or ZooKeeperAccess()
    client = KazooClient(
        hosts=hosts,
        timeout=max(timeout, 1.0),
        connection_retry=KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=1.0),
        command_retry=KazooRetry(max_tries=0),
        **{**access.client_kwargs(), "logger": _quiet},
    )
    path = f"{root}/members"
    try:
        client.start_async().wait(timeout)
        if not client.connected:
            raise errors.SchedError(f"ZooKeeper at {hosts} did not answer within {timeout:g} s")
        try:
            children = client.get_children_async(path).get(timeout=timeout)
        except NoNodeError:
            return {}
        pending = {str(name): client.get_async(f"{path}/{name}") for name in children}
        members: dict[str, MemberInfo] = {}
        for name, result in pending.items():
            try:
                data, _stat = result.get(timeout=timeout)
            except NoNodeError:
                continue  # left between the listing and the read
            members[name] = _member_info(name, data)
        return members
    except KazooTimeoutError as exc:
        raise errors.SchedError(
            f"ZooKeeper at {hosts} did not answer within {timeout:g} s"
        ) from exc
    except NoAuthError as exc:
        raise errors.SchedError(
            f"ZooKeeper refused to list {path} (NoAuth): {denied_hint(access)}"
        ) from exc
    except KazooException as exc:
        raise errors.SchedError(
            f"ZooKeeper at {hosts} refused to list {path}: {type(exc).__name__}"
        ) from exc
    finally:
        try:
            client.stop()
        finally:
            client.close()


def _member_info(name: str, data: bytes | None) -> MemberInfo:
    """Parse a member node's JSON {"host", "pid"}; anything else is shown as unknown."""
    try:
        parsed = json.loads(data or b"{}")
    except ValueError:
        return MemberInfo(name)
    if not isinstance(parsed, dict):
        return MemberInfo(name)
    host, pid = parsed.get("host"), parsed.get("pid")
    return MemberInfo(
        name,
        host=host if isinstance(host, str) else None,
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
    )


# -- putting it together ---------------------------------------------------------------------


MembersReader = Callable[[str, str], Mapping[str, MemberInfo]]


def gather_status(
    store: Store,
    config: Config,
    *,
    zookeeper_timeout: float = ZOOKEEPER_TIMEOUT_SECONDS,
    members_reader: MembersReader | None = None,
) -> ClusterStatus:
    """One snapshot of the cluster. Raises StoreUnavailable when the database is away; a
    ZooKeeper that does not answer is reported in `zookeeper_error`, not raised."""
    partition_count = store.partition_count
    database = read_database_status(store, partition_count)
    now, partitions, lag, outbox = database.at, database.partitions, database.lag, database.outbox
    dead_pending, dead_total = database.dead_letters, database.dead_letters_total
    queues = QueueRepo(store).stats()
    workers = WorkerRepo(store).live()

    live: Mapping[str, MemberInfo] | None = None
    zookeeper_error: str | None = None
    if config.zookeeper:

        def read_with_config(hosts: str, root: str) -> Mapping[str, MemberInfo]:
            from schedctl.coordination.zkaccess import ZooKeeperAccess

            access = ZooKeeperAccess.from_config(config)
            return read_members(hosts, root, timeout=zookeeper_timeout, access=access)

        reader = members_reader or read_with_config
        try:
            live = reader(config.zookeeper, config.zookeeper_root)
        except errors.SchedError as exc:
            zookeeper_error = exc.message
    members, moving, notes = _members(partitions, partition_count, live)
    if zookeeper_error is not None:
        notes = (f"members unknown: {zookeeper_error}", *notes)
    notes = (*notes, *_unserved_notes(queues, workers))
    drift = tuple(host_drift.read(store))
    notes = (*notes, *_drift_notes(drift))
    by_number = {p.partition: p for p in partitions}
    unowned = tuple(
        p for p in range(partition_count) if p not in by_number or by_number[p].owner is None
    )
    return ClusterStatus(
        at=now,
        coordinator="zookeeper" if config.zookeeper else "local",
        zookeeper=config.zookeeper,
        zookeeper_root=config.zookeeper_root if config.zookeeper else None,
        zookeeper_error=zookeeper_error,
        partition_count=partition_count,
        members=members,
        partitions=tuple(partitions),
        unowned=unowned,
        moving=moving,
        lag=lag,
        outbox=outbox,
        queues=tuple(queues),
        workers=workers,
        dead_letters=dead_pending,
        dead_letters_total=dead_total,
        notes=notes,
        host_drift=drift,
    )


def _drift_notes(drift: Sequence[HostDrift]) -> tuple[str, ...]:
    """A note per host whose job files differ from the central jobs."""
    notes = []
    for d in drift:
        if d.drift:
            shown = "; ".join(d.drift[:5]) + ("; ..." if len(d.drift) > 5 else "")
            notes.append(
                f"host {d.host}: job files differ from the central jobs ({shown}): run "
                "`schedctl apply` there"
            )
    return tuple(notes)


def _members(
    partitions: list[PartitionStatus],
    partition_count: int,
    live: Mapping[str, MemberInfo] | None,
) -> tuple[tuple[MemberStatus, ...], int | None, tuple[str, ...]]:
    """Members (live ones first, then owners that are no members), how many partitions are
    not (yet) with the owner the live members' assignment names, and notes for people."""
    owned: dict[str, list[PartitionStatus]] = {}
    for p in partitions:
        if p.owner is not None and p.partition < partition_count:
            owned.setdefault(p.owner, []).append(p)
    names = sorted(live or {}) + sorted(set(owned) - set(live or {}))
    members = []
    for name in names:
        held = owned.get(name, [])
        info = (live or {}).get(name, MemberInfo(name))
        epochs = [p.epoch for p in held]
        members.append(
            MemberStatus(
                name=name,
                live=None if live is None else name in live,
                host=info.host,
                pid=info.pid,
                partitions=tuple(p.partition for p in held),
                epoch_min=min(epochs) if epochs else None,
                epoch_max=max(epochs) if epochs else None,
            )
        )
    notes: list[str] = []
    moving: int | None = None
    if live is not None:
        wanted = assignment(live, partition_count)
        current = {p.partition: p.owner for p in partitions}
        moving = sum(1 for p, member in wanted.items() if current.get(p) != member)
        if not live:
            notes.append("no dispatcher is registered in ZooKeeper: nothing is being claimed")
        stale = [m.name for m in members if m.live is False]
        if stale:
            notes.append(
                "owners that are no members (dead or paused; their partitions move once "
                f"their session expires): {', '.join(stale)}"
            )
    return tuple(members), moving, tuple(notes)
