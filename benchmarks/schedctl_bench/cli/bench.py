"""Owns the `schedctl bench` group and `bench api`: jobs created per second through the REST
API on loopback, and the latency percentiles of POST /v1/jobs (reported, never asserted).
The dispatch benchmarks (`bench burst`, `bench steady`) live in cli/bench_dispatch.py."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from schedctl.cli.common import (
    OutputOption,
    actor,
    cli_state,
    output_format,
    say,
)
from schedctl.cli.output import OutputFormat, emit
from schedctl.core import errors
from schedctl_bench import children
from schedctl_bench.cli.bench_options import KeepJobsOption, count, seconds
from schedctl_bench.measure import ms, percentile

if TYPE_CHECKING:
    # requests and the storage modules are imported where they are used: `schedctl --help`
    # must not load them
    from schedctl.app.service import Scheduler

app = typer.Typer(help="Benchmarks on the configured database (measured, not asserted).")

API_START_SECONDS = 30.0
WARMUP_PER_THREAD = 5


@dataclass
class _Results:
    latencies: list[float] = field(default_factory=list)  # seconds, successful creates only
    statuses: Counter[int] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


@app.command("api")
def api(
    ctx: typer.Context,
    requests_total: Annotated[int, count("--requests", 1, 1_000_000, "POSTs to send", "-n")] = 2000,
    threads: Annotated[int, count("--threads", 1, 64, "Concurrent clients", "-c")] = 4,
    max_seconds: Annotated[
        float, seconds("--max-seconds", 1.0, 86_400.0, "Stop sending after this")
    ] = 60.0,
    payload_bytes: Annotated[
        int, count("--payload-bytes", 0, 60_000, "Payload size per job")
    ] = 256,
    keep: KeepJobsOption = False,
    output: OutputOption = None,
) -> None:
    """Jobs created per second through `scheduled-d api` on 127.0.0.1, and the latency of
    POST /v1/jobs (p50/p90/p99/max), against the configured database.

    The API runs as its own process, as in production (and so that the clients here do not
    share its interpreter), on a free loopback port, with the access log off. A throwaway
    tenant with unlimited quotas creates one-time jobs a year ahead (nothing fires); the
    tenant and its jobs are deleted at the end unless --keep."""
    state = cli_state(ctx)
    scheduler = state.database()  # refuses --api: the benchmark starts its own API
    url = state.database_url()
    tenant, token = scheduler.create_tenant(f"bench-api-{uuid.uuid4().hex[:8]}", actor())
    try:
        scheduler.set_quotas(
            tenant.tenant_id,
            max_jobs=requests_total + threads * WARMUP_PER_THREAD + 10,
            create_rate_per_minute=1_000_000_000,
            actor=actor(),
        )
        with _api_process(url) as base_url:
            results, elapsed = _run(
                base_url, token, requests_total, threads, max_seconds, payload_bytes
            )
    finally:
        if not keep:
            _delete_tenant(scheduler, tenant.tenant_id)
    report = _report(
        scheduler, results, elapsed, requests_total, threads, payload_bytes, tenant.name, keep
    )
    fmt = output_format(ctx, output)
    if fmt is OutputFormat.json:
        emit(report, fmt)
        return
    emit(report, fmt, title="bench api: POST /v1/jobs on loopback")


def _run(
    base_url: str,
    token: str,
    total: int,
    threads: int,
    max_seconds: float,
    payload_bytes: int,
) -> tuple[_Results, float]:
    import requests

    body = {
        "schedule": {"delay": "365d"},
        "target": {"type": "queue", "name": "bench"},
        "payload": {"bench": "x" * payload_bytes},
    }
    results = _Results()
    sent = [0]
    sent_lock = threading.Lock()
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def client() -> None:
        with requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {token}"
            for _ in range(WARMUP_PER_THREAD):  # connections and caches, not measured
                session.post(f"{base_url}/v1/jobs", json=body, timeout=30)
            start.wait()
            while time.monotonic() < deadline[0]:
                with sent_lock:
                    if sent[0] >= total:
                        return
                    sent[0] += 1
                began = time.perf_counter()
                try:
                    response = session.post(f"{base_url}/v1/jobs", json=body, timeout=30)
                except requests.RequestException as exc:
                    with results.lock:
                        results.failures[type(exc).__name__] += 1
                    continue
                took = time.perf_counter() - began
                with results.lock:
                    results.statuses[response.status_code] += 1
                    if response.status_code == 201:
                        results.latencies.append(took)

    workers = [threading.Thread(target=client, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    deadline[0] = time.monotonic() + max_seconds + 3600.0  # set for real at the barrier
    start.wait()
    began = time.perf_counter()
    deadline[0] = time.monotonic() + max_seconds
    for worker in workers:
        worker.join(max_seconds + 60)
    return results, time.perf_counter() - began


def _report(
    scheduler: Scheduler,
    results: _Results,
    elapsed: float,
    total: int,
    threads: int,
    payload_bytes: int,
    tenant: str,
    keep: bool,
) -> dict[str, Any]:
    from schedctl.storage.db.engine import redact
    from schedctl.storage.jobs.payloads import payload_cipher

    created = len(results.latencies)
    other = {str(k): v for k, v in sorted(results.statuses.items()) if k != 201}
    other.update(results.failures)
    return {
        "database": redact(str(scheduler.store.engine.url)),
        "dialect": scheduler.store.dialect.name,
        "payload_encryption": payload_cipher() is not None,
        "requests": total,
        "threads": threads,
        "payload_bytes": payload_bytes,
        "created": created,
        "errors": other,
        "elapsed_s": round(elapsed, 3),
        "jobs_per_s": round(created / elapsed, 1) if elapsed > 0 else None,
        "p50_ms": ms(percentile(results.latencies, 50)),
        "p90_ms": ms(percentile(results.latencies, 90)),
        "p99_ms": ms(percentile(results.latencies, 99)),
        "max_ms": ms(max(results.latencies) if results.latencies else None),
        "tenant": tenant if keep else None,
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _api_process(database_url: str) -> Any:
    """`scheduled-d api` on a free loopback port; yields its base URL, stops it by its pid."""
    port = _free_port()
    env = {**os.environ, "SCHEDULED_LOG_LEVEL": "WARNING"}
    with tempfile.TemporaryDirectory(prefix="schedctl-bench-") as tmp:
        log_path = Path(tmp) / "api.log"
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "scheduled_d",
                    "api",
                    "--db",
                    database_url,
                    "--listen",
                    f"127.0.0.1:{port}",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        base_url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(base_url, process, log_path)
            yield base_url
        finally:
            children.stop(process, 20)


def _wait_healthy(base_url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    import requests

    deadline = time.monotonic() + API_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if requests.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
    raise errors.SchedError(
        "the API server did not start: " + (" | ".join(tail) or f"exit {process.poll()}")
    )


def _delete_tenant(scheduler: Scheduler, tenant_id: str) -> None:
    """Remove what the benchmark made: its jobs (and any runs), tokens, audit rows, tenant."""
    from schedctl_bench.storage import bench as bench_rows

    bench_rows.delete_tenant(scheduler.store, tenant_id)


if __name__ == "__main__":  # pragma: no cover
    say("use `schedctl bench api`")
