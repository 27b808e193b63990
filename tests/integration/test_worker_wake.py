"""Word that work is ready, on a real Postgres: a claim that fills a built-in queue, and a
relay moving outbox rows into one, notify that queue's workers at commit (one notification
per queue, another tenant's queue of the same name not woken); a claim, a manual trigger,
a dead letter's replay and a chained run notify the relays of new outbox rows; an idle
worker, and an idle relay, whose poll is an hour away act on that word alone."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from datetime import UTC, datetime

import psycopg
from sqlalchemy import text

from schedctl.coordination.local import LocalCoordinator
from schedctl.domain.leasing import LeasedRun
from schedctl.domain.models import Target, TargetType
from schedctl.storage.backend.dialect import OUTBOX_WORD, queue_word
from schedctl.storage.backend.dialect_postgres import QUEUE_CHANNEL
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline import dependencies
from schedctl.storage.pipeline.claim import Claimer
from schedctl.storage.pipeline.dead_letters import DeadLetterRepo
from schedctl.storage.pipeline.queue import QueueRepo
from scheduled_d.direct_backend import DirectBackend
from scheduled_d.relay import Relay
from tests.factories import ago, create_job, make_tenant, once_at
from tests.integration.queue_support import queue_job, run_row, settle_lease, trigger, wait_for
from tests.integration.queue_support import queue_worker as worker

HOUR = 3600.0


@contextmanager
def listening(pg_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with closing(psycopg.connect(dsn, autocommit=True)) as connection:
        connection.execute(f"LISTEN {QUEUE_CHANNEL}")
        yield connection


def heard(connection: psycopg.Connection[tuple[object, ...]]) -> list[str]:
    """The payloads already delivered (a notification arrives at its sender's commit)."""
    return [n.payload for n in connection.notifies(timeout=1.0, stop_after=100)]


def claim_all(store: Store) -> None:
    coordinator = LocalCoordinator(store, "d1")
    coordinator.start()
    claimer = Claimer(store, "d1")
    now = datetime.now(UTC)
    claimer.claim(claimer.load_due(range(1024), now), dict(coordinator.owned()), now)


def test_a_claim_notifies_each_queue_it_filled_once(pg_store: Store, pg_url: str) -> None:
    tenant = make_tenant(pg_store)
    for _ in range(3):
        create_job(pg_store, tenant, once_at(ago(1), queue="backups"))
    create_job(pg_store, tenant, once_at(ago(1), queue="reports"))
    http = Target(TargetType.http, url="https://hooks.example.com/x")
    create_job(pg_store, tenant, dataclasses.replace(once_at(ago(1)), target=http))
    with listening(pg_url) as connection:
        claim_all(pg_store)
        # the HTTP run went to the outbox: the relays' word, once
        words = sorted(heard(connection))
    assert words == sorted(
        [queue_word(tenant, "backups"), queue_word(tenant, "reports"), OUTBOX_WORD]
    )


def test_moving_outbox_rows_into_a_queue_notifies_it(pg_store: Store, pg_url: str) -> None:
    tenant = make_tenant(pg_store)
    job = queue_job(pg_store, tenant=tenant, queue="q")
    with listening(pg_url) as connection:
        trigger(pg_store, job)  # a manual run: through the outbox, a relay's word
        assert heard(connection) == [OUTBOX_WORD]
        assert QueueRepo(pg_store).move_outbox() == 1
        assert heard(connection) == [queue_word(tenant, "q")]


def lease_and_settle(store: Store, tenant: str, *, ok: bool) -> None:
    repo = QueueRepo(store)
    (lease,) = repo.lease("q", "worker/1", 60, limit=5, tenant_id=tenant)
    settle_lease(repo, lease, ok=ok)


def test_a_chained_run_and_a_replayed_dead_letter_notify_the_relays(
    pg_store: Store, pg_url: str
) -> None:
    tenant = make_tenant(pg_store)
    upstream = queue_job(pg_store, tenant=tenant, queue="q")
    downstream = queue_job(pg_store, tenant=tenant, queue="q", max_attempts=1)
    with pg_store.tx() as connection:
        dependencies.add(connection, downstream, tenant, [upstream])
    trigger(pg_store, upstream)
    QueueRepo(pg_store).move_outbox()
    with listening(pg_url) as connection:
        lease_and_settle(pg_store, tenant, ok=True)  # the downstream run: to the outbox
        assert heard(connection) == [OUTBOX_WORD]
        QueueRepo(pg_store).move_outbox()
        assert heard(connection) == [queue_word(tenant, "q")]
        lease_and_settle(pg_store, tenant, ok=False)  # one attempt: a dead letter
        assert heard(connection) == []
        letters = DeadLetterRepo(pg_store).list_letters(tenant_id=tenant)
        DeadLetterRepo(pg_store).replay(letters.items[0].id, tenant_id=tenant, actor="test")
        assert heard(connection) == [OUTBOX_WORD]


def test_a_feed_answers_only_for_its_own_tenants_queue(pg_store: Store) -> None:
    mine, other = make_tenant(pg_store), make_tenant(pg_store, "other")
    dialect, engine = pg_store.dialect, pg_store.engine
    feeds = [dialect.ready_feed(engine, queue_word(t, "q")) for t in (mine, other)]
    try:
        assert all(feed is not None for feed in feeds)
        own, others = [f for f in feeds if f is not None]
        # the first wait listens, and answers True: runs queued before may be unheard
        assert own.wait(1.0) and others.wait(1.0)
        trigger(pg_store, queue_job(pg_store, tenant=mine, queue="q"))
        QueueRepo(pg_store).move_outbox()
        assert own.wait(30.0)
        assert not others.wait(1.0)
    finally:
        for feed in feeds:
            if feed is not None:
                feed.close()


def test_a_feed_hearing_another_queues_word_waits_on_for_its_own(
    pg_store: Store, pg_url: str
) -> None:
    mine, other = make_tenant(pg_store), make_tenant(pg_store, "other")
    feed = pg_store.dialect.ready_feed(pg_store.engine, queue_word(mine, "q"))
    assert feed is not None
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")

    def notify(word: str) -> None:
        with closing(psycopg.connect(dsn, autocommit=True)) as connection:
            connection.execute("SELECT pg_notify(%s, %s)", (QUEUE_CHANNEL, word))

    try:
        assert feed.wait(1.0)  # the first wait listens
        notify(queue_word(other, "q"))
        later = threading.Timer(0.5, notify, (queue_word(mine, "q"),))
        later.start()
        try:
            # the other tenant's word arrives first; the wait goes on to hear its own
            assert feed.wait(30.0)
        finally:
            later.join(10)
        notify(queue_word(other, "q"))
        assert not feed.wait(1.0)  # only another queue's word: no
    finally:
        feed.close()


def test_sqlite_feed_hears_nothing_its_workers_poll(sqlite_url: str) -> None:
    # no word crosses processes on one machine's file: the feed answers after each wait
    # that it heard nothing, and the loops' own polling finds the work
    with closing(Store.open(sqlite_url)) as store:
        feed = store.dialect.ready_feed(store.engine, OUTBOX_WORD)
        try:
            assert feed.wait(0.01) is False
        finally:
            feed.close()
        assert feed.wait(5.0) is False  # closed: answers at once


class CountingBackend(DirectBackend):
    """The worker's own backend, counting the leases that found nothing."""

    empty_looks = 0

    def lease(self, queue: str, owner: str, lease_seconds: float, limit: int) -> list[LeasedRun]:
        leases = super().lease(queue, owner, lease_seconds, limit)
        if not leases:
            self.empty_looks += 1
        return leases


def succeeded(store: Store, job: str, at: datetime) -> Callable[[], bool]:
    return lambda: run_row(store, job, at)["status"] == "succeeded"


def test_an_idle_worker_starts_a_run_on_the_word_not_its_poll(pg_store: Store) -> None:
    tenant = make_tenant(pg_store)
    job = queue_job(pg_store, tenant=tenant, queue="q")
    backend = CountingBackend(pg_store, tenant)
    w = worker(backend, ["true"], poll_seconds=HOUR)  # type: ignore[arg-type]

    def listening_for_runs() -> bool:
        return listeners(pg_store) > 0

    taken: list[int] = []
    stop = threading.Event()
    thread = threading.Thread(target=lambda: taken.append(w.run(stop)), daemon=True)
    thread.start()
    try:
        # listening, and past its first look at the empty queue: its next poll is an
        # hour away, so only the word can start the run within the wait
        wait_for(listening_for_runs, "the worker's LISTEN")
        wait_for(lambda: backend.empty_looks > 0, "the worker's first look")
        at = trigger(pg_store, job)
        QueueRepo(pg_store).move_outbox()
        wait_for(succeeded(pg_store, job, at), "the run")
    finally:
        stop.set()
        w.wake()  # out of its hour-long wait, to see `stop`
        thread.join(120)
    assert not thread.is_alive()
    assert taken == [1]


def listeners(store: Store) -> int:
    query = "SELECT count(*) FROM pg_stat_activity WHERE query = :listen"
    with store.read() as connection:
        found = connection.execute(text(query), {"listen": f"LISTEN {QUEUE_CHANNEL}"})
        return int(found.scalar_one())


def test_an_idle_relay_moves_a_triggered_run_on_the_word_not_its_poll(pg_store: Store) -> None:
    tenant = make_tenant(pg_store)
    job = queue_job(pg_store, tenant=tenant, queue="q")
    relay = Relay(pg_store, poll_seconds=HOUR)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: listeners(pg_store) > 0, "the relay's LISTEN")
        at = trigger(pg_store, job)
        wait_for(lambda: relay.moved == 1, "the run moved into its queue")
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive()
    assert run_row(pg_store, job, at)["status"] == "dispatched"


def test_a_worker_over_the_api_has_no_feed() -> None:
    from schedctl.clients.queue_client import ApiLeaseBackend

    backend = ApiLeaseBackend.__new__(ApiLeaseBackend)
    assert backend.ready_feed("q") is None
