"""Owns tenants, their quotas and their API tokens in the database.

Tenants are created, looked up and given quotas; tokens are issued, authenticated, listed
and revoked.

A token is `st_<token_id>_<secret>`. Only its sha256 is stored, so a database dump does not
hand out credentials; the token itself is returned once, at creation. The token_id part
names the token (for revocation and audit) without revealing it.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import json
import re
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from schedctl.core import errors, limits
from schedctl.domain.host_scope import HostScope
from schedctl.domain.models import Tenant
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.rows import tenant_from_row
from schedctl.storage.db.store import Store
from schedctl.storage.records.audit import audit
from schedctl.storage.tenants.token_cache import VERIFIED_TOKENS, Verified

TOKEN_PREFIX = "st_"
DEFAULT_MAX_JOBS = 10_000
DEFAULT_CREATE_RATE_PER_MINUTE = 600
DEFAULT_DISPATCH_RATE_PER_SECOND = 1000
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
_TOKEN = re.compile(r"st_([0-9a-f]{12})_[A-Za-z0-9_-]{20,100}")
_TOKEN_ID = re.compile(r"[0-9a-f]{12}")
MAX_QUOTA = limits.MAX_QUOTA


@dataclass(frozen=True)
class TokenInfo:
    """What may be shown about an API token: never the token or its hash."""

    token_id: str
    tenant_id: str
    created_at: datetime
    revoked_at: datetime | None
    host: HostScope | None = None  # a host token's host and groups


def token_id_of(token_or_id: str) -> str:
    """The token id from a token id or a whole token (`st_<token_id>_<secret>`)."""
    value = token_or_id.strip()
    match = _TOKEN.fullmatch(value)
    if match:
        return match.group(1)
    if _TOKEN_ID.fullmatch(value):
        return value
    raise errors.ValidationError(
        "expected a token id (12 hex digits) or a whole API token", field="token_id"
    )


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def validate_tenant_name(name: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise errors.ValidationError(
            f"tenant name {name!r} must be 1-200 characters of letters, digits, '.', '_' or '-'",
            field="name",
        )
    return name


def change_tenant(
    connection: Connection,
    tenant_id: str,
    values: dict[str, Any],
    *,
    actor: str,
    action: str,
    detail: dict[str, Any] | None = None,
) -> None:
    """Update a tenant's row and record who did it (`detail`, by default the values), in the
    caller's transaction."""
    connection.execute(
        update(schema.tenants).where(schema.tenants.c.tenant_id == tenant_id).values(**values)
    )
    # the API's cached Tenant (allow-list, quotas) of this process is stale from now on
    VERIFIED_TOKENS.forget(tenant_id=tenant_id)
    audit(
        connection,
        at=db_now(connection),
        tenant_id=tenant_id,
        actor=actor,
        action=action,
        detail=dict(values) if detail is None else detail,
    )


class TenantRepo:
    def __init__(self, store: Store) -> None:
        self.store = store

    def create(self, name: str, *, actor: str) -> tuple[Tenant, str]:
        """A new tenant and its first API token (returned here and never again)."""
        # here: signing_secrets imports this module
        from schedctl.storage.tenants.signing_secrets import encode_secret, new_secret

        validate_tenant_name(name)
        tenant_id = uuid.uuid4().hex
        try:
            with self.store.tx() as connection:
                taken = connection.execute(
                    select(schema.tenants.c.tenant_id).where(schema.tenants.c.name == name)
                ).first()
                if taken is not None:
                    raise errors.Conflict(f"a tenant named {name!r} already exists", field="name")
                now = db_now(connection)
                connection.execute(
                    schema.tenants.insert().values(
                        tenant_id=tenant_id,
                        name=name,
                        # encrypted at rest when payload keys are configured
                        signing_secret=encode_secret(new_secret()),
                        max_jobs=DEFAULT_MAX_JOBS,
                        create_rate_per_minute=DEFAULT_CREATE_RATE_PER_MINUTE,
                        dispatch_rate_per_second=DEFAULT_DISPATCH_RATE_PER_SECOND,
                        allow_list=json.dumps([]),
                        created_at=now,
                    )
                )
                token_id, token = self._insert_token(connection, tenant_id)
                audit(
                    connection,
                    at=now,
                    tenant_id=tenant_id,
                    actor=actor,
                    action="tenant_create",
                    detail={"name": name, "token_id": token_id},
                )
                return self._get(connection, tenant_id), token
        except IntegrityError as exc:
            # another creator of the same name committed between our check and insert
            raise errors.Conflict(f"a tenant named {name!r} already exists", field="name") from exc

    def get(self, name_or_id: str) -> Tenant:
        with self.store.read() as connection:
            return self._get(connection, name_or_id)

    def _get(self, connection: Connection, name_or_id: str) -> Tenant:
        rows = (
            connection.execute(
                select(schema.tenants).where(
                    or_(
                        schema.tenants.c.tenant_id == name_or_id,
                        schema.tenants.c.name == name_or_id,
                    )
                )
            )
            .mappings()
            .all()
        )
        if not rows:
            raise errors.NotFound(f"no tenant {name_or_id!r}", field="tenant")
        # an id wins over a name that happens to look like another tenant's id
        row = next((r for r in rows if r["tenant_id"] == name_or_id), rows[0])
        return tenant_from_row(row)

    def list(self) -> list[Tenant]:
        with self.store.read() as connection:
            rows = (
                connection.execute(select(schema.tenants).order_by(schema.tenants.c.name))
                .mappings()
                .all()
            )
        return [tenant_from_row(r) for r in rows]

    def dispatch_rates(self) -> dict[str, float]:
        """Every tenant's dispatch rate (runs per second), by tenant id: the dispatcher's
        catch-up pacing."""
        tenants = schema.tenants
        with self.store.read() as connection:
            rows = connection.execute(
                select(tenants.c.tenant_id, tenants.c.dispatch_rate_per_second)
            ).all()
        return {r[0]: float(r[1]) for r in rows}

    def signing_secret(self, name_or_id: str) -> str:
        """The HMAC key for the tenant's HTTP deliveries (the receiver verifies with it),
        decrypted; see schedctl.storage.tenants.signing_secrets for the previous one and
        rotation."""
        from schedctl.storage.tenants.signing_secrets import decode_secret

        tenant = self.get(name_or_id)
        with self.store.read() as connection:
            value = connection.execute(
                select(schema.tenants.c.signing_secret).where(
                    schema.tenants.c.tenant_id == tenant.tenant_id
                )
            ).scalar_one()
        return decode_secret(str(value))

    # -- tokens ------------------------------------------------------------------------

    def authenticate(self, token: str) -> tuple[str, str]:
        """(tenant_id, token_id) for a valid, unrevoked token; Unauthorized otherwise."""
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise errors.Unauthorized("invalid API token", field="token")
        with self.store.read() as connection:
            row = connection.execute(
                select(
                    schema.api_tokens.c.tenant_id,
                    schema.api_tokens.c.token_id,
                    schema.api_tokens.c.revoked_at,
                ).where(schema.api_tokens.c.token_hash == hash_token(token))
            ).first()
        # one message for unknown and revoked: the answer must not help guessing
        if row is None or row.revoked_at is not None:
            raise errors.Unauthorized("invalid API token", field="token")
        return str(row.tenant_id), str(row.token_id)

    def authenticate_tenant(self, token: str) -> Verified:
        """(tenant, token_id, host scope or None) for a valid, unrevoked token, in one query
        or from the
        process's cache of verified tokens (storage/tenants/token_cache.py: a revocation elsewhere
        takes effect here within TOKEN_CACHE_SECONDS); Unauthorized otherwise."""
        cached = self.cached_tenant(token)
        if cached is not None:
            return cached
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise errors.Unauthorized("invalid API token", field="token")
        token_hash = hash_token(token)
        generation = VERIFIED_TOKENS.generation
        tokens = schema.api_tokens
        with self.store.read() as connection:
            row = (
                connection.execute(
                    select(
                        schema.tenants,
                        tokens.c.token_id,
                        tokens.c.revoked_at,
                        tokens.c.host,
                        tokens.c.groups,
                    )
                    .join(tokens, tokens.c.tenant_id == schema.tenants.c.tenant_id)
                    .where(tokens.c.token_hash == token_hash)
                )
                .mappings()
                .first()
            )
        if row is None or row["revoked_at"] is not None:
            raise errors.Unauthorized("invalid API token", field="token")
        tenant, token_id = tenant_from_row(row), str(row["token_id"])
        scope = HostScope.from_columns(row["host"], row["groups"])
        VERIFIED_TOKENS.put(
            self._database, token_hash, tenant, token_id, generation=generation, scope=scope
        )
        return tenant, token_id, scope

    def cached_tenant(self, token: str) -> Verified | None:
        """(tenant, token_id, host scope) when the token was verified within the cache's
        TTL, without touching the database; None: ask authenticate_tenant."""
        if not isinstance(token, str):
            return None
        return VERIFIED_TOKENS.get(self._database, hash_token(token))

    @functools.cached_property
    def _database(self) -> str:
        return str(self.store.engine.url)

    def list_tokens(self, tenant: str) -> builtins.list[TokenInfo]:
        """The tenant's API tokens (ids and dates only), oldest first."""
        tokens = schema.api_tokens
        with self.store.read() as connection:
            found = self._get(connection, tenant)
            rows = connection.execute(
                select(
                    tokens.c.token_id,
                    tokens.c.created_at,
                    tokens.c.revoked_at,
                    tokens.c.host,
                    tokens.c.groups,
                )
                .where(tokens.c.tenant_id == found.tenant_id)
                .order_by(tokens.c.created_at, tokens.c.token_id)
            ).all()
        return [
            TokenInfo(
                token_id=str(r.token_id),
                tenant_id=found.tenant_id,
                created_at=r.created_at,
                revoked_at=r.revoked_at,
                host=HostScope.from_columns(r.host, r.groups),
            )
            for r in rows
        ]

    def set_quotas(
        self,
        tenant: str,
        *,
        max_jobs: int | None = None,
        create_rate_per_minute: int | None = None,
        actor: str = "system",
    ) -> Tenant:
        """Change the tenant's quotas; None leaves one as it is. Lowering max_jobs below the
        active count cancels nothing: it only refuses new jobs until enough have ended."""
        changes: dict[str, int] = {}
        for field, value in (
            ("max_jobs", max_jobs),
            ("create_rate_per_minute", create_rate_per_minute),
        ):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUOTA:
                raise errors.ValidationError(
                    f"must be an integer from 0 to {MAX_QUOTA}, got {value!r}", field=field
                )
            changes[field] = value
        if not changes:
            raise errors.ValidationError(
                "give at least one quota to change", field="max_jobs, create_rate_per_minute"
            )
        with self.store.tx() as connection:
            found = self._get(connection, tenant)
            change_tenant(connection, found.tenant_id, changes, actor=actor, action="tenant_quota")
            return self._get(connection, found.tenant_id)

    def new_token(
        self, tenant: str, *, actor: str = "system", host: HostScope | None = None
    ) -> str:
        """Another API token for the tenant (name or id), e.g. to rotate the first one; with
        `host`, a host token bound to that host and its groups (schedctl.domain.host_scope)."""
        detail: dict[str, Any] = {}
        if host is not None:
            detail = {"host": host.host, "groups": list(host.groups)}
        with self.store.tx() as connection:
            found = self._get(connection, tenant)
            token_id, token = self._insert_token(connection, found.tenant_id, host)
            audit(
                connection,
                at=db_now(connection),
                tenant_id=found.tenant_id,
                actor=actor,
                action="token_create",
                detail={"token_id": token_id, **detail},
            )
        return token

    def revoke_token(self, token_id: str, *, actor: str = "system") -> None:
        with self.store.tx() as connection:
            now = db_now(connection)
            tenant_id = connection.execute(
                select(schema.api_tokens.c.tenant_id).where(
                    schema.api_tokens.c.token_id == token_id
                )
            ).scalar_one_or_none()
            if tenant_id is None:
                raise errors.NotFound(f"no API token {token_id!r}", field="token_id")
            connection.execute(
                update(schema.api_tokens)
                .where(
                    schema.api_tokens.c.token_id == token_id,
                    schema.api_tokens.c.revoked_at.is_(None),
                )
                .values(revoked_at=now)
            )
            audit(
                connection,
                at=now,
                tenant_id=tenant_id,
                actor=actor,
                action="token_revoke",
                detail={"token_id": token_id},
            )
        # after the commit: a lookup racing the revocation cannot cache the old row
        VERIFIED_TOKENS.forget(token_id=token_id)

    @staticmethod
    def _insert_token(
        connection: Connection, tenant_id: str, host: HostScope | None = None
    ) -> tuple[str, str]:
        token_id = secrets.token_hex(6)
        token = f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"
        connection.execute(
            schema.api_tokens.insert().values(
                token_id=token_id,
                tenant_id=tenant_id,
                token_hash=hash_token(token),
                created_at=db_now(connection),
                revoked_at=None,
                host=host.host if host is not None else None,
                groups=host.groups_column() if host is not None else None,
            )
        )
        return token_id, token
