"""Owns the benchmarks' loopback HTTP receiver: a minimal keep-alive HTTP/1.1 server
(asyncio, Content-Length bodies) on 127.0.0.1 that answers 204 to every POST and records,
per run key (the Idempotency-Key header), each time it was received, and how many POSTs
came without a v2 signature. It runs as its own process (`python -m schedctl_bench.receiver`),
so that it does not compete with the bench or a relay for CPU or an interpreter lock; it
prints its port on the first line of stdout and stops when its stdin closes.

GET /keys answers {KEY: [unix times]}; any other GET answers the counts: {"received",
"distinct", "duplicates", "unsigned", "first", "last"}.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from schedctl.core import errors
from schedctl_bench import children


class _Counts:
    def __init__(self) -> None:
        self.keys: dict[str, list[float]] = {}
        self.times: list[float] = []
        self.unsigned = 0

    def post(self, key: str, signed: bool) -> None:
        now = time.time()
        self.keys.setdefault(key, []).append(now)
        self.times.append(now)
        if not signed:
            self.unsigned += 1

    def answer(self, path: str) -> Any:
        if path == "/keys":
            return self.keys
        return {
            "received": len(self.times),
            "distinct": len(self.keys),
            "duplicates": sum(len(v) - 1 for v in self.keys.values()),
            "unsigned": self.unsigned,
            "first": self.times[0] if self.times else None,
            "last": self.times[-1] if self.times else None,
        }


COUNTS = _Counts()


def _header(head: bytes, lowered: bytes, name: bytes) -> bytes:
    """The value of header `name` (lower case, with its colon) in a request head, or b"".
    Only what the counts need is looked at: the receiver shares the cores with the relay
    it measures, so it does as little per request as it can."""
    at = lowered.find(b"\r\n" + name)
    if at < 0:
        return b""
    start = at + 2 + len(name)
    end = head.find(b"\r\n", start)
    return head[start : end if end >= 0 else len(head)].strip()


class _Protocol(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer = self.buffer + data if self.buffer else data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:  # bounded: each turn eats one
            head = self.buffer[:end]
            lowered = head.lower()
            length = int(_header(head, lowered, b"content-length:") or 0)
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            if head.startswith(b"POST "):
                key = _header(head, lowered, b"idempotency-key:").decode("latin-1")
                signed = _header(head, lowered, b"x-sched-signature:").startswith(b"v2=")
                COUNTS.post(key, signed)
                self.transport.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
                continue
            path = head.split(b"\r\n", 1)[0].split(b" ")[1].decode("latin-1")
            body = json.dumps(COUNTS.answer(path)).encode()
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Protocol, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()


class Receiver:
    """The receiver process, started by the bench and stopped by close()."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "schedctl_bench.receiver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            raise errors.SchedError("the benchmark's HTTP receiver did not start")
        self.port = int(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/bench"

    def _get(self, path: str, timeout: float) -> Any:
        import requests  # here: the receiver process itself does not need it

        return requests.get(f"http://127.0.0.1:{self.port}{path}", timeout=timeout).json()

    def count(self) -> dict[str, Any]:
        """received, distinct, duplicates, unsigned, first and last (unix times or None)."""
        data: dict[str, Any] = self._get("/count", 30)
        return data

    def keys(self) -> dict[str, list[float]]:
        data: dict[str, list[float]] = self._get("/keys", 120)
        return data

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        children.reap(self.process, 10)  # it stops when its stdin closes
        if self.process.stdout is not None:
            self.process.stdout.close()


if __name__ == "__main__":
    asyncio.run(_serve())
