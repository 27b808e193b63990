"""Relay leases and their heartbeat: OutboxRepo.extend moves only this relay's leases, a
relay holding calls far longer than its lease keeps them (no second relay delivers them
again meanwhile), and after a real `scheduled-d relay` process is killed with kill -9 its
in-flight runs are delivered by another relay about one lease later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

from schedctl.core.signing import IDEMPOTENCY_HEADER
from schedctl.domain.models import Lane, TargetType
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.outbox import OutboxRepo
from scheduled_d.relay import DEFAULT_LEASE_SECONDS, Relay
from tests.factories import make_tenant
from tests.integration.queue_support import (
    Received,
    allow_loopback_tenant,
    attempts,
    hook_server,
    http_job,
    outbox_rows,
    run_row,
    running_relay,
    set_allow_list,
    trigger,
    wait_for,
)

SCHEDULED_D = str(Path(sys.executable).parent / "scheduled-d")


@pytest.fixture
def store(store: Store) -> Store:
    allow_loopback_tenant(store)
    return store


class FirstCallsHeld:
    """A responder that holds the first request of each run until `release` is set (an
    endpoint that stopped answering for the first relay's calls); a later request for
    the same run -- a redelivery -- and every call to /probe are answered at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, received: Received, _number: int) -> tuple[int, dict[str, str], bytes]:
        if received.path == "/probe":
            return 200, {}, b"ok"
        key = received.headers[IDEMPOTENCY_HEADER]
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        if first:
            self.release.wait(180)
        return 200, {}, b"ok"


def test_extend_moves_only_this_relays_leases_in_one_statement(store: Store) -> None:
    tenant = make_tenant(store, "other")
    set_allow_list(store, tenant, ["127.0.0.1"])
    ours = [http_job(store, "http://127.0.0.1:9/ours") for _ in range(3)]
    theirs = http_job(store, "http://127.0.0.1:9/theirs", tenant=tenant)
    for job in [*ours, theirs]:
        trigger(store, job)
    repo = OutboxRepo(store)
    mine = repo.claim({Lane("tenant-acme", TargetType.http): 10}, "relay-a", 5.0).deliveries
    other = repo.claim({Lane(tenant, TargetType.http): 10}, "relay-a-two", 5.0).deliveries
    assert len(mine) == 3 and len(other) == 1
    before = {r["id"]: r["available_at"] for r in outbox_rows(store)}
    ids = [d.outbox_id for d in mine + other]
    # "relay-a" is a prefix of "relay-a-two", but not its owner: only the three are ours
    assert repo.extend(ids, "relay-a", 120.0) == 3
    after = {r["id"]: r["available_at"] for r in outbox_rows(store)}
    with store.read() as connection:
        now = db_now(connection)
    for d in mine:
        assert after[d.outbox_id] > before[d.outbox_id]
        assert after[d.outbox_id] > now + timedelta(seconds=100)
    assert after[other[0].outbox_id] == before[other[0].outbox_id]
    assert repo.extend([], "relay-a", 120.0) == 0
    # another relay's lease alone: nothing to extend
    assert repo.extend([d.outbox_id for d in other], "relay-a", 120.0) == 0


def test_a_relay_keeps_the_leases_of_calls_that_outlast_them(store: Store) -> None:
    """Calls held for several leases: the heartbeat keeps them this relay's, so a second
    relay polling meanwhile delivers none of them again; then they complete once each."""
    responder = FirstCallsHeld()
    lease = 1.5
    with hook_server(responder) as server:
        jobs = [http_job(store, server.url()) for _ in range(4)]
        runs = [(job, trigger(store, job)) for job in jobs]
        first = Relay(
            store,
            owner="relay-first",
            poll_seconds=0.05,
            settings_seconds=0.2,
            lease_seconds=lease,
            http_timeout=60,
        )
        second = Relay(
            store,
            owner="relay-second",
            poll_seconds=0.05,
            settings_seconds=0.2,
            lease_seconds=lease,
        )
        try:
            with running_relay(first):
                wait_for(lambda: server.count() == len(runs), "every call under way")
                with running_relay(second):
                    held_since = time.monotonic()
                    # the calls hang for more than three leases
                    wait_for(lambda: first.extended >= 4 * 3, "three heartbeats")
                    wait_for(lambda: time.monotonic() - held_since > 3 * lease, "three leases")
                    assert server.count() == len(runs), "a held call was delivered again"
                    assert {r["lease_owner"].split("/")[0] for r in outbox_rows(store)} == {
                        "relay-first"
                    }
                    assert first.held() == len(runs)
                    responder.release.set()
                    wait_for(
                        lambda: all(
                            run_row(store, j, at)["status"] == "succeeded" for j, at in runs
                        ),
                        "the held calls completing",
                    )
        finally:
            responder.release.set()
    print(
        f"\nheld {time.monotonic() - held_since:.1f} s with a {lease} s lease: "
        f"{first.extended} lease extensions, {server.count()} calls for {len(runs)} runs"
    )
    assert first.held() == 0
    assert second.stats.lost == 0 and first.stats.stale == 0
    keys = Counter(r.headers[IDEMPOTENCY_HEADER] for r in server.requests())
    assert len(keys) == len(runs) and set(keys.values()) == {1}
    for job, at in runs:
        assert [(a["status"], a["worker"]) for a in attempts(store, job, at)] == [
            ("succeeded", "relay-first")
        ]


def test_defaults_lease_heartbeat_and_deadline(store: Store) -> None:
    relay = Relay(store)
    try:
        assert relay.lease_seconds == DEFAULT_LEASE_SECONDS == 9.0
        assert relay.heartbeat_seconds == pytest.approx(9.0 / 3)
        assert relay.http.timeout == 7.0  # shorter than the lease by a margin
    finally:
        relay.close()
    # a long deadline makes the default lease longer; a short lease, the deadline shorter
    slow = Relay(store, http_timeout=45)
    short = Relay(store, lease_seconds=3)
    try:
        assert slow.lease_seconds >= 45 + 1
        assert short.http.timeout < 3
    finally:
        slow.close()
        short.close()


# -- kill -9 of a real relay process -----------------------------------------------------------


def _relay_process(url: str, log: Path, lease: float, in_flight: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SCHEDULED_DATABASE_URL": url,
        "SCHEDULED_RELAY_LEASE_SECONDS": str(lease),
        # the first relay's calls are held far past the lease: only the heartbeat keeps them
        "SCHEDULED_HTTP_TIMEOUT_SECONDS": "120",
        "SCHEDULED_RELAY_MAX_IN_FLIGHT": str(in_flight),
        "SCHEDULED_LOG_LEVEL": "INFO",
    }
    with log.open("ab") as out:
        return subprocess.Popen(
            [SCHEDULED_D, "relay"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_in_flight_runs_of_a_relay_killed_with_kill_9_are_delivered_by_another(
    pg_runtime_url: str, tmp_path: Path
) -> None:
    pg_url = pg_runtime_url  # the relays run as the runtime role (no DDL), as deployed
    lease = 3.0
    count = 6
    store = Store.open(pg_url)
    log = tmp_path / "relays.log"
    responder = FirstCallsHeld()
    first = second = None
    passed = False
    try:
        tenant = make_tenant(store)
        probe_tenant = make_tenant(store, "probe")
        for t in (tenant, probe_tenant):
            set_allow_list(store, t, ["127.0.0.1"])
        with hook_server(responder) as server:
            jobs = [http_job(store, server.url("/held")) for _ in range(count)]
            runs = [(job, trigger(store, job)) for job in jobs]
            # the first relay takes every run; its calls hang, and fill it (max in flight)
            first = _relay_process(pg_url, log, lease, in_flight=count)
            wait_for(lambda: server.count() == count, "the first relay's calls", 120)
            claimed_at = time.monotonic()
            second = _relay_process(pg_url, log, lease, in_flight=count)
            # the second relay is up and polling: it delivers a probe run of another tenant
            # (the first relay is full and takes none)
            probe = http_job(store, server.url("/probe"), tenant=probe_tenant)
            probe_at = trigger(store, probe)
            wait_for(
                lambda: run_row(store, probe, probe_at)["status"] == "succeeded",
                "the second relay delivering the probe",
                120,
            )
            (probe_attempt,) = attempts(store, probe, probe_at)
            assert f":{second.pid}:" in probe_attempt["worker"]
            # both alive, calls held for more than two leases: none is delivered again
            wait_for(lambda: time.monotonic() - claimed_at > 2.5 * lease, "two leases", 60)
            held = [r for r in server.requests() if r.path == "/held"]
            assert len(held) == count, "a run was delivered again while its relay lived"
            leases = {r["lease_owner"] for r in outbox_rows(store)}
            assert len(leases) >= 1 and all(f":{first.pid}:" in o for o in leases), leases
            # kill -9 the first relay with its calls in flight
            first.send_signal(signal.SIGKILL)
            first.wait(30)
            killed_at = time.monotonic()
            wait_for(
                lambda: all(run_row(store, j, at)["status"] == "succeeded" for j, at in runs),
                "the second relay delivering the killed relay's runs",
                lease + 60,
            )
            recovered = time.monotonic() - killed_at
            keys = Counter(
                r.headers[IDEMPOTENCY_HEADER] for r in server.requests() if r.path == "/held"
            )
        print(
            f"\nkill -9 of a relay with {count} calls in flight: delivered again by the other "
            f"relay {recovered:.1f} s after the kill (lease {lease:g} s, heartbeat every "
            f"{lease / 3:g} s)"
        )
        assert recovered < lease + 30  # liveness only
        assert set(keys.values()) == {2}  # the held call, and the one that completed
        for job, at in runs:
            history = [(a["status"], a["worker"]) for a in attempts(store, job, at)]
            assert [s for s, _ in history] == ["lost", "succeeded"], history
            assert f":{first.pid}:" in history[0][1]
            assert f":{second.pid}:" in history[1][1]
        passed = True
    finally:
        responder.release.set()
        for process in (first, second):
            if process is not None:
                _stop(process)
        store.close()
        if not passed and log.exists():
            print(log.read_text()[-5000:])
