"""Owns the claim's writes (storage/pipeline/claim.py), Postgres's and SQLite's side by side:
the conditional advance of the claimed jobs and the insert of their runs with each
dispatched run's delivery (a built-in queue message or an outbox row: straight_to_queue,
decided once for both backends)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection

from schedctl.core import errors
from schedctl.domain.models import EVERY_HOST_QUEUE_PREFIX, JobStatus, RunStatus, TargetType
from schedctl.storage.backend.dialect import OUTBOX_WORD, Dialect
from schedctl.storage.backend.dialect_postgres import QUEUE_CHANNEL, pg_binary
from schedctl.storage.backend.dialect_sqlite import chunks
from schedctl.storage.db import schema


class ClaimStatements(Protocol):
    """The claim's statements on one backend, inside the caller's transaction."""

    def advance_jobs(
        self, connection: Connection, updates: list[dict[str, Any]], now: datetime
    ) -> set[str]:
        """The claim's conditional advance: each job moves to its next run only at the
        version it was read at and while active; returns the job ids advanced."""
        ...

    def insert_runs(
        self, connection: Connection, rows: list[dict[str, Any]], now: datetime
    ) -> list[tuple[str, datetime, str]]:
        """Insert run rows, skipping any (job_id, scheduled_at) that exists, and for each
        dispatched one inserted, its delivery: a ready queue message when it goes
        straight_to_queue, else an outbox row; returns the runs inserted.

        A built-in queue lives in this database, so the claim's own transaction delivers to
        it: the run reaches its target at the instant it is claimed, with no relay stage
        between. The outbox keeps what needs a relay's decision at delivery time: HTTP,
        tenants whose queues are a RabbitMQ broker, and every-host queues (skipped on a
        host with no live worker at that moment). A cancel that commits after the claim is
        honoured where the outbox honoured it, at the lease: a stopped job's message is
        skipped."""
        ...


def queue_target(row: Mapping[str, Any]) -> bool:
    """The routing rule of insert_runs, in Python for both backends: a dispatched run goes
    straight into its queue when it targets a built-in queue that is not an every-host
    one -- and its tenant has no broker (a RabbitMQ tenant's queues are the broker's),
    which each backend reads in its statement."""
    return row["target_type"] == TargetType.queue.value and not str(row["target"]).startswith(
        EVERY_HOST_QUEUE_PREFIX
    )


class _Postgres:
    def advance_jobs(
        self, connection: Connection, updates: list[dict[str, Any]], now: datetime
    ) -> set[str]:
        # Lock order: job rows are locked in job_id order before the update, whose join
        # would otherwise lock them in whatever order its plan visits them. Every
        # statement that locks several job rows does so in this order (or, like the
        # worker's lease, takes advisory locks instead), so claims cannot deadlock with
        # each other, cancels, updates or acks. FOR NO KEY UPDATE is what the UPDATE
        # takes anyway, so there is no lock upgrade.
        pg_binary(
            connection,
            """
            SELECT job_id FROM jobs
             WHERE job_id = ANY(CAST(%(job_ids)b AS text[]))
             ORDER BY job_id
               FOR NO KEY UPDATE
            """,
            {"job_ids": sorted(u["job_id"] for u in updates)},
        )
        statement = """
            UPDATE jobs AS j
               SET next_run_at = v.next_run_at,
                   next_fire_at = v.next_fire_at,
                   status = v.status,
                   version = j.version + 1,
                   updated_at = %(now)b
              FROM unnest(CAST(%(job_ids)b AS text[]), CAST(%(versions)b AS bigint[]),
                          CAST(%(next_run_ats)b AS timestamptz[]),
                          CAST(%(next_fire_ats)b AS timestamptz[]),
                          CAST(%(statuses)b AS text[]))
                   AS v(job_id, version, next_run_at, next_fire_at, status)
             WHERE j.job_id = v.job_id AND j.version = v.version AND j.status = 'active'
         RETURNING j.job_id
            """
        rows = pg_binary(
            connection,
            statement,
            {
                "now": now,
                "job_ids": [u["job_id"] for u in updates],
                "versions": [u["version"] for u in updates],
                "next_run_ats": [u["next_run_at"] for u in updates],
                "next_fire_ats": [u["next_fire_at"] for u in updates],
                "statuses": [u["status"] for u in updates],
            },
        )
        return {r[0] for r in rows}

    def insert_runs(
        self, connection: Connection, rows: list[dict[str, Any]], now: datetime
    ) -> list[tuple[str, datetime, str]]:
        if not rows:
            return []
        # one statement for runs and outbox rows, one round trip; everything comes in
        # arrays (a join to jobs would hang on the planner's row estimates)
        statement = """
            WITH v AS (
                SELECT * FROM unnest(
                    CAST(%(job_ids)b AS text[]), CAST(%(scheduled_ats)b AS timestamptz[]),
                    CAST(%(statuses)b AS text[]), CAST(%(fire_ats)b AS timestamptz[]),
                    CAST(%(epochs)b AS bigint[]), CAST(%(versions)b AS bigint[]),
                    CAST(%(tenant_ids)b AS text[]), CAST(%(partitions)b AS integer[]),
                    CAST(%(target_types)b AS text[]), CAST(%(targets)b AS text[]),
                    CAST(%(queue_targets)b AS boolean[]))
                AS v(job_id, scheduled_at, status, fire_at, epoch, job_version, tenant_id,
                     partition, target_type, target, queue_target)
            ), ins AS (
                INSERT INTO runs (job_id, scheduled_at, tenant_id, partition, trigger, status,
                                  attempt, fire_at, dispatched_at, finished_at, epoch,
                                  job_version)
                SELECT v.job_id, v.scheduled_at, v.tenant_id, v.partition, 'schedule', v.status,
                       CASE WHEN v.status = 'dispatched' THEN 1 ELSE 0 END, v.fire_at,
                       CASE WHEN v.status = 'dispatched' THEN CAST(%(now)b AS timestamptz) END,
                       CASE WHEN v.status = 'dispatched' THEN NULL
                            ELSE CAST(%(now)b AS timestamptz) END,
                       v.epoch, v.job_version
                  FROM v
                ON CONFLICT DO NOTHING
                RETURNING job_id, scheduled_at, status
            ), sent AS (
                -- the dispatched runs inserted, and whether each goes straight into its
                -- built-in queue (queue_target, and a tenant without a broker) or
                -- through the outbox
                SELECT v.job_id, v.scheduled_at, v.tenant_id, v.target_type, v.target,
                       v.queue_target
                         AND v.tenant_id NOT IN (
                             SELECT tenant_id FROM tenants WHERE broker_url IS NOT NULL)
                         AS direct
                  FROM ins JOIN v ON v.job_id = ins.job_id AND v.scheduled_at = ins.scheduled_at
                 WHERE ins.status = 'dispatched'
            ), ob AS (
                INSERT INTO outbox (job_id, scheduled_at, tenant_id, target_type, target,
                                    attempt, available_at, created_at)
                SELECT job_id, scheduled_at, tenant_id, target_type, target, 1,
                       CAST(%(now)b AS timestamptz), CAST(%(now)b AS timestamptz)
                  FROM sent WHERE NOT direct
                RETURNING 1
            ), qm AS (
                INSERT INTO queue_messages (queue, job_id, scheduled_at, tenant_id, attempt,
                                            available_at, created_at)
                SELECT target, job_id, scheduled_at, tenant_id, 1,
                       CAST(%(now)b AS timestamptz), CAST(%(now)b AS timestamptz)
                  FROM sent WHERE direct
                ON CONFLICT (job_id, scheduled_at) DO NOTHING
                RETURNING tenant_id, queue
            ), woken AS (
                -- idle workers of the queues filled, and the relays when the outbox got
                -- rows, start at once, not at their next poll (sent at commit; one word
                -- per queue and one for the outbox, whatever the batch's size)
                SELECT count(pg_notify(%(queue_channel)s, word)) AS notified
                  FROM (SELECT tenant_id || ':' || queue AS word FROM qm
                        UNION SELECT %(outbox_word)s FROM ob) AS filled
            )
            -- the join with woken's one row makes Postgres run it: a CTE nothing reads
            -- is skipped unless it writes
            SELECT job_id, scheduled_at, status FROM ins, woken
            """
        result = pg_binary(
            connection,
            statement,
            {
                "now": now,
                "queue_targets": [queue_target(r) for r in rows],
                "queue_channel": QUEUE_CHANNEL,
                "outbox_word": OUTBOX_WORD,
                **{
                    name: [r[column] for r in rows]
                    for name, column in (
                        ("job_ids", "job_id"),
                        ("scheduled_ats", "scheduled_at"),
                        ("statuses", "status"),
                        ("fire_ats", "fire_at"),
                        ("epochs", "epoch"),
                        ("versions", "job_version"),
                        ("tenant_ids", "tenant_id"),
                        ("partitions", "partition"),
                        ("target_types", "target_type"),
                        ("targets", "target"),
                    )
                },
            },
        )
        return [(r[0], r[1], r[2]) for r in result]


class _Sqlite:
    def advance_jobs(
        self, connection: Connection, updates: list[dict[str, Any]], now: datetime
    ) -> set[str]:
        # The transaction is BEGIN IMMEDIATE: no other writer until it ends, so the jobs
        # read active at their version here are exactly those the conditional UPDATE
        # matches. One read and one executemany of one compiled UPDATE, instead of a
        # statement built per job (the claim of a 10,000 burst took 15 s of CPU so).
        stored: dict[str, tuple[int, str]] = {}
        for chunk in chunks(sorted({u["job_id"] for u in updates})):
            found = connection.execute(_job_versions(), {"ids": chunk})
            stored.update({j: (v, st) for j, v, st in found})
        advancing: dict[str, dict[str, Any]] = {}
        for u in updates:
            if u["job_id"] not in advancing and stored.get(u["job_id"]) == (
                u["version"],
                JobStatus.active.value,
            ):
                advancing[u["job_id"]] = u  # a job listed twice advances once
        if not advancing:
            return set()
        outcome = connection.execute(
            _advance_job(),
            [
                {
                    "b_job_id": u["job_id"],
                    "b_version": u["version"],
                    "b_next_run_at": u["next_run_at"],
                    "b_next_fire_at": u["next_fire_at"],
                    "b_status": u["status"],
                    "b_now": now,
                }
                for u in advancing.values()
            ],
        )
        if outcome.rowcount != len(advancing):
            # cannot happen under the write lock; if it did, claim nothing rather than guess
            raise errors.StoreUnavailable(
                f"claim: {outcome.rowcount} of {len(advancing)} jobs advanced; rolled back"
            )
        return set(advancing)

    def insert_runs(
        self, connection: Connection, rows: list[dict[str, Any]], now: datetime
    ) -> list[tuple[str, datetime, str]]:
        # as in advance_jobs, the write lock makes "not there yet" the same as "inserted":
        # read which runs exist (both keys: not a recurring job's whole history), then one
        # executemany for the runs and one for the outbox rows
        r = schema.runs
        existing: set[tuple[str, datetime]] = set()
        for chunk in chunks(rows):
            found = connection.execute(
                _existing_runs(),
                {
                    "job_ids": list({row["job_id"] for row in chunk}),
                    "instants": list({row["scheduled_at"] for row in chunk}),
                },
            )
            existing.update((j, at) for j, at in found)
        new: list[dict[str, Any]] = []
        for row in rows:
            key = (row["job_id"], row["scheduled_at"])
            if key not in existing:
                existing.add(key)  # a run listed twice is inserted once
                new.append(row)
        if not new:
            return []
        outcome = connection.execute(
            _insert_new(r),
            [{k: v for k, v in row.items() if k not in ("target_type", "target")} for row in new],
        )
        if outcome.rowcount != len(new):
            raise errors.StoreUnavailable(
                f"claim: {outcome.rowcount} of {len(new)} runs inserted; rolled back"
            )
        sent = [row for row in new if row["status"] == RunStatus.dispatched.value]
        if not sent:
            return [(row["job_id"], row["scheduled_at"], row["status"]) for row in new]
        brokers = set(connection.execute(_broker_tenants()).scalars())
        queued = [row for row in sent if queue_target(row) and row["tenant_id"] not in brokers]
        if queued:
            connection.execute(
                _insert_new(schema.queue_messages),
                [
                    {
                        "queue": row["target"],
                        "job_id": row["job_id"],
                        "scheduled_at": row["scheduled_at"],
                        "tenant_id": row["tenant_id"],
                        "attempt": 1,
                        "available_at": now,
                        "created_at": now,
                    }
                    for row in queued
                ],
            )
        outbox_rows = [
            {
                "job_id": row["job_id"],
                "scheduled_at": row["scheduled_at"],
                "tenant_id": row["tenant_id"],
                "target_type": row["target_type"],
                "target": row["target"],
                "attempt": 1,
                "available_at": now,
                "created_at": now,
            }
            for row in sent
            if not (queue_target(row) and row["tenant_id"] not in brokers)
        ]
        if outbox_rows:
            connection.execute(schema.outbox.insert(), outbox_rows)
        return [(row["job_id"], row["scheduled_at"], row["status"]) for row in new]


_STATEMENTS: dict[str, ClaimStatements] = {"postgresql": _Postgres(), "sqlite": _Sqlite()}


def claim_statements(dialect: Dialect) -> ClaimStatements:
    """The claim statements of the dialect's backend."""
    return _STATEMENTS[dialect.name]


@functools.cache
def _job_versions() -> Any:
    jobs = schema.jobs
    return select(jobs.c.job_id, jobs.c.version, jobs.c.status).where(
        jobs.c.job_id.in_(bindparam("ids", expanding=True))
    )


@functools.cache
def _advance_job() -> Any:
    jobs = schema.jobs
    return (
        update(jobs)
        .where(
            jobs.c.job_id == bindparam("b_job_id"),
            jobs.c.version == bindparam("b_version"),
            jobs.c.status == JobStatus.active.value,
        )
        .values(
            next_run_at=bindparam("b_next_run_at", type_=jobs.c.next_run_at.type),
            next_fire_at=bindparam("b_next_fire_at", type_=jobs.c.next_fire_at.type),
            status=bindparam("b_status"),
            version=jobs.c.version + 1,
            updated_at=bindparam("b_now", type_=jobs.c.updated_at.type),
        )
    )


@functools.cache
def _existing_runs() -> Any:
    r = schema.runs
    return select(r.c.job_id, r.c.scheduled_at).where(
        r.c.job_id.in_(bindparam("job_ids", expanding=True)),
        r.c.scheduled_at.in_(bindparam("instants", expanding=True, type_=r.c.scheduled_at.type)),
    )


@functools.cache
def _insert_new(table: Table) -> Any:
    return sqlite.insert(table).on_conflict_do_nothing()


@functools.cache
def _broker_tenants() -> Any:
    t = schema.tenants
    return select(t.c.tenant_id).where(t.c.broker_url.is_not(None))
