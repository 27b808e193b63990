"""RabbitMQ as a tenant's queue target, against a real broker started for this module:
persistent, signed messages in a durable queue, published with confirms; broker outages are
retried; persistent messages survive a broker restart; and at least once into the broker
across a relay kill -9 (the relay runs in a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pika  # type: ignore[import-untyped]
import pytest

from schedctl.core.signing import IDEMPOTENCY_HEADER, verify
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.tenants.tenant_delivery import TenantDeliveryRepo
from schedctl_bench.storage.bench import insert_claimed
from scheduled_d.relay import Relay
from tests.factories import make_tenant, set_tenant
from tests.integration.queue_support import (
    attempts,
    messages,
    outbox_count,
    queue_job,
    run_row,
    running_relay,
    trigger,
    wait_for,
)
from tests.services.rabbitmq import RabbitMQServer

ROOT = Path(__file__).resolve().parents[2]
SECRET = "secret"


@pytest.fixture(scope="module")
def broker() -> Iterator[RabbitMQServer]:
    server = RabbitMQServer()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


def channel(broker: RabbitMQServer) -> Any:
    connection = pika.BlockingConnection(pika.URLParameters(broker.url()))
    return connection.channel()


def drain(broker: RabbitMQServer, queue: str) -> list[tuple[Any, bytes]]:
    """Every message in `queue` (acknowledged: the queue is empty afterwards)."""
    ch = channel(broker)
    taken = []
    try:
        while True:
            method, properties, body = ch.basic_get(queue=queue, auto_ack=True)
            if method is None:
                return taken
            taken.append((properties, body))
    finally:
        ch.connection.close()


def depth(broker: RabbitMQServer, queue: str) -> int:
    ch = channel(broker)
    try:
        return int(ch.queue_declare(queue=queue, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker:
        return 0
    finally:
        if ch.connection.is_open:
            ch.connection.close()


@pytest.fixture
def store(db_url: str, broker: RabbitMQServer) -> Iterator[Store]:
    store = Store.open(db_url)
    make_tenant(store)
    TenantDeliveryRepo(store).set_broker("acme", broker.url(), actor="test")
    yield store
    store.close()


def test_messages_arrive_persistent_signed_and_confirmed(
    store: Store, broker: RabbitMQServer, request: pytest.FixtureRequest
) -> None:
    queue = f"orders-{request.node.callspec.id}-{os.getpid()}"
    job = queue_job(store, queue=queue, payload={"order": 42})
    runs = [trigger(store, job) for _ in range(25)]
    with running_relay(Relay(store, poll_seconds=0.05, settings_seconds=0.2)):
        wait_for(
            lambda: all(run_row(store, job, at)["status"] == "succeeded" for at in runs),
            "every run published",
        )
    # never the built-in queue for a tenant with a broker
    assert messages(store) == []
    assert outbox_count(store) == 0
    # durable: declaring it durable again is accepted (a transient queue would refuse)
    ch = channel(broker)
    ch.queue_declare(queue=queue, durable=True)
    ch.connection.close()
    # persistent messages survive a broker restart
    broker.stop()
    broker.start()
    got = drain(broker, queue)
    assert len(got) == len(runs)
    keys = set()
    for properties, body in got:
        assert properties.delivery_mode == 2
        assert properties.content_type == "application/json"
        headers = {k: str(v) for k, v in properties.headers.items()}
        verify(SECRET, headers, body, method="PUBLISH", path=queue)
        document = json.loads(body)
        assert document["job_id"] == job and document["payload"] == {"order": 42}
        assert properties.message_id == headers[IDEMPOTENCY_HEADER]
        assert properties.message_id == f"{job}:{document['scheduled_at']}"
        keys.add(properties.message_id)
    assert keys == {f"{job}:{format_instant(at)}" for at in runs}
    (attempt,) = attempts(store, job, runs[0])
    assert attempt["status"] == "succeeded" and "confirmed by the broker" in attempt["output_tail"]


def test_a_broker_outage_is_retried(
    store: Store, broker: RabbitMQServer, request: pytest.FixtureRequest
) -> None:
    queue = f"outage-{request.node.callspec.id}-{os.getpid()}"
    # up to 100 attempts about 0.5 s apart: the broker is back long before they run out
    job = queue_job(store, queue=queue, max_attempts=100, base=1.0, cap=1.0)
    broker.stop()
    try:
        at = trigger(store, job)
        with running_relay(Relay(store, poll_seconds=0.05, settings_seconds=0.2, http_timeout=2)):
            wait_for(lambda: len(attempts(store, job, at)) >= 1, "a failed attempt")
            failed = attempts(store, job, at)[0]
            assert failed["status"] == "failed" and "broker error" in failed["error"]
            broker.start()
            wait_for(lambda: run_row(store, job, at)["status"] == "succeeded", "the publish")
    finally:
        broker.start()
    (message,) = drain(broker, queue)
    assert json.loads(message[1])["attempt"] >= 2


def _bulk_queue_runs(store: Store, tenant_id: str, queue: str, count: int) -> list[str]:
    """`count` claimed runs of one job (run + outbox rows, due now), like a big claim."""
    job = queue_job(store, queue=queue, tenant=tenant_id, max_attempts=3)
    now = datetime.now(UTC)
    keys = []
    rows = []
    for i in range(count):
        at = now - timedelta(milliseconds=i)
        keys.append(f"{job}:{format_instant(at)}")
        rows.append(at)
    insert_claimed(store, job, tenant_id, ("queue", queue), rows, now=now)
    return keys


def _relay_process(url: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.integration.queue_support", "relay", url, "3"],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.slow
def test_at_least_once_into_the_broker_across_a_relay_kill_9(
    pg_url: str, broker: RabbitMQServer, tmp_path: Path
) -> None:
    store = Store.open(pg_url)
    try:
        tenant = make_tenant(store)
        TenantDeliveryRepo(store).set_broker(tenant, broker.url(), actor="test")
        # paced, so the kill lands in the middle of the work
        set_tenant(store, tenant, dispatch_rate_per_second=400)
        queue = f"kill9-{os.getpid()}"
        total = 2000
        keys = _bulk_queue_runs(store, tenant, queue, total)
        log = tmp_path / "relay.log"
        first = _relay_process(pg_url, log)
        try:
            wait_for(lambda: depth(broker, queue) >= 300, "the first relay publishing", 90)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(30)
        at_kill = depth(broker, queue)
        assert at_kill < total, "the relay finished before the kill: nothing was tested"
        killed_at = time.monotonic()
        second = _relay_process(pg_url, log)
        try:
            wait_for(lambda: outbox_count(store) == 0, "the second relay finishing", 120)
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(60)
        recovered = time.monotonic() - killed_at
        with store.read() as connection:
            statuses = Counter(
                connection.execute(
                    schema.runs.select().with_only_columns(schema.runs.c.status)
                ).scalars()
            )
            lost_rows = connection.execute(
                schema.run_attempts.select().where(schema.run_attempts.c.status == "lost")
            ).all()
        got = Counter(p.message_id for p, _ in drain(broker, queue))
        missing = set(keys) - set(got)
        duplicates = sum(n - 1 for n in got.values())
        print(
            f"\nkill -9 after {at_kill}/{total} in the broker; recovered in {recovered:.1f} s; "
            f"{len(got)} distinct runs in the broker, {duplicates} duplicate(s), "
            f"{len(lost_rows)} lease(s) recorded lost"
        )
        assert not missing
        assert statuses == Counter({"succeeded": total})
    finally:
        store.close()
