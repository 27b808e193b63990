"""Postgres over TLS with `sslmode=verify-full` against a local CA: the project's engine,
its migrations and its LISTEN connections (which build their own connection from the
engine's URL) all verify the server; a server certified by another CA is refused with a
one-line error that shows no password, from the CLI and from the daemon."""

from __future__ import annotations

import ipaddress
import logging
import os
import pwd
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sqlalchemy import text

from schedctl.storage.db.engine import check_connection, make_engine
from schedctl.storage.db.migrate import upgrade
from schedctl.storage.db.store import Store
from tests.services.postgres import SERVER_USER, PostgresServer

pytestmark = pytest.mark.postgres

BIN = Path(sys.executable).parent
PASSWORD = "tls-Secret-5f2c9a"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + timedelta(days=2))
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
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


@dataclass(frozen=True)
class TlsPostgres:
    server: PostgresServer
    ca_file: Path  # the CA that signed the server's certificate
    wrong_ca_file: Path  # another CA

    def url(self, dbname: str, ca_file: Path, *, password: bool = False) -> str:
        user = f"postgres:{PASSWORD}" if password else "postgres"
        return (
            f"postgresql+psycopg://{user}@127.0.0.1:{self.server.port}/{dbname}"
            f"?sslmode=verify-full&sslrootcert={ca_file}"
        )


@pytest.fixture(scope="module")
def tls_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsPostgres]:
    base = Path("/var/tmp") / f"schedctl-pgtls-{uuid.uuid4().hex[:12]}"
    tls = base / "tls"
    tls.mkdir(parents=True, mode=0o700)
    ca_key, ca = make_ca("schedctl test CA")
    key, cert = make_server_cert(ca_key, ca)
    (tls / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = tls / "server.key"
    key_file.write_bytes(_pem_key(key))
    # Postgres refuses a key file that others may read, or that another user owns
    os.chmod(key_file, 0o600)
    if os.geteuid() == 0:
        user = pwd.getpwnam(SERVER_USER)
        for path in (tls, tls / "server.crt", key_file):
            os.chown(path, user.pw_uid, user.pw_gid)
    clients = tmp_path_factory.mktemp("tls-clients")
    ca_file = clients / "ca.crt"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    wrong_ca_file = clients / "wrong-ca.crt"
    wrong_ca_file.write_bytes(make_ca("another CA")[1].public_bytes(serialization.Encoding.PEM))
    server = PostgresServer(
        base_dir=base,
        settings=(
            "ssl=on",
            f"ssl_cert_file={tls / 'server.crt'}",
            f"ssl_key_file={key_file}",
        ),
    )
    try:
        server.start()
        server.create_database("tls")
        yield TlsPostgres(server, ca_file, wrong_ca_file)
    finally:
        server.cleanup()


def test_verify_full_against_the_local_ca_connects_over_tls(tls_pg: TlsPostgres) -> None:
    url = tls_pg.url("tls", tls_pg.ca_file)
    upgrade(url)  # the migrations go over the same verified connection
    engine = make_engine(url)
    try:
        check_connection(engine)
        with engine.connect() as connection:
            ssl, version = connection.execute(
                text("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            ).one()
        assert ssl is True and str(version).startswith("TLS")
    finally:
        engine.dispose()
    store = Store.open(url)  # the schema check too
    store.close()


def _run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULED_", "PG"))}
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=120, env=env, check=False
    )


@pytest.mark.parametrize(
    "argv",
    [["schedctl", "--db", "{url}", "db", "status"], ["scheduled-d", "dispatcher", "--db", "{url}"]],
    ids=["schedctl", "scheduled-d"],
)
def test_a_server_of_another_ca_is_refused_clearly_without_the_password(
    tls_pg: TlsPostgres, argv: list[str]
) -> None:
    url = tls_pg.url("tls", tls_pg.wrong_ca_file, password=True)
    done = _run(BIN / argv[0], *(a.replace("{url}", url) for a in argv[1:]))
    output = done.stdout + done.stderr
    assert done.returncode == 7, output
    assert "cannot reach the database" in done.stderr, output
    assert "certificate verify failed" in done.stderr, output
    assert "Traceback" not in output
    assert PASSWORD not in output


def test_the_listen_connections_keep_the_tls_parameters(
    tls_pg: TlsPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    upgrade(tls_pg.url("tls", tls_pg.ca_file))
    good = Store(make_engine(tls_pg.url("tls", tls_pg.ca_file)))
    # the same database with the other CA: a listener that dropped the URL's ssl
    # parameters would connect anyway (libpq's default sslmode is prefer, no verification)
    bad = Store(make_engine(tls_pg.url("tls", tls_pg.wrong_ca_file, password=True)))
    try:
        feed = good.dialect.ready_feed(good.engine, "acme:q")
        assert feed is not None
        try:
            assert feed.wait(1.0) is True  # connected (and listening) at the first look
            with good.tx() as connection:
                good.dialect.notify_ready(connection, ["acme:q"])
            assert any(feed.wait(1.0) for _ in range(20))
        finally:
            feed.close()
        caplog.set_level(logging.WARNING)
        refused = bad.dialect.ready_feed(bad.engine, "acme:q")
        changes = bad.dialect.change_feed(bad.engine, 0.1)
        assert refused is not None
        try:
            assert refused.wait(0.1) is False
            assert changes.wait(0.1).reload
        finally:
            refused.close()
            changes.close()
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any(
            "cannot LISTEN for ready work" in m and "certificate verify failed" in m for m in warned
        ), warned
        assert any(
            "cannot LISTEN for job changes" in m and "certificate verify failed" in m
            for m in warned
        ), warned
        assert not any(PASSWORD in m for m in warned)
    finally:
        good.close()
        bad.close()
