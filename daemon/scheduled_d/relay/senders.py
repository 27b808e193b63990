"""Owns the relay's delivering: the slots that take their lane's claimed batches
(scheduled_d.relay.lanes) and deliver them -- HTTP calls as coroutines on the HTTP
client's one event loop thread (schedctl.delivery.http), broker publishes on a thread pool
(pika blocks) -- and hand each attempt's outcome to the settler."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from schedctl.core import errors
from schedctl.delivery.http import DeliveryResult, EncodedPayload, HttpDelivery, encode_payload
from schedctl.delivery.rabbitmq import BrokerPool, Message
from schedctl.domain.models import Lane, TargetType, Verdict
from schedctl.storage.jobs.payloads import decode_payload
from schedctl.storage.pipeline.outbox import Delivery
from schedctl.storage.pipeline.settle import unexpected_error
from schedctl.storage.tenants.signing_secrets import SigningKeyCache
from scheduled_d.relay.lanes import Lanes
from scheduled_d.relay.leases import HeldLeases
from scheduled_d.relay.settling import Settler

log = logging.getLogger("scheduled_d.relay")

# encoded payloads kept for HTTP deliveries: how many, and up to what stored size
PAYLOAD_CACHE_ENTRIES = 256
PAYLOAD_CACHE_MAX_CHARS = 4096


class Senders:
    """Delivers what `lanes` hands its slots: over `http` (signed with `signing`'s
    secrets) or to a tenant's broker (`brokers`), at most `max_in_flight` broker slots at
    once; every outcome goes to `settler`. A batch lost to a bug lets go of its leases
    (they expire and the runs are claimed again)."""

    def __init__(
        self,
        lanes: Lanes,
        settler: Settler,
        leases: HeldLeases,
        *,
        http: HttpDelivery,
        brokers: BrokerPool,
        signing: SigningKeyCache,
        max_in_flight: int,
    ) -> None:
        self.lanes = lanes
        self.settler = settler
        self.leases = leases
        self.http = http
        self.brokers = brokers
        self.signing = signing
        self._payloads: dict[str, EncodedPayload] = {}  # _encoded_payload's
        # broker slots; HTTP slots are coroutines on the HTTP client's loop
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="deliver")
        # HTTP slots started and not ended yet (close() waits for them), and their tasks
        self._async_slots = 0
        self._async_ended = threading.Condition(threading.Lock())
        self._async_tasks: set[asyncio.Task[None]] = set()

    def start(self, lanes: Sequence[Lane]) -> None:
        """Start a slot per entry of `lanes` (their places taken already)."""
        http_slots: list[Lane] = []
        for lane in lanes:
            if lane.kind == TargetType.http:
                http_slots.append(lane)
            else:
                self._pool.submit(self._slot, lane)
        if http_slots:
            self._start_http_slots(http_slots)

    def close(self) -> None:
        """Wait for the calls under way (each bounded by its deadline)."""
        self._pool.shutdown(wait=True)
        with self._async_ended:
            self._async_ended.wait_for(lambda: self._async_slots == 0, self.http.timeout + 5)

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
                self.lanes.slot_left(lane, True)
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

    def _slot(self, lane: Lane) -> None:
        """One slot of a lane: deliver the lane's waiting batches until there are none."""
        counted = True
        try:
            while (batch := self.lanes.next_batch(lane)) is not None:
                try:
                    if lane.kind == TargetType.rabbitmq:
                        self._publish(batch)
                    else:
                        for delivery in batch:
                            self._guarded(self._call, delivery)
                except Exception:
                    # no more heartbeats for them: the leases expire and the next claim
                    # records a lost attempt each; nothing is lost
                    self.leases.let_go(batch)
                    log.exception("relay: delivery to %s failed unexpectedly", lane)
            counted = False
        finally:
            self.lanes.slot_left(lane, counted)

    async def _http_slot(self, lane: Lane) -> None:
        """_slot for an HTTP lane, on the HTTP loop."""
        counted = True
        try:
            while (batch := self.lanes.next_batch(lane)) is not None:
                for delivery in batch:
                    started = datetime.now(UTC)
                    try:
                        await self._call_async(delivery, started)
                    except Exception as exc:  # like _guarded
                        log.exception(
                            "relay: delivery of %s failed unexpectedly", delivery.idempotency_key
                        )
                        self.settler.record(
                            delivery,
                            DeliveryResult(Verdict.retry, error=unexpected_error(exc)),
                            started,
                        )
            counted = False
        finally:
            self.lanes.slot_left(lane, counted)

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
        self.settler.record(delivery, call, started)

    def _guarded(self, deliver: Callable[[Delivery], None], delivery: Delivery) -> None:
        """deliver(delivery), with any exception escaping it recorded as a retryable
        failed attempt naming its class: a bug in a delivery path costs attempts and ends
        in the dead letters, instead of sending the run again forever."""
        started = datetime.now(UTC)
        try:
            deliver(delivery)
        except Exception as exc:
            log.exception("relay: delivery of %s failed unexpectedly", delivery.idempotency_key)
            self.settler.record(
                delivery, DeliveryResult(Verdict.retry, error=unexpected_error(exc)), started
            )

    def _call(self, delivery: Delivery) -> None:
        started = datetime.now(UTC)
        call = self._http_call(delivery)
        if not isinstance(call, DeliveryResult):
            call = self.http.deliver(**call)
        self.settler.record(delivery, call, started)

    def _publish(self, deliveries: Sequence[Delivery]) -> None:
        url = deliveries[0].broker_url
        if not url:
            for delivery in deliveries:
                self.settler.record(
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
                    self.settler.record(delivery, result, started)
        except errors.SchedError as exc:
            for delivery in deliveries:
                self.settler.record(
                    delivery, DeliveryResult(Verdict.retry, error=str(exc)), datetime.now(UTC)
                )
        except Exception as exc:
            # like _guarded (outcomes recorded already stay: settling keeps one per lease)
            log.exception("relay: publishing to %s failed unexpectedly", deliveries[0].lane)
            for delivery in deliveries:
                self.settler.record(
                    delivery,
                    DeliveryResult(Verdict.retry, error=unexpected_error(exc)),
                    datetime.now(UTC),
                )
