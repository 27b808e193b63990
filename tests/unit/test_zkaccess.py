"""ZooKeeper credentials and TLS settings from the configuration: the kazoo options they
become, every kind of bad setting refused with an error naming its key (and never the
secret), the checks `scheduled-d check-config` makes, and the kazoo log filter that keeps
the password and the ACL digests out of the log."""

from __future__ import annotations

import datetime as dt
import logging
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kazoo.protocol.serialization import Auth, Create
from kazoo.security import make_digest_acl

from schedctl.coordination.zkaccess import KAZOO_LOG, ZooKeeperAccess
from schedctl.core import errors
from schedctl.domain.config import load_config
from scheduled_d.checks import check_configuration

SECRET = "pa55:word with spaces"


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scheduled.toml"
    path.write_text('zookeeper = "127.0.0.1:2181"\n' + text)
    return path


def auth_file(tmp_path: Path, content: bytes, name: str = "zk-auth") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    path.chmod(0o600)
    return path


def access_of(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> ZooKeeperAccess:
    config = load_config(config_file(tmp_path, text), environ=environ or {})
    return ZooKeeperAccess.from_config(config, environ=environ or {})


def pem_pair(tmp_path: Path, name: str = "client") -> tuple[Path, Path]:
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
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


# -- what the settings become ----------------------------------------------------------------


def test_no_settings_mean_an_open_acl_and_no_tls(tmp_path: Path) -> None:
    access = access_of(tmp_path, "")
    assert access.acl is None
    kwargs = access.client_kwargs()
    assert "auth_data" not in kwargs and "default_acl" not in kwargs
    assert "use_ssl" not in kwargs
    assert access.describe() == "no auth, no TLS"


def test_an_auth_file_gives_digest_auth_and_our_acl(tmp_path: Path) -> None:
    path = auth_file(tmp_path, f"sched:{SECRET}\n".encode())
    access = access_of(tmp_path, f'zookeeper_auth_file = "{path}"\n')
    assert (access.user, access.password) == ("sched", SECRET)
    kwargs = access.client_kwargs()
    assert kwargs["auth_data"] == [("digest", f"sched:{SECRET}")]
    assert kwargs["default_acl"] == [make_digest_acl("sched", SECRET, all=True)]
    assert SECRET not in repr(access)
    assert SECRET not in access.describe()
    assert access.describe() == "digest auth as 'sched', no TLS"


def test_the_environment_can_hold_the_credentials(tmp_path: Path) -> None:
    access = access_of(tmp_path, "", {"SCHEDULED_ZOOKEEPER_AUTH": "sched:pw"})
    assert (access.user, access.password) == ("sched", "pw")


def test_tls_settings_become_kazoo_options_that_check_the_host_name(tmp_path: Path) -> None:
    ca, _ = pem_pair(tmp_path, "ca")
    cert, key = pem_pair(tmp_path)
    access = access_of(
        tmp_path,
        f'zookeeper_tls_ca = "{ca}"\nzookeeper_tls_cert = "{cert}"\nzookeeper_tls_key = "{key}"\n',
    )
    kwargs = access.client_kwargs()
    assert kwargs["use_ssl"] is True
    assert kwargs["verify_certs"] is True
    assert kwargs["check_hostname"] is True
    assert (kwargs["ca"], kwargs["certfile"], kwargs["keyfile"]) == (str(ca), str(cert), str(key))
    assert access.describe() == f"no auth, TLS (CA {ca})"
    public = access_of(tmp_path, "zookeeper_tls = true\n")
    assert public.client_kwargs()["ca"] is None
    assert public.describe() == "no auth, TLS (public CAs)"


def test_environment_overrides_reach_the_new_keys(tmp_path: Path) -> None:
    path = auth_file(tmp_path, b"env-user:pw\n")
    config = load_config(
        config_file(tmp_path, ""), environ={"SCHEDULED_ZOOKEEPER_AUTH_FILE": str(path)}
    )
    assert config.zookeeper_auth_file == str(path)
    assert ZooKeeperAccess.from_config(config, environ={}).user == "env-user"


# -- bad settings: an error naming the key, never the secret ----------------------------------


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        pytest.param(b"", "must hold one line user:password", id="empty"),
        pytest.param(b"no-colon\n", "must hold one line user:password", id="no-colon"),
        pytest.param(b":" + SECRET.encode(), "must hold one line user:password", id="no-user"),
        pytest.param(b"user:\n", "must hold one line user:password", id="no-password"),
        pytest.param(b"user:a\nsecond:line\n", "without control characters", id="two-lines"),
        pytest.param(b"user:a\x00b", "without control characters", id="nul"),
        pytest.param("user:a\u2028b".encode(), "without control characters", id="line-sep"),
        pytest.param(b" user:pw", "white space", id="spaced-user"),
        pytest.param(b"user:\xff\xfe", "not UTF-8", id="not-utf8"),
        pytest.param(b"u:" + b"x" * 5000, "larger than", id="too-large"),
    ],
)
def test_malformed_credentials_name_the_key(tmp_path: Path, content: bytes, problem: str) -> None:
    path = auth_file(tmp_path, content)
    with pytest.raises(errors.ConfigError) as raised:
        access_of(tmp_path, f'zookeeper_auth_file = "{path}"\n')
    assert raised.value.field == "zookeeper_auth_file"
    assert problem in raised.value.message
    assert str(path) in raised.value.message
    assert SECRET not in raised.value.message


def test_malformed_credentials_in_the_environment_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError) as raised:
        access_of(tmp_path, "", {"SCHEDULED_ZOOKEEPER_AUTH": "nocolon-secret"})
    assert raised.value.field == "SCHEDULED_ZOOKEEPER_AUTH"
    assert "nocolon-secret" not in raised.value.message


def test_a_missing_or_unreadable_auth_file_names_the_key(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(errors.ConfigError, match="No such file") as raised:
        access_of(tmp_path, f'zookeeper_auth_file = "{missing}"\n')
    assert raised.value.field == "zookeeper_auth_file"
    for special in (tmp_path, tmp_path / "fifo"):
        if special.name == "fifo":
            os.mkfifo(special)  # no writer: a blocking open would hang here
        with pytest.raises(errors.ConfigError, match="not a regular file") as raised:
            access_of(tmp_path, f'zookeeper_auth_file = "{special}"\n')
        assert raised.value.field == "zookeeper_auth_file"


def test_file_and_environment_together_are_refused(tmp_path: Path) -> None:
    path = auth_file(tmp_path, b"a:b\n")
    with pytest.raises(errors.ConfigError, match="not both") as raised:
        access_of(
            tmp_path, f'zookeeper_auth_file = "{path}"\n', {"SCHEDULED_ZOOKEEPER_AUTH": "c:d"}
        )
    assert raised.value.field == "zookeeper_auth_file"


@pytest.mark.parametrize("key", ["zookeeper_auth_file", "zookeeper_tls_ca", "zookeeper_tls_key"])
def test_a_relative_path_is_refused_at_load(tmp_path: Path, key: str) -> None:
    with pytest.raises(errors.ConfigError, match="absolute file path") as raised:
        load_config(config_file(tmp_path, f'{key} = "relative/file"\n'), environ={})
    assert raised.value.field == key


def test_bad_tls_files_name_their_key(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cert, key = pem_pair(tmp_path)
    _, other_key = pem_pair(tmp_path, "other")
    cases = {
        f'zookeeper_tls_ca = "{garbage}"\n': "zookeeper_tls_ca",
        f'zookeeper_tls_ca = "{tmp_path / "none.pem"}"\n': "zookeeper_tls_ca",
        f'zookeeper_tls = true\nzookeeper_tls_cert = "{cert}"\n': "zookeeper_tls_key",
        f'zookeeper_tls = true\nzookeeper_tls_key = "{key}"\n': "zookeeper_tls_cert",
        f'zookeeper_tls_cert = "{cert}"\nzookeeper_tls_key = "{key}"\n': "zookeeper_tls_cert",
        (
            f'zookeeper_tls = true\nzookeeper_tls_cert = "{cert}"\n'
            f'zookeeper_tls_key = "{other_key}"\n'
        ): "zookeeper_tls_cert",
        (
            f'zookeeper_tls = true\nzookeeper_tls_cert = "{cert}"\n'
            f'zookeeper_tls_key = "{tmp_path / "none.key"}"\n'
        ): "zookeeper_tls_key",
    }
    for text, field in cases.items():
        with pytest.raises(errors.ConfigError) as raised:
            access_of(tmp_path, text)
        assert raised.value.field == field, text


# -- scheduled-d check-config -----------------------------------------------------------------


def test_check_config_reports_zookeeper_security_and_refuses_a_bad_auth_file(
    tmp_path: Path,
) -> None:
    path = auth_file(tmp_path, f"sched:{SECRET}\n".encode())
    config = config_file(tmp_path, f'zookeeper_auth_file = "{path}"\n')
    summary = check_configuration(str(config), bind=False)
    assert "zookeeper 127.0.0.1:2181: digest auth as 'sched', no TLS" in summary
    assert SECRET not in summary
    path.write_bytes(b"no colon here\n")
    with pytest.raises(errors.ConfigError) as raised:
        check_configuration(str(config), bind=False)
    assert raised.value.field == "zookeeper_auth_file"
    assert f"{config}:2:" in raised.value.message  # the key's line in the file


# -- the log ----------------------------------------------------------------------------------


def test_the_kazoo_log_filter_takes_out_credentials_and_acls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    acl = make_digest_acl("sched", SECRET, all=True)
    digest = acl.id.id.split(":", 1)[1]
    with caplog.at_level(logging.DEBUG, logger=KAZOO_LOG.name):
        KAZOO_LOG.debug("Sending request(xid=%s): %s", 1, Auth(0, "digest", f"sched:{SECRET}"))
        KAZOO_LOG.debug("Sending request(xid=%s): %s", 2, Create("/x", b"d", [acl], 0))
        KAZOO_LOG.debug("Received response(xid=%s): %s", 3, ([acl], None))
        KAZOO_LOG.debug("Session created, session_passwd: %s", b"\x01\x02session")
    text = caplog.text
    assert len(caplog.records) == 4
    assert SECRET not in text and digest not in text
    assert "x02session" not in text and "<bytes redacted>" in text
    assert "Auth(scheme='digest', auth=<redacted>)" in text
    assert "Create(path='/x', ...)" in text
