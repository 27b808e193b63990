"""Owns the tenant worker's start (`scheduled-d worker --api URL`): a Worker over the REST
API with the tenant's token, stopped by the usual signals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from schedctl.core import limits
from scheduled_d.signals import stop_on_signals
from scheduled_d.worker.loop import Worker


def run_api_worker(
    api_url: str,
    token: str,
    queue: str,
    command: Sequence[str],
    *,
    concurrency: int,
    lease_seconds: float,
    max_runs: int | None,
    env: Mapping[str, str] | None = None,
    output_bytes: int = limits.DEFAULT_OUTPUT_BYTES,
) -> None:
    """The tenant worker (`scheduled-d worker --api URL`): leases, heartbeats and settles
    through the REST API with the tenant's token; no database, no database code."""
    from schedctl.clients.queue_client import ApiLeaseBackend

    heartbeat = min(5.0, lease_seconds / 3)
    backend = ApiLeaseBackend(
        api_url,
        token,
        timeout=max(1.0, min(10.0, lease_seconds / 3)),
        connections=concurrency,
    )
    try:
        with stop_on_signals() as (stop, force):
            worker = Worker(
                backend,
                queue,
                command,
                concurrency=concurrency,
                lease_seconds=lease_seconds,
                heartbeat_seconds=heartbeat,
                env=env,
                output_tail_bytes=output_bytes,
            )
            worker.run(stop, max_runs=max_runs, force=force)
    finally:
        backend.close()
