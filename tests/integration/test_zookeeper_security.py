"""ZooKeeper with credentials and TLS, on real servers: with digest credentials every node
the coordinator creates is its identity's alone (a client without them, or with a wrong
password, can create, change, delete and read none of them, nor add children to their
parents), a tree made before credentials were configured is taken over, a member without
the credentials fails its start with a clear error, `schedctl status` reads the members
with the same credentials, and the password never reaches the log. Over TLS with a local
CA (the server asks for a client certificate), the coordinator works; a client that does
not trust the CA, that names a host the certificate does not, or that has no client
certificate, gets nowhere.
"""

from __future__ import annotations

import datetime as dt
import gc
import ipaddress
import json
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.retry import KazooRetry
from kazoo.security import make_digest_acl
from typer.testing import CliRunner

from schedctl.app.cluster_status import gather_status, read_members
from schedctl.cli.app import app
from schedctl.coordination.zkaccess import ZooKeeperAccess
from schedctl.coordination.zookeeper import ZooKeeperCoordinator
from schedctl.core import errors
from schedctl.domain.config import Config
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.partitions import PartitionRepo
from scheduled_d.runtime import make_coordinator
from tests.services.zookeeper import ZooKeeperEnsemble, ZooKeeperTls

pytestmark = pytest.mark.zookeeper

P = 16  # the count does not matter here; small keeps it quick
WAIT = 60.0  # generous upper bound of every wait; never a timing assertion
USER, PASSWORD = "scheduler", "s3cret-Pa55word"
ACCESS = ZooKeeperAccess(user=USER, password=PASSWORD)
OUR_ACL = [make_digest_acl(USER, PASSWORD, all=True)]


# what an attacker would put in: an ACL of its own
OPEN = [make_digest_acl("anyone", "x", all=True)]


@pytest.fixture
def store(sqlite_url: str) -> Iterator[Store]:
    """One backend is enough: what is tested here happens in ZooKeeper (the contract suite
    runs the coordinator with credentials on both)."""
    with closing(Store.open(sqlite_url)) as opened:
        opened.ensure_settings(P)
        yield opened


class Clients:
    """Plain kazoo clients for a test (the attacker's, the operator's), all closed after."""

    def __init__(self) -> None:
        self.made: list[KazooClient] = []

    def connect(self, hosts: str, **kwargs: Any) -> KazooClient:
        client = KazooClient(hosts=hosts, timeout=10.0, **kwargs)
        self.made.append(client)
        client.start(timeout=30)
        return client

    def close(self) -> None:
        for client in self.made:
            client.stop()
            client.close()


@pytest.fixture
def clients() -> Iterator[Clients]:
    made = Clients()
    yield made
    made.close()


Start = Callable[..., ZooKeeperCoordinator]


@pytest.fixture
def start(store: Store) -> Iterator[Start]:
    """Starts coordinators (stopped after the test) that must settle owning every partition
    they are assigned."""
    made: list[ZooKeeperCoordinator] = []

    def make(hosts: str, name: str = "a", **kwargs: Any) -> ZooKeeperCoordinator:
        coordinator = ZooKeeperCoordinator(
            store, hosts, node_name=name, partition_count=P, **kwargs
        )
        made.append(coordinator)
        coordinator.start(timeout=30)
        return coordinator

    yield make
    for coordinator in made:
        coordinator.stop()


def owner_nodes(admin: KazooClient) -> list[str]:
    return sorted(admin.get_children("/scheduled/owners"))


# -- digest credentials and ACLs -------------------------------------------------------------


def test_with_credentials_the_coordinator_owns_everything_and_every_node_is_ours(
    start: Start, store: Store, zk_hosts: str, clients: Clients
) -> None:
    coordinator = start(zk_hosts, access=ACCESS)
    assert coordinator.wait_until_stable(WAIT)
    assert set(coordinator.owned()) == set(range(P))
    assert coordinator.members() == ["a"]
    stored = PartitionRepo(store).epochs()
    assert {p: stored[p] for p in range(P)} == {p: (e, "a") for p, e in coordinator.owned().items()}

    admin = clients.connect(zk_hosts, auth_data=[("digest", f"{USER}:{PASSWORD}")])
    paths = ["/scheduled", "/scheduled/members", "/scheduled/owners", "/scheduled/members/a"]
    paths += [f"/scheduled/owners/{p}" for p in range(P)]
    for path in paths:
        acl, _stat = admin.get_acls(path)
        assert acl == OUR_ACL, path


@pytest.mark.parametrize(
    "auth",
    [
        pytest.param([], id="no-credentials"),
        pytest.param([("digest", f"{USER}:wrong")], id="wrong-password"),
        pytest.param([("digest", f"intruder:{PASSWORD}")], id="other-user"),
    ],
)
def test_a_client_without_the_credentials_can_change_nothing(
    start: Start,
    zk_hosts: str,
    clients: Clients,
    auth: list[tuple[str, str]],
) -> None:
    coordinator = start(zk_hosts, access=ACCESS)
    assert coordinator.wait_until_stable(WAIT)
    admin = clients.connect(zk_hosts, auth_data=[("digest", f"{USER}:{PASSWORD}")])
    before = {p: admin.get(f"/scheduled/owners/{p}")[1].czxid for p in range(P)}

    intruder = clients.connect(zk_hosts, auth_data=auth)
    attempts: dict[str, Callable[[], object]] = {
        "add a member": lambda: intruder.create("/scheduled/members/evil", ephemeral=True),
        "add an owner node": lambda: intruder.create("/scheduled/owners/99", ephemeral=True),
        "add a node under the root": lambda: intruder.create("/scheduled/epochs"),
        "rewrite an owner node": lambda: intruder.set("/scheduled/owners/0", b"evil"),
        "rewrite a member node": lambda: intruder.set("/scheduled/members/a", b"{}"),
        "delete an owner node": lambda: intruder.delete("/scheduled/owners/1"),
        "delete a member node": lambda: intruder.delete("/scheduled/members/a"),
        "open an owner node": lambda: intruder.set_acls("/scheduled/owners/2", OPEN),
        "open the owners": lambda: intruder.set_acls("/scheduled/owners", OPEN),
        "open the root": lambda: intruder.set_acls("/scheduled", OPEN),
        "read an owner node": lambda: intruder.get("/scheduled/owners/3"),
        "list the members": lambda: intruder.get_children("/scheduled/members"),
    }
    for what, attempt in attempts.items():
        with pytest.raises(NoAuthError):
            attempt()
            pytest.fail(f"a client without the credentials could {what}")

    # nothing changed: the same owner nodes, the same member, every partition still owned
    assert {p: admin.get(f"/scheduled/owners/{p}")[1].czxid for p in range(P)} == before
    assert admin.get_children("/scheduled/members") == ["a"]
    assert sorted(admin.get_children("/scheduled")) == ["members", "owners"]
    assert coordinator.wait_until_stable(WAIT)
    assert set(coordinator.owned()) == set(range(P))


def test_a_tree_made_without_credentials_is_taken_over(
    start: Start, zk_hosts: str, clients: Clients
) -> None:
    # a cluster that ran before credentials were configured left open parents behind
    plain = clients.connect(zk_hosts)
    plain.ensure_path("/scheduled/members")
    plain.ensure_path("/scheduled/owners")
    assert plain.get_acls("/scheduled/owners")[0][0].id.scheme == "world"

    coordinator = start(zk_hosts, access=ACCESS)
    assert coordinator.wait_until_stable(WAIT)
    admin = clients.connect(zk_hosts, auth_data=[("digest", f"{USER}:{PASSWORD}")])
    for path in ("/scheduled", "/scheduled/members", "/scheduled/owners"):
        assert admin.get_acls(path)[0] == OUR_ACL, path
    with pytest.raises(NoAuthError):
        plain.create("/scheduled/owners/99", ephemeral=True)


@pytest.mark.parametrize(
    "access",
    [
        pytest.param(ZooKeeperAccess(), id="no-credentials"),
        pytest.param(ZooKeeperAccess(user=USER, password="wrong"), id="wrong-password"),
    ],
)
def test_a_member_without_the_credentials_fails_its_start_clearly(
    start: Start, zk_hosts: str, access: ZooKeeperAccess
) -> None:
    first = start(zk_hosts, access=ACCESS)
    assert first.wait_until_stable(WAIT)
    with pytest.raises(errors.SchedError) as raised:
        start(zk_hosts, name="b", access=access)
    assert raised.value.field == "zookeeper_auth_file"
    assert "NoAuth" in raised.value.message
    assert PASSWORD not in raised.value.message
    # the first member is not disturbed
    assert first.members() == ["a"]
    assert set(first.owned()) == set(range(P))


def test_status_reads_the_members_with_the_same_credentials(start: Start, zk_hosts: str) -> None:
    coordinator = start(zk_hosts, access=ACCESS)
    assert coordinator.wait_until_stable(WAIT)
    members = read_members(zk_hosts, "/scheduled", timeout=30, access=ACCESS)
    assert list(members) == ["a"]
    with pytest.raises(errors.SchedError, match=r"NoAuth.*zookeeper_auth_file"):
        read_members(zk_hosts, "/scheduled", timeout=30)


def test_schedctl_status_and_the_daemon_take_the_credentials_from_the_configuration(
    start: Start, store: Store, zk_hosts: str, tmp_path: Path
) -> None:
    secret = tmp_path / "zk-auth"
    secret.write_text(f"{USER}:{PASSWORD}\n")
    secret.chmod(0o600)
    config = Config(zookeeper=zk_hosts, zookeeper_auth_file=str(secret), node_name="a")
    # the dispatcher's coordinator, as scheduled-d builds it
    coordinator = make_coordinator(store, config)
    assert isinstance(coordinator, ZooKeeperCoordinator)
    assert coordinator.access == ACCESS
    coordinator.start(timeout=30)
    try:
        assert coordinator.wait_until_stable(WAIT)
        status = gather_status(store, config, zookeeper_timeout=30)
        assert status.zookeeper_error is None
        assert [m.name for m in status.members] == ["a"]
        # without the credentials `schedctl status` says why, and still prints the rest
        bare = gather_status(store, Config(zookeeper=zk_hosts), zookeeper_timeout=30)
        assert bare.zookeeper_error is not None
        assert "NoAuth" in bare.zookeeper_error
        assert "zookeeper_auth_file" in bare.zookeeper_error
    finally:
        coordinator.stop()


def test_the_status_command_uses_the_credentials_of_its_environment(
    start: Start, sqlite_url: str, zk_hosts: str, tmp_path: Path
) -> None:
    coordinator = start(zk_hosts, name="disp-a", access=ACCESS)
    assert coordinator.wait_until_stable(WAIT)
    secret = tmp_path / "zk-auth"
    secret.write_text(f"{USER}:{PASSWORD}\n")
    secret.chmod(0o600)
    broken = tmp_path / "zk-auth-broken"
    broken.write_text("no colon\n")

    def status(**env: str) -> dict[str, Any]:
        result = CliRunner().invoke(
            app,
            ["--db", sqlite_url, "status", "--output", "json"],
            env={"SCHEDULED_ZOOKEEPER": zk_hosts, **env},
        )
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output and PASSWORD not in result.output
        data: dict[str, Any] = json.loads(result.stdout)
        return data

    data = status(SCHEDULED_ZOOKEEPER_AUTH_FILE=str(secret))
    assert data["coordinator"]["error"] is None
    assert [(m["name"], m["live"]) for m in data["members"]] == [("disp-a", True)]
    assert "NoAuth" in status()["coordinator"]["error"]
    assert "NoAuth" in status(SCHEDULED_ZOOKEEPER_AUTH=f"{USER}:wrong")["coordinator"]["error"]
    error = status(SCHEDULED_ZOOKEEPER_AUTH_FILE=str(broken))["coordinator"]["error"]
    assert "zookeeper_auth_file" in error and "user:password" in error


def test_the_password_never_reaches_the_log(
    start: Start, zk_hosts: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(1)  # everything kazoo says, its request-by-request DEBUG lines included
    coordinator = start(zk_hosts, access=ACCESS)
    assert coordinator.wait_until_stable(WAIT)
    coordinator.stop()
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert "Sending request" in text  # kazoo's DEBUG lines were captured
    assert PASSWORD not in text
    digest = OUR_ACL[0].id.id.split(":", 1)[1]
    assert digest not in text


# -- TLS with a local CA ----------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA the server's and the client's certificates chain to
    other_ca: Path  # a CA nobody signed with
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _issue(
    subject: str,
    key: rsa.RSAPrivateKey,
    issuer: tuple[x509.Name, rsa.RSAPrivateKey] | None,
    *,
    ca: bool = False,
    ip: str | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def tls_zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ZooKeeperEnsemble, Pki]]:
    """A ZooKeeper whose TLS port has a certificate of a local CA for 127.0.0.1 (an IP SAN,
    no name) and requires a client certificate of that CA."""
    directory = tmp_path_factory.mktemp("zk-pki")
    ca_key = _key()
    ca_cert = _issue("schedctl test CA", ca_key, None, ca=True)
    issuer = (ca_cert.subject, ca_key)
    server_key, client_key, other_key = _key(), _key(), _key()
    server_cert = _issue("zookeeper", server_key, issuer, ip="127.0.0.1")
    client_cert = _issue("scheduled-d", client_key, issuer)
    pki = Pki(
        ca=directory / "ca.pem",
        other_ca=directory / "other-ca.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
    pki.ca.write_bytes(_pem(ca_cert))
    pki.other_ca.write_bytes(_pem(_issue("another CA", other_key, None, ca=True)))
    pki.client_cert.write_bytes(_pem(client_cert))
    pki.client_key.write_bytes(_key_pem(client_key))
    keystore = directory / "server-keystore.pem"
    keystore.write_bytes(_key_pem(server_key) + _pem(server_cert))
    ensemble = ZooKeeperEnsemble(
        size=1, tls=ZooKeeperTls(keystore=keystore, truststore=pki.ca, client_auth="need")
    )
    try:
        ensemble.start(timeout=60)
        yield ensemble, pki
    finally:
        ensemble.cleanup()


def _tls_access(pki: Pki, *, ca: Path | None = None, client_cert: bool = True) -> ZooKeeperAccess:
    return ZooKeeperAccess(
        user=USER,
        password=PASSWORD,
        tls=True,
        ca=str(ca or pki.ca),
        cert=str(pki.client_cert) if client_cert else None,
        key=str(pki.client_key) if client_cert else None,
    )


def test_over_tls_the_coordinator_works_and_status_reads_the_members(
    start: Start, tls_zk: tuple[ZooKeeperEnsemble, Pki]
) -> None:
    ensemble, pki = tls_zk
    access = _tls_access(pki)
    coordinator = start(ensemble.secure_hosts, access=access)
    assert coordinator.wait_until_stable(WAIT)
    assert set(coordinator.owned()) == set(range(P))
    members = read_members(ensemble.secure_hosts, "/scheduled", timeout=30, access=access)
    assert list(members) == ["a"]


# kazoo leaves the socket of a failed TLS handshake to the garbage collector
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "problem",
    ["untrusted-ca", "wrong-host-name", "no-client-certificate", "plain-client"],
)
def test_over_tls_a_client_that_does_not_fit_gets_nowhere(
    tls_zk: tuple[ZooKeeperEnsemble, Pki], problem: str
) -> None:
    ensemble, pki = tls_zk
    hosts = ensemble.secure_hosts
    access = _tls_access(pki)
    if problem == "untrusted-ca":
        access = _tls_access(pki, ca=pki.other_ca)
    elif problem == "wrong-host-name":
        # the certificate names 127.0.0.1 only; the same address by another name must fail
        hosts = hosts.replace("127.0.0.1", "localhost")
    elif problem == "no-client-certificate":
        access = _tls_access(pki, client_cert=False)
    else:
        access = ZooKeeperAccess(user=USER, password=PASSWORD)
    # a client as the coordinator and `schedctl status` build theirs, a few tries only
    client = KazooClient(
        hosts=hosts,
        timeout=5.0,
        connection_retry=KazooRetry(max_tries=3, delay=0.1, max_delay=0.5),
        **access.client_kwargs(),
    )
    try:
        client.start_async().wait(5)
        assert not client.connected, f"connected despite {problem}"
    finally:
        client.stop()
        client.close()
        gc.collect()  # that socket, while this test's warning filters hold
    # and the same settings that fit connect (the failure above was the problem's)
    good = KazooClient(hosts=ensemble.secure_hosts, timeout=5.0, **_tls_access(pki).client_kwargs())
    try:
        good.start(timeout=30)
        assert good.connected
    finally:
        good.stop()
        good.close()
