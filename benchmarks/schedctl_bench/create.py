"""Owns the creation benchmark (`schedctl bench create`): jobs created per second through a
`scheduled-d api` process on loopback, by single POST /v1/jobs or by POST /v1/jobs:batch,
from C keep-alive clients (http.client: the client's own cost stays small next to the
server's), with the request latency percentiles; or by `schedctl --api URL job import
FILE.jsonl` run as a process (the shipped command, its batches and all). The API's CPU
per job is reported in every mode. Measured and reported, never asserted.

A throwaway tenant with quotas raised out of the way creates one-time jobs a year ahead
(nothing fires), each with its own idempotency key; the tenant and its jobs are deleted
at the end unless kept.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from schedctl.app.service import Scheduler
from schedctl.core import errors, limits
from schedctl.storage.db.engine import redact
from schedctl_bench import children, measure
from schedctl_bench.api_workers import (
    SCHEDULED_D,
    api_argv,
    api_url,
    loopback_port,
    wait_healthy,
)
from schedctl_bench.storage import bench as bench_rows
from schedctl_bench.storage import bench_sizes

API_READY_SECONDS = 30.0
WARMUP_REQUESTS = 3  # per client, before the clock starts: connections, caches
REQUEST_TIMEOUT_SECONDS = 60.0
STOP_SECONDS = 20.0


@dataclass(frozen=True)
class CreateBenchConfig:
    jobs: int
    concurrency: int
    batch: bool
    batch_size: int
    minimal: bool  # batch answers of ids, not whole jobs (Prefer: return=minimal)
    job_import: bool  # `schedctl job import` of a file of `jobs` lines, instead of clients
    max_seconds: float
    payload_bytes: int
    keep: bool


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)  # seconds per request
    created: int = 0
    statuses: Counter[int] = field(default_factory=Counter)  # per job
    failures: Counter[str] = field(default_factory=Counter)
    stale_retries: int = 0  # requests sent again on a fresh connection (_Client.post)
    lock: threading.Lock = field(default_factory=threading.Lock)


def run(scheduler: Scheduler, database_url: str, config: CreateBenchConfig) -> dict[str, Any]:
    """Start the API, create the jobs, report. The tenant is removed afterwards unless kept."""
    # from the state a former run left, vacuumed: its deleted jobs gone and the statistics
    # current. Autovacuum otherwise counts the table empty (no live rows over pages not
    # yet given back) while this run fills it, and until its next analyze Postgres takes
    # the new tenant's jobs for one row and looks each key up by walking all of them
    # (ix_jobs_tenant_status)
    for table in ("jobs", "audit_log"):
        bench_sizes.vacuum_analyze(scheduler.store, table)
    tenant, token = scheduler.create_tenant(f"bench-create-{uuid.uuid4().hex[:8]}", "cli:bench")
    warmup = config.concurrency * WARMUP_REQUESTS * (config.batch_size if config.batch else 1)
    if config.job_import:
        warmup = 0
    try:
        scheduler.set_quotas(
            tenant.tenant_id,
            max_jobs=config.jobs + warmup + 10,
            create_rate_per_minute=1_000_000_000,
            actor="cli:bench",
        )
        with _api(database_url) as (host, port, pid):
            cpu_before = measure.cpu_seconds(pid)
            if config.job_import:
                tally, elapsed, imported = _import(host, port, token, config)
            else:
                # from when the clients' warm-up is over, with the clock: a batch run's
                # warm-up (3 requests of 1,000 jobs per client) would otherwise count its
                # own CPU against the timed jobs
                tally, elapsed, cpu_before = _drive(
                    host, port, token, config, lambda: measure.cpu_seconds(pid)
                )
                imported = None
            cpu_after = measure.cpu_seconds(pid)
    finally:
        if not config.keep:
            bench_rows.delete_tenant(scheduler.store, tenant.tenant_id)
    per_request = sorted(tally.latencies)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {
        "database": redact(str(scheduler.store.engine.url)),
        "mode": "import" if config.job_import else "batch" if config.batch else "single",
        "batch_size": (
            limits.MAX_BATCH_JOBS if config.job_import else config.batch_size if config.batch else 1
        ),
        # job import always asks for minimal answers
        "answers": "minimal"
        if config.job_import or (config.batch and config.minimal)
        else "whole jobs",
        "concurrency": config.concurrency,
        "jobs": config.jobs,
        "payload_bytes": config.payload_bytes,
        "created": tally.created,
        "refused": {str(k): v for k, v in sorted(tally.statuses.items()) if k != 201},
        "failures": dict(tally.failures),
        "stale_connection_retries": tally.stale_retries,
        "elapsed_s": round(elapsed, 3),
        "jobs_per_s": round(tally.created / elapsed, 1) if elapsed > 0 else None,
        "requests": len(per_request),
        "request_p50_ms": measure.ms(measure.percentile(per_request, 50)),
        "request_p99_ms": measure.ms(measure.percentile(per_request, 99)),
        "request_max_ms": measure.ms(per_request[-1] if per_request else None),
        # CPU of the API process per job: what the machine's other load does not change
        "api_cpu_s": None if cpu is None else round(cpu, 3),
        "api_cpu_ms_per_job": None if cpu is None else round(1000 * cpu / max(1, tally.created), 3),
        "tenant": tenant.name if config.keep else None,
        # the import's own figure: from its first line read to its last batch answered,
        # without the command's start-up (elapsed_s counts that)
        **({} if imported is None else {"import_jobs_per_s": imported}),
    }


@contextmanager
def _api(database_url: str) -> Iterator[tuple[str, int, int]]:
    """`scheduled-d api` on a free loopback port, logging warnings only; stopped by its pid."""
    port = loopback_port()
    env = {
        **os.environ,
        "SCHEDULED_DATABASE_URL": database_url,
        "SCHEDULED_LOG_LEVEL": "WARNING",
    }
    process = subprocess.Popen(
        api_argv(port),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        if not wait_healthy(api_url(port), API_READY_SECONDS, lambda: process.poll() is None):
            process.kill()
            _, err = process.communicate(timeout=STOP_SECONDS)
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            raise errors.SchedError("the API did not start: " + " | ".join(tail))
        yield "127.0.0.1", port, process.pid
    finally:
        children.stop(process, STOP_SECONDS)
        if process.stderr is not None:
            process.stderr.close()


def _import(
    host: str, port: int, token: str, config: CreateBenchConfig
) -> tuple[_Tally, float, float | None]:
    """`schedctl --api URL job import FILE -o json` of `jobs` lines (each with its own
    idempotency key); the tally has one "request" (the whole command)."""
    tally = _Tally()
    payload = {"bench": "x" * config.payload_bytes}
    run_id = uuid.uuid4().hex[:8]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="bench-import-") as file:
        for number in range(config.jobs):
            body = {
                "schedule": {"delay": "365d"},
                "target": {"type": "queue", "name": "bench-create"},
                "payload": payload,
                "idempotency_key": f"{run_id}-{number}",
            }
            file.write(json.dumps(body, separators=(",", ":")) + "\n")
        file.flush()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
        env.update(SCHEDULED_API_URL=f"http://{host}:{port}", SCHEDULED_API_TOKEN=token)
        schedctl = str(SCHEDULED_D.parent / "schedctl")
        argv = [schedctl, "job", "import", file.name, "-o", "json"]
        began = time.perf_counter()
        done = subprocess.run(
            argv, env=env, capture_output=True, timeout=config.max_seconds + REQUEST_TIMEOUT_SECONDS
        )
        elapsed = time.perf_counter() - began
    try:
        report = json.loads(done.stdout)
    except ValueError:
        tally.failures[f"exit {done.returncode}"] += 1
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise errors.SchedError("job import failed: " + " | ".join(tail)) from None
    tally.latencies.append(elapsed)
    tally.created = int(report["created"])
    tally.statuses[201] += tally.created
    for failure in report["failures"]:  # refused lines, by what refused them
        tally.failures[f"{failure['code']}: {str(failure['message'])[:100]}"] += 1
    rate = report.get("jobs_per_s")
    return tally, elapsed, float(rate) if rate is not None else None


def _drive(
    host: str,
    port: int,
    token: str,
    config: CreateBenchConfig,
    cpu_seconds: Callable[[], float | None],
) -> tuple[_Tally, float, float | None]:
    """The clients' requests; the tally, the seconds from the start barrier (after every
    client's warm-up) to the last answer, and `cpu_seconds()` read at that barrier."""
    tally = _Tally()
    per_request = config.batch_size if config.batch else 1
    requests_total = math.ceil(config.jobs / per_request)
    next_request = iter(range(requests_total))
    take = threading.Lock()
    start = threading.Barrier(config.concurrency + 1)
    deadline = [math.inf]
    payload = {"bench": "x" * config.payload_bytes}
    run_id = uuid.uuid4().hex[:8]
    prefer = {"Prefer": "return=minimal"} if config.minimal else {}

    def body(key: str) -> dict[str, Any]:
        return {
            "schedule": {"delay": "365d"},
            "target": {"type": "queue", "name": "bench-create"},
            "payload": payload,
            "idempotency_key": key,
        }

    def request(client: _Client, number: int, prefix: str) -> tuple[int, list[int]]:
        """One request (number `number`): its latency's status and each job's status."""
        if not config.batch:
            status, _ = client.post("/v1/jobs", body(f"{prefix}-{number}"))
            return status, [status]
        first = number * per_request
        count = min(per_request, config.jobs - first) if prefix == run_id else per_request
        jobs = [body(f"{prefix}-{first + i}") for i in range(count)]
        status, data = client.post("/v1/jobs:batch", {"jobs": jobs}, prefer)
        if status != 200:
            return status, [status] * count
        return status, [int(r["status"]) for r in data["results"]]

    def worker(index: int) -> None:
        client = _Client(host, port, token)
        try:
            for warm in range(WARMUP_REQUESTS):
                request(client, warm, f"warm-{run_id}-{index}")
            start.wait()
            while time.monotonic() < deadline[0]:
                with take:
                    number = next(next_request, None)
                if number is None:
                    return
                began = time.perf_counter()
                try:
                    _, statuses = request(client, number, run_id)
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    with tally.lock:
                        tally.failures[type(exc).__name__] += 1
                    client.reconnect()
                    continue
                took = time.perf_counter() - began
                with tally.lock:
                    tally.latencies.append(took)
                    tally.statuses.update(statuses)
                    tally.created += statuses.count(201)
        finally:
            with tally.lock:
                tally.stale_retries += client.stale_retries
            client.close()

    threads = [
        threading.Thread(target=worker, args=(i,), daemon=True) for i in range(config.concurrency)
    ]
    for thread in threads:
        thread.start()
    start.wait(timeout=API_READY_SECONDS + 60)
    cpu_at_start = cpu_seconds()
    began = time.perf_counter()
    deadline[0] = time.monotonic() + config.max_seconds
    for thread in threads:
        thread.join(config.max_seconds + REQUEST_TIMEOUT_SECONDS)
    return tally, time.perf_counter() - began, cpu_at_start


class _Client:
    """One keep-alive HTTP/1.1 connection with the tenant's token."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.connection = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_SECONDS)
        self.reused = False  # the connection has answered a request: it may have gone stale
        self.stale_retries = 0

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        encoded = json.dumps(body).encode()
        headers = {**self.headers, **headers} if headers else self.headers
        try:
            return self._post(path, encoded, headers)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            # (RemoteDisconnected is a ConnectionResetError.) A server may close an idle
            # keep-alive connection just as the next request goes out on it (a client
            # that waited at the start barrier past the keep-alive timeout): once, on a
            # fresh connection. Safe to send again: every job carries its idempotency
            # key, so one the server did create comes back as a 200 replay.
            if not self.reused:
                raise
            self.stale_retries += 1
            self.reconnect()
            return self._post(path, encoded, headers)

    def _post(self, path: str, encoded: bytes, headers: dict[str, str]) -> tuple[int, Any]:
        self.connection.request("POST", path, encoded, headers)
        response = self.connection.getresponse()
        data = response.read()
        self.reused = True
        return response.status, json.loads(data) if data else None

    def reconnect(self) -> None:
        self.close()
        self.reused = False
        self.connection = http.client.HTTPConnection(
            self.host, self.port, timeout=REQUEST_TIMEOUT_SECONDS
        )

    def close(self) -> None:
        self.connection.close()
