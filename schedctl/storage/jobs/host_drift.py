"""Owns the host_drift rows: what each cron host's worker last found different between its
job files and the central jobs (the entries `schedctl apply --check` would report: a job
to create, change or remove), written at each rescan and read by `schedctl status`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select

from schedctl.core import errors
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.store import Store

MAX_ENTRIES = 100  # of one host's drift kept (the count is kept whole)
MAX_ENTRY_CHARS = 200


@dataclass(frozen=True)
class HostDrift:
    tenant_id: str
    host: str
    drift: tuple[str, ...]  # "changed backup@web1", ...; () when in step
    checked_at: datetime


def report(store: Store, tenant_id: str, host: str, drift: Sequence[str]) -> None:
    """Replace `host`'s drift of the tenant with `drift` (checked now)."""
    if not isinstance(host, str) or not 0 < len(host) <= 63:
        raise errors.ValidationError("must be a host name", field="host")
    entries = [str(d)[:MAX_ENTRY_CHARS] for d in drift]
    if len(entries) > MAX_ENTRIES:
        entries = [*entries[: MAX_ENTRIES - 1], f"... and {len(entries) - MAX_ENTRIES + 1} more"]
    table = schema.host_drift
    with store.tx() as connection:
        now = db_now(connection)
        connection.execute(
            delete(table).where(table.c.tenant_id == tenant_id, table.c.host == host)
        )
        connection.execute(
            table.insert().values(
                tenant_id=tenant_id, host=host, drift=json.dumps(entries), checked_at=now
            )
        )


def read(store: Store) -> list[HostDrift]:
    """Every host's last report, by tenant and host."""
    table = schema.host_drift
    with store.read() as connection:
        rows = connection.execute(
            select(table).order_by(table.c.tenant_id, table.c.host)
        ).mappings()
        return [
            HostDrift(r["tenant_id"], r["host"], tuple(json.loads(r["drift"])), r["checked_at"])
            for r in rows
        ]
