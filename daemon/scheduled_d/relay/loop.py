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

This module owns `Relay`, the polling loop and its passes; the package's other modules are
its components: lanes (what to claim, the batches waiting for a slot), senders (the slots
that deliver), settling (outcomes recorded), leases (the heartbeat), stats (its counts and
metrics). The alerts are schedctl.app.alerts.lane's, in a thread of their own.

Leases and heartbeat: a claim leases its rows for `lease_seconds` (9 s by default); a
heartbeat thread extends, every lease/3, the leases of every row this relay holds -- waiting
for a slot, in flight, or delivered and not recorded yet -- in one statement. A relay that
dies (kill -9, a lost machine) stops extending, and another relay delivers its runs again
about one lease later, without the lease having to outlast the slowest call.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from schedctl.app.alerts.lane import AlertLane
from schedctl.core import errors, retrying
from schedctl.core.ssrf import Resolver
from schedctl.delivery.email import SmtpSettings
from schedctl.delivery.http import DEFAULT_TIMEOUT_SECONDS, HttpDelivery
from schedctl.delivery.limits import DeliveryLimits
from schedctl.delivery.rabbitmq import BrokerPool
from schedctl.domain.alerts.policy import AlertPolicy
from schedctl.domain.config import Config
from schedctl.storage.backend.dialect import OUTBOX_WORD
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.outbox import OutboxRepo, TenantSettings
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.tenants.signing_secrets import SigningKeyCache
from scheduled_d.ready import ReadyListener
from scheduled_d.relay.lanes import Lanes
from scheduled_d.relay.leases import HeldLeases
from scheduled_d.relay.senders import Senders
from scheduled_d.relay.settling import Settler
from scheduled_d.relay.stats import RelayStats

log = logging.getLogger("scheduled_d.relay")

# After a slot frees, wait this long for others before claiming again: one claim
# transaction then refills several slots instead of one each.
REFILL_PAUSE_SECONDS = 0.002
# Built-in queue rows moved per transaction: the move is set-based in the database (a few
# statements whatever the size), so a big batch costs little more than a small one; 500 was
# a fifth of a burst's time in per-transaction overhead.
QUEUE_MOVE_BATCH = 5000
# How long a claimed row is this relay's without a heartbeat; the heartbeat runs every third
# of it. A stopped relay's runs are delivered again about this long after it stopped.
DEFAULT_LEASE_SECONDS = 9.0
HEARTBEAT_FRACTION = 1 / 3


def lease_margin(lease_seconds: float) -> float:
    """How much shorter than the lease an HTTP call's deadline is: a call started right
    after a heartbeat ends, and its outcome is recorded, before the lease runs out even if
    no further heartbeat gets through."""
    return max(1.0, lease_seconds / 5)


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
        self._wake = threading.Event()
        self._freed = threading.Event()
        self._next_reap = 0.0
        self._next_settings = 0.0
        self._tenants: dict[str, TenantSettings] = {}
        self._closed = False
        # the components, each with its own thread or threads, talking through public methods
        self._leases = HeldLeases(
            self.outbox, self.owner, self.lease_seconds, self.heartbeat_seconds
        )
        self._settler = Settler(self.outbox, self._leases, self.stats, self._tenant_name)
        self._lanes = Lanes(
            self.outbox,
            self.limits,
            self._leases,
            self.stats,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            poll_seconds=self.poll_seconds,
            freed=self._freed.set,
        )
        self._senders = Senders(
            self._lanes,
            self._settler,
            self._leases,
            http=self.http,
            brokers=self.brokers,
            signing=self.signing,
            max_in_flight=max_in_flight,
        )
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
        self._start()
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
        waiting = self._lanes.close()
        # each ends after its call under way, which its deadline bounds
        self._senders.close()
        try:
            self.outbox.release(waiting)
        except errors.StoreUnavailable as exc:
            log.warning("relay: could not give back %d lease(s): %s", len(waiting), exc)
        self._leases.let_go(waiting)
        self._settler.close()  # records what is left
        self._leases.stop()
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

    def pump(self, *, every_lane: bool = True) -> int:
        """Claim what the lanes can start now or right after, hand it to their slots;
        returns the number of runs claimed. With every_lane=False (a slot just freed) only
        lanes that had more than they could take last time, or delivered within the last
        poll interval, are asked again: idle tenants cost one probe per poll, not one per
        delivery."""
        if self._closed:
            return 0
        self._start()
        if not self._tenants:
            self._refresh_settings(force=True)
        claimed, slots = self._lanes.pump(self._tenants.values(), every_lane=every_lane)
        if slots:
            self._senders.start(slots)
        return claimed

    def _tenant_name(self, tenant_id: str) -> str:
        """The tenant's name (the settings, re-read every few seconds); its id until they
        have been read."""
        settings = self._tenants.get(tenant_id)
        return settings.name if settings is not None else tenant_id

    def _start(self) -> None:
        self._settler.start()
        self._leases.start()

    # -- heartbeat, tests and benchmarks ----------------------------------------------------

    @property
    def extended(self) -> int:
        """Leases extended by the heartbeat."""
        return self._leases.extended

    @property
    def heartbeat_errors(self) -> int:
        return self._leases.errors

    def held(self) -> int:
        """Leases claimed and not settled yet (what the heartbeat extends)."""
        return self._leases.count()

    def heartbeat(self) -> int:
        """Extend the leases of every run this relay holds (claimed, not settled); returns
        how many were extended. A failure is logged: the next beat tries again, and the
        lease has two more beats of slack."""
        return self._leases.extend()

    def idle(self) -> bool:
        """Nothing waiting, nothing in flight and every outcome recorded."""
        return (
            self.limits.in_flight == 0
            and self._settler.unsettled() == 0
            and not self._lanes.waiting()
        )
