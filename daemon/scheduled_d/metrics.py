"""Prometheus metrics of the daemon and the small HTTP server for /metrics and /healthz.

The metric names are what monitoring/ (the Grafana dashboard and the Prometheus rules)
reads; tests/acceptance/test_monitoring.py checks every name they use is served."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
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

from schedctl.core import errors
from schedctl.domain.config import parse_listen
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import QueueRepo, QueueStat
from schedctl.storage.pipeline.workers import WorkerRepo
from schedctl.storage.records.status import DatabaseStatus, read_database_status

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


# the database gauges are read at most this often, whatever the scrape rate or the number
# of Prometheus servers scraping (the lag read is one index probe per partition)
DATABASE_CACHE_SECONDS = 5.0


@dataclass(frozen=True)
class _Snapshot:
    queues: Sequence[QueueStat]
    status: tuple[DatabaseStatus, int] | None  # and the partition count
    workers: Mapping[tuple[str, str], tuple[str, ...]]


class _Database(Collector):
    """The gauges read from the database at scrape time (cached DATABASE_CACHE_SECONDS):

    scheduled_store_up: 1 when the last read worked, 0 while the database is unreachable
    (the other gauges here are then left out; the last-success gauge keeps its values).
    scheduled_queue_messages{tenant, queue, state}: the built-in queues per tenant (a queue
    is a tenant's; tenant names), scheduled_queue_oldest_ready_age_seconds{tenant, queue}:
    how long each queue's oldest ready run has waited for a worker (0 when none is ready),
    scheduled_queue_live_workers{tenant, queue}: the workers heartbeating on it (0 and
    ready messages: nobody will run them). With the status source (the relay and `all`),
    the cluster's: lag and due runs, the outbox, pending dead letters, partitions and how
    many of them no dispatcher owns."""

    def __init__(self) -> None:
        self.source: QueueStats | None = None
        self.status: Callable[[], tuple[DatabaseStatus, int]] | None = None
        self.workers: Callable[[], Mapping[tuple[str, str], tuple[str, ...]]] | None = None
        self._lock = threading.Lock()
        self._cached: tuple[float, _Snapshot] | None = None

    def reset(self) -> None:
        with self._lock:
            self._cached = None

    def _read(self) -> _Snapshot | None:
        """The snapshot (cached), or None when the database cannot be read."""
        with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < DATABASE_CACHE_SECONDS:
                return self._cached[1]
            try:
                snapshot = _Snapshot(
                    queues=self.source() if self.source is not None else (),
                    status=self.status() if self.status is not None else None,
                    workers=self.workers() if self.workers is not None else {},
                )
            except Exception as exc:  # the other metrics are still worth a scrape
                log.warning("metrics: the database is unreachable: %s", exc)
                self._cached = None
                return None
            self._cached = (now, snapshot)
            return snapshot

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
        live = GaugeMetricFamily(
            "scheduled_queue_live_workers",
            "Live workers (heartbeating) of each built-in queue.",
            labels=["tenant", "queue"],
        )
        if self.source is None and self.status is None:
            yield from (family, oldest, live)
            return
        snapshot = self._read()
        yield GaugeMetricFamily(
            "scheduled_store_up",
            "1 when this process could read the database at its last scrape, else 0.",
            value=0 if snapshot is None else 1,
        )
        if snapshot is None:
            yield from (family, oldest, live)
            return
        for q in snapshot.queues:
            for state, value in (
                ("ready", q.depth.ready),
                ("delayed", q.depth.delayed),
                ("leased", q.depth.leased),
            ):
                family.add_metric([q.tenant, q.queue, state], value)
            oldest.add_metric([q.tenant, q.queue], q.oldest_ready_seconds)
            workers = snapshot.workers.get((q.tenant_id, q.queue), ())
            live.add_metric([q.tenant, q.queue], len(workers))
        yield from (family, oldest, live)
        if snapshot.status is not None:
            yield from _cluster(*snapshot.status)


def _cluster(status: DatabaseStatus, partition_count: int) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "scheduled_lag_seconds",
        "Age of the oldest due run no dispatcher has claimed (0: none is due).",
        value=status.lag.seconds,
    )
    yield GaugeMetricFamily(
        "scheduled_due_runs", "Active jobs due now and not claimed yet.", value=status.lag.due
    )
    outbox = GaugeMetricFamily(
        "scheduled_outbox_messages",
        "Runs waiting in the outbox for the relay, by state (ready, delivering, waiting).",
        labels=["state"],
    )
    outbox.add_metric(["ready"], status.outbox.ready)
    outbox.add_metric(["delivering"], status.outbox.delivering)
    outbox.add_metric(["waiting"], status.outbox.waiting)
    yield outbox
    yield GaugeMetricFamily(
        "scheduled_outbox_oldest_ready_age_seconds",
        "Seconds the oldest deliverable outbox row has waited for the relay.",
        value=status.outbox.age_seconds,
    )
    yield GaugeMetricFamily(
        "scheduled_dead_letters_pending",
        "Dead letters not replayed.",
        value=status.dead_letters,
    )
    yield GaugeMetricFamily(
        "scheduled_partitions",
        "Partitions of the installation (partition_count).",
        value=partition_count,
    )
    owned = {p.partition for p in status.partitions if p.owner is not None}
    yield GaugeMetricFamily(
        "scheduled_partitions_unowned",
        "Partitions no dispatcher owns in the database (their jobs are not dispatched).",
        value=sum(1 for p in range(partition_count) if p not in owned),
    )


_DATABASE = _Database()
REGISTRY.register(_DATABASE)


def export_queue_depths(source: QueueStats | None) -> None:
    """Scrapes of this process report the queues `source` returns (QueueRepo.stats);
    None: none (and no database gauges at all)."""
    _DATABASE.source = source
    if source is None:
        _DATABASE.status = _DATABASE.workers = None
    _DATABASE.reset()


def export_store(store: Store) -> None:
    """Scrapes of this process report the database's gauges: queues, live workers,
    scheduled_store_up and the cluster's (lag, outbox, dead letters, partitions)."""
    _DATABASE.source = QueueRepo(store).stats
    _DATABASE.workers = WorkerRepo(store).live
    _DATABASE.status = partial(_status, store)
    _DATABASE.reset()


def _status(store: Store) -> tuple[DatabaseStatus, int]:
    count = store.partition_count
    return read_database_status(store, count), count


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
