"""Owns the tests that a worker's settle whose commit answer was lost (the connection dropped
during COMMIT, as in a database failover) is found recorded when settled again, not
reported as a lost lease: on SQLite and Postgres by settling twice, and on Postgres through
a loopback proxy that passes the COMMIT to the server and drops the connection instead of
its answer."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from datetime import UTC, datetime

import pytest

from schedctl.core import errors
from schedctl.domain.leasing import Finish, Settlement
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import Lease, QueueRepo, attempt_of
from tests.integration.queue_support import (
    attempts,
    existing_tenant,
    messages,
    queued_run,
    run_row,
)

# psycopg's commit: a simple-protocol Query message carrying COMMIT
_COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"


def _settlement(finish: Finish) -> Settlement:
    now = datetime.now(UTC)
    error = None if finish is Finish.succeeded else "exit code 1"
    return Settlement(finish, error, 0 if error is None else 1, "out", now, now)


def _leased(store: Store, **job_options: object) -> tuple[QueueRepo, Lease]:
    queued_run(store, **job_options)
    repo = QueueRepo(store)
    (lease,) = repo.lease("q", "worker-a", 30.0, 10, tenant_id=existing_tenant(store))
    return repo, lease


@pytest.mark.parametrize("finish", [Finish.succeeded, Finish.failed])
def test_a_settle_repeated_after_it_committed_is_reported_recorded(
    store: Store, finish: Finish
) -> None:
    # failed with attempts left: the message stays (attempt 2, no owner), so the repeat
    # finds no lease of its own either; both are answered from the run's attempts
    repo, lease = _leased(store, max_attempts=3)
    item = (lease, attempt_of(lease, _settlement(finish)))
    assert repo.finish_many([item]) == [True]
    before = run_row(store, lease.job_id, lease.scheduled_at)
    assert repo.finish_many([item]) == [True]
    assert len(attempts(store, lease.job_id, lease.scheduled_at)) == 1
    assert run_row(store, lease.job_id, lease.scheduled_at) == before


def test_a_settle_after_the_reaper_took_the_lease_is_still_not_recorded(store: Store) -> None:
    repo, lease = _leased(store, max_attempts=3)
    assert repo.finish_many([(lease, attempt_of(lease, _settlement(Finish.succeeded)))])
    # another owner's settle of the same attempt is not this one's
    other = Lease(**{**lease.__dict__, "owner": "worker-b"})
    assert repo.finish_many([(other, attempt_of(other, _settlement(Finish.succeeded)))]) == [False]


class _CommitAnswerDropper:
    """A loopback TCP proxy to Postgres; while armed, a connection that sends COMMIT is
    cut when the server answers it (the server has committed; the client never hears)."""

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream, timeout=10)
            self._sockets += [client, server]
            committing = threading.Event()
            threading.Thread(
                target=self._pump, args=(client, server, committing, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(server, client, committing, False), daemon=True
            ).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, committing: threading.Event, up: bool
    ) -> None:
        try:
            while data := source.recv(65536):
                if not up and committing.is_set():
                    # the COMMIT's answer: cut the connection instead of passing it on
                    self.dropped.set()
                    for each in (source, sink):
                        each.shutdown(socket.SHUT_RDWR)
                    return
                sink.sendall(data)
                if up and self.armed.is_set() and _COMMIT in data:
                    self.armed.clear()
                    committing.set()
        except OSError:
            pass
        finally:
            for each in (source, sink):
                each.close()

    def close(self) -> None:
        self._listener.close()
        for each in self._sockets:
            each.close()


@contextmanager
def _proxied(pg_url: str) -> Iterator[tuple[_CommitAnswerDropper, str]]:
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    assert url.host is not None and url.port is not None
    proxy = _CommitAnswerDropper(url.host, url.port)
    try:
        proxied = url.set(host="127.0.0.1", port=proxy.port, query={"sslmode": "disable"})
        yield proxy, proxied.render_as_string(hide_password=False)
    finally:
        proxy.close()


@pytest.mark.postgres
def test_a_settle_whose_commit_answer_was_lost_is_found_recorded(pg_url: str) -> None:
    with closing(Store.open(pg_url)) as direct, _proxied(pg_url) as (proxy, url):
        _, lease = _leased(direct)
        with closing(Store.open(url)) as store:
            repo = QueueRepo(store)
            item = (lease, attempt_of(lease, _settlement(Finish.succeeded)))
            proxy.armed.set()
            with pytest.raises(errors.StoreUnavailable):
                repo.finish_many([item])
            assert proxy.dropped.is_set()
            # committed though unheard: the run is recorded, its message gone
            assert run_row(direct, lease.job_id, lease.scheduled_at)["status"] == "succeeded"
            assert messages(direct) == []
            # the caller settles again (the pool connects anew): recorded, once
            assert repo.finish_many([item]) == [True]
        assert len(attempts(direct, lease.job_id, lease.scheduled_at)) == 1
