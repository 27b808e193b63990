"""Owns the alert-related Prometheus series: failed attempts and dead letters per tenant
(counted by the process that settles them), and each alerting job's last success.

Tenants and jobs are labelled with their names. Cardinality: the two counters have one
series per tenant; the last-success gauge has one
series per active job that has a no_success setting of its own (not per job), so its size
is chosen by the operators who ask for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

FAILURES = Counter(
    "scheduled_run_failures",
    "Failed (or lost) delivery attempts settled by this process, per tenant.",
    ["tenant"],
)
DEAD_LETTERS = Counter(
    "scheduled_dead_letters",
    "Runs dead-lettered by this process, per tenant.",
    ["tenant"],
)

Source = Callable[[], list[tuple[str, str, datetime]]]


class _LastSuccess(Collector):
    """scheduled_job_last_success_timestamp_seconds{tenant,job} (tenant and job names),
    read at scrape time. While the database cannot be read, the last values read are
    served: a last success does not move back, and an alert on its age keeps working
    (scheduled_store_up says the store is away)."""

    def __init__(self) -> None:
        self.source: Source | None = None
        self.last: list[tuple[str, str, datetime]] = []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "scheduled_job_last_success_timestamp_seconds",
            "Unix time of the last successful run of each job with a no_success alert "
            "(the last value read while the database is unreachable).",
            labels=["tenant", "job"],
        )
        source = self.source
        if source is not None:
            try:
                self.last = rows = source()
            except Exception:  # a scrape must not fail because the database is away
                rows = self.last
            for tenant, job, at in rows:
                family.add_metric([tenant, job], at.timestamp())
        yield family


_LAST_SUCCESS = _LastSuccess()
REGISTRY.register(_LAST_SUCCESS)


def export_last_success(source: Source | None) -> None:
    """Read the last-success series from `source` (None: stop exporting them)."""
    _LAST_SUCCESS.source = source
    _LAST_SUCCESS.last = []
