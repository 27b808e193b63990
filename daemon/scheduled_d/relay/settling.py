"""Owns the relay's settler: each delivery attempt's outcome counted (metrics, log line),
then recorded in the outbox with the ones that ended together, in one transaction per
batch (a `Batcher`), retried while the database is away; recording lets go of the
leases."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from schedctl.core import errors, retrying
from schedctl.delivery.http import DeliveryResult
from schedctl.domain.models import TargetType, Verdict
from schedctl.storage.pipeline.outbox import Delivery, DeliveryOutcome, OutboxRepo
from scheduled_d.batching import Batcher
from scheduled_d.relay.leases import HeldLeases
from scheduled_d.relay.stats import DELIVERIES, DELIVERY_SECONDS, RelayStats

log = logging.getLogger("scheduled_d.relay")

SETTLE_BATCH = 500
# how long the settler waits for more outcomes before it records a batch
SETTLE_GATHER_SECONDS = 0.04
# labelled metric children kept by record (tenant, kind, verdict)
MAX_METRIC_CHILDREN = 10_000


class Settler:
    """Records delivery outcomes (`record`, from any thread; nobody waits) in `outbox`,
    lets go of their leases in `leases` and counts them in `stats`. `tenant_name` labels
    the metrics. A batch that cannot be recorded is kept and tried again until `close`:
    if the process stops meanwhile, the leases expire and the runs are delivered again
    (at least once)."""

    def __init__(
        self,
        outbox: OutboxRepo,
        leases: HeldLeases,
        stats: RelayStats,
        tenant_name: Callable[[str], str],
    ) -> None:
        self.outbox = outbox
        self.leases = leases
        self.stats = stats
        self._tenant_name = tenant_name
        self._metric_children: dict[tuple[str, TargetType, Verdict], tuple[Any, Any]] = {}
        self._unsettled = 0  # outcomes produced and not recorded yet
        self._unsettled_lock = threading.Lock()
        self._stop = threading.Event()
        self._batcher: Batcher[DeliveryOutcome] | None = None

    def start(self) -> None:
        """Start the settling thread (once)."""
        if self._batcher is None:
            # a short wait for more: one transaction records many outcomes (each costs
            # several statements whatever its size; the leases are held meanwhile)
            self._batcher = Batcher(
                self._settle_batch,
                "relay-settle",
                gather=SETTLE_BATCH,
                linger=SETTLE_GATHER_SECONDS,
                max_batch=SETTLE_BATCH,
            )

    def close(self) -> None:
        """Record what is left, each batch tried once more, then end the thread."""
        self._stop.set()
        if self._batcher is not None:
            self._batcher.close(timeout=None)

    def unsettled(self) -> int:
        """Outcomes produced and not recorded yet."""
        with self._unsettled_lock:
            return self._unsettled

    def _metrics(self, delivery: Delivery, verdict: Verdict) -> tuple[Any, Any]:
        """The labelled counter and histogram of an outcome (labels() looked up once per
        tenant, kind and verdict, not per delivery)."""
        key = (delivery.tenant_id, delivery.kind, verdict)
        found = self._metric_children.get(key)
        if found is None:
            # labelled with the tenant's name (the relay's settings, re-read every few
            # seconds); its id until they have been read
            found = (
                DELIVERIES.labels(
                    self._tenant_name(delivery.tenant_id), delivery.kind, verdict.value
                ),
                DELIVERY_SECONDS.labels(delivery.kind),
            )
            if len(self._metric_children) >= MAX_METRIC_CHILDREN:
                self._metric_children.clear()  # a bound: tenants come and go
            self._metric_children[key] = found
        return found

    def record(self, delivery: Delivery, result: DeliveryResult, started: datetime) -> None:
        counter, seconds = self._metrics(delivery, result.verdict)
        counter.inc()
        seconds.observe(result.seconds)
        if result.verdict is not Verdict.succeeded:
            log.info(
                "run %s attempt %d to %s: %s: %s",
                delivery.idempotency_key,
                delivery.attempt,
                delivery.kind,
                result.verdict.value,
                result.error,
            )
        with self._unsettled_lock:
            self._unsettled += 1
        outcome = DeliveryOutcome(
            delivery=delivery,
            verdict=result.verdict,
            started_at=started,
            finished_at=datetime.now(UTC),
            error=result.error,
            detail=result.detail,
            retry_after=result.retry_after,
        )
        batcher = self._batcher
        assert batcher is not None, "the relay starts its settler before it claims"
        batcher.submit((outcome,))

    def _settle_batch(self, outcomes: list[DeliveryOutcome]) -> None:
        """The settling thread's call: record, retrying while the database is away (kept
        in memory meanwhile); once closing, one try only."""
        backoff = retrying.Backoff(retrying.STORE_UNAVAILABLE)
        while True:
            try:
                self._settle(outcomes)
                return
            except Exception as exc:  # this thread must not end: log it and retry
                if self._stop.is_set():
                    log.error(
                        "relay: could not record %d outcome(s) at shutdown: %s; they will be "
                        "delivered again when their leases expire",
                        len(outcomes),
                        exc,
                        exc_info=not isinstance(exc, errors.StoreUnavailable),
                    )
                    self._forget(len(outcomes))
                    return
                log.warning(
                    "relay: cannot record %d outcome(s): %s",
                    len(outcomes),
                    exc,
                    exc_info=not isinstance(exc, errors.StoreUnavailable),
                )
                backoff.wait(self._stop)

    def _settle(self, outcomes: Sequence[DeliveryOutcome]) -> None:
        result = self.outbox.settle(outcomes)
        self.leases.let_go([x.delivery for x in outcomes])
        self._forget(len(outcomes))
        self.stats.delivered += result.succeeded
        self.stats.retried += result.retried
        self.stats.dead += result.dead
        self.stats.stale += result.stale
        if result.dead:
            log.warning("relay: %d run(s) dead-lettered", result.dead)

    def _forget(self, count: int) -> None:
        with self._unsettled_lock:
            self._unsettled -= count
