"""Wiring of the daemon's modes: builds the components, runs them, shuts them down in order."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from schedctl.config import Config
from schedctl.coordination.base import Coordinator
from schedctl.coordination.local import LocalCoordinator
from schedctl.coordination.zookeeper import ZooKeeperCoordinator
from schedctl.storage.claim import ClaimResult
from schedctl.storage.queue import QueueRepo
from schedctl.storage.store import Store
from scheduled_d import sdnotify
from scheduled_d.dispatcher import Dispatcher
from scheduled_d.maintenance import run_maintenance
from scheduled_d.metrics import export_queue_depths, serve_metrics
from scheduled_d.relay import Relay
from scheduled_d.signals import stop_on_signals
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


def _serve_metrics(
    config: Config, threads: Sequence[threading.Thread], stop: threading.Event
) -> None:
    """/metrics and /healthz (healthy while every component thread runs), if configured."""
    if config.metrics_listen:
        serve_metrics(config.metrics_listen, lambda: all(t.is_alive() for t in threads), stop)


def _start(name: str, target: object) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def _join(threads: Sequence[threading.Thread]) -> None:
    for thread in threads:
        thread.join(JOIN_SECONDS)
        if thread.is_alive():
            log.warning("%s did not stop within %.0f s", thread.name, JOIN_SECONDS)


def run_all(store: Store, config: Config, *, stop: threading.Event | None = None) -> None:
    """Dispatcher + relay + configured workers, stopped in order: claims stop first, then
    the relay drains, then workers finish what they hold."""
    with stop_on_signals() as (signal_stop, force):
        stop = stop or signal_stop
        api_server = None
        if config.api_enabled:
            # imported here: the dispatcher-only modes need no web stack
            from schedctl.service import Scheduler
            from scheduled_d.api import ApiServer

            api_server = ApiServer(
                Scheduler(store, max_payload_bytes=config.max_payload_bytes), config.api_listen
            )
            # first, and binding at once: a taken port fails the start before anything runs
            api_server.start()
        coordinator = make_coordinator(store, config)
        coordinator.start()
        relay = Relay(store)

        def claimed(_result: ClaimResult) -> None:
            relay.wake()

        dispatcher = make_dispatcher(store, config, coordinator, on_claimed=claimed)
        dispatcher_stop, relay_stop, worker_stop = (threading.Event() for _ in range(3))
        dispatch_thread = _start("dispatcher", lambda: dispatcher.run(dispatcher_stop))
        relay_thread = _start("relay", lambda: relay.run(relay_stop))
        _start("maintenance", lambda: run_maintenance(store, config.retention_days, stop))
        worker_threads = []
        for spec in config.workers:
            worker = Worker(
                store,
                spec.queue,
                spec.command,
                concurrency=spec.concurrency,
                lease_seconds=spec.lease_seconds,
                heartbeat_seconds=min(5.0, spec.lease_seconds / 3),
                env=dict(spec.env),
                tenant=spec.tenant,
            )
            worker_threads.append(
                _start(f"worker-{spec.queue}", lambda w=worker: w.run(worker_stop, force=force))
            )
        export_queue_depths(QueueRepo(store).stats)
        _serve_metrics(config, [dispatch_thread, relay_thread, *worker_threads], stop)
        sdnotify.announce(  # systemd: READY=1, STATUS=, WATCHDOG=1 while healthy, STOPPING=1
            f"dispatcher: {store.partition_count} partitions; relay; "
            f"{len(worker_threads)} workers" + ("; api" if api_server else ""),
            lambda: all(t.is_alive() for t in [dispatch_thread, relay_thread, *worker_threads]),
            stop,
        )
        log.info(
            "scheduled-d all: %d partitions, %d worker(s), database %s",
            store.partition_count,
            len(worker_threads),
            store.engine.url.render_as_string(hide_password=True),
        )
        _wait(stop, force)
        if api_server is not None:
            api_server.stop()  # first: no new jobs while the rest winds down
        dispatcher_stop.set()
        _join([dispatch_thread])
        coordinator.stop()
        relay_stop.set()
        _join([relay_thread])
        worker_stop.set()
        _join_until_forced(worker_threads, force)
        log.info("scheduled-d all: stopped")


def _join_until_forced(threads: Sequence[threading.Thread], force: threading.Event) -> None:
    """Workers finish the commands they run, however long (abandoning one would let its
    lease expire and the run start again elsewhere); a second signal makes them kill."""
    while any(t.is_alive() for t in threads) and not force.is_set():
        for thread in threads:
            thread.join(0.5)
    _join(threads)


def _wait(stop: threading.Event, force: threading.Event) -> None:
    while not stop.wait(0.5) and not force.is_set():
        pass


def run_dispatcher(store: Store, config: Config) -> None:
    with stop_on_signals() as (stop, force):
        coordinator = make_coordinator(store, config)
        coordinator.start()
        dispatcher = make_dispatcher(store, config, coordinator)
        inner = threading.Event()
        thread = _start("dispatcher", lambda: dispatcher.run(inner))
        _start("maintenance", lambda: run_maintenance(store, config.retention_days, stop))
        _serve_metrics(config, [thread], stop)
        sdnotify.announce(f"dispatcher: {store.partition_count} partitions", thread.is_alive, stop)
        _wait(stop, force)
        inner.set()
        _join([thread])
        coordinator.stop()


def run_relay(store: Store, config: Config) -> None:
    with stop_on_signals() as (stop, force):
        relay = Relay(store)
        inner = threading.Event()
        thread = _start("relay", lambda: relay.run(inner))
        export_queue_depths(QueueRepo(store).stats)
        _serve_metrics(config, [thread], stop)
        sdnotify.announce("relay", thread.is_alive, stop)
        _wait(stop, force)
        inner.set()
        _join([thread])


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
) -> None:
    with stop_on_signals() as (stop, force):
        worker = Worker(
            store,
            queue,
            command,
            concurrency=concurrency,
            lease_seconds=lease_seconds,
            env=env,
            tenant=tenant,
            heartbeat_seconds=min(5.0, lease_seconds / 3),  # as in `all`: a short lease works
        )
        # the worker loop runs in this thread: alive while the process is
        sdnotify.announce(f"worker: queue {queue}, concurrency {concurrency}", lambda: True, stop)
        worker.run(stop, max_runs=max_runs, force=force)
