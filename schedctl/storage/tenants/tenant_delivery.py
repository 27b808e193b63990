"""Owns a tenant's delivery settings in the database: the HTTP destination allow-list
(tenants.allow_list, a JSON list of host names and CIDRs), its delivery concurrency and
rate, and its RabbitMQ broker. Every change is audited; the relays pick changes up within
a few seconds, and every delivery checks the allow-list as it is then.

Storage stores, delivery decides: an allow-list entry arrives here in the canonical form
the SSRF guard gave it (schedctl.core.ssrf.normalize_entry, called by the command).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from schedctl.core import errors, limits
from schedctl.domain.brokers import check_broker_url, redact_url
from schedctl.domain.models import TargetType, Tenant
from schedctl.storage.backend.dialect import Lock
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.tenants.tenants import TenantRepo, change_tenant

MAX_DELIVERY_CONCURRENCY = limits.MAX_DELIVERY_CONCURRENCY
MAX_RATE_PER_SECOND = limits.MAX_RATE_PER_SECOND
MAX_ALLOW_LIST = limits.MAX_ALLOW_LIST


@dataclass(frozen=True)
class DeliverySettings:
    tenant_id: str
    name: str
    allow_list: tuple[str, ...]
    delivery_concurrency: int
    dispatch_rate_per_second: int
    broker_url: str | None  # redacted: never the password

    def to_dict(self) -> dict[str, object]:
        return {
            "tenant_id": self.tenant_id,
            "name": self.name,
            "allow_list": list(self.allow_list),
            "delivery_concurrency": self.delivery_concurrency,
            "dispatch_rate_per_second": self.dispatch_rate_per_second,
            "broker_url": self.broker_url,
        }


class TenantDeliveryRepo:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._tenants = TenantRepo(store)

    def _lock(self, connection: Connection, tenant: str) -> Tenant:
        found = self._tenants._get(connection, tenant)
        # concurrent allow/disallow of one tenant must not lose each other's entries
        self.store.dialect.lock_rows(
            connection,
            select(schema.tenants.c.tenant_id).where(schema.tenants.c.tenant_id == found.tenant_id),
            Lock.no_key_update,
        )
        return found

    def _allow_list(self, connection: Connection, tenant_id: str) -> list[str]:
        value = connection.execute(
            select(schema.tenants.c.allow_list).where(schema.tenants.c.tenant_id == tenant_id)
        ).scalar_one()
        return [str(e) for e in json.loads(value)]

    def settings(self, tenant: str) -> DeliverySettings:
        t = schema.tenants
        with self.store.read() as connection:
            found = self._tenants._get(connection, tenant)
            row = connection.execute(select(t).where(t.c.tenant_id == found.tenant_id)).one()
        return DeliverySettings(
            tenant_id=row.tenant_id,
            name=row.name,
            allow_list=tuple(str(e) for e in json.loads(row.allow_list)),
            delivery_concurrency=int(row.delivery_concurrency),
            dispatch_rate_per_second=int(row.dispatch_rate_per_second),
            broker_url=redact_url(row.broker_url) if row.broker_url else None,
        )

    def allow(self, tenant: str, canonical: str, *, actor: str) -> tuple[list[str], bool]:
        """Add a host name or CIDR in canonical form; (the allow-list, whether it changed)."""
        with self.store.tx() as connection:
            found = self._lock(connection, tenant)
            entries = self._allow_list(connection, found.tenant_id)
            if canonical in entries:
                return entries, False
            if len(entries) >= MAX_ALLOW_LIST:
                raise errors.QuotaExceeded(
                    f"tenant {found.name!r} already has {len(entries)} allow-list entries "
                    f"(the limit is {MAX_ALLOW_LIST}): use a CIDR that covers several",
                    field="allow_list",
                )
            entries.append(canonical)
            self._write(connection, found, entries, actor, "allow", canonical)
            return entries, True

    def disallow(
        self, tenant: str, canonical: str, *, actor: str, given: str | None = None
    ) -> list[str]:
        """Remove an entry in its canonical form (`given`: as the user wrote it, for the
        error when it is not there)."""
        entry = canonical if given is None else given
        with self.store.tx() as connection:
            found = self._lock(connection, tenant)
            entries = self._allow_list(connection, found.tenant_id)
            if canonical not in entries:
                raise errors.NotFound(
                    f"{entry!r} is not on tenant {found.name!r}'s allow-list "
                    f"({', '.join(entries) or 'empty'})",
                    field="allow_list",
                )
            entries.remove(canonical)
            self._write(connection, found, entries, actor, "disallow", canonical)
            return entries

    @staticmethod
    def _write(
        connection: Connection,
        tenant: Tenant,
        entries: list[str],
        actor: str,
        action: str,
        entry: str,
    ) -> None:
        change_tenant(
            connection,
            tenant.tenant_id,
            {"allow_list": json.dumps(entries)},
            actor=actor,
            action=f"tenant_{action}",
            detail={"entry": entry},
        )

    def set_delivery(
        self,
        tenant: str,
        *,
        concurrency: int | None = None,
        rate_per_second: int | None = None,
        actor: str,
    ) -> DeliverySettings:
        changes: dict[str, int] = {}
        if concurrency is not None:
            if not 1 <= concurrency <= MAX_DELIVERY_CONCURRENCY:
                raise errors.ValidationError(
                    f"must be from 1 to {MAX_DELIVERY_CONCURRENCY}", field="delivery_concurrency"
                )
            changes["delivery_concurrency"] = concurrency
        if rate_per_second is not None:
            if not 1 <= rate_per_second <= MAX_RATE_PER_SECOND:
                raise errors.ValidationError(
                    f"must be from 1 to {MAX_RATE_PER_SECOND}", field="dispatch_rate_per_second"
                )
            changes["dispatch_rate_per_second"] = rate_per_second
        if not changes:
            raise errors.ValidationError(
                "give --concurrency and/or --rate", field="delivery_concurrency"
            )
        with self.store.tx() as connection:
            found = self._lock(connection, tenant)
            change_tenant(
                connection, found.tenant_id, changes, actor=actor, action="tenant_delivery"
            )
        return self.settings(found.tenant_id)

    def set_broker(self, tenant: str, broker_url: str | None, *, actor: str) -> DeliverySettings:
        """Send the tenant's queue targets to this RabbitMQ broker (None: the built-in
        queue again; runs waiting for the broker go back to the built-in queue)."""
        url = check_broker_url(broker_url) if broker_url is not None else None
        o = schema.outbox
        with self.store.tx() as connection:
            found = self._lock(connection, tenant)
            change_tenant(
                connection,
                found.tenant_id,
                {"broker_url": url},
                actor=actor,
                action="tenant_broker",
                detail={"broker_url": redact_url(url) if url else None},
            )
            if url is None:
                connection.execute(
                    update(o)
                    .where(
                        o.c.tenant_id == found.tenant_id,
                        o.c.target_type == TargetType.rabbitmq.value,
                    )
                    .values(target_type=TargetType.queue.value, lease_owner=None)
                )
        return self.settings(found.tenant_id)
