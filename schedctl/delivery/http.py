"""Owns HTTP delivery: one signed POST of a run to its tenant's endpoint, through the SSRF
guard, within one wall-clock deadline per call, and what the answer means.

The request: ``POST`` of ``{"job_id", "scheduled_at", "attempt", "payload"}`` (compact JSON)
with ``Content-Type: application/json`` and the headers of schedctl.signing
(Idempotency-Key, X-Sched-Timestamp, X-Sched-Signature), signed with every secret given
(the tenant's current one, and its previous one during a rotation's grace period).

The deadline: the guard's check (name resolution included), connecting, the TLS handshake,
sending, the status line and headers and the body snippet share one wall-clock budget
(`timeout`), not a timeout per socket read: an endpoint that trickles a byte every half
second is cut off at the deadline, when the event loop cancels the call and closes its
connection. A deadline reached before the status arrived is a timeout (retry); one reached
while reading the body of a complete answer only cuts the snippet short.

The I/O: an asyncio HTTP/1.1 client of this module's own on one event loop thread, with
kept-alive connections pooled per checked address -- thousands of calls a second from one
process, where requests + urllib3 on a thread per call spent most of the relay's CPU. The
connection goes to the address the SSRF guard checked (never resolved again), the Host
header, TLS SNI and certificate name are the URL's host. Only what a delivery needs: POST,
Content-Length or chunked or close-delimited answers, no redirects, no compression.

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
import ssl
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast
from urllib.parse import urlsplit

import certifi
from requests.utils import requote_uri
from urllib3.util.ssl_match_hostname import match_hostname

from schedctl import __version__, errors
from schedctl.delivery.ssrf import (
    AllowList,
    Destination,
    GuardCache,
    Resolver,
    UnresolvableHost,
    hide_addresses,
    pinned_url,
)
from schedctl.delivery.ssrf import tls_name as tls_name_of
from schedctl.models import Verdict
from schedctl.scheduling.timeparse import format_instant
from schedctl.signing import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signature_header,
)

# one deadline per call, connect to the end of the body snippet; shorter than the relay's
# default lease (9 s) by a margin
DEFAULT_TIMEOUT_SECONDS = 7.0
DEFAULT_CONNECT_TIMEOUT_SECONDS = 5.0
MAX_RETRY_AFTER_SECONDS = 3600.0
# what is kept of a response body for the run history (error answers, mostly)
RESPONSE_SNIPPET_BYTES = 512
# a larger body is not read: the connection is dropped instead of reused
MAX_RESPONSE_BYTES = 64 * 1024
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
        self._idle: dict[_PoolKey, list[_Connection]] = {}
        self._open: set[_Connection] = set()  # every connection not closed yet
        self._deadlines = _Deadlines()  # of the calls under way
        self._tls: ssl.SSLContext | None = None
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

        async def shut() -> None:
            self._idle.clear()
            for connection in list(self._open):
                connection.close(abort=True)
            # let the transports' close callbacks run before the loop closes
            for _ in range(3):
                await asyncio.sleep(0)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), loop).result(5)
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
        connection: _Connection | None = None
        try:
            try:
                connection, answer = await self._exchange(route, request, deadline)
            except TimeoutError:
                return result(Verdict.retry, error=self._timed_out())
            except (OSError, EOFError, ValueError, asyncio.IncompleteReadError) as exc:
                return result(Verdict.retry, error=f"network error: {_reason(exc)}")
            status, reason, headers = answer
            snippet, cut, broken = await _read_body(connection, status, headers)
            if cut or broken is not None or not connection.reusable:
                connection.close()
            else:
                connection.idle()
                self._put_back(route.pool, connection)
            connection = None
        finally:
            if connection is not None:
                connection.close()
        if broken is not None:
            return result(
                Verdict.retry,
                status=status,
                error=f"HTTP {status}, then the body failed: {broken}",
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

    async def _exchange(
        self, route: _Route, request: bytes, deadline: float
    ) -> tuple[_Connection, tuple[int, str, dict[str, str]]]:
        """Send the request and read the answer's head, on a kept-alive connection if one is
        idle (once more on a new one when that one turns out closed by the other side). The
        connection returned carries the call's deadline (`_Connection.arm`)."""
        for _ in range(2):
            connection = self._take(route.pool)
            fresh = connection is None
            if connection is None:
                connection = await self._connect(route, deadline)
            try:
                connection.arm(deadline)
                connection.send(request)
                answer = await connection.read_head()
            except (OSError, EOFError, asyncio.IncompleteReadError):
                connection.close()
                if fresh:
                    raise
                continue  # the server had closed the idle connection: a new one
            except BaseException:
                connection.close()
                raise
            return connection, answer
        raise EOFError("the connection closed before an answer")  # pragma: no cover

    async def _connect(self, route: _Route, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        connect_by = min(deadline, loop.time() + self.connect_timeout)
        tls = self._tls_context() if route.tls_name is not None else None
        async with asyncio.timeout_at(connect_by):
            # the TLS name only with TLS: some loops refuse server_hostname=None without it
            tls_options: dict[str, Any] = (
                {"ssl": tls, "server_hostname": route.tls_name} if tls is not None else {}
            )
            _, connection = await loop.create_connection(
                lambda: _Connection(self._open, self._deadlines),
                route.address,
                route.port,
                **tls_options,
            )
        if tls is not None and route.tls_name is not None:
            try:
                # the name check of urllib3 (which the pinned requests used): the address
                # is the checked one, the certificate must be the URL host's
                assert connection.transport is not None
                match_hostname(connection.transport.get_extra_info("peercert"), route.tls_name)
            except Exception:
                connection.close()
                raise
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            context = ssl.create_default_context(cafile=self.ca_bundle or certifi.where())
            # checked by match_hostname after the handshake (its messages name both names)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_REQUIRED
            self._tls = context
        return self._tls

    def _take(self, pool: _PoolKey) -> _Connection | None:
        idle = self._idle.get(pool)
        while idle:
            connection = idle.pop()
            if connection.alive():
                return connection
            connection.close()
        return None

    def _put_back(self, pool: _PoolKey, connection: _Connection) -> None:
        idle = self._idle.setdefault(pool, [])
        if len(idle) >= self.pool_size or self._closed:
            connection.close()
        else:
            idle.append(connection)


# the request head and route cache bounds
MAX_HEAD_BYTES = 64 * 1024
# received and not read yet: past this a connection stops reading until the call reads on
MAX_BUFFER_BYTES = 256 * 1024
MAX_HEADERS = 200
MAX_INTERIM_ANSWERS = 8  # 1xx answers skipped before the real one
MAX_ROUTES = 10_000
DEADLINE_SLACK_SECONDS = 1e-6

_PoolKey = tuple[str, str, int, str | None]  # scheme, address, port, TLS name


@dataclass(frozen=True)
class _Route:
    """A checked destination, ready to send to: the address to connect to, the TLS name,
    and the request head up to the per-call headers."""

    address: str
    port: int
    tls_name: str | None
    target: str  # path and query, as sent (and signed)
    head: bytes
    pool: _PoolKey

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
            address=address,
            port=destination.port,
            tls_name=tls_name,
            target=target,
            head=head,
            pool=(destination.scheme, address, destination.port, tls_name),
        )


class _Deadlines:
    """The deadlines of the calls under way, on one loop timer set for the nearest of them
    (each expiring connection is failed then), instead of a timer armed and cancelled per
    call: a call's deadline is its start plus the client's one timeout, so the nearest is
    nearly always the oldest call's, and the timer fires about once per timeout, not once
    per call. A deadline armed earlier than the timer (a call that spent long resolving or
    connecting) moves the timer up: each connection still expires at its own deadline."""

    def __init__(self) -> None:
        self._armed: dict[_Connection, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, connection: _Connection, deadline: float) -> None:
        self._armed[connection] = deadline
        timer = self._timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self._timer = asyncio.get_running_loop().call_at(deadline, self._fire)

    def disarm(self, connection: _Connection) -> None:
        self._armed.pop(connection, None)

    def _fire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        # the loop may run a timer a clock tick before its time
        now = loop.time() + DEADLINE_SLACK_SECONDS
        expired = [c for c, deadline in self._armed.items() if deadline <= now]
        for connection in expired:
            del self._armed[connection]
            connection.expire()
        if self._armed:
            self._timer = loop.call_at(min(self._armed.values()), self._fire)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection as an asyncio protocol: the bytes received so far, whether it
    may carry another request, and the deadline of the call it carries.

    A protocol, not a stream pair: data_received appends to one buffer and wakes the one
    waiting call, and the reads below take what they need from the buffer without another
    hand-over (the streams' reader, its waiter and flow control cost as much CPU as the
    rest of a call together). The call's deadline (`arm`) is kept by _Deadlines: when it
    passes, the call's wait raises TimeoutError; the caller then closes the connection."""

    def __init__(self, registry: set[_Connection], deadlines: _Deadlines) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False  # the other side closed (or the connection broke)
        self.error: BaseException | None = None  # why it broke, if it did
        self.reusable = True
        self.expired = False  # the deadline of the call it carries passed
        self._waiter: asyncio.Future[None] | None = None
        self._deadlines = deadlines
        self._paused = False
        self._registry = registry
        registry.add(self)

    # -- the protocol's callbacks (on the loop) ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (other loops' need not subclass asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > MAX_BUFFER_BYTES and not self._paused:
            # bounded memory for an endpoint that sends more than is read
            self._paused = True
            if self.transport is not None:
                self.transport.pause_reading()
        self._wake(None)

    def eof_received(self) -> bool:
        self.eof = True
        self.reusable = False
        self._wake(None)
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.reusable = False
        self.error = exc
        self._registry.discard(self)
        self._disarm()
        self._wake(None)

    def _wake(self, error: BaseException | None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    # -- the call's deadline -------------------------------------------------------------------

    def arm(self, deadline: float) -> None:
        """Fail the call's waits with TimeoutError at `deadline` (loop time)."""
        self.expired = False
        self._deadlines.arm(self, deadline)

    def expire(self) -> None:
        """The call's deadline passed (_Deadlines calls this)."""
        self.expired = True
        self._wake(TimeoutError())

    def _disarm(self) -> None:
        self._deadlines.disarm(self)

    # -- use -----------------------------------------------------------------------------------

    def alive(self) -> bool:
        """Whether an idle connection can carry a request: open, and nothing unasked-for
        arrived on it."""
        transport = self.transport
        return (
            not self.eof
            and not self.buffer
            and transport is not None
            and not transport.is_closing()
        )

    def send(self, request: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise EOFError("the connection is closed")
        self.transport.write(request)

    def idle(self) -> None:
        """The call ended and the connection waits in the pool: no deadline any more."""
        self._disarm()

    def close(self, *, abort: bool = False) -> None:
        # it stays in the registry until connection_lost: a TLS close takes round trips,
        # and HttpDelivery.close aborts what has not finished closing by then
        self.reusable = False
        self._disarm()
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    async def _more(self) -> None:
        """Wait for more bytes, the end of the connection or the deadline (TimeoutError)."""
        if self.expired:
            raise TimeoutError
        if self.eof:
            if self.error is not None:
                raise self.error
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        await waiter

    def _take(self, end: int) -> bytes:
        data = bytes(self.buffer[:end])
        del self.buffer[:end]
        return data

    async def readuntil(self, separator: bytes, limit: int) -> bytes:
        """The bytes up to and including `separator`; ValueError past `limit` bytes,
        IncompleteReadError when the connection ends first."""
        start = 0
        while True:
            at = self.buffer.find(separator, start)
            if at >= 0:
                return self._take(at + len(separator))
            if len(self.buffer) > limit:
                raise ValueError(f"the answer's head is over {limit} bytes")
            if self.eof:
                raise asyncio.IncompleteReadError(self._take(len(self.buffer)), None)
            start = max(0, len(self.buffer) - len(separator) + 1)
            await self._more()

    async def readexactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if self.eof:
                raise asyncio.IncompleteReadError(self._take(len(self.buffer)), size)
            await self._more()
        return self._take(size)

    async def read(self, size: int) -> bytes:
        """Up to `size` bytes, at least one; b"" once the connection has ended."""
        while not self.buffer:
            if self.eof:
                return b""
            await self._more()
        return self._take(min(size, len(self.buffer)))

    async def read_head(self) -> tuple[int, str, dict[str, str]]:
        """The status, reason and headers (names in lower case) of the answer, after any
        interim 1xx ones."""
        for _ in range(MAX_INTERIM_ANSWERS):
            raw = await self.readuntil(b"\r\n\r\n", MAX_HEAD_BYTES)
            lines = raw.decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/") or not (code.isascii() and code.isdigit()):
                raise ValueError(f"not an HTTP answer: {lines[0][:80]!r}")
            status = int(code)
            if len(lines) > MAX_HEADERS:
                raise ValueError(f"the answer has over {MAX_HEADERS} header lines")
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200 and status != 101:
                continue
            connection = headers.get("connection", "").lower()
            if (version == "HTTP/1.0" and "keep-alive" not in connection) or "close" in connection:
                self.reusable = False
            return status, reason.strip(), headers
        raise ValueError("too many interim (1xx) answers")


async def _read_body(
    connection: _Connection, status: int, headers: dict[str, str]
) -> tuple[str, bool, str | None]:
    """A bounded read of the body (a fully read one lets the connection be reused), until
    the call's deadline. Returns the snippet of what arrived, whether the deadline cut it,
    and why the read failed, if it did."""
    if _no_body(status, headers):
        return "", False, None  # nothing to read (most successes)
    data = bytearray()
    cut, broken = False, None
    try:
        await _body(connection, status, headers, data)
    except TimeoutError:
        cut = True
    except (OSError, EOFError, ValueError, asyncio.IncompleteReadError) as exc:
        broken = (
            _reason(exc)
            if not isinstance(exc, asyncio.IncompleteReadError)
            else (f"the connection closed after {len(data) + len(exc.partial)} byte(s)")
        )
        if isinstance(exc, asyncio.IncompleteReadError):
            data += exc.partial
    text = bytes(data[:RESPONSE_SNIPPET_BYTES]).decode("utf-8", errors="replace")
    # one line in the run history, whatever the endpoint sent
    snippet = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return snippet, cut, broken


def _no_body(status: int, headers: dict[str, str]) -> bool:
    """Whether the answer ends with its head (no body follows it on the connection)."""
    if status in (204, 304) or 100 <= status < 200:
        return True
    empty = headers.get("content-length", "").strip() == "0"
    return empty and "transfer-encoding" not in headers


async def _body(
    connection: _Connection, status: int, headers: dict[str, str], data: bytearray
) -> None:
    if status in (204, 304) or 100 <= status < 200:
        return
    if "chunked" in headers.get("transfer-encoding", "").lower():
        for _ in range(MAX_RESPONSE_BYTES):  # each chunk is at least a byte
            size_line = await connection.readuntil(b"\r\n", MAX_HEAD_BYTES)
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                # trailers, up to the empty line
                for _ in range(MAX_HEADERS):
                    if await connection.readuntil(b"\r\n", MAX_HEAD_BYTES) == b"\r\n":
                        return
                raise ValueError("too many trailer lines")
            if len(data) + size > MAX_RESPONSE_BYTES:
                connection.reusable = False  # not read on: dropped instead of reused
                data += await connection.read(MAX_RESPONSE_BYTES - len(data))
                return
            data += await connection.readexactly(size)
            await connection.readexactly(2)
        return
    length = headers.get("content-length")
    if length is not None:
        size = int(length)
        if size > MAX_RESPONSE_BYTES:
            connection.reusable = False
            size = RESPONSE_SNIPPET_BYTES
        while len(data) < size:
            chunk = await connection.read(min(65536, size - len(data)))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", size)
            data += chunk
        return
    # no length: the body ends with the connection
    connection.reusable = False
    while len(data) <= MAX_RESPONSE_BYTES:
        chunk = await connection.read(65536)
        if not chunk:
            return
        data += chunk


def _reason(exc: BaseException) -> str:
    """_cause without the address it was connecting to: the run history is the tenant's,
    and must not tell what a host name resolved to (the SSRF guard's rule)."""
    return hide_addresses(_cause(exc))


def _cause(exc: BaseException) -> str:
    """The innermost readable cause of a network or TLS error, on one line."""
    current: BaseException | None = exc
    text = str(exc)
    seen = 0
    while current is not None and seen < 5:
        reason = getattr(current, "reason", None)
        if isinstance(reason, BaseException):
            current = reason
            text = str(reason)
        elif current.args and isinstance(current.args[0], BaseException):
            current = current.args[0]
            text = str(current)
        else:
            break
        seen += 1
    return " ".join(text.split())[:300] or type(exc).__name__
