"""Wiring of the daemon's modes: builds the components, runs them, shuts them down in order."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from schedctl.coordination.base import Coordinator
from schedctl.coordination.local import LocalCoordinator
from schedctl.coordination.zkaccess import ZooKeeperAccess
from schedctl.coordination.zookeeper import ZooKeeperCoordinator
from schedctl.core import limits
from schedctl.domain.alerts.metrics import export_last_success
from schedctl.domain.config import Config, WorkerConfig
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.claim import ClaimResult
from schedctl.storage.records.alerts import last_successes
from scheduled_d import sdnotify
from scheduled_d.dispatcher import Dispatcher
from scheduled_d.maintenance import record_retention, run_maintenance
from scheduled_d.metrics import export_store, serve_metrics
from scheduled_d.relay import Relay
from scheduled_d.signals import stop_on_signals
from scheduled_d.supervise import ComponentFailed, Supervisor, run_inline
from scheduled_d.worker import Worker

log = logging.getLogger(__name__)

JOIN_SECONDS = 60.0


def make_coordinator(store: Store, config: Config) -> Coordinator:
    """ZooKeeper when configured (a cluster), else the in-process one (embedded)."""
    if config.zookeeper:
        return ZooKeeperCoordinator(
            store,
            config.zookeeper,
            node_name=config.node_name,
            root=config.zookeeper_root,
            session_timeout=config.session_timeout_seconds,
            access=ZooKeeperAccess.from_config(config),
        )
    return LocalCoordinator(store, config.node_name)


def make_dispatcher(
    store: Store,
    config: Config,
    coordinator: Coordinator,
    *,
    on_claimed: Callable[[ClaimResult], None] | None = None,
) -> Dispatcher:
    dispatcher = Dispatcher(
        store,
        coordinator,
        owner=config.node_name,
        batch_size=config.claim_batch_size,
        poll_seconds=config.poll_interval_seconds,
        window_seconds=config.preload_window_seconds,
        on_claimed=on_claimed,
    )
    if isinstance(coordinator, ZooKeeperCoordinator):
        coordinator.on_change = dispatcher.wake  # ownership changed: look again now
    return dispatcher


def _serve_metrics(config: Config, supervisor: Supervisor, stop: threading.Event) -> None:
    """/metrics and /healthz (healthy while no component thread died), if configured."""
    if config.metrics_listen:
        serve_metrics(config.metrics_listen, supervisor.healthy, stop)


def _join(threads: Sequence[threading.Thread]) -> None:
    for thread in threads:
        thread.join(JOIN_SECONDS)
        if thread.is_alive():
            log.warning("%s did not stop within %.0f s", thread.name, JOIN_SECONDS)


def _died(supervisor: Supervisor) -> None:
    """After the orderly shutdown that followed a component's death: exit non-zero."""
    if supervisor.died.is_set():
        dead = ", ".join(supervisor.failures()) or "a component"
        raise ComponentFailed(f"{dead} ended unexpectedly; stopped so that it is restarted")


def run_all(store: Store, config: Config, *, stop: threading.Event | None = None) -> None:
    """Dispatcher + relay + configured workers, stopped in order: claims stop first, then
    the relay drains, then workers finish what they hold. Each component runs under the
    supervisor: restarted after an unexpected exception; if one dies anyway, /healthz turns
    unhealthy, the rest stops in the same order and the process exits non-zero."""
    with stop_on_signals() as (signal_stop, force):
        stop = stop or signal_stop
        supervisor = Supervisor()
        metrics_stop = threading.Event()
        try:
            _run_all(store, config, stop, force, supervisor, metrics_stop)
        finally:
            metrics_stop.set()
        _died(supervisor)


def _run_all(
    store: Store,
    config: Config,
    stop: threading.Event,
    force: threading.Event,
    supervisor: Supervisor,
    metrics_stop: threading.Event,
) -> None:
    api_server = None
    if config.api_enabled:
        # imported here: the dispatcher-only modes need no web stack
        from schedctl.app.service import Scheduler
        from scheduled_d.api.server import ApiServer

        api_server = ApiServer(
            Scheduler(
                store,
                max_payload_bytes=config.max_payload_bytes,
                alert_policy=config.alert_policy,
                metrics_max_jobs=config.metrics_max_jobs_per_tenant,
            ),
            config.api_listen,
        )
        # first, and binding at once: a taken port fails the start before anything runs
        api_server.start()
        supervisor.watch("api", api_server.is_serving)
    coordinator = make_coordinator(store, config)
    coordinator.start()
    # the relay and workers in use: a restarted one is a new object, and the claim wakes
    # that one (the relay for HTTP and broker runs; the workers for the runs the claim
    # queued itself, which would otherwise wait for their next poll)
    relays: list[Relay] = []
    workers: dict[int, Worker] = {}  # by [[worker]] table

    def claimed(result: ClaimResult) -> None:
        # only when it has work: woken after every claim that only queued runs itself, the
        # relay spent the daemon's CPU on looking
        if relays and (result.relayed or relays[-1].routes_brokers):
            relays[-1].wake()
        for worker in list(workers.values()):
            worker.wake()

    def run_relay_once(stop_relay: threading.Event) -> None:
        relays.append(Relay.from_config(store, config))
        del relays[:-1]
        relays[-1].run(stop_relay)

    dispatcher_stop, relay_stop, worker_stop, maintenance_stop = (
        threading.Event() for _ in range(4)
    )
    dispatch_thread = supervisor.start(
        "dispatcher",
        lambda: make_dispatcher(store, config, coordinator, on_claimed=claimed).run(
            dispatcher_stop
        ),
        dispatcher_stop,
    )
    relay_thread = supervisor.start("relay", lambda: run_relay_once(relay_stop), relay_stop)
    maintenance_thread = supervisor.start(
        "maintenance",
        lambda: run_maintenance(
            store, config.retention_days, maintenance_stop, record_retention(config)
        ),
        maintenance_stop,
    )
    worker_threads = []
    for index, spec in enumerate(config.workers):

        def run_worker_once(spec: WorkerConfig = spec, index: int = index) -> None:
            worker = workers[index] = Worker(
                store,
                spec.queue,
                spec.command,
                concurrency=spec.concurrency,
                lease_seconds=spec.lease_seconds,
                heartbeat_seconds=min(5.0, spec.lease_seconds / 3),
                env=dict(spec.env),
                tenant=spec.tenant,
                alert_command=spec.alert_command,
                output_tail_bytes=spec.output_bytes,
            )
            worker.run(worker_stop, force=force)

        worker_threads.append(
            supervisor.start(f"worker-{spec.queue}", run_worker_once, worker_stop)
        )
    if config.host is not None:
        # the [host] table: this host's job-file worker (one object: @reboot jobs run once
        # per process, not once per supervised restart)
        from scheduled_d.host_worker import HostWorker

        host_worker = HostWorker(store, config.host)
        worker_threads.append(
            supervisor.start(
                "host-worker", lambda: host_worker.run(worker_stop, force=force), worker_stop
            )
        )
    export_store(store)
    export_last_success(partial(last_successes, store))
    _serve_metrics(config, supervisor, metrics_stop)
    sdnotify.announce(  # systemd: READY=1, STATUS=, WATCHDOG=1 while healthy, STOPPING=1
        f"dispatcher: {store.partition_count} partitions; relay; "
        f"{len(worker_threads)} workers" + ("; api" if api_server else ""),
        supervisor.healthy,
        stop,
    )
    log.info(
        "scheduled-d all: %d partitions, %d worker(s), database %s",
        store.partition_count,
        len(worker_threads),
        store.engine.url.render_as_string(hide_password=True),
    )
    _wait(stop, force, supervisor)
    if api_server is not None:
        supervisor.unwatch("api")
        api_server.stop()  # first: no new jobs while the rest winds down
    dispatcher_stop.set()
    _join([dispatch_thread])
    coordinator.stop()
    relay_stop.set()
    _join([relay_thread])
    maintenance_stop.set()
    worker_stop.set()
    _join_until_forced(worker_threads, force)
    _join([maintenance_thread])
    log.info("scheduled-d all: stopped")


def _join_until_forced(threads: Sequence[threading.Thread], force: threading.Event) -> None:
    """Workers finish the commands they run, however long (abandoning one would let its
    lease expire and the run start again elsewhere); a second signal makes them kill."""
    while any(t.is_alive() for t in threads) and not force.is_set():
        for thread in threads:
            thread.join(0.5)
    _join(threads)


def _wait(stop: threading.Event, force: threading.Event, supervisor: Supervisor) -> None:
    """Until a signal, or a component's death (logged; the caller then stops the rest)."""
    while not stop.wait(0.5) and not force.is_set():
        if supervisor.check():
            log.critical(
                "component(s) died: %s; stopping the process", ", ".join(supervisor.failures())
            )
            return


def run_dispatcher(store: Store, config: Config) -> None:
    with stop_on_signals() as (stop, force):
        supervisor = Supervisor()
        metrics_stop = threading.Event()
        try:
            coordinator = make_coordinator(store, config)
            coordinator.start()
            inner, maintenance_stop = threading.Event(), threading.Event()
            thread = supervisor.start(
                "dispatcher",
                lambda: make_dispatcher(store, config, coordinator).run(inner),
                inner,
            )
            maintenance = supervisor.start(
                "maintenance",
                lambda: run_maintenance(
                    store, config.retention_days, maintenance_stop, record_retention(config)
                ),
                maintenance_stop,
            )
            _serve_metrics(config, supervisor, metrics_stop)
            sdnotify.announce(
                f"dispatcher: {store.partition_count} partitions", supervisor.healthy, stop
            )
            _wait(stop, force, supervisor)
            inner.set()
            _join([thread])
            coordinator.stop()
            maintenance_stop.set()
            _join([maintenance])
        finally:
            metrics_stop.set()
        _died(supervisor)


def run_api(store: Store, config: Config) -> None:
    """The `scheduled-d api` mode: serve the tenant API on config.api_listen until
    SIGTERM/SIGINT (and /metrics on config.metrics_listen, like every mode); healthy, for
    /healthz and the systemd watchdog, while the server serves."""
    # imported here: the dispatcher-only modes need no web stack
    from schedctl.app.service import Scheduler
    from scheduled_d.api.server import ApiServer

    with stop_on_signals() as (stop, force):
        server = ApiServer(
            Scheduler(
                store,
                max_payload_bytes=config.max_payload_bytes,
                alert_policy=config.alert_policy,
                metrics_max_jobs=config.metrics_max_jobs_per_tenant,
            ),
            config.api_listen,
        )
        server.start()
        if config.metrics_listen:
            serve_metrics(config.metrics_listen, server.is_serving, stop)
        sdnotify.announce(f"api: {server.url}", server.is_serving, stop)
        try:
            while not stop.wait(0.5) and not force.is_set():
                pass
        finally:
            server.stop(timeout=1.0 if force.is_set() else 15.0)


def run_relay(store: Store, config: Config) -> None:
    with stop_on_signals() as (stop, force):
        supervisor = Supervisor()
        metrics_stop = threading.Event()
        try:
            inner = threading.Event()
            thread = supervisor.start(
                "relay", lambda: Relay.from_config(store, config).run(inner), inner
            )
            export_store(store)
            export_last_success(partial(last_successes, store))
            _serve_metrics(config, supervisor, metrics_stop)
            sdnotify.announce("relay", supervisor.healthy, stop)
            _wait(stop, force, supervisor)
            inner.set()
            _join([thread])
        finally:
            metrics_stop.set()
        _died(supervisor)


def run_worker(
    store: Store,
    queue: str,
    command: Sequence[str],
    *,
    concurrency: int,
    lease_seconds: float,
    max_runs: int | None,
    env: Mapping[str, str] | None = None,
    tenant: str | None = None,
    alert_command: Sequence[str] = (),
    output_bytes: int = limits.DEFAULT_OUTPUT_BYTES,
) -> None:
    with stop_on_signals() as (stop, force):

        def run_once() -> None:
            worker = Worker(
                store,
                queue,
                command,
                concurrency=concurrency,
                lease_seconds=lease_seconds,
                env=env,
                tenant=tenant,
                heartbeat_seconds=min(5.0, lease_seconds / 3),  # as in `all`: a short lease works
                alert_command=alert_command,
                output_tail_bytes=output_bytes,
            )
            worker.run(stop, max_runs=max_runs, force=force)

        # on the main thread: an exception is logged and the worker starts again; one that
        # escapes anyway (BaseException) ends the process non-zero
        # the worker loop runs in this thread: alive while the process is
        sdnotify.announce(f"worker: queue {queue}, concurrency {concurrency}", lambda: True, stop)
        run_inline(f"worker-{queue}", run_once, stop)
