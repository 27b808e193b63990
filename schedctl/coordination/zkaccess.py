"""Owns how every process of the scheduler reaches ZooKeeper: the digest credentials, the
ACL of every znode the scheduler creates, TLS to the server, and keeping the secret out of
the logs.

Credentials are one line `user:password`, from the file named by `zookeeper_auth_file` or
from the environment variable SCHEDULED_ZOOKEEPER_AUTH (never from the configuration file
itself, never printed). With credentials, the client authenticates with the `digest`
scheme and every node it creates (the root, its `members` and `owners` parents, member and
owner nodes) gets one ACL entry: that identity with ALL permissions. Nobody else, world
included, may read, create children, change or delete them; `schedctl status` reads the
member list with the same credentials, so no world READ is needed. Without credentials
nodes get ZooKeeper's open ACL, as before.

TLS is on when `zookeeper_tls` is true or `zookeeper_tls_ca` names a CA file; the server's
certificate must chain to that CA (or to a public CA when none is named) and name the host
of the connection string (`127.0.0.1` needs an IP SAN). `zookeeper_tls_cert` and
`zookeeper_tls_key` give a client certificate when the server asks for one
(`ssl.clientAuth=need`); the key must not be encrypted.
"""

from __future__ import annotations

import logging
import os
import ssl
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kazoo.protocol.serialization import Auth
from kazoo.security import ACL, make_digest_acl

from schedctl.core import errors

if TYPE_CHECKING:
    from schedctl.domain.config import Config

log = logging.getLogger(__name__)

AUTH_ENV = "SCHEDULED_ZOOKEEPER_AUTH"
AUTH_FILE_FIELD = "zookeeper_auth_file"
# the longest credentials line read: a guard against naming a large file by mistake
_MAX_AUTH_BYTES = 4096


def _refused(character: str) -> bool:
    """C0 and C1 controls, DEL and the Unicode line separators: never in a credential."""
    code = ord(character)
    return code < 0x20 or 0x7F <= code <= 0x9F or character in "\u2028\u2029"


def parse_credentials(text: str, field_name: str, source: str) -> tuple[str, str]:
    """`user:password` (one line, an optional final newline) -> (user, password). The user
    is not empty and holds no `:`; neither part holds control characters. Errors name
    `field_name` and `source` (where the text came from) and never repeat the text."""
    line = text[:-1] if text.endswith("\n") else text
    line = line[:-1] if line.endswith("\r") else line
    user, sep, password = line.partition(":")
    if not sep or not user or not password:
        raise errors.ConfigError(
            f"{source} must hold one line user:password (neither part empty)", field=field_name
        )
    if any(_refused(c) for c in line):
        raise errors.ConfigError(
            f"{source} must hold one line user:password without control characters",
            field=field_name,
        )
    if user != user.strip():
        raise errors.ConfigError(
            f"{source}: the user must not start or end with white space", field=field_name
        )
    return user, password


def _read_credentials(path: str) -> tuple[str, str]:
    try:
        # O_NONBLOCK: a FIFO put in its place must not hang the start
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.ConfigError(
            f"cannot read {path!r}: {exc.strerror}", field=AUTH_FILE_FIELD
        ) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise errors.ConfigError(f"{path!r} is not a regular file", field=AUTH_FILE_FIELD)
        raw = os.read(fd, _MAX_AUTH_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > _MAX_AUTH_BYTES:
        raise errors.ConfigError(
            f"{path!r} is larger than {_MAX_AUTH_BYTES} bytes", field=AUTH_FILE_FIELD
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.ConfigError(f"{path!r} is not UTF-8 text", field=AUTH_FILE_FIELD) from exc
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        # the scheduler still works; the operator should know who else can read it
        log.warning("%s: %s is readable by group or others (chmod 600)", AUTH_FILE_FIELD, path)
    return parse_credentials(text, AUTH_FILE_FIELD, repr(path))


def _check_tls_files(ca: str | None, cert: str | None, key: str | None) -> None:
    """Load the CA and the client pair once now, so a bad file is a ConfigError naming its
    key at start, not an endless reconnect loop with an SSL error in the log."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            raise errors.ConfigError(
                f"cannot load CA certificates from {ca!r}: {_reason(exc)}",
                field="zookeeper_tls_ca",
            ) from exc
    if (cert is None) != (key is None):
        missing = "zookeeper_tls_key" if key is None else "zookeeper_tls_cert"
        raise errors.ConfigError(
            "a client certificate needs both zookeeper_tls_cert and zookeeper_tls_key",
            field=missing,
        )
    if cert is not None and key is not None:
        for name, path in (("zookeeper_tls_cert", cert), ("zookeeper_tls_key", key)):
            if not os.path.isfile(path):
                raise errors.ConfigError(f"{path!r}: no such file", field=name)
        try:
            # no password callback: an encrypted key fails here instead of prompting
            context.load_cert_chain(certfile=cert, keyfile=key, password=lambda: b"")
        except (OSError, ssl.SSLError) as exc:
            raise errors.ConfigError(
                f"cannot load the client certificate {cert!r} with key {key!r} "
                f"(an unencrypted PEM key that matches the certificate): {_reason(exc)}",
                field="zookeeper_tls_cert",
            ) from exc


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


@dataclass(frozen=True)
class ZooKeeperAccess:
    """Credentials and TLS settings of a ZooKeeper client; the default is neither."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_config(
        cls, config: Config, environ: Mapping[str, str] | None = None
    ) -> ZooKeeperAccess:
        """Reads the credentials (the auth file, else SCHEDULED_ZOOKEEPER_AUTH; both set is
        an error) and checks the TLS files; ConfigError naming the key otherwise."""
        env = os.environ if environ is None else environ
        from_env = env.get(AUTH_ENV, "")
        user = password = None
        if config.zookeeper_auth_file and from_env:
            raise errors.ConfigError(
                f"set either zookeeper_auth_file or {AUTH_ENV}, not both", field=AUTH_FILE_FIELD
            )
        if config.zookeeper_auth_file:
            user, password = _read_credentials(config.zookeeper_auth_file)
        elif from_env:
            user, password = parse_credentials(from_env, AUTH_ENV, AUTH_ENV)
        tls = config.zookeeper_tls or config.zookeeper_tls_ca is not None
        if not tls and (config.zookeeper_tls_cert or config.zookeeper_tls_key):
            raise errors.ConfigError(
                "a client certificate needs TLS: set zookeeper_tls_ca (or zookeeper_tls = true)",
                field="zookeeper_tls_cert" if config.zookeeper_tls_cert else "zookeeper_tls_key",
            )
        if tls:
            _check_tls_files(
                config.zookeeper_tls_ca, config.zookeeper_tls_cert, config.zookeeper_tls_key
            )
        return cls(
            user=user,
            password=password,
            tls=tls,
            ca=config.zookeeper_tls_ca,
            cert=config.zookeeper_tls_cert,
            key=config.zookeeper_tls_key,
        )

    @property
    def acl(self) -> list[ACL] | None:
        """The ACL of every node the scheduler creates: our digest identity with ALL; None
        (ZooKeeper's open ACL) without credentials."""
        if self.user is None or self.password is None:
            return None
        return [make_digest_acl(self.user, self.password, all=True)]

    def client_kwargs(self) -> dict[str, Any]:
        """KazooClient's keyword arguments for these settings."""
        kwargs: dict[str, Any] = {"logger": KAZOO_LOG}
        if self.user is not None and self.password is not None:
            kwargs["auth_data"] = [("digest", f"{self.user}:{self.password}")]
            kwargs["default_acl"] = self.acl
        if self.tls:
            kwargs.update(
                use_ssl=True,
                verify_certs=True,
                # kazoo's default is False: any certificate of the CA would do, for any host
                check_hostname=True,
                ca=self.ca,
                certfile=self.cert,
                keyfile=self.key,
            )
        return kwargs

    def describe(self) -> str:
        """For check-config and status: what protects the connection (never the secret)."""
        parts = [f"digest auth as {self.user!r}" if self.user is not None else "no auth"]
        if self.tls:
            parts.append(f"TLS (CA {self.ca})" if self.ca else "TLS (public CAs)")
        else:
            parts.append("no TLS")
        return ", ".join(parts)


# -- keeping secrets out of kazoo's debug log ---------------------------------------------


def _redacted(value: Any) -> Any:
    """An argument of a kazoo log record, with what must not be logged taken out: the
    credentials of an Auth request, ACLs (the digest is a hash of the password), bytes
    (session passwords, node data)."""
    if isinstance(value, Auth):
        return f"Auth(scheme={value.scheme!r}, auth=<redacted>)"
    if isinstance(value, ACL):
        return "ACL(<redacted>)"
    if isinstance(value, bytes | bytearray):
        return "<bytes redacted>"
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a request or a response
        if "acl" in value._fields:
            return f"{type(value).__name__}(path={getattr(value, 'path', '?')!r}, ...)"
        return value
    if _holds_acl(value):
        return "<a result with ACLs, redacted>"
    return value


def _holds_acl(value: Any, depth: int = 3) -> bool:
    """An ACL inside `value` (a get_acls answer is a tuple of a list of ACLs and a stat)."""
    if isinstance(value, ACL):
        return True
    if depth > 0 and isinstance(value, list | tuple):
        return any(_holds_acl(item, depth - 1) for item in value)
    return False


class _Redacting(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted(arg) for arg in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {k: _redacted(v) for k, v in record.args.items()}
        return True


# Every KazooClient of the scheduler logs through this logger: at DEBUG kazoo logs each
# request it sends, the Auth request with the password in it included.
KAZOO_LOG = logging.getLogger("schedctl.coordination.kazoo")
KAZOO_LOG.addFilter(_Redacting())


def denied_hint(access: ZooKeeperAccess) -> str:
    """Why ZooKeeper may answer NoAuth, for error messages."""
    if access.user is None:
        return (
            "the nodes were created with credentials: set zookeeper_auth_file (or "
            f"{AUTH_ENV}) to the same user:password"
        )
    return (
        f"the nodes belong to another identity than {access.user!r}: check zookeeper_auth_file "
        f"(or {AUTH_ENV}) against the other members"
    )
