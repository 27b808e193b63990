"""The HTTP call itself, against loopback servers: one wall-clock deadline per call (an
endpoint trickling its answer a byte at a time is cut off at the deadline, not held for as
long as it keeps sending), and HTTPS to the pinned address with a private CA: the
certificate is checked against the URL's host name while the connection goes to the address
the SSRF guard checked, and a certificate for another name is refused."""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from schedctl.core.signing import SIGNATURE_HEADER, signed_headers
from schedctl.delivery.http import USER_AGENT, DeliveryResult, HttpDelivery, delivery_body
from schedctl.domain.config import load_config
from schedctl.domain.models import Verdict
from schedctl.storage.db.store import Store
from scheduled_d.relay import Relay
from tests.factories import make_tenant
from tests.integration.queue_support import (
    attempts,
    http_job,
    run_row,
    running_relay,
    set_allow_list,
    trigger,
    wait_for,
)

SECRET = "secret"
CALL: dict[str, Any] = {
    "secret": SECRET,
    "job_id": "j1",
    "scheduled_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    "attempt": 1,
    "payload": {"x": 1},
}


# -- a trickling endpoint ------------------------------------------------------------------


@dataclass
class Trickler:
    """A raw TCP endpoint on 127.0.0.1 that reads a request, then sends `head` at once and
    `trickle` one byte every `every` seconds (until the client goes away)."""

    head: bytes
    trickle: bytes
    every: float = 0.5
    http: bool = True  # read an HTTP request first; else whatever the client sends first
    sent: list[int] = field(default_factory=list)  # bytes of `trickle` sent, per connection
    requests: list[bytes] = field(default_factory=list)  # each request as received

    def __post_init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        index = len(self.sent)
        self.sent.append(0)
        with connection:
            if not self.http:
                connection.recv(65536)  # a TLS ClientHello
                self._send(connection, index)
                return
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = connection.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(body) < length:
                body += connection.recv(65536)
            self.requests.append(head + b"\r\n\r\n" + body)
            self._send(connection, index)

    def _send(self, connection: socket.socket, index: int) -> None:
        try:
            connection.sendall(self.head)
            for byte in self.trickle:
                if self.stop.wait(self.every):
                    return
                connection.sendall(bytes([byte]))
                self.sent[index] += 1
        except OSError:
            return  # the client hung up: what the deadline is for

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@contextlib.contextmanager
def trickler(head: bytes, trickle: bytes, *, http: bool = True) -> Iterator[Trickler]:
    server = Trickler(head, trickle, http=http)
    try:
        yield server
    finally:
        server.close()


def test_an_answer_trickled_a_byte_at_a_time_ends_at_the_deadline_as_a_retry() -> None:
    """The status line and headers arrive one byte every 0.5 s (each read well within any
    per-read timeout): the call ends at its 1 s deadline, a retryable timeout."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Padding: " + b"." * 40 + b"\r\n\r\nok"
    with trickler(b"", answer) as server:
        delivery = HttpDelivery(timeout=1.0)
        try:
            result = delivery.deliver(url=server.url, allow_list=["127.0.0.1"], **CALL)
        finally:
            delivery.close()
        sent = list(server.sent)
    print(
        f"\ntrickled headers: the call ended after {result.seconds:.2f} s (deadline 1 s; "
        f"the whole answer would take {len(answer) * 0.5:.0f} s); {sent} byte(s) had arrived"
    )
    assert result.verdict is Verdict.retry, result
    assert result.status is None
    assert (result.error or "").startswith("timed out"), result.error
    # liveness only: far less than the trickle would have held the call
    assert result.seconds < len(answer) * 0.5 / 2


def test_the_request_on_the_wire_is_the_signed_one_byte_for_byte() -> None:
    """The request line, the fixed headers, Content-Length, then signed_headers' three in
    their order, then the body: what a receiver verifies is what the relay signed."""
    with trickler(b"HTTP/1.1 204 No Content\r\n\r\n", b"") as server:
        delivery = HttpDelivery(timeout=5.0)
        try:
            secrets = [SECRET, "previous-secret"]
            result = delivery.deliver(
                url=server.url + "?a=b c", allow_list=["127.0.0.1"], **{**CALL, "secret": secrets}
            )
        finally:
            delivery.close()
        (raw,) = server.requests
        port = server.sock.getsockname()[1]
    assert result.verdict is Verdict.succeeded, result
    body = delivery_body("j1", CALL["scheduled_at"], 1, {"x": 1})
    stamp = next(
        line.split(b": ", 1)[1].decode()
        for line in raw.split(b"\r\n")
        if line.startswith(b"X-Sched-Timestamp: ")
    )
    signed = signed_headers(
        secrets,
        body,
        "j1:2026-01-01T00:00:00Z",
        method="POST",
        path="/hook?a=b%20c",
        now=int(stamp),
    )
    expected = (
        "POST /hook?a=b%20c HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\n"
        f"User-Agent: {USER_AGENT}\r\n"
        "Accept: */*\r\n"
        "Accept-Encoding: identity\r\n"
        f"Content-Length: {len(body)}\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in signed.items())
        + "\r\n"
    ).encode() + body
    assert raw == expected
    assert len(signed[SIGNATURE_HEADER].split(", ")) == 4  # v2 and v1, per secret


def test_a_body_trickled_after_a_complete_answer_is_cut_at_the_deadline() -> None:
    """A 2xx whose body trickles: the answer counts, the snippet is what arrived by the
    deadline."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 60\r\n\r\n"
    with trickler(head, b"x" * 60) as server:
        delivery = HttpDelivery(timeout=1.0)
        try:
            result = delivery.deliver(url=server.url, allow_list=["127.0.0.1"], **CALL)
            # the cut connection is not reused: the next call works on a fresh one
            again = delivery.deliver(url=server.url, allow_list=["127.0.0.1"], **CALL)
        finally:
            delivery.close()
    print(f"\ntrickled body: the call ended after {result.seconds:.2f} s (deadline 1 s)")
    assert result.verdict is Verdict.succeeded, result
    assert result.status == 200
    assert "body cut at the 1 s deadline" in (result.detail or ""), result.detail
    assert result.seconds < 60 * 0.5 / 2
    assert again.verdict is Verdict.succeeded and again.status == 200


def test_a_tls_handshake_trickled_a_byte_at_a_time_ends_at_the_deadline() -> None:
    """The server's first TLS record announces 16 KiB and sends it a byte every 0.5 s: the
    handshake is cut at the deadline like any other part of the call."""
    record = b"\x16\x03\x03\x40\x00"  # handshake record, TLS 1.2, 16384 bytes follow
    with trickler(record, b"\x00" * 16384, http=False) as server:
        url = server.url.replace("http://", "https://")
        delivery = HttpDelivery(timeout=1.0)
        try:
            result = delivery.deliver(url=url, allow_list=["127.0.0.1"], **CALL)
        finally:
            delivery.close()
    print(f"\ntrickled TLS handshake: the call ended after {result.seconds:.2f} s (deadline 1 s)")
    assert result.verdict is Verdict.retry, result
    assert (result.error or "").startswith("timed out"), result.error
    assert result.seconds < 30  # liveness only: the record alone would take 8192 s


def test_a_relay_call_to_a_trickling_endpoint_is_retried_by_the_deadline(db_url: str) -> None:
    """Through the relay: each attempt ends at the deadline and is recorded as a timeout;
    the run is retried, then dead-lettered, never held open by the endpoint."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Padding: " + b"." * 40 + b"\r\n\r\nok"
    store = Store.open(db_url)
    try:
        tenant = make_tenant(store)
        set_allow_list(store, tenant, ["127.0.0.1"])
        with trickler(b"", answer) as server:
            job = http_job(store, server.url, max_attempts=2)
            at = trigger(store, job)
            relay = Relay(store, poll_seconds=0.05, settings_seconds=0.2, http_timeout=1.0)
            with running_relay(relay):
                wait_for(lambda: run_row(store, job, at)["status"] == "dead", "the dead letter")
        history = attempts(store, job, at)
    finally:
        store.close()
    assert [a["status"] for a in history] == ["failed", "failed"]
    for attempt in history:
        took = (attempt["finished_at"] - attempt["started_at"]).total_seconds()
        print(f"\nattempt {attempt['attempt']}: {took:.2f} s, {attempt['error']}")
        assert attempt["error"].startswith("timed out"), attempt["error"]


# -- HTTPS with a private CA, to the pinned address ----------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA certificate (the bundle to trust)
    cert: Path  # server certificate for `name`, signed by the CA
    key: Path
    other_cert: Path  # signed by the same CA, for another name
    other_key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_pki(directory: Path, name: str, other: str) -> Pki:
    """A CA and two server certificates it signed (for `name` and for `other`)."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "schedctl test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(host: str, stem: str) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_key_pem(key))
        return cert_path, key_path

    cert, key = leaf(name, "server")
    other_cert, other_key = leaf(other, "other")
    return Pki(directory / "ca.pem", cert, key, other_cert, other_key)


@dataclass
class TlsServer:
    """An HTTPS endpoint on 127.0.0.1 that records what each request looked like."""

    cert: Path
    key: Path
    seen: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                server.seen.append(
                    {
                        "host": self.headers["Host"],
                        "sni": getattr(self.connection, "sni", None),
                        "peer": self.client_address[0],
                        "body": body,
                    }
                )
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        self.names: list[str | None] = []

        def sni(_sock: Any, name: str | None, _ctx: ssl.SSLContext) -> None:
            self.names.append(name)

        context.sni_callback = sni
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.http.socket = context.wrap_socket(self.http.socket, server_side=True)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.http.server_address[1])

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@contextlib.contextmanager
def tls_server(cert: Path, key: Path) -> Iterator[TlsServer]:
    server = TlsServer(cert, key)
    try:
        yield server
    finally:
        server.close()


NAME = "sched-test.localhost"


def test_https_with_a_private_ca_checks_the_name_and_connects_to_the_pinned_address(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path, NAME, "other-test.localhost")
    lookups: list[str] = []

    def resolve(host: str, _port: int) -> list[str]:
        lookups.append(host)
        return ["127.0.0.1"]

    with tls_server(pki.cert, pki.key) as server:
        url = f"https://{NAME}:{server.port}/run"
        trusted = HttpDelivery(timeout=5, resolver=resolve, ca_bundle=str(pki.ca))
        untrusted = HttpDelivery(timeout=5, resolver=resolve)  # the default bundle only
        try:
            ok = trusted.deliver(url=url, allow_list=[NAME], **CALL)
            assert ok.verdict is Verdict.succeeded, ok
            # resolved once by the guard, and the connection went to that address
            assert lookups == [NAME]
            (request,) = server.seen
            assert request["host"] == f"{NAME}:{server.port}"
            assert request["peer"] == "127.0.0.1"
            assert server.names == [NAME]  # SNI: the URL's name, not the address
            # the same server without the CA: the certificate is not trusted
            refused = untrusted.deliver(url=url, allow_list=[NAME], **CALL)
            _assert_tls_refused(refused, "certificate verify failed")
            assert len(server.seen) == 1
        finally:
            trusted.close()
            untrusted.close()


def test_https_refuses_a_certificate_for_another_name(tmp_path: Path) -> None:
    """The CA is trusted, but the server presents its certificate for another host name:
    refused (and retried later), the request never sent."""
    pki = make_pki(tmp_path, NAME, "other-test.localhost")
    with tls_server(pki.other_cert, pki.other_key) as server:
        delivery = HttpDelivery(
            timeout=5, resolver=lambda h, p: ["127.0.0.1"], ca_bundle=str(pki.ca)
        )
        try:
            result = delivery.deliver(
                url=f"https://{NAME}:{server.port}/run", allow_list=[NAME], **CALL
            )
        finally:
            delivery.close()
        assert server.seen == []
    _assert_tls_refused(result, f"hostname '{NAME}' doesn't match 'other-test.localhost'")


def _assert_tls_refused(result: DeliveryResult, fragment: str) -> None:
    assert result.verdict is Verdict.retry, result
    assert result.status is None
    error = result.error or ""
    assert error.startswith("network error") and fragment in error, error


def test_a_relay_delivers_over_https_with_the_configured_ca_bundle(
    db_url: str, tmp_path: Path
) -> None:
    """http_ca_bundle in the configuration file reaches the relay's HTTP client; a run to
    the private-CA endpoint is delivered end to end."""
    pki = make_pki(tmp_path, NAME, "other-test.localhost")
    config_file = tmp_path / "scheduled.toml"
    config_file.write_text(f'database_url = "{db_url}"\nhttp_ca_bundle = "{pki.ca}"\n')
    config = load_config(config_file, environ={})
    assert config.http_ca_bundle == str(pki.ca)
    store = Store.open(db_url)
    try:
        tenant = make_tenant(store)
        set_allow_list(store, tenant, [NAME])
        with tls_server(pki.cert, pki.key) as server:
            job = http_job(store, f"https://{NAME}:{server.port}/run")
            at = trigger(store, job)
            relay = Relay.from_config(
                store,
                config,
                poll_seconds=0.05,
                settings_seconds=0.2,
                resolver=lambda h, p: ["127.0.0.1"],
            )
            with running_relay(relay):
                wait_for(lambda: run_row(store, job, at)["status"] == "succeeded", "delivery")
            assert [r["host"] for r in server.seen] == [f"{NAME}:{server.port}"]
            assert server.names == [NAME]
    finally:
        store.close()


def test_the_deadline_and_lease_settings_are_read_from_the_configuration(
    sqlite_url: str, tmp_path: Path
) -> None:
    config_file = tmp_path / "scheduled.toml"
    config_file.write_text(
        "relay_lease_seconds = 6\nhttp_timeout_seconds = 3.5\nrelay_max_in_flight = 40\n"
    )
    config = load_config(config_file, environ={"SCHEDULED_RELAY_LEASE_SECONDS": "7"})
    assert (config.relay_lease_seconds, config.http_timeout_seconds) == (7.0, 3.5)
    assert config.relay_max_in_flight == 40
    store = Store.open(sqlite_url)
    try:
        relay = Relay.from_config(store, config)
        try:
            assert relay.lease_seconds == 7.0
            assert relay.heartbeat_seconds == pytest.approx(7.0 / 3)
            assert relay.http.timeout == 3.5
            assert relay.limits.max_in_flight == 40
        finally:
            relay.close()
    finally:
        store.close()


def test_a_deadline_is_measured_not_slept() -> None:
    """A quick answer does not wait for the deadline (the watchdog only acts when due)."""
    head = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    with trickler(head, b"") as server:
        delivery = HttpDelivery(timeout=30.0)
        try:
            started = time.monotonic()
            results = [
                delivery.deliver(url=server.url, allow_list=["127.0.0.1"], **CALL)
                for _ in range(20)
            ]
            took = time.monotonic() - started
        finally:
            delivery.close()
    print(f"\n20 quick calls with a 30 s deadline each: {took:.2f} s")
    assert all(r.verdict is Verdict.succeeded for r in results), results
