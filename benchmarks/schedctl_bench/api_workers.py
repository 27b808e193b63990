"""Owns how benchmarks, soak and chaos runs start tenant workers over the REST API: the
command lines of `scheduled-d api --listen 127.0.0.1:PORT` and of `scheduled-d worker --api
URL --queue Q -- CMD`, the worker's environment (the tenant's token, no database setting),
a free loopback port, and the wait for the API's /healthz.

The API is always started as a process through the `scheduled-d api` command, never by
importing the API's code: what is measured is what is deployed.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import requests

SCHEDULED_D = Path(sys.executable).parent / "scheduled-d"
HEALTH_POLL_SECONDS = 0.2


def loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick; the API binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def api_argv(port: int) -> list[str]:
    """`scheduled-d api` serving on loopback `port`."""
    return [str(SCHEDULED_D), "api", "--listen", f"127.0.0.1:{port}"]


def api_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def api_worker_argv(
    url: str,
    queue: str,
    command: Sequence[str],
    *,
    concurrency: int = 16,
    lease_seconds: float = 30.0,
) -> list[str]:
    """`scheduled-d worker --api URL --queue Q ... -- COMMAND`: the tenant is the token's."""
    return [
        str(SCHEDULED_D),
        "worker",
        "--api",
        url,
        "--queue",
        queue,
        "--concurrency",
        str(concurrency),
        "--lease-seconds",
        f"{lease_seconds:g}",
        "--",
        *command,
    ]


def api_worker_env(base: Mapping[str, str], token: str, **extra: str) -> dict[str, str]:
    """`base` without any SCHEDULED_* setting (no database URL reaches a tenant worker),
    plus the tenant's token and `extra` (SCHEDULED_NODE_NAME, SCHEDULED_LOG_LEVEL, ...)."""
    env = {k: v for k, v in base.items() if not k.startswith("SCHEDULED_")}
    env["SCHEDULED_API_TOKEN"] = token
    env.update(extra)
    return env


def healthy(url: str) -> bool:
    """Whether the API at `url` answers /healthz with 200 (the database reachable too)."""
    try:
        return requests.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except requests.RequestException:
        return False


def wait_healthy(url: str, timeout: float, alive: Callable[[], bool]) -> bool:
    """Poll /healthz until it is 200 (True), the process is no longer `alive` or `timeout`
    passes (False)."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / HEALTH_POLL_SECONDS) + 2):
        if healthy(url):
            return True
        if not alive() or time.monotonic() >= deadline:
            return False
        time.sleep(HEALTH_POLL_SECONDS)
    return False
