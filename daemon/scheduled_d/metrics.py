"""Prometheus metrics of the daemon and the small HTTP server for /metrics and /healthz."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socket import AF_INET6

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from schedctl import errors
from schedctl.config import parse_listen
from schedctl.storage.queue import QueueStat

log = logging.getLogger(__name__)

DISPATCH_LATENESS = Histogram(
    "scheduled_dispatch_lateness_seconds",
    "Claim time minus fire time of each dispatched run.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
CLAIMS = Counter("scheduled_claims_total", "Runs claimed (dispatched) by this process.")
SKIPPED = Counter("scheduled_skipped_total", "Runs recorded as skipped by misfire policies.")
STALE = Counter(
    "scheduled_stale_claims_total",
    "Claims that found the job changed (claimed elsewhere, cancelled).",
)
FENCED = Counter("scheduled_fenced_batches_total", "Claim batches refused by the epoch check.")
OWNED_PARTITIONS = Gauge("scheduled_owned_partitions", "Partitions this dispatcher owns.")
MAX_EPOCH = Gauge("scheduled_partition_epoch_max", "Highest fencing epoch this dispatcher holds.")
PRELOADED = Gauge("scheduled_preloaded_runs", "Runs held in the dispatcher's memory window.")
HOST_DRIFT = Gauge(
    "scheduled_host_jobs_drift",
    "Central jobs this host's job files would create, change or remove (`schedctl apply "
    "--check`), at the host worker's last check; -1 when it could not check.",
)

HealthCheck = Callable[[], bool]
QueueStats = Callable[[], Sequence[QueueStat]]


class _QueueDepths(Collector):
    """scheduled_queue_messages{tenant, queue, state}: the built-in queues per tenant (a
    queue is a tenant's), and scheduled_queue_oldest_ready_age_seconds{tenant, queue}: how
    long each queue's oldest ready run has waited for a worker (0 when none is ready; alert
    on it: a queue that no worker reads grows it without bound). Read from the database at
    each scrape."""

    def __init__(self) -> None:
        self.source: QueueStats | None = None

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "scheduled_queue_messages",
            "Built-in queue messages by tenant, queue and state (ready, delayed, leased).",
            labels=["tenant", "queue", "state"],
        )
        oldest = GaugeMetricFamily(
            "scheduled_queue_oldest_ready_age_seconds",
            "Seconds the oldest ready (not leased) message of each built-in queue has waited.",
            labels=["tenant", "queue"],
        )
        source = self.source
        if source is not None:
            try:
                stats = source()
            except Exception as exc:  # the other metrics are still worth a scrape
                log.warning("metrics: queue depths unavailable: %s", exc)
                stats = ()
            for q in stats:
                for state, value in (
                    ("ready", q.depth.ready),
                    ("delayed", q.depth.delayed),
                    ("leased", q.depth.leased),
                ):
                    family.add_metric([q.tenant, q.queue, state], value)
                oldest.add_metric([q.tenant, q.queue], q.oldest_ready_seconds)
        yield family
        yield oldest


_QUEUE_DEPTHS = _QueueDepths()
REGISTRY.register(_QUEUE_DEPTHS)


def export_queue_depths(source: QueueStats | None) -> None:
    """Scrapes of this process report the queues `source` returns (QueueRepo.stats);
    None: none."""
    _QUEUE_DEPTHS.source = source


class _Handler(BaseHTTPRequestHandler):
    health: HealthCheck = staticmethod(lambda: True)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            body, status, kind = generate_latest(), 200, CONTENT_TYPE_LATEST
        elif self.path == "/healthz":
            healthy = type(self).health()
            body = b"ok\n" if healthy else b"unhealthy\n"
            status, kind = (200 if healthy else 503), "text/plain"
        else:
            body, status, kind = b"not found\n", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        del format, args  # scrapes every few seconds would drown the log


class _Server6(ThreadingHTTPServer):
    address_family = AF_INET6


def serve_metrics(listen: str, health: HealthCheck, stop: threading.Event) -> threading.Thread:
    """Serve /metrics and /healthz on `listen` ("host:port") until `stop` is set."""
    host, port = parse_listen(listen, "metrics_listen", default_host="127.0.0.1")
    handler = type("Handler", (_Handler,), {"health": staticmethod(health)})
    server_class = _Server6 if ":" in host else ThreadingHTTPServer  # IPv6 or IPv4
    try:
        server = server_class((host, port), handler)
    except OSError as exc:  # a port in use is the operator's to fix, not a traceback
        raise errors.ConfigError(
            f"cannot listen on {listen}: {exc.strerror or exc}", field="metrics_listen"
        ) from exc
    server.daemon_threads = True

    def run() -> None:
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        stop.wait()
        server.shutdown()
        server.server_close()

    thread = threading.Thread(target=run, name="metrics", daemon=True)
    thread.start()
    log.info("metrics on http://%s/metrics", listen)
    return thread
