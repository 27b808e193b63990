"""Owns the dead-letter store behind `schedctl dlq`: runs whose delivery failed for good,
with the last error -- list, show (with the attempt history), replay and purge."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Connection, RowMapping

from schedctl.core import errors, limits
from schedctl.domain.models import Page, RunStatus, TargetType, run_key
from schedctl.scheduling.timeparse import format_instant
from schedctl.storage.backend.dialect import OUTBOX_WORD, dialect_of
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.cursors import decode_cursor, encode_cursor
from schedctl.storage.db.rows import as_stored
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.settle import STOPPED_JOB_STATUSES
from schedctl.storage.records.audit import audit


@dataclass(frozen=True)
class DeadLetter:
    id: int
    job_id: str
    scheduled_at: datetime
    tenant_id: str
    tenant: str | None  # name
    target_type: str
    target: str
    attempts: int
    last_error: str | None
    created_at: datetime
    replayed_at: datetime | None
    job: str | None = None  # the job's name (None: the job row is gone)

    @property
    def idempotency_key(self) -> str:
        return run_key(self.job_id, self.scheduled_at)


class DeadLetterRepo:
    """The dead-letter store: runs whose delivery failed for good, with the last error."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def list_letters(
        self,
        *,
        tenant_id: str | None = None,
        job_id: str | None = None,
        include_replayed: bool = False,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Newest first; pass next_cursor back for the following page."""
        limits.check_page(limit)
        d = schema.dead_letters
        query = _select_letters().order_by(d.c.id.desc()).limit(limit + 1)
        if tenant_id is not None:
            query = query.where(d.c.tenant_id == tenant_id)
        if job_id is not None:
            query = query.where(d.c.job_id == job_id)
        if not include_replayed:
            query = query.where(d.c.replayed_at.is_(None))
        if cursor:
            (before,) = decode_cursor(cursor, 1)
            query = query.where(d.c.id < limits.cursor_id(before))
        with self.store.read() as connection:
            rows = connection.execute(query).mappings().all()
        items = tuple(_letter(r) for r in rows[:limit])
        next_cursor = encode_cursor(str(items[-1].id)) if len(rows) > limit else None
        return Page(items, next_cursor)

    def get(self, letter_id: int, tenant_id: str | None = None) -> DeadLetter:
        with self.store.read() as connection:
            return self._get(connection, letter_id, tenant_id)

    @staticmethod
    def _get(connection: Connection, letter_id: int, tenant_id: str | None) -> DeadLetter:
        d = schema.dead_letters
        query = _select_letters().where(d.c.id == letter_id)
        if tenant_id is not None:
            query = query.where(d.c.tenant_id == tenant_id)
        row = connection.execute(query).mappings().first()
        if row is None:
            # the same answer for absent and another tenant's
            raise errors.NotFound(f"no dead letter {letter_id}", field="id")
        return _letter(row)

    def attempts(self, letter: DeadLetter) -> list[dict[str, Any]]:
        """The run's attempt history, oldest first."""
        a = schema.run_attempts
        with self.store.read() as connection:
            rows = (
                connection.execute(
                    select(a)
                    .where(a.c.job_id == letter.job_id, a.c.scheduled_at == letter.scheduled_at)
                    .order_by(a.c.id)
                )
                .mappings()
                .all()
            )
        return [{k: v for k, v in r.items() if k != "id"} for r in rows]

    def replay(self, letter_id: int, *, tenant_id: str | None = None, actor: str) -> DeadLetter:
        """Deliver the run again from its first attempt (a fresh retry budget)."""
        with self.store.tx() as connection:
            letter = self._get(connection, letter_id, tenant_id)
            if letter.replayed_at is not None:
                raise errors.Conflict(
                    f"dead letter {letter_id} was replayed already at "
                    f"{format_instant(letter.replayed_at)}",
                    field="id",
                )
            status = connection.execute(
                select(schema.jobs.c.status).where(schema.jobs.c.job_id == letter.job_id)
            ).scalar_one_or_none()
            if status is None or status in STOPPED_JOB_STATUSES:
                raise errors.Conflict(
                    f"cannot replay dead letter {letter_id}: job {letter.job_id} is {status}",
                    field="status",
                )
            self._requeue(connection, letter, actor=actor)
            return self._get(connection, letter_id, tenant_id)

    def replay_all(self, *, tenant_id: str | None = None, actor: str) -> tuple[int, int]:
        """Replay every pending dead letter (of one tenant); (replayed, skipped because
        their job is cancelled)."""
        d, j = schema.dead_letters, schema.jobs
        replayed = skipped = 0
        after = 0
        while True:
            with self.store.tx() as connection:
                query = (
                    _select_letters()
                    .add_columns(j.c.status.label("job_status"))
                    .outerjoin(j, j.c.job_id == d.c.job_id)
                    .where(d.c.replayed_at.is_(None), d.c.id > after)
                    .order_by(d.c.id)
                    .limit(500)
                )
                if tenant_id is not None:
                    query = query.where(d.c.tenant_id == tenant_id)
                rows = connection.execute(query).mappings().all()
                if not rows:
                    return replayed, skipped
                for row in rows:
                    after = row["id"]
                    if row["job_status"] is None or row["job_status"] in STOPPED_JOB_STATUSES:
                        skipped += 1
                        continue
                    self._requeue(connection, _letter(row), actor=actor)
                    replayed += 1

    @staticmethod
    def _requeue(connection: Connection, letter: DeadLetter, *, actor: str) -> None:
        now = db_now(connection)
        marked = connection.execute(
            update(schema.dead_letters)
            .where(
                schema.dead_letters.c.id == letter.id, schema.dead_letters.c.replayed_at.is_(None)
            )
            .values(replayed_at=now)
        )
        if marked.rowcount != 1:
            raise errors.Conflict(f"dead letter {letter.id} was replayed meanwhile", field="id")
        # RabbitMQ rows go back as queue rows: the tenant's broker setting routes them again
        kind = TargetType.http if letter.target_type == TargetType.http else TargetType.queue
        connection.execute(
            schema.outbox.insert().values(
                job_id=letter.job_id,
                scheduled_at=letter.scheduled_at,
                tenant_id=letter.tenant_id,
                target_type=kind.value,
                target=letter.target,
                attempt=1,
                available_at=now,
                created_at=now,
            )
        )
        dialect_of(connection).notify_ready(connection, {OUTBOX_WORD})  # a relay, at once
        connection.execute(
            update(schema.runs)
            .where(
                schema.runs.c.job_id == letter.job_id,
                schema.runs.c.scheduled_at == letter.scheduled_at,
            )
            .values(
                status=RunStatus.dispatched.value,
                attempt=1,
                dispatched_at=now,
                started_at=None,
                finished_at=None,
                exit_code=None,
                error=None,
                output_tail=None,
            )
        )
        audit(
            connection,
            at=now,
            tenant_id=letter.tenant_id,
            actor=actor,
            action="dlq_replay",
            job_id=letter.job_id,
            detail={"dead_letter": letter.id, "scheduled_at": format_instant(letter.scheduled_at)},
        )

    def purge(self, letter_id: int, *, tenant_id: str | None = None, actor: str) -> None:
        with self.store.tx() as connection:
            letter = self._get(connection, letter_id, tenant_id)
            connection.execute(
                delete(schema.dead_letters).where(schema.dead_letters.c.id == letter_id)
            )
            audit(
                connection,
                at=db_now(connection),
                tenant_id=letter.tenant_id,
                actor=actor,
                action="dlq_purge",
                job_id=letter.job_id,
                detail={"dead_letter": letter_id},
            )

    def purge_all(
        self,
        *,
        tenant_id: str | None = None,
        older_than: timedelta | None = None,
        actor: str,
    ) -> int:
        """Delete dead letters (of one tenant, older than a while); returns how many."""
        d = schema.dead_letters
        with self.store.tx() as connection:
            now = db_now(connection)
            conditions = []
            if tenant_id is not None:
                conditions.append(d.c.tenant_id == tenant_id)
            if older_than is not None:
                conditions.append(d.c.created_at < now - older_than)
            outcome = connection.execute(delete(d).where(*conditions))
            audit(
                connection,
                at=now,
                tenant_id=tenant_id,
                actor=actor,
                action="dlq_purge",
                detail={
                    "count": outcome.rowcount,
                    "older_than_seconds": older_than.total_seconds() if older_than else None,
                },
            )
            return int(outcome.rowcount)


def _select_letters() -> Any:
    d, t = schema.dead_letters, schema.tenants
    named = schema.jobs.alias("named_job")  # its name; an alias: replay_all joins jobs too
    return (
        select(d, t.c.name.label("tenant_name"), named.c.name.label("job_name"))
        .outerjoin(t, t.c.tenant_id == d.c.tenant_id)
        .outerjoin(named, named.c.job_id == d.c.job_id)
    )


# the dead_letters columns a DeadLetter keeps as stored
_AS_STORED = (
    "job_id",
    "scheduled_at",
    "tenant_id",
    "target_type",
    "target",
    "attempts",
    "last_error",
    "created_at",
    "replayed_at",
)


def _letter(row: RowMapping) -> DeadLetter:
    return DeadLetter(
        id=int(row["id"]),
        tenant=row["tenant_name"],
        job=row["job_name"],
        **as_stored(row, _AS_STORED),
    )
