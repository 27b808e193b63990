"""Owns the HTTP/1.1 client that deliveries go through: kept-alive connections pooled per
address, port and TLS name, one wall-clock deadline per call, and bounded reads of the
answer (its head, then a body delimited by Content-Length, chunks or the connection's end).

Why a client of our own and not aiohttp or httpx: the relay delivers from one process, with
every call's I/O on one event loop thread, so its rate is bound by the CPU a call costs; a
general-purpose client's per-request machinery (request and response objects, header
multidicts, cookie jars, tracing hooks, stream readers and a timer per request) costs
several times what this client spends on a call. The rule: a library replaces this module
once it keeps at least 90% of the rate of ``schedctl bench relay`` in a run side by side
with it, its connection pinned to the checked address and TLS checked for the URL's host.

Only what a delivery needs: one request written as prepared bytes, answers with a
Content-Length, chunked (trailers read and dropped) or ending with the connection, interim
1xx answers skipped; no redirects, no compression, no request bodies streamed. Everything
read is bounded (the head, its header lines, the body, the buffer of bytes not read yet).

The connection goes to the address in the pool key, which the SSRF guard checked; the TLS
server name (SNI) and the name the certificate must carry are the key's TLS name, the URL's
host. Pools are per (scheme, address, port, TLS name), so a connection opened for one name
never carries a request for another.

The deadline: a call arms its connection with its deadline (`Connection.arm`); `Deadlines`
keeps one loop timer for the nearest deadline of all calls under way, and a call whose
deadline passes gets TimeoutError from its next wait. The connect has its own, shorter
bound (`connect_timeout`) within the call's deadline.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, cast

import certifi
from urllib3.util.ssl_match_hostname import match_hostname

# a larger body is not read: the connection is dropped instead of reused
MAX_RESPONSE_BYTES = 64 * 1024
# what is kept of a response body for the run history (error answers, mostly)
RESPONSE_SNIPPET_BYTES = 512
# the answer's head, and a chunk-size or trailer line
MAX_HEAD_BYTES = 64 * 1024
# received and not read yet: past this a connection stops reading until the call reads on
MAX_BUFFER_BYTES = 256 * 1024
MAX_HEADERS = 200
MAX_INTERIM_ANSWERS = 8  # 1xx answers skipped before the real one
DEADLINE_SLACK_SECONDS = 1e-6

PoolKey = tuple[str, str, int, str | None]  # scheme, address, port, TLS name
Head = tuple[int, str, dict[str, str]]  # status, reason, headers (names in lower case)
# errors of a connection or of a malformed answer (ValueError): a network error to a caller
NETWORK_ERRORS = (OSError, EOFError, ValueError, asyncio.IncompleteReadError)


class Client:
    """The pooled connections of one event loop (every method runs on it).

    - connect_timeout: at most this for the TCP connect and TLS handshake (within the call's
      deadline).
    - ca_bundle: a PEM file of the CAs to check endpoints against, instead of certifi's.
    - pool_size: idle connections kept per pool key.
    """

    def __init__(
        self, *, connect_timeout: float, ca_bundle: str | None = None, pool_size: int = 256
    ) -> None:
        self.connect_timeout = connect_timeout
        self.ca_bundle = ca_bundle
        self.pool_size = pool_size
        self._idle: dict[PoolKey, list[Connection]] = {}
        self._open: set[Connection] = set()  # every connection not closed yet
        self._deadlines = Deadlines()  # of the calls under way
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def close(self) -> None:
        """Abort every connection; connections released after this are closed."""
        self._closed = True
        self._idle.clear()
        for connection in list(self._open):
            connection.close(abort=True)
        # let the transports' close callbacks run before the loop closes
        for _ in range(3):
            await asyncio.sleep(0)

    def release(self, pool: PoolKey, connection: Connection) -> None:
        """The call on `connection` ended: back to the pool if it can carry another request
        (its answer read to the end), else closed."""
        if not connection.reusable:
            connection.close()
            return
        connection.idle()
        idle = self._idle.setdefault(pool, [])
        if len(idle) >= self.pool_size or self._closed:
            connection.close()
        else:
            idle.append(connection)

    async def exchange(
        self, pool: PoolKey, request: bytes, deadline: float
    ) -> tuple[Connection, Head]:
        """Send the request and read the answer's head, on a kept-alive connection if one is
        idle (once more on a new one when that one turns out closed by the other side). The
        connection returned carries the call's deadline (`Connection.arm`): read the body
        with `read_body`, then hand the connection to `release`. Raises TimeoutError past
        the deadline, one of NETWORK_ERRORS for a broken connection or a malformed answer."""
        for _ in range(2):
            connection = self._take(pool)
            fresh = connection is None
            if connection is None:
                connection = await self._connect(pool, deadline)
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

    async def _connect(self, pool: PoolKey, deadline: float) -> Connection:
        _scheme, address, port, tls_name = pool
        loop = asyncio.get_running_loop()
        connect_by = min(deadline, loop.time() + self.connect_timeout)
        tls = self._tls_context() if tls_name is not None else None
        async with asyncio.timeout_at(connect_by):
            # the TLS name only with TLS: some loops refuse server_hostname=None without it
            tls_options: dict[str, Any] = (
                {"ssl": tls, "server_hostname": tls_name} if tls is not None else {}
            )
            _, connection = await loop.create_connection(
                lambda: Connection(self._open, self._deadlines),
                address,
                port,
                **tls_options,
            )
        if tls is not None and tls_name is not None:
            try:
                # the name check of urllib3 (which the pinned requests used): the address
                # is the checked one, the certificate must be the URL host's
                assert connection.transport is not None
                match_hostname(connection.transport.get_extra_info("peercert"), tls_name)
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

    def _take(self, pool: PoolKey) -> Connection | None:
        idle = self._idle.get(pool)
        while idle:
            connection = idle.pop()
            if connection.alive():
                return connection
            connection.close()
        return None


class Deadlines:
    """The deadlines of the calls under way, on one loop timer set for the nearest of them
    (each expiring connection is failed then), instead of a timer armed and cancelled per
    call: a call's deadline is its start plus the client's one timeout, so the nearest is
    nearly always the oldest call's, and the timer fires about once per timeout, not once
    per call. A deadline armed earlier than the timer (a call that spent long resolving or
    connecting) moves the timer up: each connection still expires at its own deadline."""

    def __init__(self) -> None:
        self._armed: dict[Connection, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, connection: Connection, deadline: float) -> None:
        self._armed[connection] = deadline
        timer = self._timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self._timer = asyncio.get_running_loop().call_at(deadline, self._fire)

    def disarm(self, connection: Connection) -> None:
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


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection as an asyncio protocol: the bytes received so far, whether it
    may carry another request, and the deadline of the call it carries.

    A protocol, not a stream pair: data_received appends to one buffer and wakes the one
    waiting call, and the reads below take what they need from the buffer without another
    hand-over (the streams' reader, its waiter and flow control cost as much CPU as the
    rest of a call together). The call's deadline (`arm`) is kept by Deadlines: when it
    passes, the call's wait raises TimeoutError; the caller then closes the connection."""

    def __init__(self, registry: set[Connection], deadlines: Deadlines) -> None:
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
        """The call's deadline passed (Deadlines calls this)."""
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
        # and Client.close aborts what has not finished closing by then
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


async def read_body(
    connection: Connection, status: int, headers: dict[str, str]
) -> tuple[str, bool, str | None]:
    """A bounded read of the body (a fully read one lets the connection be reused), until
    the call's deadline. Returns the snippet of what arrived, whether the deadline cut it,
    and why the read failed, if it did (`cause`: it may name the address connected to)."""
    if no_body(status, headers):
        return "", False, None  # nothing to read (most successes)
    data = bytearray()
    cut, broken = False, None
    try:
        await _body(connection, status, headers, data)
    except TimeoutError:
        cut = True
    except NETWORK_ERRORS as exc:
        broken = (
            cause(exc)
            if not isinstance(exc, asyncio.IncompleteReadError)
            else (f"the connection closed after {len(data) + len(exc.partial)} byte(s)")
        )
        if isinstance(exc, asyncio.IncompleteReadError):
            data += exc.partial
    if cut or broken is not None:
        connection.reusable = False  # the rest of the answer is still on it
    text = bytes(data[:RESPONSE_SNIPPET_BYTES]).decode("utf-8", errors="replace")
    # one line in the run history, whatever the endpoint sent
    snippet = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return snippet, cut, broken


def no_body(status: int, headers: dict[str, str]) -> bool:
    """Whether the answer ends with its head (no body follows it on the connection)."""
    if status in (204, 304) or 100 <= status < 200:
        return True
    empty = headers.get("content-length", "").strip() == "0"
    return empty and "transfer-encoding" not in headers


async def _body(
    connection: Connection, status: int, headers: dict[str, str], data: bytearray
) -> None:
    if status in (204, 304) or 100 <= status < 200:
        return
    if "chunked" in headers.get("transfer-encoding", "").lower():
        for _ in range(MAX_RESPONSE_BYTES):  # each chunk is at least a byte
            size = _chunk_size(await connection.readuntil(b"\r\n", MAX_HEAD_BYTES))
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
            if await connection.readexactly(2) != b"\r\n":
                raise ValueError("a chunk of the answer does not end where its size says")
        return
    length = headers.get("content-length")
    if length is not None:
        # digits only: int() would also take "-5", "+5" and "1_0"
        if not (length.isascii() and length.isdigit()):
            raise ValueError(f"the answer's Content-Length is not a number: {length[:40]!r}")
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


_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
MAX_CHUNK_SIZE_DIGITS = 16


def _chunk_size(line: bytes) -> int:
    """The size on a chunk-size line (extensions after ';' ignored): hex digits only, as
    RFC 9112 has them (int() would also take "-5", "0x10" and an empty line as 0)."""
    digits = line.split(b";", 1)[0].strip()
    if not digits or len(digits) > MAX_CHUNK_SIZE_DIGITS or not _HEX_DIGITS.issuperset(digits):
        raise ValueError(f"not a chunk size: {line[:40]!r}")
    return int(digits, 16)


def cause(exc: BaseException) -> str:
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
