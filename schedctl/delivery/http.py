"""Owns HTTP delivery: one signed POST of a run to its tenant's endpoint, through the SSRF
guard, within one wall-clock deadline per call, and what the answer means.

The request: ``POST`` of ``{"job_id", "scheduled_at", "attempt", "payload"}`` (compact JSON)
with ``Content-Type: application/json`` and the headers of schedctl.signing
(Idempotency-Key, X-Sched-Timestamp, X-Sched-Signature), signed with every secret given
(the tenant's current one, and its previous one during a rotation's grace period).

The deadline: connecting, sending, the status line and headers and the body snippet share
one wall-clock budget (`timeout`), not a timeout per socket read: an endpoint that trickles
a byte every half second is cut off at the deadline, when a watchdog thread shuts the
connection's socket down. A deadline reached before the status arrived is a timeout (retry);
one reached while reading the body of a complete answer only cuts the snippet short.

The answer: 2xx succeeded. 408, 429, 5xx, a timeout or a network error: retry, after at
least the Retry-After the endpoint asked for (seconds or an HTTP date, capped at
MAX_RETRY_AFTER_SECONDS). A redirect is not followed and fails, like every other 4xx: the
same request would get the same answer again. A destination the guard refuses fails
without any connection being made.
"""

from __future__ import annotations

import email.utils
import heapq
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import requests
import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from schedctl import __version__, errors
from schedctl.delivery.ssrf import (
    AllowList,
    PinnedAdapter,
    Resolver,
    UnresolvableHost,
    check_destination,
    hide_addresses,
    pinned_url,
)
from schedctl.models import Verdict, run_key
from schedctl.scheduling.timeparse import format_instant
from schedctl.signing import signed_headers

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


def delivery_body(job_id: str, scheduled_at: datetime, attempt: int, payload: Any) -> bytes:
    """The exact bytes POSTed (and signed)."""
    document = {
        "job_id": job_id,
        "scheduled_at": format_instant(scheduled_at),
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
    """Delivers runs over HTTP; one instance is shared by all delivery threads (the
    connection pools are thread-safe and keep connections to each checked address alive).

    - timeout: the wall-clock deadline of one call, from its start (the guard's name
      resolution counts against it, though a resolver that hangs is not cut short) to the
      end of the body snippet; connect_timeout: at most this for the TCP connect.
    - resolver: how host names become addresses (tests inject one).
    - ca_bundle: a PEM file of the CAs to check endpoints against, instead of the bundled
      public ones (certifi), for endpoints with a private CA.
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        connect_timeout: float | None = None,
        resolver: Resolver | None = None,
        ca_bundle: str | None = None,
        pool_size: int = 32,
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
        self.verify: bool | str = ca_bundle or True
        self.user_agent = user_agent
        # no retries inside urllib3: every attempt is recorded and paced by the relay
        self._adapter = _DeadlineAdapter(
            pool_connections=256, pool_maxsize=pool_size, max_retries=0, pool_block=False
        )
        self._watchdog = _Watchdog()

    def close(self) -> None:
        self._adapter.close()
        self._watchdog.stop()

    def deliver(
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
        started = time.monotonic()

        def result(verdict: Verdict, **fields: Any) -> DeliveryResult:
            return DeliveryResult(verdict, seconds=time.monotonic() - started, **fields)

        try:
            destination = check_destination(url, allow_list, resolver=self.resolver)
        except errors.ForbiddenDestination as exc:
            return result(Verdict.failed, error=f"refused by the SSRF guard: {exc}")
        except UnresolvableHost as exc:
            return result(Verdict.retry, error=f"network error: {exc}")
        except errors.ValidationError as exc:
            return result(Verdict.failed, error=str(exc))
        body = delivery_body(job_id, scheduled_at, attempt, payload)
        key = run_key(job_id, scheduled_at)
        target, host_header = pinned_url(destination, destination.addresses[0])
        headers = {
            "Host": host_header,
            "Content-Type": "application/json",
            "User-Agent": self.user_agent,
            "Accept": "*/*",
        }
        prepared = requests.Request("POST", target, headers=headers, data=body).prepare()
        # v2 signs the request target exactly as it goes on the wire (path and query)
        prepared.headers.update(
            signed_headers(secret, body, key, method="POST", path=prepared.path_url or "/")
        )
        call = _Call(started + self.timeout)
        self._watchdog.watch(call)
        _calls.current = call
        try:
            try:
                response = self._adapter.send(
                    prepared,
                    stream=True,
                    timeout=(
                        max(min(self.connect_timeout, call.left()), 0.001),
                        max(call.left(), 0.001),
                    ),
                    verify=self.verify,
                )
            except requests.Timeout as exc:
                return result(Verdict.retry, error=f"timed out: {_reason(exc)}")
            except requests.RequestException as exc:
                if call.fired:
                    return result(Verdict.retry, error=self._timed_out())
                return result(Verdict.retry, error=f"network error: {_reason(exc)}")
            try:
                snippet, broken = _read_snippet(response)
            finally:
                response.close()
        finally:
            _calls.current = None
            call.finish()
        if broken is not None and not call.fired:
            return result(
                Verdict.retry,
                status=response.status_code,
                error=f"HTTP {response.status_code}, then the body failed: {broken}",
            )
        if call.fired:
            # the answer is known; only its body was too slow for the deadline
            snippet = f"{snippet} (body cut at the {self.timeout:g} s deadline)".lstrip()
        status = response.status_code
        verdict = classify(status)
        said = f"HTTP {status} {response.reason or ''}".strip()
        detail = f"{said}: {snippet}" if snippet else said
        if verdict is Verdict.succeeded:
            return result(verdict, status=status, detail=detail)
        if 300 <= status < 400:
            location = response.headers.get("Location", "")
            error = f"{said}: redirect to {location[:200]!r} not followed"
        else:
            error = detail
        return result(
            verdict,
            status=status,
            error=error,
            detail=detail,
            retry_after=parse_retry_after(response.headers.get("Retry-After")),
        )

    def _timed_out(self) -> str:
        return f"timed out: no complete answer within the {self.timeout:g} s deadline"


def _read_snippet(response: requests.Response) -> tuple[str, str | None]:
    """A bounded read of the body; fully read bodies let the connection be reused. Returns
    the snippet (of what arrived) and why the read failed, if it did."""
    data = bytearray()
    broken: str | None = None
    try:
        for chunk in response.iter_content(8192):
            data += chunk
            if len(data) > MAX_RESPONSE_BYTES:
                break  # response.close() then drops the connection instead of reading on
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        broken = _reason(exc)
    text = bytes(data[:RESPONSE_SNIPPET_BYTES]).decode("utf-8", errors="replace")
    # one line in the run history, whatever the endpoint sent
    return " ".join("".join(c if c.isprintable() else " " for c in text).split()), broken


def _reason(exc: BaseException) -> str:
    """_cause without the address it was connecting to: the run history is the tenant's,
    and must not tell what a host name resolved to (the SSRF guard's rule)."""
    return hide_addresses(_cause(exc))


def _cause(exc: BaseException) -> str:
    """The innermost readable cause of a requests/urllib3 error, on one line."""
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


# -- the deadline --------------------------------------------------------------------------------
#
# Socket timeouts bound each read, not the call. The wall clock is kept by a watchdog: each
# call registers a _Call with its deadline; the connections the call uses (new or from the
# pool) attach themselves to it; at the deadline the watchdog shuts their sockets down
# (shutdown(2) on a dup of the socket, which wakes a blocked read or TLS handshake in the
# calling thread at once, and never touches a file descriptor the connection closed).


class _Tripwire:
    """A duplicate of a connection's socket, to shut the connection down from another
    thread; closed with the connection."""

    def __init__(self, sock: socket.socket) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = sock.dup()

    def trip(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # not connected (any more)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class _Call:
    """One call's deadline and the connections it uses."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.fired = False
        self._finished = False
        self._lock = threading.Lock()
        self._tripwires: list[_Tripwire] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def attach(self, tripwire: _Tripwire | None) -> None:
        if tripwire is None:
            return
        with self._lock:
            if self._finished:
                return
            if tripwire not in self._tripwires:
                self._tripwires.append(tripwire)
            if self.fired:
                tripwire.trip()  # connected after the deadline: cut at once

    def fire(self) -> None:
        with self._lock:
            if self._finished:
                return
            self.fired = True
            for tripwire in self._tripwires:
                tripwire.trip()

    def finish(self) -> None:
        with self._lock:
            self._finished = True
            self._tripwires.clear()

    @property
    def finished(self) -> bool:
        return self._finished


class _CallSlot(threading.local):
    current: _Call | None = None


# the call running in this thread (requests runs a call entirely in the calling thread)
_calls = _CallSlot()


class _Watchdog:
    """One thread firing the calls whose deadline passed (started on first use)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Call]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, call: _Call) -> None:
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="http-deadline", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (call.deadline, next(self._order), call))
            if self._heap[0][2] is call:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    while self._heap and self._heap[0][2].finished:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait = self._heap[0][0] - time.monotonic()
                    if wait <= 0:
                        call = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(wait)
            call.fire()


class _DeadlineHTTPConnection(HTTPConnection):
    """A connection whose socket the current call's deadline can cut (through its tripwire)."""

    tripwire: _Tripwire | None = None

    def _new_conn(self) -> socket.socket:
        # for HTTPS this runs before the TLS handshake: a handshake that trickles is cut at
        # the deadline too
        sock = super()._new_conn()
        if self.tripwire is not None:
            self.tripwire.close()
        self.tripwire = _Tripwire(sock)
        if _calls.current is not None:
            _calls.current.attach(self.tripwire)
        return sock

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.tripwire is not None:
                self.tripwire.close()
                self.tripwire = None


class _DeadlineHTTPSConnection(_DeadlineHTTPConnection, HTTPSConnection):
    """The same tripwire over TLS (HTTPSConnection overrides neither _new_conn nor close)."""


class _DeadlineHTTPPool(HTTPConnectionPool):
    ConnectionCls = _DeadlineHTTPConnection

    def _get_conn(self, timeout: float | None = None) -> Any:
        connection = super()._get_conn(timeout)
        if _calls.current is not None:
            # a kept-alive connection: its socket joins this call
            _calls.current.attach(getattr(connection, "tripwire", None))
        return connection


class _DeadlineHTTPSPool(_DeadlineHTTPPool, HTTPSConnectionPool):
    ConnectionCls = _DeadlineHTTPSConnection


class _DeadlineAdapter(PinnedAdapter):
    """PinnedAdapter whose connections a call's deadline can cut."""

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        super().init_poolmanager(connections, maxsize, block=block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": _DeadlineHTTPPool,
            "https": _DeadlineHTTPSPool,
        }
