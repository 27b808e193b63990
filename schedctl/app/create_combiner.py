"""Owns combining concurrent single creates of one tenant into batch transactions (group
commit): a tenant's creates serialize on its quota row lock anyway, so instead of N threads
queueing for that lock with a transaction each, a leader creates what every waiting thread
brought in one transaction (storage/jobs/job_create.py), in arrival order, and each thread gets
its own outcome, as if they had run one after another (a key or a name used twice is a
replay or a conflict for the later one, quotas count in order). A leader answers its own
request after one round and hands the lead to the next waiting thread, so no request waits
for more than the rounds ahead of it.

Two rounds of a tenant run at once (ROUNDS_AT_ONCE): while one holds the tenant's lock,
the next reads its keys and names and waits for the lock, instead of starting only when
the first has committed (with one, two clients took turns and made no more creates a
second than one). The two still commit one after the other; a key or a name that both
take makes the later one's insert fail, and its next pass sees the first's row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from schedctl.core import errors, limits
from schedctl.domain.models import CreateOutcome
from schedctl.storage.jobs.job_create import NewJob

# rounds of one tenant's creates in flight at once
ROUNDS_AT_ONCE = 2
# a follower gives up after this long (the leader is stuck on the database); its job may
# still be created, which its idempotency key makes safe to retry
WAIT_SECONDS = 120.0


@dataclass(eq=False)
class _Waiter:
    item: NewJob
    woken: threading.Event = field(default_factory=threading.Event)  # answered or to lead
    answered: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to lead the next round
    outcome: CreateOutcome | None = None
    error: BaseException | None = None


CreateMany = Callable[[Sequence[NewJob]], list[CreateOutcome]]


class CreateCombiner:
    """`create(tenant_id, item, create_many)` -> the item's CreateOutcome, created together with
    the same tenant's concurrent creates by one leader's `create_many(items)`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[_Waiter]] = {}
        self._leaders: dict[str, int] = {}  # tenant -> its leaders (at most ROUNDS_AT_ONCE)

    def create(self, tenant_id: str, item: NewJob, create_many: CreateMany) -> CreateOutcome:
        waiter = _Waiter(item)
        with self._lock:
            self._pending.setdefault(tenant_id, []).append(waiter)
            leaders = self._leaders.get(tenant_id, 0)
            lead = leaders < ROUNDS_AT_ONCE
            if lead:
                self._leaders[tenant_id] = leaders + 1
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
            if not waiter.answered.is_set():  # the other leader's round is stuck
                raise errors.StoreUnavailable(
                    f"the job was not created within {WAIT_SECONDS:.0f} s; "
                    "retry with the same idempotency key"
                )
        if waiter.error is not None:
            raise waiter.error
        assert waiter.outcome is not None
        return waiter.outcome

    def _lead(self, tenant_id: str, own: _Waiter, create_many: CreateMany) -> None:
        """Rounds of up to MAX_BATCH_JOBS waiting creates until `own` is answered (its
        place in the queue bounds them; the other leader's round may answer it), then the
        lead passes to the next waiter, or the tenant has one leader fewer."""
        while not own.answered.is_set():
            with self._lock:
                queue = self._pending.get(tenant_id, [])
                group = queue[: limits.MAX_BATCH_JOBS]
                del queue[: len(group)]
            if not group:
                # own is in the other leader's round, which answers it
                own.answered.wait(WAIT_SECONDS)
                break
            try:
                outcomes = create_many([w.item for w in group])
            except BaseException as exc:  # every waiter of the round gets the error
                for waiter in group:
                    waiter.error = exc
            else:
                for waiter, outcome in zip(group, outcomes, strict=True):
                    waiter.outcome = outcome
            for waiter in group:
                waiter.answered.set()
                if waiter is not own:
                    waiter.woken.set()
        with self._lock:
            queue = self._pending.get(tenant_id, [])
            # (the other leader may have handed the lead to the first waiter already)
            heir = next((w for w in queue if not w.lead), None)
            if heir is not None:
                heir.lead = True
                heir.woken.set()
            elif self._leaders[tenant_id] > 1:
                self._leaders[tenant_id] -= 1
            else:
                self._pending.pop(tenant_id, None)
                del self._leaders[tenant_id]
