"""Test support for the built-in queue, the worker and the relay: jobs with queue and HTTP
targets, manual runs, row readers, bounded waits, a loopback HTTP endpoint that records and
answers deliveries (`HookServer`), a relay running in a thread (`running_relay`), and worker
and relay child processes (``python -m`` this module) that tests can kill -9, and a Worker
in this process with short test timings (`queue_worker`).

As a program: ``python -m tests.integration.queue_support DB_URL QUEUE OWNER LEASE HEARTBEAT
-- COMMAND...`` runs one Worker, and ``python -m tests.integration.queue_support relay DB_URL
LEASE`` one Relay, until killed or sent SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table, select
from sqlalchemy.engine import Connection

from schedctl.domain.models import RetryPolicy, Target, TargetType
from schedctl.storage.db import schema
from schedctl.storage.db.rows import run_query
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.pipeline.queue import Lease, QueueRepo
from tests.factories import ahead, create_job, make_tenant, once_at, set_tenant
from tests.services.ports import pid_alive

if TYPE_CHECKING:
    from scheduled_d.relay import Relay
    from scheduled_d.worker import Worker

WAIT_SECONDS = 60.0


def queue_job(
    store: Store,
    *,
    queue: str = "q",
    tenant: str | None = None,
    base: float = 0.0,
    cap: float = 0.0,
    **spec_options: Any,
) -> str:
    """A job targeting `queue` whose own schedule is far away: its runs come from trigger().
    Its retries wait `base`, doubling up to `cap` seconds; `spec_options` are those of
    tests.factories.spec (max_attempts, max_concurrency, timeout, payload, ...)."""
    if tenant is None:
        tenant = existing_tenant(store)
    once = once_at(ahead(86_400), queue=queue, **spec_options)
    retry = RetryPolicy(
        max_attempts=once.retry.max_attempts, base_delay_seconds=base, max_delay_seconds=cap
    )
    return create_job(store, tenant, dataclasses.replace(once, retry=retry))


def queued_run(store: Store, **job_options: Any) -> tuple[str, datetime]:
    """A queue_job (with `job_options`) whose one manual run is already moved into its queue
    (a worker can lease it): (job_id, scheduled_at)."""
    job_id = queue_job(store, **job_options)
    scheduled_at = trigger(store, job_id)
    QueueRepo(store).move_outbox()
    return job_id, scheduled_at


def add_dispatched_run(
    connection: Connection,
    job_id: str,
    at: datetime,
    tenant: str,
    *,
    trigger: str = "manual",
    target: tuple[str, str] = ("queue", "q"),
    dispatched_at: datetime | None = None,
) -> None:
    """A dispatched run (job_id, at) and its outbox row, due at `at`, written directly (as
    a claim would, without one)."""
    key = {"job_id": job_id, "scheduled_at": at, "tenant_id": tenant, "attempt": 1}
    run = {"partition": 0, "trigger": trigger, "status": "dispatched"}
    connection.execute(schema.runs.insert().values(**key, **run, dispatched_at=dispatched_at))
    target_type, address = target
    row = {"target_type": target_type, "target": address, "available_at": at, "created_at": at}
    connection.execute(schema.outbox.insert().values(**key, **row))


def settle_lease(repo: QueueRepo, lease: Lease, *, ok: bool) -> None:
    """Ack the leased run (exit 0), or fail it (exit 1), as a worker would."""
    at = lease.leased_until
    if ok:
        assert repo.ack(lease, exit_code=0, output_tail="", started_at=at, finished_at=at)
    else:
        assert repo.fail(
            lease, error="exit 1", exit_code=1, output_tail="", started_at=at, finished_at=at
        )


def existing_tenant(store: Store) -> str:
    with store.read() as connection:
        found = connection.execute(select(schema.tenants.c.tenant_id)).scalars().first()
    return found if found is not None else make_tenant(store)


def trigger(store: Store, job_id: str) -> datetime:
    """A manual run: a run row plus an outbox row; returns its scheduled_at."""
    return JobRepo(store).trigger(job_id, actor="test").scheduled_at


def run_row(store: Store, job_id: str, scheduled_at: datetime) -> dict[str, Any]:
    with store.read() as connection:
        return dict(connection.execute(run_query(job_id, scheduled_at)).mappings().one())


def attempts(store: Store, job_id: str, scheduled_at: datetime) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = (
            connection.execute(
                select(schema.run_attempts)
                .where(
                    schema.run_attempts.c.job_id == job_id,
                    schema.run_attempts.c.scheduled_at == scheduled_at,
                )
                .order_by(schema.run_attempts.c.id)
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


def messages(store: Store) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = (
            connection.execute(select(schema.queue_messages).order_by(schema.queue_messages.c.id))
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


def dead_letters(store: Store) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = connection.execute(select(schema.dead_letters)).mappings().all()
    return [dict(r) for r in rows]


def table_snapshot(store: Store, tables: Iterable[Table]) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of `tables`, in a stable order: compared before and after, it shows that
    a refused request changed nothing."""
    result: dict[str, list[tuple[Any, ...]]] = {}
    with store.read() as connection:
        for table in tables:
            rows = connection.execute(select(table)).all()
            result[table.name] = sorted((tuple(r) for r in rows), key=repr)
    return result


def outbox_count(store: Store) -> int:
    with store.read() as connection:
        return len(connection.execute(select(schema.outbox.c.id)).all())


def http_job(
    store: Store,
    url: str,
    *,
    tenant: str | None = None,
    max_attempts: int = 3,
    base: float = 0.0,
    cap: float = 0.0,
    payload: Any = None,
) -> str:
    """A job POSTing to `url` (created past the SSRF check at creation, like a job created
    before its destination was disallowed); its runs come from trigger()."""
    if tenant is None:
        tenant = existing_tenant(store)
    job_spec = dataclasses.replace(
        once_at(ahead(86_400), payload=payload),
        target=Target(TargetType.http, url=url),
        retry=RetryPolicy(
            max_attempts=max_attempts, base_delay_seconds=base, max_delay_seconds=cap
        ),
    )
    return create_job(store, tenant, job_spec)


def set_allow_list(store: Store, tenant_id: str, entries: list[str]) -> None:
    set_tenant(store, tenant_id, allow_list=json.dumps(entries))


def allow_loopback_tenant(store: Store) -> str:
    """A tenant whose allow-list admits 127.0.0.1, where the tests' hook servers listen."""
    tenant = make_tenant(store)
    set_allow_list(store, tenant, ["127.0.0.1"])
    return tenant


def outbox_rows(store: Store) -> list[dict[str, Any]]:
    with store.read() as connection:
        rows = connection.execute(select(schema.outbox).order_by(schema.outbox.c.id)).mappings()
        return [dict(r) for r in rows.all()]


# -- a loopback HTTP endpoint ----------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.time() when the request was read

    @property
    def json(self) -> Any:
        return json.loads(self.body)


# (received, number of this request) -> (status, headers, body)
Responder = Callable[[Received, int], tuple[int, dict[str, str], bytes]]


def answer(status: int = 200, headers: dict[str, str] | None = None, body: bytes = b"ok"):  # type: ignore[no-untyped-def]
    def respond(_received: Received, _number: int) -> tuple[int, dict[str, str], bytes]:
        return status, dict(headers or {}), body

    return respond


def first_attempt_answers(status: int, retry_after: str, body: bytes) -> Responder:
    """Answers a run's first attempt with `status` and `Retry-After: retry_after`, every
    later attempt with 200."""

    def respond(received: Received, _number: int) -> tuple[int, dict[str, str], bytes]:
        if received.json["attempt"] == 1:
            return status, {"Retry-After": retry_after}, body
        return 200, {}, b"ok"

    return respond


@dataclass
class HookServer:
    """A ThreadingHTTPServer on 127.0.0.1 that records every POST and answers with
    `responder`; `hang` makes it hold requests until `release` is set (or the hang
    passes), like an endpoint that stopped answering."""

    responder: Responder = field(default_factory=answer)
    hang: float = 0.0
    received: list[Received] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    connections: int = 0
    in_flight: int = 0  # requests being answered (or held) right now
    max_in_flight: int = 0

    def __post_init__(self) -> None:
        hook = self
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with hook._lock:
                    hook.connections += 1

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                received = Received(self.path, dict(self.headers.items()), body, time.time())
                with hook._lock:
                    hook.received.append(received)
                    number = len(hook.received)
                    hook.in_flight += 1
                    hook.max_in_flight = max(hook.max_in_flight, hook.in_flight)
                try:
                    self._answer(received, number)
                finally:
                    with hook._lock:
                        hook.in_flight -= 1

            def _answer(self, received: Received, number: int) -> None:
                if hook.hang:
                    hook.release.wait(hook.hang)
                    if hook.release.is_set():
                        self.close_connection = True
                        return
                status, headers, answer_body = hook.responder(received, number)
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(answer_body)))
                    self.end_headers()
                    self.wfile.write(answer_body)
                except OSError:
                    self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            # several relays open dozens of connections at once: the default backlog of 5
            # would reset some of them
            request_queue_size = 256
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def count(self) -> int:
        with self._lock:
            return len(self.received)

    def requests(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def close(self) -> None:
        self.release.set()  # hanging handlers return at once
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@contextlib.contextmanager
def hook_server(responder: Responder | None = None, *, hang: float = 0.0) -> Iterator[HookServer]:
    server = HookServer(responder or answer(), hang=hang)
    try:
        yield server
    finally:
        server.close()


def fast_relay(store: Store, **options: Any) -> Relay:
    """A Relay that polls and re-reads tenant settings often (tests wait little) and gives an
    HTTP call 5 s; `options` override any of that or add more."""
    from scheduled_d.relay import Relay

    return Relay(
        store, **{"poll_seconds": 0.05, "settings_seconds": 0.2, "http_timeout": 5.0, **options}
    )


@contextlib.contextmanager
def running_loop(run: Callable[[threading.Event], object], name: str) -> Iterator[None]:
    """`run(stop)` (a relay's or a worker's loop) in a thread until the block ends; then
    `stop` is set and the thread joined."""
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(stop,), daemon=True, name=name)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(120)
        assert not thread.is_alive(), f"the {name} did not stop"


@contextlib.contextmanager
def running_relay(relay: Relay) -> Iterator[Relay]:
    """The relay's loop in a thread until the block ends (then stopped and joined)."""
    with running_loop(relay.run, "relay"):
        yield relay


def kill_when_started(worker: subprocess.Popen[bytes], pid_file: Path) -> int:
    """Once the run's command wrote its pid to `pid_file`, kill -9 the worker process (the
    command lives on in its own session); returns the command's pid."""
    wait_for(pid_file.exists, "the first attempt to start")
    wait_for(lambda: pid_file.read_text().strip() != "", "the pid file")
    pid = int(pid_file.read_text())
    worker.send_signal(signal.SIGKILL)
    worker.wait(60)
    return pid


def end_processes(children: Iterable[subprocess.Popen[bytes] | None], orphan: int | None) -> None:
    """A test's cleanup: kill the worker processes still running and the process group of
    a command that outlived its killed worker."""
    for child in children:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(60)
    if orphan is not None and pid_alive(orphan):
        os.killpg(orphan, signal.SIGKILL)


def wait_for(predicate: Callable[[], bool], what: str, seconds: float = WAIT_SECONDS) -> None:
    """Poll until `predicate` holds; the deadline is generous, only there to end a hang."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def relay_main(argv: list[str]) -> int:
    from scheduled_d.relay import Relay

    url, lease = argv
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    store = Store.open(url)
    relay = Relay(store, poll_seconds=0.05, lease_seconds=float(lease), settings_seconds=0.5)
    relay.run(stop)
    store.close()
    return 0


WORKER_LEASE_SECONDS = 2.0


def queue_worker(store: Store, command: list[str], **kwargs: Any) -> Worker:
    """A Worker on queue "q" running `command`, with short test timings (`kwargs` override
    them or add options)."""
    from scheduled_d.worker import Worker

    options: dict[str, Any] = {
        "lease_seconds": WORKER_LEASE_SECONDS,
        "heartbeat_seconds": 0.5,
        "poll_seconds": 0.05,
        "kill_grace_seconds": 1.0,
    }
    options.update(kwargs)
    return Worker(store, "q", command, **options)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "relay":
        return relay_main(argv[1:])
    from scheduled_d.worker import Worker

    separator = argv.index("--")
    url, queue, owner, lease, heartbeat = argv[:separator]
    command = argv[separator + 1 :]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    store = Store.open(url)
    worker = Worker(
        store,
        queue,
        command,
        lease_seconds=float(lease),
        heartbeat_seconds=float(heartbeat),
        poll_seconds=0.1,
        owner=owner,
    )
    worker.run(stop)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
