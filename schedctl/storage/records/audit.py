"""Owns the audit log in the database: writing an entry inside the caller's transaction
and reading entries back, newest first, by tenant, job and action."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from schedctl.core import limits
from schedctl.domain.models import Page
from schedctl.storage.db import schema
from schedctl.storage.db.cursors import check_page_limit, decode_cursor, encode_cursor
from schedctl.storage.db.rows import as_stored
from schedctl.storage.db.store import Store


@dataclass(frozen=True)
class AuditEntry:
    id: int
    at: datetime
    tenant_id: str | None
    tenant: str | None  # the tenant's name, for people
    actor: str  # "cli:USER", "token:TOKEN_ID", ...
    action: str
    job_id: str | None
    detail: dict[str, Any] | None


def audit(
    connection: Connection,
    *,
    at: datetime,
    tenant_id: str | None,
    actor: str,
    action: str,
    job_id: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    connection.execute(
        schema.audit_log.insert().values(
            at=at,
            tenant_id=tenant_id,
            actor=actor,
            action=action,
            job_id=job_id,
            detail=json.dumps(detail) if detail is not None else None,
        )
    )


class AuditRepo:
    def __init__(self, store: Store) -> None:
        self.store = store

    def list(
        self,
        *,
        tenant_id: str | None = None,
        job_id: str | None = None,
        action: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Newest first; the cursor is the last entry id seen."""
        check_page_limit(limit)
        log, tenants = schema.audit_log, schema.tenants
        query = (
            select(log, tenants.c.name.label("tenant_name"))
            .select_from(log.outerjoin(tenants, tenants.c.tenant_id == log.c.tenant_id))
            .order_by(log.c.id.desc())
            .limit(limit + 1)
        )
        if tenant_id is not None:
            query = query.where(log.c.tenant_id == tenant_id)
        if job_id is not None:
            query = query.where(log.c.job_id == job_id)
        if action is not None:
            query = query.where(log.c.action == action)
        if cursor:
            (before,) = decode_cursor(cursor, 1)
            query = query.where(log.c.id < limits.cursor_id(before))
        with self.store.read() as connection:
            rows = connection.execute(query).mappings().all()
        items = tuple(
            AuditEntry(
                id=int(r["id"]),
                tenant=r["tenant_name"],
                detail=json.loads(r["detail"]) if r["detail"] else None,
                **as_stored(r, ("at", "tenant_id", "actor", "action", "job_id")),
            )
            for r in rows[:limit]
        )
        next_cursor = encode_cursor(str(items[-1].id)) if len(rows) > limit else None
        return Page(items, next_cursor)
