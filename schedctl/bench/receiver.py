"""Owns the benchmarks' loopback HTTP receiver: a keep-alive HTTP/1.1 server on 127.0.0.1
that answers 204 to every POST and records, per run key (the Idempotency-Key header), each
time it was received. It runs as its own process (`python -m schedctl.bench.receiver`), so
that it does not compete with the bench or a relay for an interpreter lock; it prints its
port on the first line of stdout and stops when its stdin closes.

GET /count answers {"received": N, "distinct": D}; GET /keys answers {KEY: [unix times]}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import requests

from schedctl import errors
from schedctl.signing import IDEMPOTENCY_HEADER

START_SECONDS = 30.0


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[str, list[float]] = {}
        self.received = 0


STATE = _State()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the relay reuses its connections

    def do_POST(self) -> None:
        now = time.time()
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        key = self.headers.get(IDEMPOTENCY_HEADER) or ""
        with STATE.lock:
            STATE.keys.setdefault(key, []).append(now)
            STATE.received += 1
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        with STATE.lock:
            if self.path == "/keys":
                data: Any = {k: list(v) for k, v in STATE.keys.items()}
            else:
                data = {"received": STATE.received, "distinct": len(STATE.keys)}
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a line per request would cost more than the request


def serve() -> None:
    ThreadingHTTPServer.request_queue_size = 256
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)

    def stop_when_stdin_closes() -> None:
        sys.stdin.read()
        server.shutdown()

    threading.Thread(target=stop_when_stdin_closes, daemon=True).start()
    server.serve_forever()


class Receiver:
    """The receiver process, started by the bench and stopped by close()."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "schedctl.bench.receiver"],
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
        self.session = requests.Session()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/bench"

    def count(self) -> dict[str, int]:
        data: dict[str, int] = self.session.get(
            f"http://127.0.0.1:{self.port}/count", timeout=30
        ).json()
        return data

    def keys(self) -> dict[str, list[float]]:
        data: dict[str, list[float]] = self.session.get(
            f"http://127.0.0.1:{self.port}/keys", timeout=120
        ).json()
        return data

    def close(self) -> None:
        self.session.close()
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


if __name__ == "__main__":
    serve()
