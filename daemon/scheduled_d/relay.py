"""The outbox relay: moves claimed runs from the outbox to their targets -- the built-in queue
(a move inside the database), HTTP endpoints and RabbitMQ brokers (deliveries with retries
and dead letters) -- and settles queue leases whose worker died.

Isolation: HTTP and RabbitMQ deliveries run in lanes, one per tenant and kind, each with
its own concurrency (tenants.delivery_concurrency) and the tenant's rate
(tenants.dispatch_rate_per_second). A lane claims only what its slots can start now, plus
one waiting batch per slot (so a fast lane never idles while its next claim is on the
way); a tenant whose endpoint hangs holds at most that, the rest of its backlog waits in
the outbox unclaimed, and every other lane keeps claiming and delivering. The calls run
outside any transaction: HTTP calls as coroutines on the HTTP client's one event loop thread
(schedctl.delivery.http), broker publishes on a thread pool; outcomes are written in
batches by one settler thread.

Leases and heartbeat: a claim leases its rows for `lease_seconds` (9 s by default); a
heartbeat thread extends, every lease/3, the leases of every row this relay holds -- waiting
for a slot, in flight, or delivered and not recorded yet -- in one statement. A relay that
dies (kill -9, a lost machine) stops extending, and another relay delivers its runs again
about one lease later, without the lease having to outlast the slowest call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter, Histogram

from schedctl import errors, retrying
from schedctl.alerts.lane import AlertLane
from schedctl.alerts.policy import AlertPolicy
from schedctl.config import Config
from schedctl.delivery.email import SmtpSettings
from schedctl.delivery.http import (
    DEFAULT_TIMEOUT_SECONDS,
    DeliveryResult,
    EncodedPayload,
    HttpDelivery,
    encode_payload,
)
from schedctl.delivery.limits import DeliveryLimits
from schedctl.delivery.rabbitmq import BrokerPool, Message
from schedctl.delivery.ssrf import Resolver
from schedctl.models import Lane, TargetType, Verdict
from schedctl.storage.backend.dialect import OUTBOX_WORD
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.payloads import decode_payload
from schedctl.storage.pipeline.outbox import Delivery, OutboxRepo, Outcome, TenantSettings
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.pipeline.settle import unexpected_error
from schedctl.storage.tenants.signing_secrets import SigningKeyCache
from scheduled_d.ready import ReadyListener

log = logging.getLogger(__name__)

# RabbitMQ publishes are quick: one slot publishes up to this many runs in a row.
RABBITMQ_PER_SLOT = 50
# After a slot frees, wait this long for others before claiming again: one claim
# transaction then refills several slots instead of one each.
REFILL_PAUSE_SECONDS = 0.002
# A lane with batches still waiting is refilled once this fraction of its slots' worth can
# be claimed (at 1/4 and a waiting batch per slot, the lane never runs dry meanwhile).
REFILL_FRACTION = 4
SETTLE_BATCH = 500
# Built-in queue rows moved per transaction: the move is set-based in the database (a few
# statements whatever the size), so a big batch costs little more than a small one; 500 was
# a fifth of a burst's time in per-transaction overhead.
QUEUE_MOVE_BATCH = 5000
# how long the settler waits for more outcomes before it records a batch
SETTLE_GATHER_SECONDS = 0.04
# How long a claimed row is this relay's without a heartbeat; the heartbeat runs every third
# of it. A stopped relay's runs are delivered again about this long after it stopped.
DEFAULT_LEASE_SECONDS = 9.0
HEARTBEAT_FRACTION = 1 / 3
# leases extended per statement
EXTEND_BATCH = 5000
# labelled metric children kept by _record (tenant, kind, verdict)
MAX_METRIC_CHILDREN = 10_000
# encoded payloads kept for HTTP deliveries: how many, and up to what stored size
PAYLOAD_CACHE_ENTRIES = 256
PAYLOAD_CACHE_MAX_CHARS = 4096


def lease_margin(lease_seconds: float) -> float:
    """How much shorter than the lease an HTTP call's deadline is: a call started right
    after a heartbeat ends, and its outcome is recorded, before the lease runs out even if
    no further heartbeat gets through."""
    return max(1.0, lease_seconds / 5)


DELIVERIES = Counter(
    "scheduled_relay_deliveries",
    "HTTP and RabbitMQ delivery attempts by tenant, kind and verdict",
    ["tenant", "kind", "verdict"],
)
DELIVERY_SECONDS = Histogram(
    "scheduled_relay_delivery_seconds",
    "Duration of one delivery attempt (HTTP call or broker publish with confirm)",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def _per_slot(lane: Lane) -> int:
    return RABBITMQ_PER_SLOT if lane.kind == TargetType.rabbitmq else 1


@dataclass
class RelayStats:
    delivered: int = 0  # attempts that succeeded
    retried: int = 0  # attempts that failed and will be tried again
    dead: int = 0  # runs dead-lettered
    skipped: int = 0  # runs of cancelled jobs, not delivered
    lost: int = 0  # leases of a stopped relay: lost attempts, retried per policy
    stale: int = 0  # outcomes whose lease had moved on (another relay took over)
    routed: int = 0  # queue rows routed to a tenant's RabbitMQ lane


class Relay:
    """Polls the outbox every `poll_seconds` (or at once after `wake()`).

    - batch_size: built-in queue rows moved per transaction.
    - reap_seconds: how often expired built-in queue leases are settled.
    - http_timeout: the wall-clock deadline of one HTTP call; broker operations use it too
      (default: 7 s, or less than lease_seconds by lease_margin when only that is given).
    - max_in_flight: deliveries running at once in this relay, all tenants together.
    - default_concurrency: slots of a lane whose tenant setting is not loaded yet.
    - lease_seconds: how long a claimed row is this relay's without a heartbeat (default
      9 s, at least the deadline plus lease_margin); after that another relay may deliver
      it again. heartbeat_seconds: how often the leases held are extended (lease/3).
    - settings_seconds: how often tenant limits, brokers and allow-lists are re-read.
    - resolver / ca_bundle: for HTTP delivery (tests inject a resolver).
    Several relays may run at once: every claim is SKIP LOCKED (Postgres) and leased.
    """

    def __init__(
        self,
        store: Store,
        *,
        batch_size: int = QUEUE_MOVE_BATCH,
        poll_seconds: float = 0.2,
        reap_seconds: float = 1.0,
        http_timeout: float | None = None,
        max_in_flight: int = 256,
        default_concurrency: int = 16,
        lease_seconds: float | None = None,
        heartbeat_seconds: float | None = None,
        settings_seconds: float = 2.0,
        owner: str | None = None,
        resolver: Resolver | None = None,
        ca_bundle: str | None = None,
        http: HttpDelivery | None = None,
        smtp: SmtpSettings | None = None,
        alert_poll_seconds: float = 1.0,
        alert_policy: AlertPolicy | None = None,
    ) -> None:
        self.store = store
        self.repo = QueueRepo(store)
        self.outbox = OutboxRepo(store)
        # the secrets deliveries are signed with (decrypted; two during a rotation's grace)
        self.signing = SigningKeyCache(store)
        self.batch_size = batch_size
        self.poll_seconds = poll_seconds
        self.reap_seconds = reap_seconds
        self.settings_seconds = settings_seconds
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if lease_seconds is not None and lease_seconds <= 0:
            raise errors.ConfigError("must be positive", field="relay_lease_seconds")
        if http is not None:
            timeout = http.timeout
        elif http_timeout is not None:
            timeout = http_timeout
        elif lease_seconds is not None:
            timeout = min(
                DEFAULT_TIMEOUT_SECONDS,
                max(lease_seconds - lease_margin(lease_seconds), lease_seconds / 2),
            )
        else:
            timeout = DEFAULT_TIMEOUT_SECONDS
        self.http = http or HttpDelivery(timeout=timeout, resolver=resolver, ca_bundle=ca_bundle)
        if lease_seconds is None:
            # long enough that the deadline is shorter by lease_margin
            lease_seconds = max(
                DEFAULT_LEASE_SECONDS, self.http.timeout + 1.0, self.http.timeout * 1.25
            )
        elif self.http.timeout > lease_seconds - lease_margin(lease_seconds):
            log.warning(
                "relay: the HTTP deadline (%g s) is not shorter than the lease (%g s) by "
                "%g s: a call outlives its lease unless a heartbeat gets through meanwhile",
                self.http.timeout,
                lease_seconds,
                lease_margin(lease_seconds),
            )
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds or lease_seconds * HEARTBEAT_FRACTION
        if not 0 < self.heartbeat_seconds < self.lease_seconds:
            raise errors.ConfigError(
                f"the heartbeat ({self.heartbeat_seconds:g} s) must be shorter than the lease "
                f"({self.lease_seconds:g} s)",
                field="heartbeat_seconds",
            )
        self.brokers = BrokerPool(timeout=self.http.timeout)
        self.limits = DeliveryLimits(
            max_in_flight=max_in_flight, default_concurrency=default_concurrency
        )
        self.moved = 0
        self.reaped = 0
        self.store_errors = 0  # passes that found the database unavailable
        self.stats = RelayStats()
        self._metric_children: dict[tuple[str, TargetType, Verdict], tuple[Any, Any]] = {}
        self._payloads: dict[str, EncodedPayload] = {}  # _encoded_payload's
        self._wake = threading.Event()
        self._freed = threading.Event()
        self._next_reap = 0.0
        self._next_settings = 0.0
        self._tenants: dict[str, TenantSettings] = {}
        self._rotation = 0
        # broker slots; HTTP slots are coroutines on the HTTP client's loop
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="deliver")
        # HTTP slots started and not ended yet (close() waits for them), and their tasks
        self._async_slots = 0
        self._async_ended = threading.Condition(threading.Lock())
        self._async_tasks: set[asyncio.Task[None]] = set()
        # outcomes for the settler: a deque (an append is atomic) and an event set only when
        # it is not set already, instead of a queue.Queue, whose put takes a lock and
        # notifies a condition for every delivery
        self._outcomes: deque[Outcome] = deque()
        self._outcome_ready = threading.Event()
        self._unsettled = 0  # outcomes produced and not recorded yet
        self._unsettled_lock = threading.Lock()
        self._settler: threading.Thread | None = None
        self._settler_stop = threading.Event()
        self._closed = False
        self._closing = threading.Event()
        # batches claimed and waiting for a slot of their lane, and the slots running
        self._queued: dict[Lane, deque[list[Delivery]]] = {}
        self._running: dict[Lane, int] = {}
        self._queue_lock = threading.Lock()
        self._drained: set[Lane] = set()  # lanes whose last claim found less than it asked
        self._last_active: dict[Lane, float] = {}  # when a slot of the lane last finished
        # leases claimed and not settled yet: (outbox id, lease token) -> outbox id
        self._held: dict[tuple[int, str], int] = {}
        self._held_lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_stop = threading.Event()
        self.extended = 0  # leases extended by the heartbeat
        self.heartbeat_errors = 0
        # alerts go in a lane (thread) of their own: a slow SMTP server holds up no delivery
        self.alerts = AlertLane(
            store,
            http=self.http,
            signing=self.signing,
            smtp=smtp or SmtpSettings(host=None),
            owner=self.owner,
            poll_seconds=alert_poll_seconds,
            policy=alert_policy,
        )

    @classmethod
    def from_config(cls, store: Store, config: Config, **options: Any) -> Relay:
        """A relay with the configuration's lease, HTTP deadline, in-flight cap and CA
        bundle (unset keys keep the defaults); `options` override (tests)."""
        settings: dict[str, Any] = {
            "lease_seconds": config.relay_lease_seconds,
            "http_timeout": config.http_timeout_seconds,
            "max_in_flight": config.relay_max_in_flight,
            "ca_bundle": config.http_ca_bundle,
            "smtp": SmtpSettings(
                host=config.smtp_host,
                port=config.smtp_port,
                sender=config.smtp_from,
                starttls=config.smtp_starttls,
                credentials_file=config.smtp_credentials_file,
            ),
            "alert_policy": config.alert_policy,
        }
        settings.update(options)
        return cls(store, **settings)

    # -- control -----------------------------------------------------------------------------

    def wake(self) -> None:
        """New outbox rows were committed: relay them now instead of at the next poll."""
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """Relay until `stop` is set, then finish the deliveries in flight (each is bounded
        by the HTTP timeout) and record them; database outages are waited out."""
        self._start_settler()
        self.alerts.start()
        backoff = retrying.Backoff(retrying.STORE_UNAVAILABLE)
        unavailable = False
        # word of new outbox rows (Postgres): a claim's HTTP runs go out at once, not at
        # the next poll
        feed = self.store.dialect.ready_feed(self.store.engine, OUTBOX_WORD)
        listener = ReadyListener(feed, self.wake, "relay-listen") if feed is not None else None
        try:
            last_full = float("-inf")
            while not stop.is_set():
                # a freed slot alone only refills lanes; the rest runs on wake() and at
                # least once per poll interval, however busy the lanes are
                full = (
                    self._wake.is_set()
                    or not self._freed.is_set()
                    or time.monotonic() - last_full >= self.poll_seconds
                )
                if full:
                    last_full = time.monotonic()
                # cleared before the pass: a wake() during it makes the next wait return
                self._wake.clear()
                self._freed.clear()
                try:
                    moved = self.run_once() if full else self.pump(every_lane=False)
                except errors.StoreUnavailable as exc:
                    self.store_errors += 1
                    if not unavailable:
                        log.warning("relay: database unavailable: %s; retrying", exc)
                    unavailable = True
                    backoff.wait(stop)
                    continue
                if unavailable:
                    log.info("relay: database reachable again")
                    unavailable = False
                    backoff.reset()
                if moved >= self.batch_size:
                    continue  # a full batch: more are probably waiting
                self._sleep(stop)
        finally:
            if listener is not None:
                listener.close()
            self.close()

    def _sleep(self, stop: threading.Event) -> None:
        """Until the poll interval passes, wake() is called, or a delivery slot frees up
        (then a short pause, so one claim refills several slots)."""
        deadline = time.monotonic() + self.poll_seconds
        while not stop.is_set() and not self._wake.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._freed.wait(min(left, 0.05)):
                time.sleep(REFILL_PAUSE_SECONDS)
                return

    def close(self) -> None:
        """Stop taking work, wait for the deliveries in flight, record their outcomes."""
        if self._closed:
            return
        self._closed = True
        # batches not started yet go back to the outbox at once; calls under way finish
        self._closing.set()
        with self._queue_lock:
            waiting = [d for batches in self._queued.values() for b in batches for d in b]
            self._queued.clear()
        self._pool.shutdown(wait=True)
        # each ends after its call under way, which its deadline bounds
        with self._async_ended:
            self._async_ended.wait_for(lambda: self._async_slots == 0, self.http.timeout + 5)
        try:
            self.outbox.release(waiting)
        except errors.StoreUnavailable as exc:
            log.warning("relay: could not give back %d lease(s): %s", len(waiting), exc)
        self._let_go(waiting)
        self._settler_stop.set()
        if self._settler is not None:
            self._settler.join()
        self._settle_pending()  # anything the settler did not get to
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        self.alerts.stop()
        self.brokers.close()
        self.http.close()
        log.info(
            "relay %s: stopped (%d moved, %d delivered, %d retried, %d dead)",
            self.owner,
            self.moved,
            self.stats.delivered,
            self.stats.retried,
            self.stats.dead,
        )

    # -- one pass ----------------------------------------------------------------------------

    def run_once(self) -> int:
        """One full pass: refresh tenant settings when due, route broker tenants' queue
        rows, move a batch of built-in queue rows, reap expired queue leases when due, and
        start the deliveries that have a free slot. Returns the queue rows moved."""
        self._refresh_settings()
        brokers = [t.tenant_id for t in self._tenants.values() if t.broker_url]
        if brokers:
            routed = self.outbox.route_broker_rows(brokers)
            self.stats.routed += routed
        moved = self.repo.move_outbox(self.batch_size, exclude_tenants=brokers)
        self.moved += moved
        if time.monotonic() >= self._next_reap:
            reaped = self.repo.expire_leases(self.batch_size)
            self.reaped += reaped
            if reaped:
                log.info("relay: settled %d expired queue lease(s)", reaped)
            self._next_reap = time.monotonic() + self.reap_seconds
        self.pump()
        return moved

    @property
    def routes_brokers(self) -> bool:
        """Whether a tenant's built-in queues are a RabbitMQ broker: its queue runs wait in
        the outbox for this relay to route them."""
        return any(t.broker_url for t in self._tenants.values())

    def _refresh_settings(self, force: bool = False) -> None:
        if not force and time.monotonic() < self._next_settings:
            return
        tenants = {t.tenant_id: t for t in self.outbox.tenant_settings()}
        self.signing.refresh()
        for tenant in tenants.values():
            self.limits.configure(
                tenant.tenant_id,
                rate_per_second=tenant.rate_per_second,
                concurrency=tenant.concurrency,
            )
        self._tenants = tenants
        self._next_settings = time.monotonic() + self.settings_seconds

    def _lanes(self) -> list[Lane]:
        lanes = []
        for tenant in self._tenants.values():
            lanes.append(Lane(tenant.tenant_id, TargetType.http))
            if tenant.broker_url:
                lanes.append(Lane(tenant.tenant_id, TargetType.rabbitmq))
        # a different lane goes first each pass: when the whole relay is at max_in_flight,
        # the slots that free up are shared round-robin, not always won by the first tenant
        if lanes:
            self._rotation = (self._rotation + 1) % len(lanes)
            lanes = lanes[self._rotation :] + lanes[: self._rotation]
        return lanes

    def pump(self, *, every_lane: bool = True) -> int:
        """Claim what the lanes can start now or right after, hand it to their slots;
        returns the number of runs claimed. With every_lane=False (a slot just freed) only
        lanes that had more than they could take last time, or delivered within the last
        poll interval, are asked again: idle tenants cost one probe per poll, not one per
        delivery."""
        if self._closed:
            return 0
        self._start_settler()
        if not self._tenants:
            self._refresh_settings(force=True)
        caps: dict[Lane, int] = {}
        now = time.monotonic()
        for lane in self._lanes():
            if (
                not every_lane
                and lane in self._drained
                and now - self._last_active.get(lane, float("-inf")) > self.poll_seconds
            ):
                continue
            per_slot = _per_slot(lane)
            with self._queue_lock:
                queued = len(self._queued.get(lane, ()))
            rows = self.limits.capacity(lane, per_slot=per_slot, queued=queued)
            if not every_lane and queued and rows < self._refill_rows(lane, per_slot):
                # the lane still has batches waiting: let a few more slots free up, so that
                # one claim transaction refills many of them (claims cost several
                # statements whatever their size)
                continue
            if rows > 0:
                caps[lane] = rows
        claimed = self.outbox.claim(caps, self.owner, self.lease_seconds) if caps else None
        by_lane: dict[Lane, list[Delivery]] = {}
        if claimed is not None:
            self.stats.skipped += claimed.cancelled
            self.stats.lost += claimed.lost
            if claimed.lost:
                log.warning(
                    "relay: %d delivery lease(s) of a stopped relay expired: lost attempts",
                    claimed.lost,
                )
            self._hold(claimed.deliveries)
            for delivery in claimed.deliveries:
                by_lane.setdefault(delivery.lane, []).append(delivery)
            for lane, cap in caps.items():
                # fewer than asked: nothing more is due there until the next full pass
                if len(by_lane.get(lane, ())) + claimed.cancelled < cap:
                    self._drained.add(lane)
                else:
                    self._drained.discard(lane)
        with self._queue_lock:
            for lane, deliveries in by_lane.items():
                self.limits.take_tokens(lane.tenant_id, len(deliveries))
                waiting = self._queued.setdefault(lane, deque())
                per_slot = _per_slot(lane)
                for i in range(0, len(deliveries), per_slot):
                    waiting.append(deliveries[i : i + per_slot])
            # a slot per waiting batch, as far as the lane and the relay allow
            http_slots: list[Lane] = []
            for lane, waiting in list(self._queued.items()):
                started = self._running.get(lane, 0)
                while len(waiting) > started and self.limits.try_acquire(lane):
                    if lane.kind == TargetType.http:
                        http_slots.append(lane)
                    else:
                        self._pool.submit(self._slot, lane)
                    started += 1
                self._running[lane] = started
                if not waiting and not started:
                    del self._queued[lane]
                    self._running.pop(lane, None)
        if http_slots:
            self._start_http_slots(http_slots)
        return len(claimed.deliveries) if claimed is not None else 0

    def _refill_rows(self, lane: Lane, per_slot: int) -> int:
        """The smallest claim worth making for a lane that still has batches waiting: a
        quarter of its slots' worth (its waiting batches cover half of them meanwhile)."""
        return max(1, self.limits.concurrency(lane) // REFILL_FRACTION) * per_slot

    # -- delivering (HTTP: coroutines on the HTTP loop; RabbitMQ: pool threads) -------------

    def _start_http_slots(self, lanes: list[Lane]) -> None:
        """Start one slot per entry of `lanes` (their places taken already), as coroutines on
        the HTTP client's event loop (one thread does every call's I/O; broker slots run on
        the thread pool instead, pika blocks): one hand-over to the loop for all of them."""
        with self._async_ended:
            self._async_slots += len(lanes)
        try:
            self.http.loop.call_soon_threadsafe(self._spawn_http_slots, lanes)
        except Exception:
            with self._async_ended:
                self._async_slots -= len(lanes)
                self._async_ended.notify_all()
            for lane in lanes:
                self._slot_left(lane, True)
            raise

    def _spawn_http_slots(self, lanes: list[Lane]) -> None:
        """On the HTTP loop: a task per slot (kept referenced until it ends)."""
        loop = asyncio.get_running_loop()
        for lane in lanes:
            task = loop.create_task(self._http_slot(lane))
            self._async_tasks.add(task)
            task.add_done_callback(self._http_slot_ended)

    def _http_slot_ended(self, task: asyncio.Task[None]) -> None:
        self._async_tasks.discard(task)
        with self._async_ended:
            self._async_slots -= 1
            self._async_ended.notify_all()

    def _next_batch(self, lane: Lane) -> list[Delivery] | None:
        """The lane's next waiting batch, or None when the slot leaves (counted out of the
        lane's running slots in the same lock as the look: pump() never counts on a slot
        that is already leaving)."""
        with self._queue_lock:
            waiting = self._queued.get(lane)
            if self._closing.is_set() or not waiting:
                self._running[lane] = self._running.get(lane, 1) - 1
                return None
            return waiting.popleft()

    def _slot_left(self, lane: Lane, counted: bool) -> None:
        with self._queue_lock:
            if counted:
                self._running[lane] = self._running.get(lane, 1) - 1
            self._last_active[lane] = time.monotonic()
        self.limits.release(lane)
        self._freed.set()

    def _slot(self, lane: Lane) -> None:
        """One slot of a lane: deliver the lane's waiting batches until there are none."""
        counted = True
        try:
            while (batch := self._next_batch(lane)) is not None:
                try:
                    if lane.kind == TargetType.rabbitmq:
                        self._publish(batch)
                    else:
                        for delivery in batch:
                            self._guarded(self._call, delivery)
                except Exception:
                    # no more heartbeats for them: the leases expire and the next claim
                    # records a lost attempt each; nothing is lost
                    self._let_go(batch)
                    log.exception("relay: delivery to %s failed unexpectedly", lane)
            counted = False
        finally:
            self._slot_left(lane, counted)

    async def _http_slot(self, lane: Lane) -> None:
        """_slot for an HTTP lane, on the HTTP loop."""
        counted = True
        try:
            while (batch := self._next_batch(lane)) is not None:
                for delivery in batch:
                    started = datetime.now(UTC)
                    try:
                        await self._call_async(delivery, started)
                    except Exception as exc:  # like _guarded
                        log.exception(
                            "relay: delivery of %s failed unexpectedly", delivery.idempotency_key
                        )
                        self._record(
                            delivery,
                            DeliveryResult(Verdict.retry, error=unexpected_error(exc)),
                            started,
                        )
            counted = False
        finally:
            self._slot_left(lane, counted)

    def _http_call(self, delivery: Delivery) -> dict[str, Any] | DeliveryResult:
        """The HTTP delivery's keyword arguments, or a retryable result when the payload or
        the tenant's signing secret cannot be read."""
        try:
            payload = self._encoded_payload(delivery.stored_payload)
            secrets = self.signing.secrets_for(delivery.tenant_id)
        except errors.SchedError as exc:
            return DeliveryResult(Verdict.retry, error=str(exc))
        return {
            "url": delivery.target,
            "allow_list": delivery.allow_list,
            "secret": secrets,
            "job_id": delivery.job_id,
            "scheduled_at": delivery.scheduled_at,
            "attempt": delivery.attempt,
            "payload": payload,
        }

    def _encoded_payload(self, stored: str) -> EncodedPayload:
        """The stored payload decoded (decrypted) and encoded for the body, once per stored
        form: the runs of a job share it. Only small payloads are kept, and few of them (no
        lock: a dict's get and set are atomic, and a race only encodes one twice)."""
        found = self._payloads.get(stored)
        if found is None:
            found = encode_payload(decode_payload(stored))
            if len(stored) <= PAYLOAD_CACHE_MAX_CHARS:
                if len(self._payloads) >= PAYLOAD_CACHE_ENTRIES:
                    self._payloads.clear()  # a bound, not an eviction policy
                self._payloads[stored] = found
        return found

    async def _call_async(self, delivery: Delivery, started: datetime) -> None:
        call = self._http_call(delivery)
        if not isinstance(call, DeliveryResult):
            call = await self.http.deliver_async(**call)
        self._record(delivery, call, started)

    def _guarded(self, deliver: Callable[[Delivery], None], delivery: Delivery) -> None:
        """deliver(delivery), with any exception escaping it recorded as a retryable
        failed attempt naming its class: a bug in a delivery path costs attempts and ends
        in the dead letters, instead of sending the run again forever."""
        started = datetime.now(UTC)
        try:
            deliver(delivery)
        except Exception as exc:
            log.exception("relay: delivery of %s failed unexpectedly", delivery.idempotency_key)
            self._record(
                delivery, DeliveryResult(Verdict.retry, error=unexpected_error(exc)), started
            )

    def _call(self, delivery: Delivery) -> None:
        started = datetime.now(UTC)
        call = self._http_call(delivery)
        if not isinstance(call, DeliveryResult):
            call = self.http.deliver(**call)
        self._record(delivery, call, started)

    def _publish(self, deliveries: Sequence[Delivery]) -> None:
        url = deliveries[0].broker_url
        if not url:
            for delivery in deliveries:
                self._record(
                    delivery,
                    DeliveryResult(Verdict.retry, error="the tenant has no broker any more"),
                    datetime.now(UTC),
                )
            return
        try:
            with self.brokers.publisher(url) as publisher:
                broken: str | None = None
                for delivery in deliveries:
                    started = datetime.now(UTC)
                    if broken is not None:
                        # the broker just failed: do not spend a whole timeout per message
                        result = DeliveryResult(Verdict.retry, error=broken)
                    else:
                        try:
                            payload = decode_payload(delivery.stored_payload)
                            secrets = self.signing.secrets_for(delivery.tenant_id)
                        except errors.SchedError as exc:
                            result = DeliveryResult(Verdict.retry, error=str(exc))
                        else:
                            result = publisher.publish(
                                Message(
                                    queue=delivery.target,
                                    job_id=delivery.job_id,
                                    scheduled_at=delivery.scheduled_at,
                                    attempt=delivery.attempt,
                                    payload=payload,
                                    secret=secrets,
                                )
                            )
                            if result.verdict is Verdict.retry and "broker error" in (
                                result.error or ""
                            ):
                                broken = f"not tried: {result.error}"
                    self._record(delivery, result, started)
        except errors.SchedError as exc:
            for delivery in deliveries:
                self._record(
                    delivery, DeliveryResult(Verdict.retry, error=str(exc)), datetime.now(UTC)
                )
        except Exception as exc:
            # like _guarded (outcomes recorded already stay: settling keeps one per lease)
            log.exception("relay: publishing to %s failed unexpectedly", deliveries[0].lane)
            for delivery in deliveries:
                self._record(
                    delivery,
                    DeliveryResult(Verdict.retry, error=unexpected_error(exc)),
                    datetime.now(UTC),
                )

    def _metrics(self, delivery: Delivery, verdict: Verdict) -> tuple[Any, Any]:
        """The labelled counter and histogram of an outcome (labels() looked up once per
        tenant, kind and verdict, not per delivery)."""
        key = (delivery.tenant_id, delivery.kind, verdict)
        found = self._metric_children.get(key)
        if found is None:
            # labelled with the tenant's name (the relay's settings, re-read every few
            # seconds); its id until they have been read
            settings = self._tenants.get(delivery.tenant_id)
            tenant = settings.name if settings is not None else delivery.tenant_id
            found = (
                DELIVERIES.labels(tenant, delivery.kind, verdict.value),
                DELIVERY_SECONDS.labels(delivery.kind),
            )
            if len(self._metric_children) >= MAX_METRIC_CHILDREN:
                self._metric_children.clear()  # a bound: tenants come and go
            self._metric_children[key] = found
        return found

    def _record(self, delivery: Delivery, result: DeliveryResult, started: datetime) -> None:
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
        self._outcomes.append(
            Outcome(
                delivery=delivery,
                verdict=result.verdict,
                started_at=started,
                finished_at=datetime.now(UTC),
                error=result.error,
                detail=result.detail,
                retry_after=result.retry_after,
            )
        )
        if not self._outcome_ready.is_set():
            self._outcome_ready.set()

    # -- settling (one thread) ---------------------------------------------------------------

    def _start_settler(self) -> None:
        if self._settler is None:
            self._settler = threading.Thread(
                target=self._settle_loop, name="relay-settle", daemon=True
            )
            self._settler.start()
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop, name="relay-heartbeat", daemon=True
            )
            self._heartbeat.start()

    def _settle_loop(self) -> None:
        backoff = retrying.Backoff(retrying.STORE_UNAVAILABLE)
        pending: list[Outcome] = []
        while True:
            if not pending:
                if not self._outcomes:
                    self._outcome_ready.wait(0.05)
                    # cleared before the look: an outcome appended after it sets it again
                    self._outcome_ready.clear()
                    if not self._outcomes:
                        if self._settler_stop.is_set():
                            return
                        continue
                # a short pause for more: one transaction records many outcomes (each costs
                # several statements whatever its size; the leases are held meanwhile). A
                # sleep, not a wait on the queue: that would wake this thread (and hand it
                # the interpreter lock) once per outcome
                if not self._settler_stop.is_set():
                    time.sleep(SETTLE_GATHER_SECONDS)
            while len(pending) < SETTLE_BATCH and self._outcomes:
                pending.append(self._outcomes.popleft())
            try:
                self._settle(pending)
            except Exception as exc:  # this thread must not end: log it and retry
                # kept in memory and tried again; if this process stops meanwhile, the
                # leases expire and the runs are delivered again: at least once
                log.warning(
                    "relay: cannot record %d outcome(s): %s",
                    len(pending),
                    exc,
                    exc_info=not isinstance(exc, errors.StoreUnavailable),
                )
                if self._settler_stop.is_set():
                    self._forget(len(pending))
                    return
                backoff.wait(self._settler_stop)
                continue
            pending = []
            backoff.reset()

    def _settle(self, outcomes: Sequence[Outcome]) -> None:
        result = self.outbox.settle(outcomes)
        self._let_go([x.delivery for x in outcomes])
        self._forget(len(outcomes))
        self.stats.delivered += result.succeeded
        self.stats.retried += result.retried
        self.stats.dead += result.dead
        self.stats.stale += result.stale
        if result.dead:
            log.warning("relay: %d run(s) dead-lettered", result.dead)

    def _settle_pending(self) -> None:
        pending: list[Outcome] = []
        while self._outcomes:
            pending.append(self._outcomes.popleft())
        for start in range(0, len(pending), SETTLE_BATCH):
            try:
                self._settle(pending[start : start + SETTLE_BATCH])
            except errors.StoreUnavailable as exc:
                log.error(
                    "relay: could not record %d outcome(s) at shutdown: %s; they will be "
                    "delivered again when their leases expire",
                    len(pending) - start,
                    exc,
                )
                self._forget(len(pending) - start)
                return

    def _forget(self, count: int) -> None:
        with self._unsettled_lock:
            self._unsettled -= count

    # -- heartbeat (one thread) --------------------------------------------------------------

    def _hold(self, deliveries: Sequence[Delivery]) -> None:
        with self._held_lock:
            for d in deliveries:
                self._held[(d.outbox_id, d.lease)] = d.outbox_id

    def _let_go(self, deliveries: Sequence[Delivery]) -> None:
        with self._held_lock:
            for d in deliveries:
                self._held.pop((d.outbox_id, d.lease), None)

    def held(self) -> int:
        """Leases claimed and not settled yet (what the heartbeat extends)."""
        with self._held_lock:
            return len(self._held)

    def _heartbeat_loop(self) -> None:
        while not self._heartbeat_stop.wait(self.heartbeat_seconds):
            self.heartbeat()

    def heartbeat(self) -> int:
        """Extend the leases of every run this relay holds (claimed, not settled); returns
        how many were extended. A failure is logged: the next beat tries again, and the
        lease has two more beats of slack."""
        with self._held_lock:
            ids = sorted(set(self._held.values()))
        extended = 0
        try:
            for start in range(0, len(ids), EXTEND_BATCH):
                extended += self.outbox.extend(
                    ids[start : start + EXTEND_BATCH], self.owner, self.lease_seconds
                )
        except errors.StoreUnavailable as exc:
            self.heartbeat_errors += 1
            log.warning("relay: cannot extend %d lease(s): %s", len(ids), exc)
        except Exception:
            self.heartbeat_errors += 1
            log.exception("relay: extending %d lease(s) failed", len(ids))
        self.extended += extended
        return extended

    # -- tests and benchmarks ----------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing waiting, nothing in flight and every outcome recorded."""
        with self._unsettled_lock:
            unsettled = self._unsettled
        with self._queue_lock:
            waiting = any(self._queued.values())
        return self.limits.in_flight == 0 and unsettled == 0 and not waiting
