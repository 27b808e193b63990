"""The dispatcher: preloads the next window of due runs of the partitions it owns into a
heap, fires each from memory at its time (by the database clock), claims in batches, and
paces catch-up per tenant."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from schedctl.coordination.base import Coordinator
from schedctl.core import errors, retrying
from schedctl.delivery.limits import TokenBucket
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.changes import ChangeFeed, open_change_feed
from schedctl.storage.pipeline.claim import Claimer, ClaimResult, DueJob
from schedctl.storage.tenants.tenants import TenantRepo
from scheduled_d import metrics

log = logging.getLogger(__name__)

CLOCK_RESYNC_SECONDS = 30.0
# the memory is rebuilt from the database this often even when nothing seems to change
FULL_RELOAD_SECONDS = 300.0
LATENESS_SAMPLES = 100_000
# Runs due within this of each other are claimed together: at a steady rate each run is due
# a few ms after the last, and waking for each one made a claim transaction per run or two
# (the claim's fixed cost then dominated `scheduled-d all`'s CPU). The price is at most
# this much lateness, against a 2 s promise.
CLAIM_LINGER_SECONDS = 0.02


@dataclass
class DispatcherStats:
    claimed: int = 0
    skipped: int = 0
    stale: int = 0
    fenced_batches: int = 0
    reloads: int = 0
    claims: int = 0  # claim transactions (batches)
    # seconds between each claimed run's fire time and its claim, newest last
    lateness: deque[float] = field(default_factory=lambda: deque(maxlen=LATENESS_SAMPLES))


class Dispatcher:
    """Claims due runs of owned partitions at their time; "now" is the database clock.

    Correctness never depends on the memory: every claim is fenced by epoch and
    conditional on the job version it read, so a stale heap entry just claims nothing.
    The memory is what makes it fast: one range read per window instead of a poll.
    """

    def __init__(
        self,
        store: Store,
        coordinator: Coordinator,
        *,
        owner: str,
        batch_size: int = 1000,
        poll_seconds: float = 0.25,
        window_seconds: float = 60.0,
        preload_limit: int = 200_000,
        catchup_after_seconds: float = 2.0,
        claim_threads: int = 2,
        on_claimed: Callable[[ClaimResult], None] | None = None,
        change_feed: ChangeFeed | None = None,
    ) -> None:
        self.store = store
        self.coordinator = coordinator
        self.claimer = Claimer(store, owner)
        self.batch_size = batch_size
        self.poll_seconds = poll_seconds
        self.window = timedelta(seconds=window_seconds)
        self.extend_seconds = max(0.5, window_seconds / 12)
        self.preload_limit = preload_limit
        self.catchup_after = timedelta(seconds=catchup_after_seconds)
        self.on_claimed = on_claimed
        # SQLite has one writer: parallel claims would only queue for its lock
        self.claim_threads = 1 if store.dialect.single_writer else claim_threads
        self._pool = ThreadPoolExecutor(self.claim_threads, thread_name_prefix="claim")
        self.stats = DispatcherStats()
        self._feed = change_feed
        self._wake = threading.Event()
        self._offset = 0.0
        self._offset_at = float("-inf")
        self._heap: list[tuple[datetime, int, DueJob]] = []
        self._seq = itertools.count()
        self._versions: dict[str, int] = {}  # the newest version seen per job in the heap
        self._loaded_for: Mapping[int, int] = {}
        self._horizon = datetime.min.replace(tzinfo=UTC)
        self._full_reload_at = float("-inf")
        self._extend_at = float("-inf")
        self._deferring = False
        self._buckets: dict[str, TokenBucket] = {}
        self._rates: dict[str, float] = {}

    # -- clock -------------------------------------------------------------------------

    def now(self) -> datetime:
        if time.monotonic() - self._offset_at > CLOCK_RESYNC_SECONDS:
            self._offset = self.store.clock_offset()
            self._offset_at = time.monotonic()
        return datetime.now(UTC) + timedelta(seconds=self._offset)

    def wake(self) -> None:
        """Ownership changed: look again now."""
        self._wake.set()

    # -- memory --------------------------------------------------------------------------

    def _push(self, due: DueJob) -> None:
        if self._versions.get(due.job_id, -1) > due.version:
            return
        self._versions[due.job_id] = due.version
        heapq.heappush(self._heap, (due.next_fire_at, next(self._seq), due))

    def reload(self, owned: Mapping[int, int]) -> None:
        """Forget the memory and load every run due within the window (start, ownership
        change, a missed notification, and now and then as a safety net)."""
        self._heap, self._versions = [], {}
        self._horizon = datetime.min.replace(tzinfo=UTC)
        self._loaded_for = dict(owned)
        self._full_reload_at = time.monotonic() + FULL_RELOAD_SECONDS
        self._load_rates()
        self.stats.reloads += 1
        self.extend(owned)

    def extend(self, owned: Mapping[int, int]) -> None:
        """Load what entered the window since the last load: small, frequent reads keep
        the firing loop from stalling behind one big load."""
        horizon = self.now() + self.window
        due = self.claimer.load_due(owned.keys(), horizon, self.preload_limit, after=self._horizon)
        for item in due:
            self._push(item)
        # a full page means there may be more before the horizon: load on from its end
        truncated = len(due) >= self.preload_limit
        self._horizon = due[-1].next_fire_at if truncated else horizon
        self._extend_at = time.monotonic() + (0.0 if truncated else self.extend_seconds)

    def _load_rates(self) -> None:
        self._rates = TenantRepo(self.store).dispatch_rates()

    def add_changed(self, job_ids: tuple[str, ...], owned: Mapping[int, int]) -> None:
        for item in self.claimer.load_jobs(job_ids, owned.keys(), self._horizon):
            self._push(item)

    # -- firing --------------------------------------------------------------------------

    def fire_due(self, owned: Mapping[int, int]) -> int:
        """Claim what is due now: up to one batch per claim thread, the batches in parallel
        (disjoint jobs, so they never wait for each other); returns how many were taken."""
        now = self.now()
        batch: list[DueJob] = []
        deferred: list[DueJob] = []
        limit = self.batch_size * self.claim_threads
        while self._heap and self._heap[0][0] <= now and len(batch) < limit:
            _, _, item = heapq.heappop(self._heap)
            if self._versions.get(item.job_id) != item.version or item.partition not in owned:
                continue
            if now - item.next_fire_at > self.catchup_after and not self._paced(item.tenant_id):
                deferred.append(item)  # catch-up beyond the tenant's rate: a little later
                continue
            batch.append(item)
        for item in deferred:
            heapq.heappush(self._heap, (item.next_fire_at, next(self._seq), item))
        self._deferring = bool(deferred)
        if not batch:
            return 0
        size = -(-len(batch) // self.claim_threads)
        chunks = [batch[i : i + size] for i in range(0, len(batch), size)]
        if len(chunks) == 1:
            results = [self.claimer.claim(batch, owned, now)]
        else:
            results = list(self._pool.map(lambda c: self.claimer.claim(c, owned, now), chunks))
        for chunk, result in zip(chunks, results, strict=True):
            self._settle(chunk, result, now)
        return len(batch)

    def _settle(self, chunk: list[DueJob], result: ClaimResult, now: datetime) -> None:
        self._account(result, chunk, now)
        if result.aborted:
            for item in chunk:  # nothing committed: try again
                heapq.heappush(self._heap, (item.next_fire_at, next(self._seq), item))
            return
        for item in chunk:
            self._versions.pop(item.job_id, None)
        for item in result.advanced:
            if item.next_fire_at <= self._horizon:
                self._push(item)
        if result.dispatched and self.on_claimed is not None:
            self.on_claimed(result)

    def _paced(self, tenant_id: str) -> bool:
        bucket = self._buckets.get(tenant_id)
        if bucket is None:
            bucket = self._buckets[tenant_id] = TokenBucket(self._rates.get(tenant_id, 1000.0))
        return bucket.take(1) == 1

    def _account(self, result: ClaimResult, batch: list[DueJob], now: datetime) -> None:
        self.stats.claims += 1
        self.stats.claimed += len(result.dispatched)
        self.stats.skipped += result.skipped
        self.stats.stale += result.stale
        metrics.CLAIMS.inc(len(result.dispatched))
        metrics.SKIPPED.inc(result.skipped)
        metrics.STALE.inc(result.stale)
        metrics.FENCED.inc(1 if result.fenced else 0)
        if result.fenced:
            self.stats.fenced_batches += 1
            log.warning("fenced off partitions %s: another owner has them", sorted(result.fenced))
        fire_at = {d.job_id: d.next_fire_at for d in batch}
        for job_id, _scheduled_at in result.dispatched:
            if job_id in fire_at:
                lateness = (now - fire_at[job_id]).total_seconds()
                self.stats.lateness.append(lateness)
                metrics.DISPATCH_LATENESS.observe(max(lateness, 0.0))

    # -- loop ----------------------------------------------------------------------------

    def _sleep_seconds(self) -> float:
        timeout = self.poll_seconds
        if self._deferring:
            return min(timeout, 0.05)  # paced catch-up: tokens come back continuously
        if self._heap:
            until_next = (self._heap[0][0] - self.now()).total_seconds()
            timeout = min(timeout, max(until_next, CLAIM_LINGER_SECONDS))
        return max(timeout, 0.0)

    def run_once(self, feed: ChangeFeed) -> int:
        owned = self.coordinator.owned()
        metrics.OWNED_PARTITIONS.set(len(owned))
        metrics.MAX_EPOCH.set(max(owned.values(), default=0))
        metrics.PRELOADED.set(len(self._heap))
        if not owned:
            self._heap, self._versions, self._loaded_for = [], {}, {}
            self._wake.wait(self.poll_seconds)
            self._wake.clear()
            return 0
        if owned != self._loaded_for or time.monotonic() >= self._full_reload_at:
            self.reload(owned)
        elif time.monotonic() >= self._extend_at:
            self.extend(owned)
        fired = self.fire_due(owned)
        if fired >= self.batch_size * self.claim_threads:
            return fired  # more is due: no waiting
        if self._wake.is_set():
            self._wake.clear()
            return fired
        changes = feed.wait(self._sleep_seconds())
        if changes.reload:
            self._full_reload_at = float("-inf")
        elif changes.job_ids:
            self.add_changed(changes.job_ids, owned)
        return fired

    def run(self, stop: threading.Event) -> None:
        feed = self._feed or open_change_feed(self.store, self.poll_seconds)
        log.info("dispatcher started")
        backoff = retrying.Backoff(retrying.STORE_UNAVAILABLE)
        try:
            while not stop.is_set():
                try:
                    self.run_once(feed)
                except errors.StoreUnavailable as exc:
                    log.warning("database unavailable, retrying: %s", exc)
                    self._full_reload_at = float("-inf")
                    backoff.wait(stop)
                    continue
                backoff.reset()
        finally:
            feed.close()
            self._pool.shutdown(wait=True)
        log.info("dispatcher stopped (claimed %d runs)", self.stats.claimed)
