"""Owns `DirectBackend`, the operator worker's LeaseBackend: one tenant's queue in the
database, through schedctl.storage.queue.QueueRepo.

The database layer is imported only when a DirectBackend is made, so a tenant worker
(`--api`), which imports this module with the worker, loads no database code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schedctl.group_commit import GroupCommit
from schedctl.leasing import Beat, LeaseBackend, LeasedRun, Settlement

if TYPE_CHECKING:
    from schedctl.storage.queue import Lease as StoredLease
    from schedctl.storage.queue import QueueRepo
    from schedctl.storage.settle import Attempt
    from schedctl.storage.store import Store


class DirectBackend(LeaseBackend):
    """The operator worker's backend: the database, through QueueRepo, for one tenant's
    queue.

    - tenant: the tenant's name or id; may be left out while exactly one tenant exists
      (ConfigError otherwise: a worker guessing could run one tenant's runs with a command
      meant for another's).
    """

    def __init__(self, store: Store, tenant: str | None = None) -> None:
        from schedctl.storage.queue import QueueRepo, worker_tenant

        self.store = store
        self.repo: QueueRepo = QueueRepo(store)
        self.tenant_id = worker_tenant(store, tenant)
        # the outcomes of runs ending together are recorded in one transaction, each
        # caller still waiting for its own (QueueRepo.finish_many)
        self._settles: GroupCommit[tuple[StoredLease, Attempt], bool] = GroupCommit(
            self.repo.finish_many, name="worker-settle"
        )

    def lease(self, queue: str, owner: str, lease_seconds: float, limit: int) -> list[LeasedRun]:
        from schedctl.storage.workers import record_presence

        leases: list[LeasedRun] = list(
            self.repo.lease(queue, owner, lease_seconds, limit, tenant_id=self.tenant_id)
        )
        # a poll says this worker serves the queue (`schedctl status`); throttled
        record_presence(self.store, self.tenant_id, queue, owner, lease_seconds)
        return leases

    def beat(self, lease: LeasedRun, lease_seconds: float, output_tail: str | None = None) -> Beat:
        from schedctl.storage.workers import record_presence

        stored = _stored(lease)
        # a busy worker polls no more: its heartbeats say it is still there
        record_presence(self.store, stored.tenant_id, stored.queue, stored.owner, lease_seconds)
        return self.repo.beat(stored, lease_seconds, output_tail)

    def settle(self, lease: LeasedRun, settlement: Settlement) -> bool:
        from schedctl.storage.queue import attempt_of

        stored = _stored(lease)
        return self._settles.submit((stored, attempt_of(stored, settlement)))

    def reap(self) -> int:
        return self.repo.expire_leases()


def _stored(lease: LeasedRun) -> StoredLease:
    from schedctl.storage.queue import Lease as StoredLease

    assert isinstance(lease, StoredLease), "a lease is settled by the backend that leased it"
    return lease
