"""Owns worker presence: which workers serve each tenant's built-in queue, and which of them
are live (the `workers` table, migration 0008).

A worker is seen when it leases (every poll, while it has a free slot) and when it
heartbeats a run (while busy): a direct worker through its DirectBackend (by its lease owner
name, host:pid:random), an API worker through the API's lease and heartbeat routes (as
`api:TOKEN_ID`: the API cannot tell apart two processes that share a token). A process
writes a worker's row at most every PRESENCE_SECONDS (`Presence`), and the row says the
worker is live until `live_until` = the time seen plus max(LIVE_SECONDS, its lease time):
three times the default 5 s heartbeat, which a polling or heartbeating worker renews well
before; a busy worker with a longer heartbeat still beats before its lease runs out. So a
worker that stopped (or was killed) shows as not live within 15 s, or its lease time.

`schedctl status` reads `live()` to flag queues with ready runs and no live worker. Rows
of workers gone for FORGET_SECONDS are deleted when a new worker of the same tenant shows up,
so restarts (a new name each time) do not grow the table without bound, and a tenant has
at most MAX_ROWS_PER_TENANT rows (its token may poll any queue name: each is a row).

Plain SQLAlchemy: update, then insert if missing (another process inserting the same row
first is an IntegrityError, after which the update is done again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from schedctl.core import errors
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store

log = logging.getLogger(__name__)

PRESENCE_SECONDS = 5.0  # one write per worker and queue at most this often, per process
LIVE_SECONDS = 3 * 5.0  # live this long after being seen (or the lease time, if longer)
FORGET_SECONDS = 24 * 3600.0  # rows not live for this long are deleted
MAX_NAME = 200  # the column's size; longer names are cut
MAX_TRACKED = 10_000  # throttle entries one process keeps before starting afresh
# rows one tenant may have: a tenant's token can poll any queue name, and each new (queue,
# worker) pair is a row; past this, new pairs are not recorded (presence is advisory)
MAX_ROWS_PER_TENANT = 10_000


@dataclass(frozen=True)
class WorkerSeen:
    tenant_id: str
    queue: str
    worker: str
    last_seen: datetime
    live_until: datetime


class WorkerRepo:
    """The `workers` table."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def seen(self, tenant_id: str, queue: str, worker: str, *, lease_seconds: float = 0) -> None:
        """Record that `worker` served the tenant's `queue` now (the database's clock)."""
        worker = worker[:MAX_NAME]
        window = timedelta(seconds=max(LIVE_SECONDS, float(lease_seconds)))
        for _ in range(3):  # update, insert, and once more if an insert raced ours
            with self.store.tx() as connection:
                if self._touch(connection, tenant_id, queue, worker, window):
                    return
            try:
                with self.store.tx() as connection:
                    now = db_now(connection)
                    self._forget(connection, tenant_id, now)
                    if self._rows(connection, tenant_id) >= MAX_ROWS_PER_TENANT:
                        log.warning(
                            "worker %s on queue %r of tenant %s not recorded: the tenant has "
                            "%d worker rows already",
                            worker,
                            queue,
                            tenant_id,
                            MAX_ROWS_PER_TENANT,
                        )
                        return
                    connection.execute(
                        schema.workers.insert().values(
                            tenant_id=tenant_id,
                            queue=queue,
                            worker=worker,
                            last_seen=now,
                            live_until=now + window,
                        )
                    )
                return
            except IntegrityError:
                continue  # another process inserted it first: update it

    def _touch(
        self, connection: Connection, tenant_id: str, queue: str, worker: str, window: timedelta
    ) -> bool:
        w = schema.workers
        now = db_now(connection)
        result = connection.execute(
            update(w)
            .where(w.c.tenant_id == tenant_id, w.c.queue == queue, w.c.worker == worker)
            .values(last_seen=now, live_until=now + window)
        )
        return result.rowcount == 1

    def _forget(self, connection: Connection, tenant_id: str, now: datetime) -> None:
        w = schema.workers
        connection.execute(
            delete(w).where(
                w.c.tenant_id == tenant_id,
                w.c.live_until < now - timedelta(seconds=FORGET_SECONDS),
            )
        )

    def _rows(self, connection: Connection, tenant_id: str) -> int:
        """The tenant's rows, counted up to MAX_ROWS_PER_TENANT."""
        w = schema.workers
        held = select(w.c.queue).where(w.c.tenant_id == tenant_id).limit(MAX_ROWS_PER_TENANT)
        return int(
            connection.execute(select(func.count()).select_from(held.subquery())).scalar_one()
        )

    def live(self) -> dict[tuple[str, str], tuple[str, ...]]:
        """The live workers' names by (tenant_id, queue)."""
        w = schema.workers
        with self.store.read() as connection:
            now = db_now(connection)
            rows = connection.execute(
                select(w.c.tenant_id, w.c.queue, w.c.worker)
                .where(w.c.live_until >= now)
                .order_by(w.c.tenant_id, w.c.queue, w.c.worker)
            ).all()
        found: dict[tuple[str, str], list[str]] = {}
        for tenant_id, queue, worker in rows:
            found.setdefault((str(tenant_id), str(queue)), []).append(str(worker))
        return {key: tuple(names) for key, names in found.items()}

    def live_of(self, tenant_id: str, queue: str) -> list[WorkerSeen]:
        """The live workers of one tenant's queue (`job why`), by name."""
        w = schema.workers
        with self.store.read() as connection:
            now = db_now(connection)
            rows = connection.execute(
                select(w.c.worker, w.c.last_seen, w.c.live_until)
                .where(w.c.tenant_id == tenant_id, w.c.queue == queue, w.c.live_until >= now)
                .order_by(w.c.worker)
                .limit(1000)
            ).all()
        return [WorkerSeen(tenant_id, queue, str(n), seen, until) for n, seen, until in rows]

    def all(self) -> list[WorkerSeen]:
        """Every row, live or not, by tenant, queue and worker."""
        w = schema.workers
        with self.store.read() as connection:
            rows = connection.execute(
                select(
                    w.c.tenant_id, w.c.queue, w.c.worker, w.c.last_seen, w.c.live_until
                ).order_by(w.c.tenant_id, w.c.queue, w.c.worker)
            ).all()
        return [WorkerSeen(str(t), str(q), str(n), seen, until) for t, q, n, seen, until in rows]


class Presence:
    """Records presence at most every `interval` seconds per (database, tenant, queue,
    worker), and never fails its caller: presence is advisory, while the lease or heartbeat
    it rides on must go through (a failure is logged once until a write succeeds again)."""

    def __init__(
        self, interval: float = PRESENCE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str, str, str], float] = {}
        self._failing = False

    def seen(
        self, store: Store, tenant_id: str, queue: str, worker: str, lease_seconds: float = 0
    ) -> bool:
        """True when a row was written now; False when throttled or when it failed."""
        key = (str(store.engine.url), tenant_id, queue, worker)
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                return False
            if len(self._last) >= MAX_TRACKED:
                self._last.clear()  # bounded; the cost is one early write per worker
            self._last[key] = now
        try:
            WorkerRepo(store).seen(tenant_id, queue, worker, lease_seconds=lease_seconds)
        except (errors.SchedError, SQLAlchemyError) as exc:
            if not self._failing:
                log.warning("cannot record worker %s on queue %r: %s", worker, queue, exc)
            self._failing = True
            return False
        self._failing = False
        return True


PRESENCE = Presence()


class _Tenant(Protocol):
    @property
    def tenant_id(self) -> str: ...


class _Caller(Protocol):
    @property
    def token_id(self) -> str: ...

    @property
    def tenant(self) -> _Tenant: ...


def api_worker(caller: _Caller, queue: str) -> tuple[str, str, str]:
    """(tenant_id, queue, worker name) of an API worker: its token stands for it."""
    return caller.tenant.tenant_id, queue, f"api:{caller.token_id}"


def record_presence(
    store: Store, tenant_id: str, queue: str, worker: str, lease_seconds: float = 0
) -> None:
    """The one call a lease or heartbeat path makes (throttled, never raises)."""
    PRESENCE.seen(store, tenant_id, queue, worker, lease_seconds)


def live_queues(
    connection: Connection, queues: Collection[tuple[str, str]], now: datetime
) -> set[tuple[str, str]]:
    """Which of the (tenant_id, queue) pairs have a live worker now, in the caller's
    transaction (the relay's routing of every-host runs)."""
    if not queues:
        return set()
    w = schema.workers
    rows = connection.execute(
        select(w.c.tenant_id, w.c.queue)
        .where(
            w.c.queue.in_(sorted({queue for _, queue in queues})),
            w.c.live_until >= now,
        )
        .distinct()
    ).all()
    return {(str(t), str(q)) for t, q in rows} & set(queues)


def worker_tenant(store: Store, tenant: str | None, *, field: str = "tenant") -> str:
    """The id of the tenant whose queue a worker serves, from its name or id. It may be
    left out only while exactly one tenant exists: with two, a worker guessing would run
    one tenant's runs with a command meant for another's."""
    t = schema.tenants
    with store.read() as connection:
        if tenant is not None:
            rows = connection.execute(
                select(t.c.tenant_id).where(or_(t.c.tenant_id == tenant, t.c.name == tenant))
            ).all()
            ids = [r.tenant_id for r in rows]
            if not ids:
                raise errors.ConfigError(f"no tenant {tenant!r}", field=field)
            # an id wins over a name that happens to look like another tenant's id
            return tenant if tenant in ids else str(ids[0])
        found = connection.execute(select(t.c.tenant_id).limit(2)).scalars().all()
    if len(found) != 1:
        raise errors.ConfigError(
            "a worker serves one tenant's queue: name the tenant with --tenant NAME (or "
            f'tenant = "NAME" in its [[worker]] table); there are '
            f"{'no' if not found else 'several'} tenants",
            field=field,
        )
    return str(found[0])
