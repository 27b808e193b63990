"""Owns what the relay counts: its RelayStats (for tests, benchmarks and its stop line)
and its Prometheus metrics of delivery attempts."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram

DELIVERIES = Counter(
    "scheduled_relay_deliveries",
    "HTTP and RabbitMQ delivery attempts by tenant, kind and verdict",
    ["tenant", "kind", "verdict"],
)
DELIVERY_SECONDS = Histogram(
    "scheduled_relay_delivery_seconds",
    "Duration of one delivery attempt (HTTP call or broker publish with confirm)",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


@dataclass
class RelayStats:
    delivered: int = 0  # attempts that succeeded
    retried: int = 0  # attempts that failed and will be tried again
    dead: int = 0  # runs dead-lettered
    skipped: int = 0  # runs of cancelled jobs, not delivered
    lost: int = 0  # leases of a stopped relay: lost attempts, retried per policy
    stale: int = 0  # outcomes whose lease had moved on (another relay took over)
    routed: int = 0  # queue rows routed to a tenant's RabbitMQ lane
