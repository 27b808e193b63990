"""One settle path for the outbox relay and the built-in queue, on SQLite and a real
Postgres: a delivery that raises is a retryable failed attempt (then one dead letter), a
lost outbox lease counts as an attempt, output is clipped to its end, a cancelled job's
run is skipped from the same statuses on both paths, and broker routing never strands a
run whose tenant's broker is being removed."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select, text, update

from schedctl.delivery.http import HttpDelivery, parse_retry_after
from schedctl.domain.models import Lane, RunStatus, TargetType, Verdict
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.outbox import DeliveryOutcome, OutboxRepo
from schedctl.storage.pipeline.queue import QueueRepo
from schedctl.storage.pipeline.settle import (
    CANCELLED_ERROR,
    LOST_ERROR,
    MAX_OUTPUT_CHARS,
    MAX_TEXT_CHARS,
    SKIPPABLE_STATUSES,
    clip,
)
from schedctl.storage.tenants.tenant_delivery import TenantDeliveryRepo
from tests.factories import make_tenant
from tests.integration.queue_support import (
    allow_loopback_tenant,
    attempts,
    dead_letters,
    fast_relay,
    first_attempt_answers,
    hook_server,
    http_job,
    messages,
    outbox_count,
    outbox_rows,
    queue_job,
    queued_run,
    run_row,
    running_relay,
    trigger,
    wait_for,
)

BROKER = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture
def store(store: Store) -> Store:
    allow_loopback_tenant(store)
    return store


def set_run_status(store: Store, job: str, at: datetime, status: str) -> None:
    with store.tx() as connection:
        connection.execute(
            update(schema.runs)
            .where(schema.runs.c.job_id == job, schema.runs.c.scheduled_at == at)
            .values(status=status)
        )


# -- exceptions inside a delivery ----------------------------------------------------------


class ExplodingHttp(HttpDelivery):
    """An HTTP delivery with a bug: every call raises."""

    def deliver(self, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug in the delivery path")

    async def deliver_async(self, **kwargs: Any) -> Any:  # the relay's path
        raise ZeroDivisionError("a bug in the delivery path")


def test_an_exception_inside_a_delivery_is_a_retryable_failed_attempt(store: Store) -> None:
    job = http_job(store, "http://127.0.0.1:9/hook", max_attempts=2)
    at = trigger(store, job)
    with running_relay(fast_relay(store, http=ExplodingHttp(timeout=5.0))):
        wait_for(lambda: run_row(store, job, at)["status"] == "dead", "the dead letter")
    history = attempts(store, job, at)
    assert [(a["attempt"], a["status"]) for a in history] == [(1, "failed"), (2, "failed")]
    assert all("ZeroDivisionError" in a["error"] for a in history)
    (letter,) = dead_letters(store)
    assert (letter["job_id"], letter["attempts"]) == (job, 2)
    assert "ZeroDivisionError" in letter["last_error"]
    assert outbox_count(store) == 0


def test_retry_after_superscript_two_is_an_ordinary_retry(store: Store) -> None:
    """ "²".isdigit() is True and float("²") raises: it once escaped the delivery."""
    assert parse_retry_after("²") is None
    assert parse_retry_after("٣") is None  # Arabic-Indic three: a digit, not ASCII

    with hook_server(first_attempt_answers(503, "²", b"busy")) as server:
        job = http_job(store, server.url(), max_attempts=3, base=0.01, cap=0.01)
        at = trigger(store, job)
        with running_relay(fast_relay(store)):
            wait_for(lambda: run_row(store, job, at)["status"] == "succeeded", "the retry")
        assert [r.json["attempt"] for r in server.requests()] == [1, 2]
    history = attempts(store, job, at)
    assert [(a["attempt"], a["status"]) for a in history] == [(1, "failed"), (2, "succeeded")]
    assert history[0]["error"].startswith("HTTP 503")


# -- lost leases ---------------------------------------------------------------------------


def claim_and_let_expire(store: Store, tenant: str, owner: str) -> int:
    """Claim the tenant's HTTP rows under a lease that runs out at once; returns how many."""
    repo = OutboxRepo(store)
    claimed = repo.claim({Lane(tenant, TargetType.http): 10}, owner, lease_seconds=0.05)
    wait_for(
        lambda: all(r["available_at"] < store.now() for r in outbox_rows(store)),
        "the lease to run out",
    )
    return len(claimed.deliveries)


def test_a_lost_outbox_lease_counts_as_an_attempt(store: Store) -> None:
    tenant = make_tenant(store, "globex")
    job = http_job(store, "http://127.0.0.1:9/hook", tenant=tenant, max_attempts=2)
    at = trigger(store, job)
    repo = OutboxRepo(store)
    for attempt in (1, 2):
        assert claim_and_let_expire(store, tenant, f"relay-{attempt}") == 1
        # the next claim finds the expired lease: a lost attempt, retried or dead-lettered
        result = repo.claim({Lane(tenant, TargetType.http): 10}, "relay-next", lease_seconds=60)
        assert (result.lost, result.deliveries) == (1, [])
        history = attempts(store, job, at)
        assert history[-1]["status"] == "lost" and history[-1]["error"] == LOST_ERROR
        assert history[-1]["worker"] == f"relay-{attempt}"
        if attempt == 1:
            (row,) = outbox_rows(store)
            assert (row["attempt"], row["lease_owner"]) == (2, None)
            assert run_row(store, job, at)["status"] == "lost"
            # no backoff in this job's policy: due again at once
            wait_for(lambda: outbox_rows(store)[0]["available_at"] <= store.now(), "due")
    assert [(a["attempt"], a["status"]) for a in attempts(store, job, at)] == [
        (1, "lost"),
        (2, "lost"),
    ]
    (letter,) = dead_letters(store)
    assert (letter["attempts"], letter["last_error"]) == (2, LOST_ERROR)
    assert run_row(store, job, at)["status"] == "dead"
    assert outbox_count(store) == 0


# -- clipping ------------------------------------------------------------------------------


def test_clip_keeps_the_end() -> None:
    long = "start" + "x" * (2 * MAX_TEXT_CHARS) + "the end"
    clipped = clip(long)
    assert clipped is not None and len(clipped) == MAX_TEXT_CHARS
    assert clipped.endswith("the end") and not clipped.startswith("start")
    assert clip("nul\x00byte") == "nul\ufffdbyte"
    assert clip(None) is None
    # output has its own, larger bound (limits.MAX_OUTPUT_BYTES: 1 MiB)
    output = "start" + "y" * MAX_OUTPUT_CHARS + "the end"
    kept = clip(output, MAX_OUTPUT_CHARS)
    assert kept is not None and len(kept) == MAX_OUTPUT_CHARS and kept.endswith("the end")


def test_both_paths_keep_the_end_of_long_output(store: Store) -> None:
    long = "start" + "x" * (2 * MAX_TEXT_CHARS) + "the end"
    # the built-in queue
    job = queue_job(store)
    at = trigger(store, job)
    queue = QueueRepo(store)
    queue.move_outbox()
    tenant = run_row(store, job, at)["tenant_id"]
    (lease,) = queue.lease("q", "w1", 30, tenant_id=tenant)
    now = datetime.now(UTC)
    assert queue.ack(lease, exit_code=0, output_tail=long, started_at=now, finished_at=now)
    # an outbox delivery whose outcome is as long (the HTTP module reads less of a body;
    # the rule is the settle path's)
    http = http_job(store, "http://127.0.0.1:9/hook", max_attempts=1)
    http_at = trigger(store, http)
    outbox = OutboxRepo(store)
    (delivery,) = outbox.claim(
        {Lane(tenant, TargetType.http): 10}, "relay", lease_seconds=60
    ).deliveries
    outcome = DeliveryOutcome(delivery, Verdict.failed, now, now, error=long, detail=long)
    assert outbox.settle([outcome]).dead == 1
    for job_id, scheduled_at in ((job, at), (http, http_at)):
        (attempt,) = attempts(store, job_id, scheduled_at)
        run = run_row(store, job_id, scheduled_at)
        for tail in (attempt["output_tail"], run["output_tail"]):
            # an output over the old 16 KiB is kept whole (it is under MAX_OUTPUT_CHARS)
            assert tail == long
    (letter,) = dead_letters(store)
    assert len(letter["last_error"]) == MAX_TEXT_CHARS and letter["last_error"].endswith("end")


# -- cancelled jobs ------------------------------------------------------------------------


@pytest.mark.parametrize("status", [s.value for s in SKIPPABLE_STATUSES])
def test_both_paths_skip_a_cancelled_jobs_run_from_the_same_statuses(
    store: Store, status: str
) -> None:
    queued = queue_job(store)
    queued_at = trigger(store, queued)
    QueueRepo(store).move_outbox()  # waiting in the built-in queue
    http = http_job(store, "http://127.0.0.1:9/hook")
    http_at = trigger(store, http)  # waiting in the outbox
    for job, at in ((queued, queued_at), (http, http_at)):
        set_run_status(store, job, at, status)
        JobRepo(store).cancel(job, actor="test")
    tenant = run_row(store, queued, queued_at)["tenant_id"]
    assert QueueRepo(store).lease("q", "w1", 30, tenant_id=tenant) == []
    result = OutboxRepo(store).claim({Lane(tenant, TargetType.http): 10}, "relay", lease_seconds=60)
    assert (result.cancelled, result.deliveries) == (1, [])
    for job, at in ((queued, queued_at), (http, http_at)):
        run = run_row(store, job, at)
        assert (run["status"], run["error"]) == ("skipped", CANCELLED_ERROR)
    assert messages(store) == [] and outbox_count(store) == 0


def test_a_run_that_ended_is_not_skipped_by_a_cancel(store: Store) -> None:
    """Statuses outside the set (here: succeeded, recorded by an earlier delivery whose
    row came back) are history, on both paths alike."""
    assert RunStatus.succeeded not in SKIPPABLE_STATUSES
    queued, queued_at = queued_run(store)
    http = http_job(store, "http://127.0.0.1:9/hook")
    http_at = trigger(store, http)
    for job, at in ((queued, queued_at), (http, http_at)):
        set_run_status(store, job, at, "succeeded")
        JobRepo(store).cancel(job, actor="test")
    tenant = run_row(store, queued, queued_at)["tenant_id"]
    assert QueueRepo(store).lease("q", "w1", 30, tenant_id=tenant) == []
    OutboxRepo(store).claim({Lane(tenant, TargetType.http): 10}, "relay", lease_seconds=60)
    assert {
        run_row(store, j, at)["status"] for j, at in ((queued, queued_at), (http, http_at))
    } == {"succeeded"}
    assert messages(store) == [] and outbox_count(store) == 0


# -- broker routing ------------------------------------------------------------------------


def target_types(store: Store) -> list[str]:
    return [str(r["target_type"]) for r in outbox_rows(store)]


def test_routing_from_a_stale_tenant_list_after_the_broker_was_removed(store: Store) -> None:
    tenant = make_tenant(store, "brokered")
    brokers = TenantDeliveryRepo(store)
    brokers.set_broker(tenant, BROKER, actor="test")
    repo = OutboxRepo(store)
    cached = [t.tenant_id for t in repo.tenant_settings() if t.broker_url]
    assert cached == [tenant]
    job = queue_job(store, tenant=tenant)
    trigger(store, job)
    brokers.set_broker(tenant, None, actor="test")
    # the relay's list is up to a couple of seconds old: the routing transaction reads again
    assert repo.route_broker_rows(cached) == 0
    assert target_types(store) == [TargetType.queue]
    assert QueueRepo(store).move_outbox() == 1


def test_routing_while_the_broker_is_being_removed_strands_nothing(pg_url: str) -> None:
    """The removal holds the tenant row and turns RabbitMQ rows back into queue rows (here:
    none yet); a routing pass started from a list naming the broker waits for it, then
    sees no broker. Before the fix it routed the queue rows right away, the removal's
    commit came after, and they stayed RabbitMQ rows of a tenant without a broker: a lane
    no relay serves."""
    store = Store.open(pg_url)
    try:
        tenant = make_tenant(store, "racing")
        TenantDeliveryRepo(store).set_broker(tenant, BROKER, actor="test")
        repo = OutboxRepo(store)
        cached = [t.tenant_id for t in repo.tenant_settings() if t.broker_url]
        job = queue_job(store, tenant=tenant)
        trigger(store, job)
        with store.engine.connect() as removal:
            transaction = removal.begin()
            # what TenantDeliveryRepo.set_broker(tenant, None) does, held open midway
            removal.execute(
                select(schema.tenants.c.tenant_id)
                .where(schema.tenants.c.tenant_id == tenant)
                .with_for_update(key_share=True)
            )
            removal.execute(
                update(schema.tenants)
                .where(schema.tenants.c.tenant_id == tenant)
                .values(broker_url=None)
            )
            removal.execute(
                update(schema.outbox)
                .where(
                    schema.outbox.c.tenant_id == tenant,
                    schema.outbox.c.target_type == TargetType.rabbitmq.value,
                )
                .values(target_type=TargetType.queue.value, lease_owner=None)
            )
            routed: list[int] = []
            router = threading.Thread(
                target=lambda: routed.append(repo.route_broker_rows(cached)), daemon=True
            )
            router.start()
            wait_for(
                lambda: _waiting_on_a_lock(store) or not router.is_alive(),
                "the routing pass to wait for the removal (or to finish)",
            )
            transaction.commit()
        router.join(60)
        assert routed == [0]
        assert target_types(store) == [TargetType.queue]
        assert QueueRepo(store).move_outbox() == 1
    finally:
        store.close()


def _waiting_on_a_lock(store: Store) -> bool:
    with store.engine.connect() as connection:
        waiting = connection.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar_one()
    return int(waiting) > 0
