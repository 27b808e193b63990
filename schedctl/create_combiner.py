"""Owns combining concurrent single creates of one tenant into one batch transaction (group
commit): a tenant's creates serialize on its quota row lock anyway, so instead of N threads
queueing for that lock with a transaction each, the first becomes the leader and creates
what every waiting thread brought in one transaction (storage/job_create.py), in arrival
order, and each thread gets its own outcome, exactly as if they had run one after another
(a key or a name used twice is a replay or a conflict for the later one, quotas count in
order). The leader answers its own request after one round and hands the lead to the next
waiting thread, so no request waits for more than the rounds ahead of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from schedctl import errors, limits
from schedctl.models import Outcome
from schedctl.storage.job_create import NewJob

# a follower gives up after this long (the leader is stuck on the database); its job may
# still be created, which its idempotency key makes safe to retry
WAIT_SECONDS = 120.0


@dataclass(eq=False)
class _Waiter:
    item: NewJob
    woken: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to lead the next round
    outcome: Outcome | None = None
    error: BaseException | None = None


CreateMany = Callable[[Sequence[NewJob]], list[Outcome]]


class CreateCombiner:
    """`create(tenant_id, item, create_many)` -> the item's Outcome, created together with
    the same tenant's concurrent creates by one leader's `create_many(items)`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[_Waiter]] = {}
        self._leading: set[str] = set()

    def create(self, tenant_id: str, item: NewJob, create_many: CreateMany) -> Outcome:
        waiter = _Waiter(item)
        with self._lock:
            self._pending.setdefault(tenant_id, []).append(waiter)
            lead = tenant_id not in self._leading
            self._leading.add(tenant_id)
        if not lead:
            if not waiter.woken.wait(WAIT_SECONDS):
                with self._lock:
                    if not waiter.woken.is_set():  # still queued: leave the queue
                        queue = self._pending.get(tenant_id, [])
                        queue[:] = [w for w in queue if w is not waiter]
                        raise errors.StoreUnavailable(
                            f"the job was not created within {WAIT_SECONDS:.0f} s; "
                            "retry with the same idempotency key"
                        )
            lead = waiter.lead
        if lead:
            self._lead(tenant_id, waiter, create_many)
        if waiter.error is not None:
            raise waiter.error
        assert waiter.outcome is not None
        return waiter.outcome

    def _lead(self, tenant_id: str, own: _Waiter, create_many: CreateMany) -> None:
        """Rounds of up to MAX_BATCH_JOBS waiting creates until `own` is answered (its
        place in the queue bounds them), then the lead passes to the next waiter."""
        while own.outcome is None and own.error is None:
            with self._lock:
                queue = self._pending.get(tenant_id, [])
                group = queue[: limits.MAX_BATCH_JOBS]
                del queue[: len(group)]
            if not group:
                break  # own left the queue (it cannot: it waits for this very loop)
            try:
                outcomes = create_many([w.item for w in group])
            except BaseException as exc:  # every waiter of the round gets the error
                for waiter in group:
                    waiter.error = exc
            else:
                for waiter, outcome in zip(group, outcomes, strict=True):
                    waiter.outcome = outcome
            for waiter in group:
                if waiter is not own:
                    waiter.woken.set()
        with self._lock:
            queue = self._pending.get(tenant_id, [])
            if queue:
                queue[0].lead = True
                queue[0].woken.set()
            else:
                self._pending.pop(tenant_id, None)
                self._leading.discard(tenant_id)
