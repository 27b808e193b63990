"""Owns tenants' signing secrets in the database: how they are stored (encrypted at rest with
the payload keys, exactly like job payloads), their rotation with a grace period, the keys
a relay signs with, and their re-encryption after a payload key rotation.

Columns of `tenants`: `signing_secret` (the current secret), `signing_secret_previous` (the
secret before the last rotation, NULL when none) and `signing_secret_previous_until` (when
the previous secret stops signing). Both secrets are stored as `schedctl.core.crypto` stores
payloads: ``enc:v1:<Fernet token>`` when payload keys are configured
(SCHEDULED_PAYLOAD_KEYS_FILE / SCHEDULED_PAYLOAD_KEYS), plain text when none are (the same
choice as payloads: encryption is off without keys). Plain values (written before keys were
configured) are read as they are; migration 0006 and ``schedctl db rotate-payload-key``
encrypt them. An encrypted secret with no keys configured is an error that says so, never a
wrong signature.

Rotation (``schedctl tenant signing-secret rotate TENANT --grace 24h``): a new secret becomes
current, the old one becomes the previous one until now + grace. During the grace the relay
signs every delivery with both (``v2=<new>, v2=<old>``), so receivers can switch secrets at
any moment of it; afterwards only the new one. Rotating again during a grace drops the
oldest secret at once (two secrets at most).
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Column, bindparam, select, update
from sqlalchemy.engine import Connection

from schedctl.core import errors
from schedctl.core.crypto import PayloadCipher, is_encrypted
from schedctl.storage.backend.dialect import Lock
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.payloads import payload_cipher, rotation_cipher
from schedctl.storage.tenants.tenants import TenantRepo, change_tenant

DEFAULT_GRACE = timedelta(hours=24)
MAX_GRACE = timedelta(days=30)
ROTATE_BATCH = 500


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def encode_secret(secret: str) -> str:
    """The stored form of a signing secret: encrypted when payload keys are configured."""
    cipher = payload_cipher()
    return cipher.encrypt(secret) if cipher is not None else secret


def decode_secret(stored: str) -> str:
    """The secret from its stored form, encrypted or (written before encryption) plain."""
    if not is_encrypted(stored):
        return stored
    cipher = payload_cipher()
    if cipher is None:
        raise errors.ConfigError(
            "a tenant's signing secret is encrypted but no payload keys are configured: set "
            "SCHEDULED_PAYLOAD_KEYS_FILE (or SCHEDULED_PAYLOAD_KEYS)",
            field="payload_keys",
        )
    try:
        return cipher.decrypt(stored)
    except errors.ConfigError:
        raise errors.ConfigError(
            f"a tenant's signing secret cannot be decrypted with any of the {cipher.key_count} "
            f"configured key(s) from {cipher.source}: was a key removed before "
            "`schedctl db rotate-payload-key` finished?",
            field="payload_keys",
        ) from None


@dataclass(frozen=True)
class SigningKeys:
    """A tenant's signing secrets, decrypted."""

    tenant_id: str
    current: str = field(repr=False)
    previous: str | None = field(default=None, repr=False)
    previous_until: datetime | None = None

    def active(self, at: datetime | None = None) -> tuple[str, ...]:
        """The secrets to sign with at `at` (default now): the current one, then the
        previous one while its grace period lasts."""
        moment = at or datetime.now(UTC)
        if self.previous and self.previous_until is not None and moment < self.previous_until:
            return (self.current, self.previous)
        return (self.current,)


def _keys_from_row(
    tenant_id: str, current: str, previous: str | None, until: datetime | None
) -> SigningKeys:
    return SigningKeys(
        tenant_id=tenant_id,
        current=decode_secret(current),
        previous=decode_secret(previous) if previous else None,
        previous_until=until if previous else None,
    )


def _columns() -> tuple[Column[Any], ...]:
    t = schema.tenants
    return (
        t.c.tenant_id,
        t.c.signing_secret,
        t.c.signing_secret_previous,
        t.c.signing_secret_previous_until,
    )


class SigningSecretRepo:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._tenants = TenantRepo(store)

    def keys(self, tenant: str) -> SigningKeys:
        """The tenant's (name or id) secrets, decrypted."""
        with self.store.read() as connection:
            found = self._tenants._get(connection, tenant)
            return self._keys(connection, found.tenant_id)

    @staticmethod
    def _keys(connection: Connection, tenant_id: str) -> SigningKeys:
        row = connection.execute(
            select(*_columns()).where(schema.tenants.c.tenant_id == tenant_id)
        ).one()
        return _keys_from_row(str(row[0]), str(row[1]), row[2], row[3])

    def stored(self) -> dict[str, tuple[str, str | None, datetime | None]]:
        """Every tenant's stored (still encrypted) secrets and grace end, by tenant id."""
        with self.store.read() as connection:
            rows = connection.execute(select(*_columns())).all()
        return {str(r[0]): (str(r[1]), r[2], r[3]) for r in rows}

    def rotate(
        self, tenant: str, *, grace: timedelta = DEFAULT_GRACE, actor: str = "system"
    ) -> tuple[SigningKeys, str]:
        """A new current secret for the tenant; the old one keeps signing for `grace` (zero:
        not at all). Returns the tenant's keys after the change and the new secret."""
        if not isinstance(grace, timedelta) or grace < timedelta(0) or grace > MAX_GRACE:
            raise errors.ValidationError(
                f"the grace period must be from 0 to {MAX_GRACE.days} days", field="grace"
            )
        secret = new_secret()
        with self.store.tx() as connection:
            found = self._tenants._get(connection, tenant)
            t = schema.tenants
            # two rotations at once must not both keep the same "previous" secret
            self.store.dialect.lock_rows(
                connection,
                select(t.c.tenant_id).where(t.c.tenant_id == found.tenant_id),
                Lock.no_key_update,
            )
            old = connection.execute(
                select(t.c.signing_secret).where(t.c.tenant_id == found.tenant_id)
            ).scalar_one()
            now = db_now(connection)
            until = now + grace if grace > timedelta(0) else None
            # the old secret is re-encoded: plain text from before encryption gets encrypted
            previous = encode_secret(decode_secret(str(old))) if until is not None else None
            change_tenant(
                connection,
                found.tenant_id,
                {
                    "signing_secret": encode_secret(secret),
                    "signing_secret_previous": previous,
                    "signing_secret_previous_until": until,
                },
                actor=actor,
                action="signing_secret_rotate",
                # never a secret in the audit log
                detail={
                    "grace_seconds": grace.total_seconds(),
                    "previous_until": until.isoformat() if until else None,
                },
            )
            return self._keys(connection, found.tenant_id), secret

    def set_previous_until(
        self, tenant: str, until: datetime | None, *, actor: str = "system"
    ) -> None:
        """Move the end of the previous secret's grace period (None or a past time: end it
        now)."""
        with self.store.tx() as connection:
            found = self._tenants._get(connection, tenant)
            change_tenant(
                connection,
                found.tenant_id,
                {"signing_secret_previous_until": until},
                actor=actor,
                action="signing_secret_grace",
                detail={"previous_until": until.isoformat() if until else None},
            )


class SigningKeyCache:
    """What a relay signs with: every tenant's secrets, re-read with `refresh` (together with
    the other tenant settings), decrypted once per stored value. A tenant unknown at the last
    refresh (created since) is read on its own."""

    def __init__(self, store: Store) -> None:
        self.repo = SigningSecretRepo(store)
        self._lock = threading.Lock()
        self._stored: dict[str, tuple[str, str | None, datetime | None]] = {}
        self._keys: dict[str, SigningKeys | errors.SchedError] = {}

    def refresh(self) -> None:
        stored = self.repo.stored()
        with self._lock:
            keys: dict[str, SigningKeys | errors.SchedError] = {}
            for tenant_id, values in stored.items():
                known = self._keys.get(tenant_id)
                if known is not None and self._stored.get(tenant_id) == values:
                    keys[tenant_id] = known
                    continue
                keys[tenant_id] = self._decode(tenant_id, values)
            self._stored, self._keys = stored, keys

    @staticmethod
    def _decode(
        tenant_id: str, values: tuple[str, str | None, datetime | None]
    ) -> SigningKeys | errors.SchedError:
        try:
            return _keys_from_row(tenant_id, values[0], values[1], values[2])
        except errors.SchedError as exc:
            return exc

    def secrets_for(self, tenant_id: str, at: datetime | None = None) -> tuple[str, ...]:
        """The secrets to sign the tenant's deliveries with now; raises the decryption error
        (a ConfigError) when its secret cannot be read."""
        with self._lock:
            found = self._keys.get(tenant_id)
        if found is None:
            with self.repo.store.read() as connection:
                row = connection.execute(
                    select(*_columns()).where(schema.tenants.c.tenant_id == tenant_id)
                ).first()
            if row is None:
                raise errors.NotFound(f"no tenant {tenant_id!r}", field="tenant")
            values = (str(row[1]), row[2], row[3])
            found = self._decode(tenant_id, values)
            with self._lock:
                self._stored[tenant_id], self._keys[tenant_id] = values, found
        if isinstance(found, errors.SchedError):
            raise found
        return found.active(at)


@dataclass(frozen=True)
class SecretRotationResult:
    examined: int  # secrets read (current and previous ones)
    rewritten: int  # re-encrypted with the current key (including formerly plain ones)
    already_current: int


def rotate_signing_secrets(
    store: Store, cipher: PayloadCipher | None = None, *, batch_size: int = ROTATE_BATCH
) -> SecretRotationResult:
    """Re-encrypt every stored signing secret (current and previous) that is not under the
    current payload key, plain ones included; each update is conditional on the value read,
    so a rotation of the tenant's secret meanwhile is never undone."""
    cipher = rotation_cipher(cipher)
    t = schema.tenants
    examined = rewritten = current = 0
    after = ""
    while True:
        with store.tx() as connection:
            rows = connection.execute(
                select(*_columns())
                .where(t.c.tenant_id > after)
                .order_by(t.c.tenant_id)
                .limit(batch_size)
            ).all()
            if not rows:
                break
            for column in (t.c.signing_secret, t.c.signing_secret_previous):
                index = 1 if column is t.c.signing_secret else 2
                changes = []
                for row in rows:
                    stored = row[index]
                    if stored is None:
                        continue
                    examined += 1
                    if cipher.is_current(stored):
                        current += 1
                        continue
                    try:
                        new = cipher.rotate(stored)
                    except errors.ConfigError:
                        decode_secret(stored)  # the signing-secret wording of the error
                        raise
                    changes.append({"b_id": row[0], "b_old": stored, "b_new": new})
                if changes:
                    connection.execute(
                        update(t)
                        .where(t.c.tenant_id == bindparam("b_id"), column == bindparam("b_old"))
                        .values({column.name: bindparam("b_new")}),
                        changes,
                    )
                    rewritten += len(changes)
            after = rows[-1][0]
    return SecretRotationResult(examined=examined, rewritten=rewritten, already_current=current)
