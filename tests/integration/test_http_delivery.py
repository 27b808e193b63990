"""HTTP delivery end to end on SQLite and a real Postgres, against loopback HTTP servers:
signed requests a handler verifies, retry classification with Retry-After, retries that
survive a relay restart, dead letters, no redirects, the SSRF guard at creation and at
delivery, TLS to a pinned address, and relays side by side delivering each run once."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sqlalchemy import select

from schedctl.app.service import Scheduler
from schedctl.core import errors
from schedctl.core.crypto import KEYS_ENV, KEYS_FILE_ENV, PayloadCipher, is_encrypted
from schedctl.core.signing import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
from schedctl.delivery.http import HttpDelivery, parse_retry_after
from schedctl.domain.models import Verdict
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.jobs.payloads import configure_payload_cipher, reset_payload_cipher
from schedctl.storage.pipeline.queue import CANCELLED_ERROR
from schedctl.storage.tenants.signing_secrets import SigningSecretRepo
from tests.factories import make_tenant
from tests.integration.queue_support import (
    Received,
    allow_loopback_tenant,
    answer,
    attempts,
    dead_letters,
    existing_tenant,
    fast_relay,
    first_attempt_answers,
    hook_server,
    http_job,
    outbox_count,
    outbox_rows,
    run_row,
    running_relay,
    set_allow_list,
    trigger,
    wait_for,
)

SECRET = "secret"  # tests.factories.make_tenant's signing secret


@pytest.fixture
def store(store: Store) -> Store:
    allow_loopback_tenant(store)
    return store


def settled(store: Store, job: str, at: dt.datetime, *statuses: str) -> bool:
    return str(run_row(store, job, at)["status"]) in (statuses or ("succeeded", "dead"))


# -- the request ---------------------------------------------------------------------------


def test_a_handler_verifies_a_real_delivery(store: Store) -> None:
    verdicts: list[str] = []

    def handler(received: Received, _number: int) -> tuple[int, dict[str, str], bytes]:
        # what a tenant's endpoint does with schedctl.core.signing
        try:
            verify(SECRET, received.headers, received.body, method="POST", path=received.path)
        except errors.SignatureError as exc:
            verdicts.append(str(exc))
            return 401, {}, b"bad signature"
        verdicts.append("ok")
        return 200, {}, b"thanks"

    with hook_server(handler) as server:
        job = http_job(store, server.url("/jobs/run?source=sched"), payload={"db": "orders"})
        at = trigger(store, job)
        with running_relay(fast_relay(store)):
            wait_for(lambda: settled(store, job, at), "the delivery")
        (request,) = server.requests()
    assert verdicts == ["ok"]
    assert request.path == "/jobs/run?source=sched"
    assert request.json == {
        "job_id": job,
        "scheduled_at": format_instant(at),
        "attempt": 1,
        "payload": {"db": "orders"},
    }
    assert request.headers[IDEMPOTENCY_HEADER] == f"{job}:{format_instant(at)}"
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["Host"] == f"127.0.0.1:{server.port}"
    # v2 first, v1 after it during v1's deprecation period
    schemes = [v.strip()[:3] for v in request.headers[SIGNATURE_HEADER].split(",")]
    assert schemes == ["v2=", "v1="]

    def check(headers: dict[str, str], body: bytes, **kwargs: Any) -> None:
        options: dict[str, Any] = {"method": "POST", "path": request.path}
        options.update(kwargs)
        verify(SECRET, headers, body, **options)

    check(request.headers, request.body)
    # a tampered body, Idempotency-Key, method or path, and a replay older than five
    # minutes are refused
    tampered = request.body.replace(b'"orders"', b'"payroll"')
    with pytest.raises(errors.SignatureError, match="does not match"):
        check(request.headers, tampered)
    rekeyed = {**request.headers, IDEMPOTENCY_HEADER: f"{job}:2030-01-01T00:00:00Z"}
    with pytest.raises(errors.SignatureError, match="does not match"):
        check(rekeyed, request.body)
    with pytest.raises(errors.SignatureError, match="does not match"):
        check(request.headers, request.body, method="PUT")
    with pytest.raises(errors.SignatureError, match="does not match"):
        check(request.headers, request.body, path="/jobs/run?source=other")
    with pytest.raises(errors.SignatureError, match="does not match"):
        check(request.headers, request.body, path="/jobs/other?source=sched")
    # the window is measured from the signed timestamp (whole seconds, rounded down when
    # signed), not from when the request arrived: the two can lie either side of a
    # second's boundary, so an arrival + 299 s could be 300.x s after the timestamp
    signed_at = int(request.headers[TIMESTAMP_HEADER])
    with pytest.raises(errors.SignatureError, match="replay"):
        check(request.headers, request.body, now=signed_at + 300.001)
    check(request.headers, request.body, now=signed_at + 300)
    check(request.headers, request.body, now=signed_at + 299.999)
    with pytest.raises(errors.SignatureError, match="future"):
        check(request.headers, request.body, now=signed_at - 300.001)
    # receivers still on v1 (the old call form) keep working during the deprecation period
    with pytest.warns(DeprecationWarning):
        verify(SECRET, request.headers, request.body)
    run = run_row(store, job, at)
    assert (run["status"], run["attempt"], run["error"]) == ("succeeded", 1, None)
    assert run["output_tail"] == "HTTP 200 OK: thanks"
    (attempt,) = attempts(store, job, at)
    assert (attempt["status"], attempt["attempt"]) == ("succeeded", 1)
    assert attempt["worker"] and attempt["started_at"] <= attempt["finished_at"]
    assert outbox_count(store) == 0


@pytest.fixture
def payload_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A payload key in use for the test (so signing secrets are encrypted at rest)."""
    monkeypatch.delenv(KEYS_ENV, raising=False)
    monkeypatch.delenv(KEYS_FILE_ENV, raising=False)
    key = PayloadCipher.generate_key()
    configure_payload_cipher(PayloadCipher([key]))
    try:
        yield key
    finally:
        reset_payload_cipher()


def test_rotation_signs_with_both_secrets_during_the_grace_then_only_the_new(
    store: Store, payload_key: str
) -> None:
    tenant = existing_tenant(store)
    secrets = SigningSecretRepo(store)
    _, new = secrets.rotate(tenant, grace=dt.timedelta(hours=24), actor="test")
    stored = str(raw_column(store, tenant, "signing_secret"))
    assert is_encrypted(stored) and new not in stored

    def deliver_once() -> Received:
        with hook_server() as server:
            job = http_job(store, server.url("/rotating?x=1"))
            at = trigger(store, job)
            with running_relay(fast_relay(store)):
                wait_for(lambda: settled(store, job, at), "the delivery")
            (request,) = server.requests()
        assert run_row(store, job, at)["status"] == "succeeded"
        return request

    def check(secret: str, request: Received) -> None:
        verify(secret, request.headers, request.body, method="POST", path=request.path)

    during = deliver_once()
    schemes = [v.strip()[:3] for v in during.headers[SIGNATURE_HEADER].split(",")]
    assert schemes == ["v2=", "v2=", "v1=", "v1="]
    # a receiver that has switched and one that has not yet both verify
    check(new, during)
    check(SECRET, during)
    with pytest.raises(errors.SignatureError, match="does not match"):
        check("neither", during)
    # the grace is over: only the new secret signs
    secrets.set_previous_until(tenant, dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
    after = deliver_once()
    schemes = [v.strip()[:3] for v in after.headers[SIGNATURE_HEADER].split(",")]
    assert schemes == ["v2=", "v1="]
    check(new, after)
    with pytest.raises(errors.SignatureError, match="does not match"):
        check(SECRET, after)


def raw_column(store: Store, tenant: str, column: str) -> Any:
    with store.read() as connection:
        return connection.execute(
            select(schema.tenants.c[column]).where(schema.tenants.c.tenant_id == tenant)
        ).scalar_one()


# -- classification ------------------------------------------------------------------------


RETRIED = [500, 502, 503, 504, 408, 429]
FAILED = [400, 401, 403, 404, 409, 410, 422, 301, 302, 307]


def test_retry_classification(store: Store) -> None:
    """5xx, 408 and 429 are retried (and then succeed here); other 4xx and redirects fail
    at once into the dead letters."""

    def by_path(received: Received, _number: int) -> tuple[int, dict[str, str], bytes]:
        status = int(received.path.rsplit("/", 1)[1])
        if received.json["attempt"] > 1:
            return 200, {}, b"ok"
        headers = {"Location": "http://127.0.0.1:9/elsewhere"} if 300 <= status < 400 else {}
        return status, headers, f"said {status}".encode()

    with hook_server(by_path) as server:
        jobs = {
            status: http_job(store, server.url(f"/s/{status}"), max_attempts=3)
            for status in RETRIED + FAILED
        }
        runs = {status: (job, trigger(store, job)) for status, job in jobs.items()}
        with running_relay(fast_relay(store)):
            wait_for(
                lambda: all(settled(store, j, at) for j, at in runs.values()), "every run settled"
            )
        calls = Counter(int(r.path.rsplit("/", 1)[1]) for r in server.requests())
    letters = {d["job_id"]: d for d in dead_letters(store)}
    for status in RETRIED:
        job, at = runs[status]
        assert run_row(store, job, at)["status"] == "succeeded", status
        assert calls[status] == 2, status
        history = [(a["attempt"], a["status"]) for a in attempts(store, job, at)]
        assert history == [(1, "failed"), (2, "succeeded")], status
        assert f"HTTP {status}" in attempts(store, job, at)[0]["error"]
    for status in FAILED:
        job, at = runs[status]
        assert run_row(store, job, at)["status"] == "dead", status
        assert calls[status] == 1, status
        letter = letters[job]
        assert letter["attempts"] == 1
        assert letter["last_error"].startswith(f"HTTP {status}"), letter["last_error"]
        if 300 <= status < 400:
            assert "not followed" in letter["last_error"]
    assert outbox_count(store) == 0


def test_network_errors_and_timeouts_are_retried_then_dead_lettered(store: Store) -> None:
    closed = socket_port_nobody_listens_on()
    with hook_server(hang=30) as hanging:
        refused = http_job(store, f"http://127.0.0.1:{closed}/x", max_attempts=2)
        slow = http_job(store, hanging.url(), max_attempts=2)
        runs = [(refused, trigger(store, refused)), (slow, trigger(store, slow))]
        with running_relay(fast_relay(store, http_timeout=0.5)):
            wait_for(lambda: all(settled(store, j, at) for j, at in runs), "both dead")
        assert hanging.count() == 2
    errors_seen = {d["job_id"]: d["last_error"] for d in dead_letters(store)}
    assert "network error" in errors_seen[refused]
    assert "timed out" in errors_seen[slow]
    for job, at in runs:
        assert [a["status"] for a in attempts(store, job, at)] == ["failed", "failed"]


def socket_port_nobody_listens_on() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_retry_after_is_honoured(store: Store) -> None:
    with hook_server(first_attempt_answers(429, "3", b"slow down")) as server:
        job = http_job(store, server.url(), max_attempts=3, base=0.01, cap=0.01)
        at = trigger(store, job)
        with running_relay(fast_relay(store)):
            wait_for(lambda: len(attempts(store, job, at)) == 1, "the first attempt")
            (row,) = outbox_rows(store)
            first = attempts(store, job, at)[0]
            # the backoff alone would be at most 0.01 s; the endpoint asked for 3 s
            waited = (row["available_at"] - first["finished_at"]).total_seconds()
            assert waited >= 2.9
            assert row["attempt"] == 2 and row["last_error"].startswith("HTTP 429")
            wait_for(lambda: settled(store, job, at), "the second attempt")
        first_at, second_at = (r.at for r in server.requests())
    print(f"\nRetry-After: 3 -> second attempt {second_at - first_at:.2f} s after the first")
    assert run_row(store, job, at)["status"] == "succeeded"


def test_parse_retry_after() -> None:
    now = 1_767_225_600.0
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    date = "Thu, 01 Jan 2026 00:00:30 GMT"
    assert parse_retry_after(date, now=now) == pytest.approx(30.0)
    assert parse_retry_after("999999") == 3600.0


def test_retries_survive_a_relay_restart(store: Store) -> None:
    """Stop the relay mid-backoff; a new relay continues with the next attempt number."""

    with hook_server(first_attempt_answers(503, "2", b"maintenance")) as server:
        job = http_job(store, server.url(), max_attempts=3, base=0.01, cap=0.01)
        at = trigger(store, job)
        first = fast_relay(store, owner="relay-one")
        with running_relay(first):
            wait_for(lambda: len(attempts(store, job, at)) == 1, "the first attempt")
        # stopped: the retry state is all in the database
        (row,) = outbox_rows(store)
        assert (row["attempt"], row["lease_owner"]) == (2, None)
        assert run_row(store, job, at)["status"] == "failed"
        assert server.count() == 1
        with running_relay(fast_relay(store, owner="relay-two")):
            wait_for(lambda: settled(store, job, at), "the second attempt")
        assert [r.json["attempt"] for r in server.requests()] == [1, 2]
    history = [(a["attempt"], a["status"], a["worker"]) for a in attempts(store, job, at)]
    assert history == [(1, "failed", "relay-one"), (2, "succeeded", "relay-two")]
    assert run_row(store, job, at)["attempt"] == 2


def test_dead_letter_after_the_last_attempt(store: Store) -> None:
    with hook_server(answer(500, body=b"boom")) as server:
        job = http_job(store, server.url(), max_attempts=3)
        at = trigger(store, job)
        with running_relay(fast_relay(store)):
            wait_for(lambda: settled(store, job, at, "dead"), "the dead letter")
        assert [r.json["attempt"] for r in server.requests()] == [1, 2, 3]
    (letter,) = dead_letters(store)
    assert (letter["job_id"], letter["scheduled_at"], letter["attempts"]) == (job, at, 3)
    assert (letter["target_type"], letter["target"]) == ("http", server.url())
    assert letter["last_error"] == "HTTP 500 Internal Server Error: boom"
    run = run_row(store, job, at)
    assert (run["status"], run["attempt"]) == ("dead", 3)
    assert [(a["attempt"], a["status"]) for a in attempts(store, job, at)] == [
        (1, "failed"),
        (2, "failed"),
        (3, "failed"),
    ]
    assert outbox_count(store) == 0


def test_no_redirect_is_followed(store: Store) -> None:
    with hook_server() as elsewhere:
        redirect = answer(302, {"Location": elsewhere.url("/stolen")}, b"")
        with hook_server(redirect) as server:
            job = http_job(store, server.url(), max_attempts=3)
            at = trigger(store, job)
            with running_relay(fast_relay(store)):
                wait_for(lambda: settled(store, job, at), "the run")
            assert server.count() == 1
        assert elsewhere.count() == 0
    (letter,) = dead_letters(store)
    assert "redirect" in letter["last_error"] and "not followed" in letter["last_error"]


# -- cancellation and SSRF -----------------------------------------------------------------


def test_an_http_run_not_yet_sent_is_not_sent_after_cancel(store: Store) -> None:
    with hook_server() as server:
        job = http_job(store, server.url())
        at = trigger(store, job)
        JobRepo(store).cancel(job, actor="test")
        with running_relay(fast_relay(store)) as r:
            wait_for(lambda: outbox_count(store) == 0, "the outbox emptied")
            wait_for(r.idle, "the relay idle")
        assert server.count() == 0
    run = run_row(store, job, at)
    assert (run["status"], run["error"]) == ("skipped", CANCELLED_ERROR)
    assert dead_letters(store) == []


def test_disallowed_after_creation_is_refused_at_delivery_without_connecting(
    store: Store,
) -> None:
    with hook_server() as server:
        job = http_job(store, server.url())
        tenant = existing_tenant(store)
        set_allow_list(store, tenant, [])  # the operator ran `tenant disallow`
        at = trigger(store, job)
        with running_relay(fast_relay(store)):
            wait_for(lambda: settled(store, job, at), "the refusal")
        assert server.count() == 0
        assert server.connections == 0
    letters = [d for d in dead_letters(store) if d["scheduled_at"] == at]
    assert letters and "refused by the SSRF guard" in letters[0]["last_error"]
    assert "loopback" in letters[0]["last_error"]


def test_the_guard_at_creation_names_target_url(db_url: str) -> None:
    with Scheduler.open(db_url) as scheduler:
        scheduler.create_tenant("acme", "test")

        def body(url: str) -> dict[str, Any]:
            return {"schedule": {"delay": "1h"}, "target": {"type": "http", "url": url}}

        for url in (
            "http://localhost:8080/hook",  # a host name that resolves to loopback
            "http://127.0.0.1/",
            "http://2130706433/",
            "http://0x7f.1/",
            "http://[::ffff:127.0.0.1]/",
            "http://169.254.169.254/latest/meta-data/",
            "http://10.0.0.1/",
        ):
            with pytest.raises(errors.ForbiddenDestination) as caught:
                scheduler.create_job("acme", body(url), actor="test")
            assert caught.value.field == "target.url"
            assert str(caught.value).startswith("target.url: ")
            assert caught.value.exit_code == 2 and caught.value.http_status == 422
        assert scheduler.list_jobs("acme").items == ()
        # allowed by name: accepted
        from schedctl.storage.tenants.tenant_delivery import TenantDeliveryRepo

        TenantDeliveryRepo(scheduler.store).allow("acme", "localhost", actor="test")
        job, created = scheduler.create_job(
            "acme", body("http://localhost:8080/hook"), actor="test"
        )
        assert created and job.target.url == "http://localhost:8080/hook"
        # a public name that does not resolve (offline) is left to the delivery check
        scheduler.create_job("acme", body("https://hooks.example.com/x"), actor="test")


# -- TLS to the pinned address -------------------------------------------------------------


def _certificate(tmp_path: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_connects_to_the_checked_address_with_the_right_name(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path, "hooks.test")
    seen: dict[str, Any] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen["host"] = self.headers["Host"]
            seen["body"] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    def sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        seen["sni"] = name

    context.sni_callback = sni  # type: ignore[assignment]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    lookups: list[str] = []

    def resolve(host: str, _port: int) -> list[str]:
        lookups.append(host)
        return ["127.0.0.1"]

    delivery = HttpDelivery(timeout=5, resolver=resolve, ca_bundle=str(cert))
    try:
        common = {
            "secret": SECRET,
            "job_id": "j1",
            "scheduled_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
            "attempt": 1,
            "payload": {"x": 1},
        }
        result = delivery.deliver(
            url=f"https://hooks.test:{port}/run", allow_list=["hooks.test"], **common
        )
        assert result.verdict is Verdict.succeeded, result
        assert seen["sni"] == "hooks.test"
        assert seen["host"] == f"hooks.test:{port}"
        assert json.loads(seen["body"])["job_id"] == "j1"
        assert lookups == ["hooks.test"]
        # the same name, not allow-listed: refused before any connection
        refused = delivery.deliver(url=f"https://hooks.test:{port}/run", allow_list=[], **common)
        assert refused.verdict is Verdict.failed and "SSRF" in (refused.error or "")
        # a certificate for another name fails (and is retried later), never accepted
        lookups.clear()
        mismatch = HttpDelivery(
            timeout=5, resolver=lambda h, p: ["127.0.0.1"], ca_bundle=str(cert)
        ).deliver(url=f"https://other.test:{port}/run", allow_list=["other.test"], **common)
        assert mismatch.verdict is Verdict.retry and "network error" in (mismatch.error or "")
    finally:
        delivery.close()
        server.shutdown()
        server.server_close()


# -- relays side by side -------------------------------------------------------------------


def test_relays_side_by_side_deliver_each_run_once(pg_url: str) -> None:
    store = Store.open(pg_url)
    try:
        tenant = make_tenant(store)
        set_allow_list(store, tenant, [str(ipaddress.ip_network("127.0.0.0/8"))])
        with hook_server() as server:
            jobs = [http_job(store, server.url()) for _ in range(20)]
            runs = [(job, trigger(store, job)) for job in jobs for _ in range(15)]
            relays = [fast_relay(store, owner=f"relay-{i}") for i in range(3)]
            started = time.monotonic()
            with running_relay(relays[0]), running_relay(relays[1]), running_relay(relays[2]):
                wait_for(lambda: server.count() >= len(runs), "every delivery", 120)
                wait_for(lambda: outbox_count(store) == 0, "the outbox emptied")
                wait_for(lambda: all(r.idle() for r in relays), "the relays idle")
            elapsed = time.monotonic() - started
            keys = Counter(r.headers[IDEMPOTENCY_HEADER] for r in server.requests())
        assert len(keys) == len(runs)
        assert set(keys.values()) == {1}
        shares = [r.stats.delivered for r in relays]
        print(f"\n3 relays: {len(runs)} deliveries in {elapsed:.2f} s, shares {shares}")
        assert sum(shares) == len(runs)
        for job, at in runs:
            history = attempts(store, job, at)
            assert [a["status"] for a in history] == ["succeeded"], [a["error"] for a in history]
    finally:
        store.close()
