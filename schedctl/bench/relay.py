"""Owns the relay benchmark behind `schedctl bench relay` (cli/bench_relay.py): signed HTTP
deliveries per second from one `scheduled-d relay` process to a loopback keep-alive receiver,
the p50/p99 call latency the relay recorded, and duplicates and missing runs counted by the
receiver. Measured and reported, never asserted.

The receiver is an asyncio HTTP/1.1 server in a child process of its own (in the relay's
process, or this one's, it would take CPU from what is measured); it answers 204 to every
POST and counts each Idempotency-Key. Everything is bounded: a fixed number of runs, a
deadline, servers on 127.0.0.1 this command starts and stops. Use a scratch database: it
adds a tenant, a job and its runs (removed at the end unless --keep).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from schedctl import errors
from schedctl.bench.delivery import _claimed_runs, _tenant
from schedctl.storage import bench as bench_rows
from schedctl.storage.store import Store

# The receiver: minimal HTTP/1.1 (Content-Length bodies, keep-alive), 204 to a POST, its
# counts as JSON to a GET; it stops when its stdin closes.
_RECEIVER = r"""
import asyncio, json, sys, time
keys = {}
times = []
unsigned = 0
class Receiver(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        global unsigned
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buffer[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length:]
            if lines[0].startswith("POST"):
                key = headers.get("idempotency-key", "")
                keys[key] = keys.get(key, 0) + 1
                times.append(time.time())
                if not headers.get("x-sched-signature", "").startswith("v2="):
                    unsigned += 1
                self.transport.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
            else:
                body = json.dumps({
                    "received": len(times),
                    "distinct": len(keys),
                    "duplicates": sum(c - 1 for c in keys.values()),
                    "unsigned": unsigned,
                    "first": times[0] if times else None,
                    "last": times[-1] if times else None,
                }).encode()
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body
                )
async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Receiver, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()
asyncio.run(main())
"""


class Receiver:
    """The loopback receiver in its child process."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER],
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
        return f"http://127.0.0.1:{self.port}/bench/relay"

    def stats(self) -> dict[str, Any]:
        import requests

        data: dict[str, Any] = requests.get(f"http://127.0.0.1:{self.port}/", timeout=10).json()
        return data

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


def _peak_rss_mb(pid: int) -> float | None:
    """VmHWM of a live process, in MB (Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process so far (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _relay(store: Store, job_id: str, runs: int, deadline: float) -> dict[str, Any]:
    """Run one real `scheduled-d relay` until the job's outbox rows are all settled; the
    rate is timed from the first settled row (start-up is not delivery) to the last."""
    url = store.engine.url.render_as_string(hide_password=False)
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "scheduled-d"), "relay"],
        env={**os.environ, "SCHEDULED_DATABASE_URL": url, "SCHEDULED_LOG_LEVEL": "WARNING"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    launched = time.monotonic()
    try:
        started = counted = None
        while (left := bench_rows.outbox_left(store, job_id)) > 0:
            if process.poll() is not None:
                raise errors.SchedError(f"the relay exited with code {process.returncode}")
            if time.monotonic() > deadline:
                raise errors.SchedError(f"the benchmark did not finish in time ({left} left)")
            if started is None and left < runs:
                started, counted = time.monotonic(), left
            time.sleep(0.02)
        finished = time.monotonic()
        cpu = _cpu_seconds(process.pid)
        if started is None or counted is None:  # all settled before the first look
            started, counted = launched, runs
        return {
            "seconds": finished - started,
            "settled": counted,
            "pid": process.pid,
            "peak_rss_mb": _peak_rss_mb(process.pid),
            "cpu_seconds": cpu,
        }
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_relay_bench(
    store: Store, *, runs: int, concurrency: int, timeout: float, keep: bool = False
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    tenant_id = _tenant(store, concurrency)
    receiver = Receiver()
    try:
        job_id = _claimed_runs(store, tenant_id, "http", receiver.url, runs)
        relay = _relay(store, job_id, runs, deadline)
        received = receiver.stats()
        calls = bench_rows.attempt_seconds(store, job_id)
        statuses = bench_rows.run_statuses(store, job_id)
    finally:
        receiver.close()
        if not keep:
            bench_rows.delete_tenant(store, tenant_id)
    span = (received["last"] or 0.0) - (received["first"] or 0.0)
    p50, p99 = _percentile(calls, 0.50), _percentile(calls, 0.99)
    return {
        "runs": runs,
        "tenant_delivery_concurrency": concurrency,
        "database": bench_rows.database_settings(store),
        "deliveries_per_second": round(relay["settled"] / max(relay["seconds"], 1e-6), 1),
        "received_per_second": round((received["received"] - 1) / span, 1) if span else None,
        "call_p50_ms": round(p50 * 1000, 2) if p50 is not None else None,
        "call_p99_ms": round(p99 * 1000, 2) if p99 is not None else None,
        "received": received["received"],
        "duplicates": received["duplicates"],
        "missing": runs - received["distinct"],
        "unsigned": received["unsigned"],
        "run_statuses": statuses,
        "relay_peak_rss_mb": relay["peak_rss_mb"],
        # noise-proof on a shared machine: what one core would do, start-up included
        "relay_cpu_seconds": relay["cpu_seconds"],
        "deliveries_per_relay_cpu_second": (
            round(runs / relay["cpu_seconds"], 1) if relay["cpu_seconds"] else None
        ),
        "note": "one scheduled-d relay process; a receiver process on loopback (keep-alive)",
    }
