"""Owns HTTP delivery: one signed POST of a run to its tenant's endpoint, through the SSRF
guard, within one wall-clock deadline per call, and what the answer means.

The request: ``POST`` of ``{"job_id", "scheduled_at", "attempt", "payload"}`` (compact JSON)
with ``Content-Type: application/json`` and the headers of schedctl.core.signing
(Idempotency-Key, X-Sched-Timestamp, X-Sched-Signature), signed with every secret given
(the tenant's current one, and its previous one during a rotation's grace period).

The deadline: the guard's check (name resolution included), connecting, the TLS handshake,
sending, the status line and headers and the body snippet share one wall-clock budget
(`timeout`), not a timeout per socket read: an endpoint that trickles a byte every half
second is cut off at the deadline, when the event loop cancels the call and closes its
connection. A deadline reached before the status arrived is a timeout (retry); one reached
while reading the body of a complete answer only cuts the snippet short.

The I/O: the project's own asyncio HTTP/1.1 client (schedctl.delivery.http_client, which
says why it is not a library's) on one event loop thread, with kept-alive connections
pooled per checked address. The connection goes to the address the SSRF guard checked
(never resolved again), the Host header, TLS SNI and certificate name are the URL's host.

The answer: 2xx succeeded. 408, 429, 5xx, a timeout or a network error: retry, after at
least the Retry-After the endpoint asked for (seconds or an HTTP date, capped at
MAX_RETRY_AFTER_SECONDS). A redirect is not followed and fails, like every other 4xx: the
same request would get the same answer again. A destination the guard refuses fails
without any connection being made.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import math
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from requests.utils import requote_uri

from schedctl import __version__
from schedctl.core import errors
from schedctl.core.signing import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature_header,
)
from schedctl.core.ssrf import (
    AllowList,
    Destination,
    GuardCache,
    Resolver,
    UnresolvableHost,
    hide_addresses,
    pinned_url,
)
from schedctl.core.ssrf import tls_name as tls_name_of
from schedctl.delivery.http_client import (
    NETWORK_ERRORS,
    Client,
    Connection,
    PoolKey,
    cause,
    read_body,
)
from schedctl.domain.models import Verdict
from schedctl.scheduling.timeparse import format_instant

# one deadline per call, connect to the end of the body snippet; shorter than the relay's
# default lease (9 s) by a margin
DEFAULT_TIMEOUT_SECONDS = 7.0
DEFAULT_CONNECT_TIMEOUT_SECONDS = 5.0
MAX_RETRY_AFTER_SECONDS = 3600.0
RETRY_STATUSES = frozenset({408, 429})
USER_AGENT = f"scheduled-d/{__version__} (+schedctl)"


@dataclass(frozen=True)
class DeliveryResult:
    verdict: Verdict
    status: int | None = None  # the HTTP status, when there was an answer
    error: str | None = None  # why it did not succeed
    detail: str | None = None  # what the endpoint said (for the run history)
    retry_after: float | None = None  # seconds the endpoint asked us to wait
    seconds: float = 0.0  # how long the call took


@dataclass(frozen=True)
class EncodedPayload:
    """A payload already in its compact JSON form (`encode_payload`): delivery_body puts it
    in as it is, so a relay encodes each job's payload once, not once per delivery."""

    text: str = field(repr=False)


def encode_payload(payload: Any) -> EncodedPayload:
    """The payload as delivery_body would encode it inside the document."""
    return EncodedPayload(json.dumps(payload, separators=(",", ":"), ensure_ascii=False))


def delivery_body(job_id: str, scheduled_at: datetime, attempt: int, payload: Any) -> bytes:
    """The exact bytes POSTed (and signed). An EncodedPayload gives the same bytes as the
    payload it encodes."""
    return _body_bytes(job_id, _instant(scheduled_at), attempt, payload)


def _instant(scheduled_at: datetime) -> str:
    """format_instant, without its conversions for the instants the database gives (in UTC
    already): isoformat's "+00:00" becomes the "Z"."""
    if scheduled_at.tzinfo is UTC:
        return scheduled_at.isoformat()[:-6] + "Z"
    return format_instant(scheduled_at)


# the start of the document per job id, up to the instant's opening quote (runs of a job
# share it); bounded like the relay's payload cache
_PREFIXES: dict[str, str] = {}
MAX_PREFIXES = 4096


def _body_bytes(job_id: str, stamp: str, attempt: int, payload: Any) -> bytes:
    if isinstance(payload, EncodedPayload):
        # the document json.dumps would make, key by key, with the payload as encoded: an
        # RFC 3339 instant and an int need no escaping
        prefix = _PREFIXES.get(job_id)
        if prefix is None:
            if len(_PREFIXES) >= MAX_PREFIXES:
                _PREFIXES.clear()  # a bound, not an eviction policy
            prefix = _PREFIXES[job_id] = (
                f'{{"job_id":{json.dumps(job_id, ensure_ascii=False)},"scheduled_at":"'
            )
        number = str(attempt) if type(attempt) is int else json.dumps(attempt)
        return f'{prefix}{stamp}","attempt":{number},"payload":{payload.text}}}'.encode()
    document = {
        "job_id": job_id,
        "scheduled_at": stamp,
        "attempt": attempt,
        "payload": payload,
    }
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date), capped."""
    if not value:
        return None
    text = value.strip()
    # ASCII only: str.isdigit() is also true for "²", which float() refuses
    if text.isascii() and text.isdigit():
        seconds = float(text)
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def classify(status: int) -> Verdict:
    if 200 <= status < 300:
        return Verdict.succeeded
    if status in RETRY_STATUSES or status >= 500:
        return Verdict.retry
    return Verdict.failed


class HttpDelivery:
    """Delivers runs over HTTP; one instance is shared by the relay's lanes and its alert lane.

    The calls run on one event loop, in a thread of this object's own (started on first use):
    `deliver_async` is for coroutines on that loop (`loop`), `deliver` for any other thread.
    Kept-alive connections are pooled per checked address and TLS name.

    - timeout: the wall-clock deadline of one call, from its start (the guard's name
      resolution counts against it) to the end of the body snippet; connect_timeout: at most
      this for the TCP connect.
    - resolver: how host names become addresses (tests inject one); answers are cached for
      ssrf.DNS_CACHE_SECONDS.
    - ca_bundle: a PEM file of the CAs to check endpoints against, instead of the bundled
      public ones (certifi), for endpoints with a private CA.
    - pool_size: idle connections kept per destination address.
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        connect_timeout: float | None = None,
        resolver: Resolver | None = None,
        ca_bundle: str | None = None,
        pool_size: int = 256,
        user_agent: str = USER_AGENT,
    ) -> None:
        if timeout <= 0:
            raise errors.ConfigError("must be positive", field="http_timeout")
        self.timeout = timeout
        self.connect_timeout = min(
            connect_timeout if connect_timeout is not None else DEFAULT_CONNECT_TIMEOUT_SECONDS,
            timeout,
        )
        self.resolver = resolver
        self.ca_bundle = ca_bundle
        self.user_agent = user_agent
        self.pool_size = pool_size
        self._guard = GuardCache(resolver)
        self._routes: dict[tuple[str, Hashable], tuple[float, _Route]] = {}
        self._client = Client(
            connect_timeout=self.connect_timeout, ca_bundle=ca_bundle, pool_size=pool_size
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    # -- the loop ------------------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the calls run on (its thread starts on first use)."""
        with self._lock:
            if self._closed:
                raise errors.SchedError("the HTTP client is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=run, name="http-loop", daemon=True)
                self._thread.start()
                ready.wait(10)
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Close the pooled connections and stop the loop (calls under way are cut)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._client.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not thread.is_alive():
            loop.close()

    def deliver(self, **call: Any) -> DeliveryResult:
        """deliver_async from a thread that is not the loop's (same keyword arguments)."""
        return asyncio.run_coroutine_threadsafe(self.deliver_async(**call), self.loop).result()

    # -- one call ------------------------------------------------------------------------------

    async def deliver_async(
        self,
        *,
        url: str,
        allow_list: AllowList | Iterable[str],
        secret: str | Sequence[str],
        job_id: str,
        scheduled_at: datetime,
        attempt: int,
        payload: Any,
    ) -> DeliveryResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.timeout

        def result(verdict: Verdict, **fields: Any) -> DeliveryResult:
            return DeliveryResult(verdict, seconds=loop.time() - started, **fields)

        allowed: Hashable = allow_list if isinstance(allow_list, AllowList) else tuple(allow_list)
        try:
            route = self._cached_route(url, allowed)
            if route is None:  # a timer only when the guard has to resolve
                async with asyncio.timeout_at(deadline):
                    route = await self._route(url, allowed)
        except errors.ForbiddenDestination as exc:
            return result(Verdict.failed, error=f"refused by the SSRF guard: {exc}")
        except UnresolvableHost as exc:
            return result(Verdict.retry, error=f"network error: {exc}")
        except errors.ValidationError as exc:
            return result(Verdict.failed, error=str(exc))
        except TimeoutError:
            return result(Verdict.retry, error=self._timed_out())
        stamp = _instant(scheduled_at)
        body = _body_bytes(job_id, stamp, attempt, payload)
        key = f"{job_id}:{stamp}"  # run_key, with the instant formatted once
        # v2 signs the request target exactly as it goes on the wire (path and query); the
        # headers of signed_headers, in its order, written straight into the head
        timestamp = int(time.time())
        signature = signature_header(
            secret, timestamp, method="POST", path=route.target, idempotency_key=key, body=body
        )
        request = b"".join(
            (
                route.head,
                (
                    f"Content-Length: {len(body)}\r\n{IDEMPOTENCY_HEADER}: {key}\r\n"
                    f"{TIMESTAMP_HEADER}: {timestamp}\r\n{SIGNATURE_HEADER}: {signature}\r\n\r\n"
                ).encode(),
                body,
            )
        )
        connection: Connection | None = None
        try:
            try:
                connection, answer = await self._client.exchange(route.pool, request, deadline)
            except TimeoutError:
                return result(Verdict.retry, error=self._timed_out())
            except NETWORK_ERRORS as exc:
                return result(Verdict.retry, error=f"network error: {_reason(exc)}")
            status, reason, headers = answer
            snippet, cut, broken = await read_body(connection, status, headers)
            self._client.release(route.pool, connection)
            connection = None
        finally:
            if connection is not None:
                connection.close()
        if broken is not None:
            return result(
                Verdict.retry,
                status=status,
                error=f"HTTP {status}, then the body failed: {hide_addresses(broken)}",
            )
        if cut:
            # the answer is known; only its body was too slow for the deadline
            snippet = f"{snippet} (body cut at the {self.timeout:g} s deadline)".lstrip()
        verdict = classify(status)
        said = f"HTTP {status} {reason}".strip()
        detail = f"{said}: {snippet}" if snippet else said
        if verdict is Verdict.succeeded:
            return result(verdict, status=status, detail=detail)
        if 300 <= status < 400:
            location = headers.get("location", "")
            error = f"{said}: redirect to {location[:200]!r} not followed"
        else:
            error = detail
        return result(
            verdict,
            status=status,
            error=error,
            detail=detail,
            retry_after=parse_retry_after(headers.get("retry-after")),
        )

    def _timed_out(self) -> str:
        return f"timed out: no complete answer within the {self.timeout:g} s deadline"

    def _cached_route(self, url: str, allowed: Hashable) -> _Route | None:
        found = self._routes.get((url, allowed))
        if found is not None and found[0] > time.monotonic():
            return found[1]
        return None

    async def _route(self, url: str, allowed: Hashable) -> _Route:
        """Where and how to send a call to `url`: checked by the guard (its answer cached as
        long as the name's resolution), the request head prepared."""
        destination, expires = await self._guard.check_async(url, allowed)  # type: ignore[arg-type]
        route = _Route.of(destination, self.user_agent)
        if len(self._routes) >= MAX_ROUTES:
            self._routes.clear()  # a bound, not an eviction policy: entries live seconds
        self._routes[(url, allowed)] = (expires, route)
        return route


MAX_ROUTES = 10_000  # the route cache's bound


@dataclass(frozen=True)
class _Route:
    """A checked destination, ready to send to: the pool key (the checked address to connect
    to, the TLS name) and the request head up to the per-call headers."""

    target: str  # path and query, as sent (and signed)
    head: bytes
    pool: PoolKey  # where to connect, and the TLS name

    @classmethod
    def of(cls, destination: Destination, user_agent: str) -> _Route:
        url, host_header = pinned_url(destination, destination.addresses[0])
        parts = urlsplit(url)
        # the request target as requests sent it (percent-encoded the same way)
        target = requote_uri(parts.path or "/") + (
            f"?{requote_uri(parts.query)}" if parts.query else ""
        )
        address = destination.addresses[0]
        tls_name = tls_name_of(host_header) if destination.scheme == "https" else None
        head = (
            f"POST {target} HTTP/1.1\r\n"
            f"Host: {host_header}\r\n"
            "Content-Type: application/json\r\n"
            f"User-Agent: {user_agent}\r\n"
            "Accept: */*\r\n"
            "Accept-Encoding: identity\r\n"
        ).encode()
        return cls(
            target=target,
            head=head,
            pool=(destination.scheme, address, destination.port, tls_name),
        )


def _reason(exc: BaseException) -> str:
    """_cause without the address it was connecting to: the run history is the tenant's,
    and must not tell what a host name resolved to (the SSRF guard's rule)."""
    return hide_addresses(cause(exc))
