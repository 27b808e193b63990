"""The delivery HTTP client's protocol (schedctl.delivery.http_client) against a scripted
loopback server in the test's own event loop: chunked bodies (extensions, trailers, bad
chunk sizes), kept-alive connections reused and a connection the server closed replaced,
the connect, first-byte and body deadlines, malformed status lines and heads, and bodies
over the bound cut to a snippet with their connection dropped."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import re
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from schedctl.delivery.http import HttpDelivery
from schedctl.delivery.http_client import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_INTERIM_ANSWERS,
    MAX_RESPONSE_BYTES,
    NETWORK_ERRORS,
    RESPONSE_SNIPPET_BYTES,
    Client,
    PoolKey,
    read_body,
)

REQUEST = b"POST /hook HTTP/1.1\r\nHost: hooks.test\r\nContent-Length: 2\r\n\r\n{}"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
# what the server does after its reply: wait for the next request on the connection, close
# it, or keep it open without reading on (until the test ends)
Then = Literal["keep", "close", "hang"]
MAX_SCRIPT = 100  # requests one server answers at most (every loop is bounded)


@dataclass
class Script:
    """A loopback HTTP server answering requests, in arrival order across connections, with
    `replies`; it counts connections and requests."""

    replies: deque[tuple[bytes, Then]]
    connections: int = 0
    requests: int = 0
    port: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def pool(self) -> PoolKey:
        return ("http", "127.0.0.1", self.port, None)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            for _ in range(MAX_SCRIPT):
                if not self.replies:
                    return
                head = await reader.readuntil(b"\r\n\r\n")
                found = re.search(rb"content-length: *(\d+)", head.lower())
                await reader.readexactly(int(found.group(1)) if found else 0)
                self.requests += 1
                data, then = self.replies.popleft()
                writer.write(data)
                await writer.drain()
                if then == "close":
                    return
                if then == "hang":
                    await self.stop.wait()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(*replies: tuple[bytes, Then]) -> AsyncIterator[Script]:
    script = Script(deque(replies))
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    script.port = server.sockets[0].getsockname()[1]
    try:
        yield script
    finally:
        script.stop.set()
        server.close()
        for writer in script.writers:
            writer.close()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    snippet: str
    cut: bool
    broken: str | None
    reused: bool  # the connection went back to the pool


async def call(client: Client, pool: PoolKey, *, seconds: float = 10.0) -> Answer:
    """One call as HttpDelivery makes it: exchange, bounded body read, release."""
    deadline = asyncio.get_running_loop().time() + seconds
    connection, (status, _reason, headers) = await client.exchange(pool, REQUEST, deadline)
    snippet, cut, broken = await read_body(connection, status, headers)
    reused = connection.reusable
    client.release(pool, connection)
    return Answer(status, headers, snippet, cut, broken, reused)


def run(test: Callable[[Client], Coroutine[Any, Any, None]], **options: Any) -> None:
    """`test` on a new event loop with a new client, closed after it."""

    async def main() -> None:
        client = Client(connect_timeout=options.get("connect_timeout", 5.0))
        try:
            await test(client)
        finally:
            await client.close()

    asyncio.run(main())


def chunked(*pieces: bytes, trailers: bytes = b"") -> bytes:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + body
        + b"0\r\n"
        + trailers
        + b"\r\n"
    )


# -- chunked bodies -------------------------------------------------------------------------


def test_a_chunked_body_with_extensions_and_trailers_is_read_and_its_connection_reused() -> None:
    async def test(client: Client) -> None:
        answer = chunked(b"hello", b" chunked", b" world", trailers=b"X-Checksum: 1\r\nX-B: 2\r\n")
        async with serving((answer, "keep"), (OK, "keep")) as server:
            first = await call(client, server.pool)
            assert (first.status, first.snippet, first.cut, first.broken) == (
                200,
                "hello chunked world",
                False,
                None,
            )
            # the trailers were read to the end: the next answer parses on the same connection
            second = await call(client, server.pool)
            assert (second.status, second.snippet) == (200, "ok")
            assert (server.connections, server.requests) == (1, 2)

    run(test)


@pytest.mark.parametrize(
    "size_line",
    [b"zz", b"-5", b"0x5", b"", b"+5", b"1" * 17],
    ids=["not-hex", "negative", "0x-prefix", "empty", "plus-sign", "too-many-digits"],
)
def test_a_bad_chunk_size_breaks_the_body_and_the_connection_is_not_reused(
    size_line: bytes,
) -> None:
    async def test(client: Client) -> None:
        answer = (
            b"HTTP/1.1 502 Bad\r\nTransfer-Encoding: chunked\r\n\r\n"
            + size_line
            + b"\r\nhello\r\n0\r\n\r\n"
        )
        async with serving((answer, "keep"), (OK, "keep")) as server:
            first = await call(client, server.pool)
            assert first.status == 502
            assert first.broken is not None and "chunk size" in first.broken, first
            assert not first.reused
            second = await call(client, server.pool)
            assert second.status == 200
            assert server.connections == 2  # a new connection, not the broken one

    run(test)


def test_a_chunk_longer_than_its_size_breaks_the_body() -> None:
    async def test(client: Client) -> None:
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n"
        async with serving((answer, "keep")) as server:
            first = await call(client, server.pool)
            assert first.broken is not None and "does not end where its size says" in first.broken
            assert not first.reused

    run(test)


def test_a_chunked_body_cut_by_the_server_names_what_arrived() -> None:
    async def test(client: Client) -> None:
        answer = b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n10\r\npartial"
        async with serving((answer, "close")) as server:
            first = await call(client, server.pool)
            assert first.status == 500
            assert first.broken == "the connection closed after 7 byte(s)"
            assert first.snippet == "partial"

    run(test)


# -- bodies over the bound ----------------------------------------------------------------------


def _oversize(kind: str) -> bytes:
    body = b"x" * (MAX_RESPONSE_BYTES * 2)
    if kind == "content-length":
        return b"HTTP/1.1 500 Big\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    if kind == "chunked":
        return b"HTTP/1.1 500 Big\r\nTransfer-Encoding: chunked\r\n\r\n" + (
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
    return b"HTTP/1.1 500 Big\r\n\r\n" + body  # ends with the connection


@pytest.mark.parametrize("kind", ["content-length", "chunked", "close-delimited"])
def test_a_body_over_the_bound_is_cut_to_a_snippet_and_its_connection_dropped(kind: str) -> None:
    async def test(client: Client) -> None:
        async with serving((_oversize(kind), "hang"), (OK, "keep")) as server:
            first = await call(client, server.pool)
            assert (first.status, first.cut, first.broken) == (500, False, None)
            # what had arrived, up to the snippet's bound
            assert set(first.snippet) == {"x"} and len(first.snippet) <= RESPONSE_SNIPPET_BYTES
            assert not first.reused  # the rest of the body was not read
            second = await call(client, server.pool)
            assert (second.status, server.connections) == (200, 2)

    run(test)


# -- keep-alive -----------------------------------------------------------------------------


def test_kept_alive_connections_carry_one_call_after_another() -> None:
    async def test(client: Client) -> None:
        no_content = b"HTTP/1.1 204 No Content\r\n\r\n"
        async with serving((OK, "keep"), (no_content, "keep"), (OK, "keep")) as server:
            answers = [await call(client, server.pool) for _ in range(3)]
            assert [a.status for a in answers] == [200, 204, 200]
            assert all(a.reused for a in answers)
            assert (server.connections, server.requests) == (1, 3)

    run(test)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["connection-close", "http-1.0"],
)
def test_an_answer_that_ends_its_connection_is_not_reused(answer: bytes) -> None:
    async def test(client: Client) -> None:
        async with serving((answer, "hang"), (OK, "keep")) as server:
            first = await call(client, server.pool)
            assert (first.status, first.reused) == (200, False)
            await call(client, server.pool)
            assert server.connections == 2

    run(test)


def test_an_idle_connection_the_server_closed_is_replaced_by_a_new_one() -> None:
    async def test(client: Client) -> None:
        # the second request reaches the kept-alive connection, which the server then closes
        # without an answer (a keep-alive timeout racing the request): sent again, once, on
        # a new connection
        async with serving((OK, "keep"), (b"", "close"), (OK, "keep")) as server:
            assert (await call(client, server.pool)).status == 200
            second = await call(client, server.pool)
            assert second.status == 200
            assert (server.connections, server.requests) == (2, 3)

    run(test)


def test_an_idle_connection_closed_while_idle_is_not_used() -> None:
    async def test(client: Client) -> None:
        async with serving((OK, "close"), (OK, "keep")) as server:
            deadline = asyncio.get_running_loop().time() + 10
            connection, head = await client.exchange(server.pool, REQUEST, deadline)
            await read_body(connection, head[0], head[2])
            client.release(server.pool, connection)
            for _ in range(1000):  # bounded: 10 s for the server's close to arrive
                if not connection.alive():
                    break
                await asyncio.sleep(0.01)
            assert not connection.alive()
            second = await call(client, server.pool)
            assert second.status == 200
            assert (server.connections, server.requests) == (2, 2)

    run(test)


def test_a_new_connection_closed_before_an_answer_is_a_network_error_not_retried() -> None:
    async def test(client: Client) -> None:
        async with serving((b"", "close"), (OK, "keep")) as server:
            with pytest.raises(NETWORK_ERRORS):
                await call(client, server.pool)
            assert (server.connections, server.requests) == (1, 1)

    run(test)


# -- deadlines ------------------------------------------------------------------------------


@contextlib.contextmanager
def unanswered_listener() -> Iterator[int]:
    """A port whose accept queue is full: the kernel drops further SYNs, so a connect to it
    neither succeeds nor fails until the client gives up."""
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            fillers.append(filler)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_the_connect_is_bounded_by_connect_timeout_within_the_calls_deadline() -> None:
    async def test(client: Client) -> None:
        with unanswered_listener() as port:
            pool: PoolKey = ("http", "127.0.0.1", port, None)
            # the call's deadline is far; only connect_timeout can end the connect
            task = asyncio.ensure_future(call(client, pool, seconds=3600))
            done, _ = await asyncio.wait({task}, timeout=60)
            if not done:
                task.cancel()
            assert done, "the connect outlived connect_timeout"
            assert isinstance(task.exception(), TimeoutError)

    run(test, connect_timeout=0.2)


def test_no_first_byte_by_the_deadline_is_a_timeout_and_the_connection_is_closed() -> None:
    async def test(client: Client) -> None:
        async with serving((b"", "hang"), (OK, "keep")) as server:
            with pytest.raises(TimeoutError):
                await call(client, server.pool, seconds=0.3)
            assert (await call(client, server.pool)).status == 200
            assert server.connections == 2

    run(test)


def test_a_head_slower_than_the_deadline_is_a_timeout() -> None:
    async def test(client: Client) -> None:
        async with serving((b"HTTP/1.1 200 OK\r\nContent-Le", "hang")) as server:
            with pytest.raises(TimeoutError):
                await call(client, server.pool, seconds=0.3)

    run(test)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 500 Oops\r\nContent-Length: 10\r\n\r\nslow",
        b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nslow\r\n",
    ],
    ids=["content-length", "chunked"],
)
def test_a_body_slower_than_the_deadline_is_cut_and_its_connection_dropped(answer: bytes) -> None:
    async def test(client: Client) -> None:
        async with serving((answer, "hang"), (OK, "keep")) as server:
            first = await call(client, server.pool, seconds=0.3)
            assert (first.status, first.snippet, first.cut, first.broken) == (
                500,
                "slow",
                True,
                None,
            )
            assert not first.reused
            assert (await call(client, server.pool)).status == 200
            assert server.connections == 2

    run(test)


# -- malformed answers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status_line",
    [b"HTPT/1.1 200 OK", b"HTTP/1.1 2x0 OK", b"HTTP/1.1 \xb200 OK", b"hello", b""],
    ids=["not-http", "letter-in-code", "superscript-digit", "one-word", "empty"],
)
def test_a_malformed_status_line_is_a_network_error(status_line: bytes) -> None:
    async def test(client: Client) -> None:
        async with serving((status_line + b"\r\nContent-Length: 0\r\n\r\n", "hang")) as server:
            with pytest.raises(ValueError, match="not an HTTP answer"):
                await call(client, server.pool)

    run(test)


def test_a_head_with_too_many_lines_is_a_network_error() -> None:
    async def test(client: Client) -> None:
        head = b"HTTP/1.1 200 OK\r\n" + b"X-A: 1\r\n" * MAX_HEADERS + b"\r\n"
        async with serving((head, "hang")) as server:
            with pytest.raises(ValueError, match="header lines"):
                await call(client, server.pool)

    run(test)


def test_a_head_over_its_bound_is_a_network_error() -> None:
    async def test(client: Client) -> None:
        # no end of the head in sight: refused once the bound is passed, not read on
        head = b"HTTP/1.1 200 OK\r\nX-Padding: " + b"." * (MAX_HEAD_BYTES + 1024)
        async with serving((head, "hang")) as server:
            with pytest.raises(ValueError, match="head is over"):
                await call(client, server.pool)

    run(test)


def test_interim_answers_are_skipped_up_to_a_bound() -> None:
    async def test(client: Client) -> None:
        interim = b"HTTP/1.1 100 Continue\r\n\r\n"
        endless = interim * (MAX_INTERIM_ANSWERS + 1) + OK
        async with serving((interim * 2 + OK, "keep"), (endless, "hang")) as server:
            first = await call(client, server.pool)
            assert (first.status, first.snippet) == (200, "ok")
            with pytest.raises(ValueError, match="interim"):
                await call(client, server.pool)

    run(test)


@pytest.mark.parametrize("length", [b"abc", b"-5", b"+2", b"1_0", b"2 2"])
def test_a_content_length_that_is_not_a_number_breaks_the_body(length: bytes) -> None:
    async def test(client: Client) -> None:
        answer = b"HTTP/1.1 500 Oops\r\nContent-Length: " + length + b"\r\n\r\nok"
        async with serving((answer, "hang")) as server:
            first = await call(client, server.pool)
            assert first.broken is not None and "Content-Length" in first.broken, first
            assert not first.reused

    run(test)


# -- what a delivery makes of them ---------------------------------------------------------------


CALL: dict[str, Any] = {
    "allow_list": ["127.0.0.1/32"],
    "secret": "secret",
    "job_id": "j1",
    "scheduled_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    "attempt": 1,
    "payload": {"x": 1},
}


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTPT/1.1 200 OK\r\n\r\n", "network error: not an HTTP answer"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "HTTP 200, then the body failed: not a chunk size",
        ),
    ],
    ids=["status-line", "chunk-size"],
)
def test_a_malformed_answer_is_a_retry(answer: bytes, error: str) -> None:
    delivery = HttpDelivery(timeout=10.0)

    async def test() -> None:
        async with serving((answer, "hang")) as server:
            result = await delivery.deliver_async(
                url=f"http://127.0.0.1:{server.port}/hook", **CALL
            )
            # compared by value: the test needs no import of where Verdict lives
            assert result.verdict == "retry", result
            assert (result.error or "").startswith(error), result

    try:
        asyncio.run_coroutine_threadsafe(test(), delivery.loop).result(60)
    finally:
        delivery.close()
