"""Owns RabbitMQ delivery: publishing runs to a tenant's broker with publisher confirms and
persistent messages.

Design: the queue target of a job stays ``{"type": "queue", "name": "orders"}``; whether
it means the built-in queue or RabbitMQ is the *tenant's* setting (``schedctl tenant broker
TENANT amqp://user:pass@host:5672/vhost``, stored in tenants.broker_url). A tenant with a
broker gets every queue run published there, to the queue of that name (declared durable
when missing), so each tenant's broker or vhost is its own: no tenant can publish into
another's queues, and only operators choose where the scheduler connects.

A message is published on the default exchange with routing key = queue name,
``mandatory`` (an unroutable message is an error, not silently dropped), persistent
(delivery_mode 2), and the publish returns only after the broker confirmed it (confirm
mode): a run is marked delivered only once the broker has it. Body: the same JSON as the
HTTP target; properties: message_id = the idempotency key, content_type
application/json, and the signature headers of schedctl.core.signing, so a consumer can verify
and deduplicate exactly like an HTTP receiver (v2 signs method ``PUBLISH`` and the queue name
as the path: ``verify(secret, headers, body, method="PUBLISH", path=queue)``).

Connections are blocking (pika.BlockingConnection): one per publisher, a small pool per
broker, each publisher used by one thread at a time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]

from schedctl.core import errors, retrying
from schedctl.core.signing import BROKER_METHOD, signed_headers
from schedctl.delivery.http import DeliveryResult, delivery_body
from schedctl.domain.brokers import redact_url
from schedctl.domain.models import Verdict, run_key

log = logging.getLogger(__name__)
# pika logs every failed connection at ERROR with a traceback; the relay reports each failed
# attempt itself, once, with the run it concerns
logging.getLogger("pika").setLevel(logging.CRITICAL)

DEFAULT_TIMEOUT_SECONDS = 10.0
APP_ID = "scheduled-d"
PERSISTENT = 2


@dataclass(frozen=True)
class Message:
    """One run to publish."""

    queue: str
    job_id: str
    scheduled_at: datetime
    attempt: int
    payload: Any
    secret: str | tuple[str, ...]  # the current secret, then one in its grace period

    @property
    def idempotency_key(self) -> str:
        return run_key(self.job_id, self.scheduled_at)


class RabbitPublisher:
    """One connection and one confirm-mode channel to one broker; not thread-safe."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.url = url
        self.timeout = timeout
        self._connection: Any = None
        self._channel: Any = None
        self._declared: set[str] = set()
        self.last_used = time.monotonic()

    def _parameters(self) -> Any:
        parameters = pika.URLParameters(self.url)
        parameters.connection_attempts = 1
        parameters.socket_timeout = self.timeout
        parameters.stack_timeout = self.timeout * 2
        # a broker under a memory or disk alarm blocks publishers: give up instead of
        # hanging a delivery thread forever
        parameters.blocked_connection_timeout = self.timeout
        parameters.client_properties = {"connection_name": APP_ID}
        return parameters

    def _open(self) -> None:
        if self._connection is not None and self._connection.is_open:
            try:
                # answers heartbeats and notices a connection the broker closed while idle
                self._connection.process_data_events(0)
                if self._channel is not None and self._channel.is_open:
                    return
            except pika.exceptions.AMQPError:
                self.close()
        if self._connection is None or not self._connection.is_open:
            self._connection = pika.BlockingConnection(self._parameters())
            self._declared.clear()
        self._channel = self._connection.channel()
        self._channel.confirm_delivery()

    def _ensure_queue(self, queue: str) -> None:
        if queue in self._declared:
            return
        try:
            self._channel.queue_declare(queue=queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 404:
                raise
            # missing: create it durable, so the persistent messages survive a broker restart
            self._channel = self._connection.channel()
            self._channel.confirm_delivery()
            self._channel.queue_declare(queue=queue, durable=True)
        self._declared.add(queue)

    def publish(self, message: Message) -> DeliveryResult:
        """Publish and wait for the broker's confirm; never raises for broker trouble."""
        started = time.monotonic()
        body = delivery_body(message.job_id, message.scheduled_at, message.attempt, message.payload)
        headers = signed_headers(
            message.secret,
            body,
            message.idempotency_key,
            method=BROKER_METHOD,
            path=message.queue,
        )
        properties = pika.BasicProperties(
            content_type="application/json",
            delivery_mode=PERSISTENT,
            message_id=message.idempotency_key,
            timestamp=int(time.time()),
            app_id=APP_ID,
            headers={**headers, "X-Sched-Attempt": message.attempt},
        )

        def send() -> None:
            try:
                self._open()
                self._ensure_queue(message.queue)
                self._channel.basic_publish(
                    exchange="",
                    routing_key=message.queue,
                    body=body,
                    properties=properties,
                    mandatory=True,
                )
            except _CONNECTION_ERRORS as exc:
                if _connection_trouble(exc):
                    self.close()
                raise

        try:
            retrying.call_with_retries(
                send,
                policy=retrying.BROKER_RECONNECT,
                retry_on=_connection_trouble,
                # a pooled connection may have died while idle: one fresh connection is
                # part of the same attempt, not a retry
                attempts=1 if self._connection is None else 2,
            )
        except pika.exceptions.UnroutableError:
            self._declared.discard(message.queue)
            error = f"the broker returned the message: queue {message.queue!r} is missing"
        except pika.exceptions.NackError:
            error = "the broker refused the message (nack)"
        except _CONNECTION_ERRORS as exc:
            error = f"broker error: {type(exc).__name__}: {_text(exc)}"
        else:
            self.last_used = time.monotonic()
            return DeliveryResult(
                Verdict.succeeded,
                detail=f"confirmed by the broker into queue {message.queue!r}",
                seconds=time.monotonic() - started,
            )
        return DeliveryResult(Verdict.retry, error=error, seconds=time.monotonic() - started)

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._declared.clear()
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()


class BrokerPool:
    """Publishers per broker URL, at most `per_broker` of them; thread-safe borrowing."""

    def __init__(self, *, per_broker: int = 4, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.per_broker = per_broker
        self.timeout = timeout
        self._lock = threading.Condition()
        self._idle: dict[str, list[RabbitPublisher]] = {}
        self._count: dict[str, int] = {}
        self._closed = False

    @contextlib.contextmanager
    def publisher(self, url: str, wait: float | None = None) -> Iterator[RabbitPublisher]:
        """Borrow a publisher for `url` (waiting up to `wait` s for a free one)."""
        deadline = time.monotonic() + (wait if wait is not None else self.timeout * 3)
        with self._lock:
            while True:
                if self._closed:
                    raise errors.SchedError("the broker pool is closed")
                idle = self._idle.setdefault(url, [])
                if idle:
                    publisher = idle.pop()
                    break
                if self._count.get(url, 0) < self.per_broker:
                    self._count[url] = self._count.get(url, 0) + 1
                    publisher = RabbitPublisher(url, timeout=self.timeout)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.SchedError(f"no free connection to {redact_url(url)}")
                self._lock.wait(left)
        try:
            yield publisher
        finally:
            with self._lock:
                if self._closed:
                    publisher.close()
                else:
                    self._idle.setdefault(url, []).append(publisher)
                self._lock.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            publishers = [p for idle in self._idle.values() for p in idle]
            self._idle.clear()
            self._lock.notify_all()
        for publisher in publishers:
            publisher.close()


_CONNECTION_ERRORS = (pika.exceptions.AMQPError, OSError)


def _connection_trouble(exc: BaseException) -> bool:
    """A broken connection or channel (worth a fresh connection), not the broker's answer
    about this message (returned or refused, which a new connection would not change)."""
    answers = (pika.exceptions.UnroutableError, pika.exceptions.NackError)
    return isinstance(exc, _CONNECTION_ERRORS) and not isinstance(exc, answers)


def _text(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
