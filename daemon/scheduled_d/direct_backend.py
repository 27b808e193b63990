"""Owns `DirectBackend`, the operator worker's LeaseBackend: one tenant's queue in the
database, through schedctl.storage.pipeline.queue.QueueRepo.

The database layer is imported only when a DirectBackend is made, so a tenant worker
(`--api`), which imports this module with the worker, loads no database code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from schedctl.core import errors
from schedctl.domain.leasing import Beat, LeaseBackend, LeasedRun, ReadyFeed, Settlement

if TYPE_CHECKING:
    from schedctl.storage.db.store import Store
    from schedctl.storage.pipeline.queue import Lease as StoredLease
    from schedctl.storage.pipeline.queue import QueueRepo


class DirectBackend(LeaseBackend):
    """The operator worker's backend: the database, through QueueRepo, for one tenant's
    queue.

    - tenant: the tenant's name or id; may be left out while exactly one tenant exists
      (ConfigError otherwise: a worker guessing could run one tenant's runs with a command
      meant for another's).
    """

    def __init__(self, store: Store, tenant: str | None = None) -> None:
        from schedctl.storage.pipeline.queue import QueueRepo
        from schedctl.storage.pipeline.workers import worker_tenant

        self.store = store
        self.repo: QueueRepo = QueueRepo(store)
        self.tenant_id = worker_tenant(store, tenant)

    def lease(self, queue: str, owner: str, lease_seconds: float, limit: int) -> list[LeasedRun]:
        from schedctl.storage.pipeline.workers import record_presence

        leases: list[LeasedRun] = list(
            self.repo.lease(queue, owner, lease_seconds, limit, tenant_id=self.tenant_id)
        )
        # a poll says this worker serves the queue (`schedctl status`); throttled
        record_presence(self.store, self.tenant_id, queue, owner, lease_seconds)
        return leases

    def ready_feed(self, queue: str) -> ReadyFeed | None:
        from schedctl.storage.backend.dialect import queue_word

        return self.store.dialect.ready_feed(self.store.engine, queue_word(self.tenant_id, queue))

    def beat(self, lease: LeasedRun, lease_seconds: float, output_tail: str | None = None) -> Beat:
        beat = self.beat_many([(lease, output_tail)], lease_seconds)[0]
        if isinstance(beat, errors.StoreUnavailable):
            raise beat
        return beat

    def beat_many(
        self, items: Sequence[tuple[LeasedRun, str | None]], lease_seconds: float
    ) -> list[Beat | errors.StoreUnavailable]:
        """Every lease extended in one transaction (QueueRepo.beat_many)."""
        from schedctl.storage.pipeline.workers import record_presence

        stored = [(_stored(lease), tail) for lease, tail in items]
        # a busy worker polls no more: its heartbeats say it is still there
        for lease, _tail in stored[:1]:
            record_presence(self.store, lease.tenant_id, lease.queue, lease.owner, lease_seconds)
        return list(self.repo.beat_many(stored, lease_seconds))

    def settle(self, lease: LeasedRun, settlement: Settlement) -> bool:
        result = self.settle_many([(lease, settlement)])[0]
        if isinstance(result, errors.StoreUnavailable):
            raise result
        return result

    def settle_many(
        self, items: Sequence[tuple[LeasedRun, Settlement]]
    ) -> list[bool | errors.StoreUnavailable]:
        """Every outcome in one transaction (QueueRepo.finish_many); StoreUnavailable for
        the whole batch when it could not commit."""
        from schedctl.storage.pipeline.queue import attempt_of

        stored = [_stored(lease) for lease, _ in items]
        return list(
            self.repo.finish_many(
                [(lease, attempt_of(lease, s)) for lease, (_, s) in zip(stored, items, strict=True)]
            )
        )

    def reap(self) -> int:
        return self.repo.expire_leases()

    def run_alert_commands(
        self,
        queue: str,
        owner: str,
        command: Sequence[str],
        command_for: Callable[[Any], Any] | None,
    ) -> bool:
        """From the database, for this backend's tenant (schedctl.app.alerts.command)."""
        from schedctl.app.alerts.command import run_alert_commands  # database workers only

        run_alert_commands(
            self.store,
            tenant_id=self.tenant_id,
            queue=queue,
            owner=owner,
            command=command,
            command_for=command_for,
        )
        return True


def _stored(lease: LeasedRun) -> StoredLease:
    from schedctl.storage.pipeline.queue import Lease as StoredLease

    assert isinstance(lease, StoredLease), "a lease is settled by the backend that leased it"
    return lease
