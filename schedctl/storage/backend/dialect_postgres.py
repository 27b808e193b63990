"""Owns the Postgres side of the Dialect (storage/backend/dialect.py): clock_timestamp(), row locks
with SKIP LOCKED, LISTEN/NOTIFY, advisory locks for worker leases, the claim's batched
statements over arrays bound in binary, the relay's one-statement lane read, and the day
partitions of run history."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    Select,
    Table,
    Text,
    any_,
    bindparam,
    func,
    literal_column,
    select,
    text,
    true,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Engine, RowMapping
from sqlalchemy.exc import IntegrityError

from schedctl import errors
from schedctl.leasing import ReadyFeed
from schedctl.models import EVERY_HOST_QUEUE_PREFIX, JobStatus, Lane
from schedctl.storage.backend.dialect import (
    OUTBOX_WORD,
    ChangeFeed,
    Changes,
    LeasedRow,
    LeaseMark,
    Lock,
    OutcomeWrites,
    RoleGrants,
    RunPartitions,
    ServerSessions,
)
from schedctl.storage.db import schema
from schedctl.storage.db.engine import session_kwargs

if TYPE_CHECKING:
    # the driver is loaded by the change feed only: a CLI command needs it not
    import psycopg

log = logging.getLogger(__name__)

# SQLSTATEs of a transaction that lost a lock race: deadlock_detected and
# serialization_failure. Nothing was committed; the same work can be tried again.
LOCK_RACE_SQLSTATES = frozenset({"40P01", "40001"})
CHANNEL = "scheduled_jobs"
# word that work is ready: payload queue_word(TENANT_ID, QUEUE) for a built-in queue's new
# ready messages, OUTBOX_WORD for new outbox rows (dialect.py)
QUEUE_CHANNEL = "scheduled_queues"


class PostgresDialect:
    name = "postgresql"
    driver = "psycopg"
    # row locks (in job_id order for claims): claim threads run side by side, and
    # writers that find nothing block nobody
    single_writer = False
    naive_instants = False  # timestamptz
    embedded = False
    generates_rows = True

    def now(self, connection: Connection) -> datetime:
        value = connection.execute(text("SELECT clock_timestamp()")).scalar_one()
        assert isinstance(value, datetime)
        return value.astimezone(UTC)

    def locked_clock(self) -> Any:
        # the statement's start (statement_timestamp) would come before its wait for locks
        return func.clock_timestamp()

    def clock(self, begin: Callable[[], AbstractContextManager[Connection]]) -> datetime:
        with begin() as connection:
            return self.now(connection)

    def insert(self, table: Table) -> Any:
        return postgresql.insert(table)

    def lock(
        self, query: Any, mode: Lock = Lock.update, *, skip_locked: bool = False, of: Any = None
    ) -> Any:
        return query.with_for_update(
            read=mode is Lock.share,
            key_share=mode is Lock.no_key_update,
            skip_locked=skip_locked,
            of=of,
        )

    def lock_rows(self, connection: Connection, query: Any, mode: Lock = Lock.update) -> None:
        connection.execute(self.lock(query, mode))

    def is_lock_race(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) in LOCK_RACE_SQLSTATES

    def lock_job_slots(self, connection: Connection, job_ids: Sequence[str]) -> None:
        # Transaction-scoped advisory locks on a hash of each job id, not job row locks:
        # they conflict only with other leases (taken in sorted order, so leases never
        # deadlock each other), never with the claim's, a cancel's or an update's row
        # locks. Taken in hash order (the lock keys' order, whatever collides); a hash
        # collision only serializes two jobs' leases a little more.
        _pg_rows(
            connection,
            "SELECT pg_advisory_xact_lock(h) FROM (SELECT DISTINCT"
            " hashtextextended(k, 0) AS h FROM unnest(CAST(%(keys)b AS text[])) AS k) AS s"
            " ORDER BY h",
            {"keys": [f"lease:{job_id}" for job_id in job_ids]},
        )

    def lease_candidates(
        self, connection: Connection, tenant_id: str, queue: str, fetch: int
    ) -> tuple[datetime, Sequence[Sequence[Any]]]:
        # Planned at each execution, never prepared: a generic plan does not know the LIMIT
        # and was made while the queue looked empty; with 100,000 messages queued it joined
        # and sorted the whole queue (or worse) and two workers stalled for minutes on it.
        rows = _pg_rows(
            connection,
            _LEASE_CANDIDATES,
            {"tenant_id": tenant_id, "queue": queue, "fetch": fetch},
            prepare=False,
        )
        if not rows:
            return datetime.now(UTC), []  # nothing is leased: the time is not used
        # the clock column of the first row; scheduled_at as a UTC instant, as the column type
        return rows[0][-1].astimezone(UTC), [
            (r[0], r[1], r[2].astimezone(UTC), *r[3:-1]) for r in rows
        ]

    def leased_counts(self, connection: Connection, job_ids: Sequence[str]) -> dict[str, int]:
        return dict(_pg_rows(connection, _LEASED_COUNTS, {"job_ids": list(job_ids)}, prepare=False))

    def mark_leased(
        self, connection: Connection, leases: Sequence[LeasedRow], mark: LeaseMark
    ) -> None:
        # unprepared, as lease_candidates: the generic plan made on a near-empty queue
        # joined by seq scans of the queue and today's runs, 6 ms a lease at 60,000 runs
        _pg_keyed(
            connection,
            _MARK_LEASED,
            {
                "ids": [x[0] for x in leases],
                "job_ids": [x[1] for x in leases],
                "scheduled_ats": [x[2] for x in leases],
                "attempts": [x[3] for x in leases],
                "owners": (
                    [mark.owner] * len(leases) if isinstance(mark.owner, str) else mark.owner
                ),
                "leased_until": mark.leased_until,
                "now": mark.now,
                **_span([x[2] for x in leases]),
            },
        )

    def held_messages(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime, Sequence[Sequence[Any]]]:
        rows = _pg_rows(connection, _HELD_MESSAGES, {"ids": list(ids)}, prepare=False)
        if not rows:
            return self.now(connection), []
        return rows[0][-1].astimezone(UTC), [
            (r[0], r[1], r[2], r[3].astimezone(UTC), *r[4:-1]) for r in rows
        ]

    def notify_job_change(self, connection: Connection, job_id: str, partition: int) -> None:
        connection.execute(
            text("SELECT pg_notify(:channel, :payload)"),
            {"channel": CHANNEL, "payload": f"{partition}:{job_id}"},
        )

    def notify_job_changes(
        self, connection: Connection, changed: Sequence[tuple[str, int]]
    ) -> None:
        _notify_all(connection, CHANNEL, [f"{part}:{job_id}" for job_id, part in changed])

    def change_feed(self, engine: Engine, poll_seconds: float) -> ChangeFeed:
        return PostgresChangeFeed(engine)

    def notify_ready(self, connection: Connection, words: Collection[str]) -> None:
        if words:
            _notify_all(connection, QUEUE_CHANNEL, sorted(words))

    def ready_feed(self, engine: Engine, word: str) -> ReadyFeed | None:
        return PostgresReadyFeed(engine, word)

    def advance_jobs(
        self, connection: Connection, updates: list[dict[str, Any]], now: datetime
    ) -> set[str]:
        # Lock order: job rows are locked in job_id order before the update, whose join
        # would otherwise lock them in whatever order its plan visits them. Every
        # statement that locks several job rows does so in this order (or, like the
        # worker's lease, takes advisory locks instead), so claims cannot deadlock with
        # each other, cancels, updates or acks. FOR NO KEY UPDATE is what the UPDATE
        # takes anyway, so there is no lock upgrade.
        _pg_binary(
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
        rows = _pg_binary(
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
                    CAST(%(target_types)b AS text[]), CAST(%(targets)b AS text[]))
                AS v(job_id, scheduled_at, status, fire_at, epoch, job_version, tenant_id,
                     partition, target_type, target)
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
                -- built-in queue (see insert_runs' docstring) or through the outbox
                SELECT v.job_id, v.scheduled_at, v.tenant_id, v.target_type, v.target,
                       v.target_type = 'queue'
                         AND NOT starts_with(v.target, %(every_host)s)
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
        result = _pg_binary(
            connection,
            statement,
            {
                "now": now,
                "every_host": EVERY_HOST_QUEUE_PREFIX,
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

    def id_in(self, column: Any, ids: Sequence[int]) -> Any:
        # one array parameter (= ANY): one statement text whatever the batch size, which
        # psycopg parses once, instead of one placeholder per id (a new text, parsed again,
        # for every length; it cost the relay a tenth of its CPU)
        return column == any_(bindparam(None, list(ids), type_=ARRAY(BigInteger)))

    def insert_attempts(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        _pg_binary(
            connection,
            _INSERT_ATTEMPTS,
            {name: [row[name] for row in rows] for name, _ in _ATTEMPT_ARRAYS},
        )

    def update_runs(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        _pg_keyed(
            connection,
            _UPDATE_RUNS,
            {name: [row[name] for row in rows] for name, _ in _RUN_ARRAYS}
            | _span([row["scheduled_at"] for row in rows]),
        )

    def record_outcomes(
        self, connection: Connection, writes: OutcomeWrites
    ) -> list[tuple[str, str]] | None:
        # one statement, one round trip: the three writes touch three different tables,
        # and the read of job_dependencies a fourth
        table_name = writes.gone[0].name if writes.gone is not None else schema.queue_messages.name
        # a run per attempt (each attempt of another run), in the same order: the runs'
        # columns are the attempts' (settle builds both rows from the same values) but for
        # the run's status, so only that array is sent for them -- psycopg dumps every array
        # element by element, and these were eight more arrays per batch
        aligned = len(writes.runs) == len(writes.attempts)
        key = (table_name, aligned)
        statement = _RECORD_OUTCOMES.get(key)
        if statement is None:
            statement = _RECORD_OUTCOMES[key] = _record_outcomes(table_name, aligned=aligned)
        runs = _ALIGNED_RUN_ARRAYS if aligned else _RUN_ARRAYS
        # Planned at each execution, never prepared (as lease_candidates): a worker that
        # settled its first runs while the queue and today's runs were near empty kept a
        # generic plan scanning both whole for every batch; at 2,000 runs/s that scan grew
        # with the run history until Postgres's CPU, not the workers, set the pace
        return _pg_keyed(
            connection,
            statement,
            {
                "upstreams": list(writes.upstreams),
                **{
                    f"a_{name}": [row[name] for row in writes.attempts]
                    for name, _ in _ATTEMPT_ARRAYS
                },
                **{f"r_{name}": [row[name] for row in writes.runs] for name, _ in runs},
                **{
                    f"r_{k}": v
                    for k, v in _span([row["scheduled_at"] for row in writes.runs]).items()
                },
                "gone": list(writes.gone[1]) if writes.gone is not None else [],
            },
        )

    def due_outbox_rows(
        self, connection: Connection, wanted: Mapping[Lane, int], now: datetime
    ) -> list[RowMapping]:
        lanes = sorted(wanted.items(), key=lambda item: (item[0].tenant_id, item[0].kind))
        # one statement for every lane: a LATERAL range read of ix_outbox_lane each,
        # locking what it takes and skipping rows another relay holds
        statement = text(
            """
            SELECT o.id, o.job_id, o.scheduled_at, o.tenant_id, o.target_type, o.target,
                   o.attempt, o.lease_owner, o.payload
              FROM unnest(CAST(:tenants AS text[]), CAST(:kinds AS text[]),
                          CAST(:caps AS integer[])) AS l(tenant_id, kind, cap)
             CROSS JOIN LATERAL (
                    SELECT id, job_id, scheduled_at, tenant_id, target_type, target,
                           attempt, lease_owner, payload
                      FROM outbox
                     WHERE outbox.tenant_id = l.tenant_id
                       AND outbox.target_type = l.kind
                       AND outbox.available_at <= :now
                     ORDER BY outbox.available_at
                     LIMIT l.cap
                       FOR UPDATE SKIP LOCKED) AS o
            """
        ).columns(scheduled_at=schema.outbox.c.scheduled_at.type)
        return list(
            connection.execute(
                statement,
                {
                    "tenants": [lane.tenant_id for lane, _ in lanes],
                    "kinds": [str(lane.kind) for lane, _ in lanes],
                    "caps": [cap for _, cap in lanes],
                    "now": now,
                },
            )
            .mappings()
            .all()
        )

    def lease_outbox_rows(
        self,
        connection: Connection,
        wanted: Mapping[Lane, int],
        token: str,
        lease_seconds: float,
    ) -> list[tuple[Any, ...]] | None:
        lanes = sorted(wanted.items(), key=lambda item: (item[0].tenant_id, item[0].kind))
        # Planned at each execution, never prepared (as lease_candidates): a relay started
        # before a burst ran it on an empty outbox, and the generic plan Postgres then kept
        # was a seq scan and a sort of the whole outbox per claim (25-33 ms instead of 3 at
        # 20,000 rows) until an analyze happened to replace it: a 100,000-run burst over
        # HTTP took 44-57 s instead of 15-18
        return _pg_rows(
            connection,
            _LEASE_OUTBOX,
            {
                "tenants": [lane.tenant_id for lane, _ in lanes],
                "kinds": [str(lane.kind) for lane, _ in lanes],
                "caps": [cap for _, cap in lanes],
                "token": token,
                "lease_seconds": float(lease_seconds),
            },
            prepare=False,
        )

    def lock_outbox_leases(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime | None, dict[int, tuple[str | None, int]]] | None:
        rows = _pg_rows(connection, _LOCK_OUTBOX_LEASES, {"ids": list(ids)})
        now = rows[0][3].astimezone(UTC) if rows else None
        return now, {r[0]: (r[1], r[2]) for r in rows}

    def runtime_grants(self, connection: Connection, role: str) -> RoleGrants | None:
        found = connection.execute(
            text(
                "SELECT r.rolsuper, r.rolbypassrls, pg_has_role(:role, current_user, 'USAGE'),"
                " current_database(), current_schema(), current_user,"
                " has_schema_privilege(:role, current_schema(), 'CREATE')"
                " FROM pg_roles r WHERE r.rolname = :role"
            ),
            {"role": role},
        ).one_or_none()
        if found is None:
            raise errors.NotFound(
                f"no role {role!r} in this cluster: create it first "
                f"(CREATE ROLE {_ident(role)} LOGIN PASSWORD '...')",
                field="role",
            )
        superuser, bypass_rls, is_owner, database, namespace, owner, may_create = found
        if superuser:
            raise errors.ValidationError(
                f"{role!r} is a superuser: no grant limits it (ALTER ROLE {_ident(role)} "
                "NOSUPERUSER, or another role)",
                field="role",
            )
        if is_owner:
            raise errors.ValidationError(
                f"{role!r} is (or is a member of) {owner!r}, the role running this command "
                "and owning the tables: the runtime role must be another one",
                field="role",
            )
        found_rows = connection.execute(
            text(
                "SELECT c.relname::text, c.relkind::text, pg_get_userbyid(c.relowner)::text,"
                " pg_has_role(current_user, c.relowner, 'USAGE') FROM pg_class c"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'S')"
                " AND NOT c.relispartition ORDER BY c.relname"
            )
        ).all()
        # a GRANT by a role that may not grant only warns ("no privileges were granted"):
        # whoever runs this must own what it grants, or it would report a success
        foreign = sorted({str(r[2]) for r in found_rows if not r[3]})
        if foreign:
            raise errors.ConfigError(
                f"{owner!r} does not own the scheduler's tables (owned by "
                f"{', '.join(map(repr, foreign))}): run it as the role that owns them "
                "(the one that runs `schedctl db upgrade`)",
                field="database_url",
            )
        rows = [(str(r[0]), str(r[1])) for r in found_rows]
        owners = sorted({str(r[2]) for r in found_rows})
        # the scheduler's tables (the version table: read, to check the schema's revision)
        version_table = "alembic_version"
        tables = [name for name, kind in rows if kind in ("r", "p") and name != version_table]
        sequences = [name for name, kind in rows if kind == "S"]
        if not tables:
            raise errors.ValidationError(
                f"schema {namespace!r} of {database!r} has no tables: run "
                "`schedctl db upgrade` first",
                field="database_url",
            )
        who, where, table_list = _ident(role), _ident(namespace), ", ".join(map(_ident, tables))
        dml = "SELECT, INSERT, UPDATE, DELETE"
        statements = [
            f"GRANT CONNECT ON DATABASE {_ident(database)} TO {who}",
            f"GRANT USAGE ON SCHEMA {where} TO {who}",
            # what it held before (TRUNCATE, REFERENCES, TRIGGER) goes: the grants are exact
            f"REVOKE ALL ON TABLE {table_list} FROM {who}",
            f"GRANT {dml} ON TABLE {table_list} TO {who}",
        ]
        if version_table in {name for name, _ in rows}:
            statements.append(f"GRANT SELECT ON TABLE {_ident(version_table)} TO {who}")
        if sequences:
            statements.append(
                f"GRANT USAGE ON SEQUENCE {', '.join(map(_ident, sequences))} TO {who}"
            )
        # the tables and sequences a later migration creates (run by the same owner) are
        # the runtime role's at once: no grant step to forget after `db upgrade`
        for table_owner in owners or [owner]:
            for kind, rights in (("TABLES", dml), ("SEQUENCES", "USAGE")):
                statements.append(
                    f"ALTER DEFAULT PRIVILEGES FOR ROLE {_ident(table_owner)} IN SCHEMA "
                    f"{where} GRANT {rights} ON {kind} TO {who}"
                )
        notes = []
        if bypass_rls:
            notes.append(f"{role!r} bypasses row-level security (ALTER ROLE NOBYPASSRLS)")
        if may_create:
            notes.append(
                f"{role!r} may create tables in schema {namespace!r} (granted to it or to "
                f"PUBLIC): REVOKE CREATE ON SCHEMA {where} FROM PUBLIC, {who}"
            )
        return RoleGrants(statements=tuple(statements), notes=tuple(notes))

    def run_partitions(self, connection: Connection) -> RunPartitions | None:
        # owning runs (or a role that does, superusers too) is what CREATE TABLE ...
        # PARTITION OF and DROP TABLE of a partition need
        row = connection.execute(
            text(
                "SELECT pg_has_role(current_user, p.relowner, 'USAGE'), ARRAY("
                " SELECT c.relname::text FROM pg_inherits i JOIN pg_class c"
                " ON c.oid = i.inhrelid WHERE i.inhparent = p.oid"
                " AND c.relname ~ '^runs_[0-9]{8}$') "
                "FROM pg_class p WHERE p.oid = to_regclass('runs') AND p.relkind = 'p'"
            )
        ).one_or_none()
        if row is None:
            return None
        days = frozenset(datetime.strptime(name[5:], "%Y%m%d").date() for name in row[1])
        return RunPartitions(days=days, owned=bool(row[0]))

    def create_run_partition(
        self, connection: Connection, name: str, start: datetime, end: datetime
    ) -> bool:
        exists = connection.execute(
            text("SELECT to_regclass(:name) IS NOT NULL"), {"name": name}
        ).scalar_one()
        if exists:
            return False
        connection.execute(
            text(
                f"CREATE TABLE {name} PARTITION OF runs "
                f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
            )
        )
        return True

    def drop_run_partitions(self, connection: Connection, cutoff: datetime) -> int:
        names = connection.execute(
            text(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = 'runs' "
                "AND c.relname ~ '^runs_[0-9]{8}$'"
            )
        ).scalars()
        dropped = 0
        for name in list(names):
            day = datetime.strptime(name[5:], "%Y%m%d").replace(tzinfo=UTC)
            if day + timedelta(days=1) <= cutoff:
                connection.execute(text(f"DROP TABLE {name}"))
                dropped += 1
        return dropped

    def due_lag(
        self, connection: Connection, now: datetime, partition_count: int
    ) -> tuple[datetime | None, int]:
        # one probe of the (partition, next_fire_at) index per partition
        row = connection.execute(
            text(
                """
                SELECT min(d.oldest), coalesce(sum(d.due), 0)
                  FROM generate_series(0, :last) AS p(partition)
                 CROSS JOIN LATERAL (
                       SELECT min(j.next_fire_at) AS oldest, count(*) AS due
                         FROM jobs AS j
                        WHERE j.partition = p.partition
                          AND j.next_fire_at <= :now
                          AND j.status = 'active'
                       ) AS d
                """
            ),
            {"last": partition_count - 1, "now": now},
        ).one()
        return row[0], int(row[1])

    def describe(self, connection: Connection) -> str:
        fsync = connection.execute(text("SHOW fsync")).scalar_one()
        sync = connection.execute(text("SHOW synchronous_commit")).scalar_one()
        return f"postgres (fsync={fsync}, synchronous_commit={sync})"

    def server_sessions(self, connection: Connection) -> ServerSessions | None:
        own_pid, address = connection.exec_driver_sql(
            "SELECT pg_backend_pid(), host(inet_server_addr())"
        ).one()
        rows = connection.exec_driver_sql(
            "SELECT pid, application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND backend_type = 'client backend'"
        ).all()
        return ServerSessions(
            int(own_pid), address, {int(pid): str(name or "") for pid, name in rows}
        )

    def table_bytes(self, connection: Connection, table: str) -> int | None:
        value = connection.execute(
            # a plain table is its own tree's only member (a partitioned one's root has no
            # storage of its own, its leaves have it all)
            text(
                "SELECT COALESCE(SUM(pg_total_relation_size(relid)), 0) FROM "
                "(SELECT relid FROM pg_partition_tree(CAST(:table AS regclass)) UNION "
                "SELECT CAST(:table AS regclass)) AS tree"
            ),
            {"table": table},
        ).scalar_one()
        return int(value)

    def generate_once_jobs(
        self, connection: Connection, columns: Sequence[str], params: dict[str, Any]
    ) -> None:
        names = ", ".join(f'"{c}"' for c in columns)
        connection.execute(text(_GENERATE_ONCE_JOBS.format(columns=names)), params)

    def set_jobs_due(self, connection: Connection, due: Sequence[tuple[str, datetime]]) -> None:
        # one UPDATE from arrays per 40,000: an executemany of 120,000 single-row updates
        # once took ten minutes here
        for start in range(0, len(due), 40_000):
            chunk = due[start : start + 40_000]
            connection.execute(
                text(
                    "UPDATE jobs SET next_run_at = d.at, next_fire_at = d.at"
                    " FROM unnest(CAST(:ids AS text[]), CAST(:ats AS timestamptz[]))"
                    " AS d(job_id, at) WHERE jobs.job_id = d.job_id"
                ),
                {"ids": [job_id for job_id, _ in chunk], "ats": [at for _, at in chunk]},
            )

    def vacuum(self, engine: Engine, table: str, *, full: bool) -> None:
        command = "VACUUM FULL" if full else "VACUUM ANALYZE"
        with engine.connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").execute(
                text(f"{command} {table}")
            )

    def checkpoint(self, engine: Engine) -> bool:
        # the server's own WAL and checkpoints: a clean stop of a client leaves nothing
        return True

    # -- text keys in one parameter (job creation, the built-in queue's move) ------------

    def text_in(self, column: Any, name: str) -> Any:
        # one array parameter: one statement text whatever the batch (see id_in)
        return column == any_(bindparam(name, type_=ARRAY(Text)))

    def select_each(self, query: Select[Any], column: Any, name: str) -> Select[Any]:
        # A probe per string, each limited to its one row. `column = ANY(:name)` could be
        # planned as one scan of the table or of the tenant's rows, and the same lateral
        # join without the LIMIT is flattened into a join that was (a hash of every job of
        # the tenant per batch): either way a 1,000-job batch's lookups grew with the table,
        # from 10 ms at 1,000 jobs to 75 ms at 20,000. The LIMIT keeps the subquery whole.
        wanted = (
            func.unnest(bindparam(name, type_=ARRAY(Text))).table_valued("value").render_derived()
        )
        probe = query.where(column == wanted.c.value).limit(literal_column("1")).lateral()
        return select(probe).select_from(wanted.join(probe, true()))

    def mappings_planned_now(
        self, connection: Connection, statement: Any, params: Mapping[str, Any]
    ) -> list[RowMapping]:
        # psycopg prepares a statement run five times, and Postgres may then keep one
        # generic plan until the table's next analyze. Made while the table was empty (a
        # fresh database, or a deleted tenant's jobs vacuumed away) it scans the table
        # for each key: the first import's batches took 48-66 s each instead of 0.1,
        # until autovacuum's minute came.
        driver = connection.connection.driver_connection
        assert driver is not None
        threshold = driver.prepare_threshold
        driver.prepare_threshold = None  # psycopg: neither prepare nor use a prepared one
        try:
            return list(connection.execute(statement, params).mappings())
        finally:
            driver.prepare_threshold = threshold

    def insert_jobs(self, connection: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        import psycopg

        try:
            _pg_binary(connection, _INSERT_JOBS, _arrays(rows, _JOB_ARRAYS))
        except psycopg.IntegrityError as exc:
            # the driver's own cursor: wrapped as SQLAlchemy would, for job_create's retry
            # of a key or a name a concurrent create took
            raise IntegrityError(_INSERT_JOBS, None, exc) from exc

    def insert_audit_entries(
        self, connection: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> None:
        _pg_binary(connection, _INSERT_AUDIT, _arrays(rows, _AUDIT_ARRAYS))

    def insert_created_jobs(
        self,
        connection: Connection,
        rows: Sequence[Mapping[str, Any]],
        audit_rows: Sequence[Mapping[str, Any]],
        changed: Sequence[tuple[str, int]],
    ) -> set[str]:
        import psycopg

        # one round trip, not three (each a wait on the server and a hand-over of the
        # interpreter lock, per combiner round of single creates); the rows go as one
        # JSON document each (orjson, in C), not one array per column: psycopg dumps an
        # array element by element in Python, 32 arrays per statement, which cost more
        # than the rest of a small batch's insert
        params = {
            "jobs": _json_rows(rows),
            "audit": _json_rows(audit_rows),
            "channel": CHANNEL,
            "payloads": [f"{part}:{job_id}" for job_id, part in changed],
        }
        try:
            ((written, _),) = _pg_binary(connection, _INSERT_CREATED, params)
        except psycopg.IntegrityError as exc:  # as insert_jobs
            raise IntegrityError(_INSERT_CREATED, None, exc) from exc
        if written == len(rows):
            return set()
        ids = [row["job_id"] for row in rows]
        kept = _pg_rows(connection, _JOBS_WRITTEN, {"ids": ids})
        return set(ids) - {r[0] for r in kept}


def _ident(name: str) -> str:
    """`name` as a double-quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _notify_all(connection: Connection, channel: str, payloads: list[str]) -> None:
    """NOTIFY `channel` once per payload, in one statement (sent at commit)."""
    connection.execute(
        text("SELECT pg_notify(:channel, p) FROM unnest(CAST(:payloads AS text[])) AS p"),
        {"channel": channel, "payloads": payloads},
    )


class _Listener:
    """A dedicated autocommit connection LISTENing on one channel (opened on first use),
    opened with the pool's own session arguments: every host of a multi-host URL,
    target_session_attrs (after a failover it follows the new primary: NOTIFY is sent on
    the primary only), TLS parameters, the process's application_name."""

    def __init__(self, engine: Engine, channel: str) -> None:
        self._kwargs = session_kwargs(engine, autocommit=True)
        self._channel = channel
        self._connection: psycopg.Connection[tuple[object, ...]] | None = None

    @property
    def listening(self) -> bool:
        return self._connection is not None and not self._connection.closed

    def connect(self) -> None:
        """Listen (psycopg.Error if the database cannot be reached)."""
        import psycopg

        self._connection = psycopg.connect(**self._kwargs)
        self._connection.execute(f"LISTEN {self._channel}")

    def payloads(self, timeout: float) -> list[str]:
        """The payloads of the notifications that arrive within `timeout` seconds,
        returning with the first (and what came with it); psycopg.Error when the connection
        is lost (it is closed then)."""
        import psycopg

        assert self._connection is not None
        found: list[str] = []
        try:
            for notice in self._connection.notifies(timeout=timeout, stop_after=1):
                found.append(notice.payload)
            # drain what else arrived with it, without waiting again
            for notice in self._connection.notifies(timeout=0.0, stop_after=10_000):
                found.append(notice.payload)
        except psycopg.Error:
            self.close()
            raise
        return found

    def close(self) -> None:
        import psycopg

        if self._connection is not None:
            try:
                self._connection.close()
            except psycopg.Error:
                pass
            self._connection = None


class PostgresChangeFeed:
    """The jobs channel for one dispatcher; after losing its connection (a database
    restart), it reconnects and asks for a reload, since notifications sent meanwhile are
    gone."""

    def __init__(self, engine: Engine) -> None:
        self._listener = _Listener(engine, CHANNEL)

    def wait(self, timeout: float) -> Changes:
        import psycopg

        if not self._listener.listening:
            try:
                self._listener.connect()
            except psycopg.Error as exc:
                log.warning("cannot LISTEN for job changes: %s", str(exc).splitlines()[0])
                time.sleep(max(0.0, min(timeout, 1.0)))
            return Changes(reload=True)  # anything may have changed while not listening
        try:
            payloads = self._listener.payloads(timeout)
        except psycopg.Error as exc:
            log.warning("lost the LISTEN connection: %s", str(exc).splitlines()[0])
            return Changes(reload=True)
        return Changes(job_ids=tuple(p.partition(":")[2] for p in payloads))

    def close(self) -> None:
        self._listener.close()


class PostgresReadyFeed:
    """QUEUE_CHANNEL for one worker or relay, answering True for its own `word`. After
    losing its connection it answers True once reconnected, since work readied meanwhile
    went unheard; while it cannot reconnect it sleeps and answers False (the worker's or
    relay's own polling and backoff carry on)."""

    def __init__(self, engine: Engine, word: str) -> None:
        self._listener = _Listener(engine, QUEUE_CHANNEL)
        self._word = word
        self._lost = False

    def wait(self, timeout: float) -> bool:
        import psycopg

        if not self._listener.listening:
            try:
                self._listener.connect()
            except psycopg.Error as exc:
                if not self._lost:  # once per outage: the worker says the rest
                    log.warning("cannot LISTEN for ready work: %s", str(exc).splitlines()[0])
                self._lost = True
                time.sleep(max(0.0, min(timeout, 1.0)))
                return False
            self._lost = False
            return True
        try:
            return self._word in self._listener.payloads(timeout)
        except psycopg.Error as exc:
            log.warning("lost the LISTEN connection: %s", str(exc).splitlines()[0])
            self._lost = True
            return False

    def close(self) -> None:
        self._listener.close()


def _pg_rows(
    connection: Connection, sql: str, params: dict[str, Any], *, prepare: bool | None = None
) -> list[Any]:
    """_pg_binary for a worker's statements: the tuples as psycopg made them, no copy.
    `prepare=False`: planned anew at every execution (psycopg's default prepares a statement
    run five times, and the server may then keep one generic plan for every parameter)."""
    driver = connection.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cursor:
        cursor.execute(sql, params, prepare=prepare)
        return cursor.fetchall() if cursor.description else []


def _pg_keyed(connection: Connection, sql: str, params: dict[str, Any]) -> list[Any]:
    """_pg_rows (planned now) for a statement that joins runs or messages with a batch's
    unnested keys, with nested loops off for it. The batch's runs are new to the
    statistics, so Postgres expects one row where the batch has hundreds; with nested
    loops it then compared every row found with the whole batch (a join filter: 87 ms for
    500 runs, and the relay's settles and the worker's leases went quadratic in the batch).
    Without them it hashes the batch and reads the runs by their keys' index."""
    driver = connection.connection.driver_connection
    assert driver is not None
    driver.execute("SET LOCAL enable_nestloop = off")
    rows = _pg_rows(connection, sql, params, prepare=False)
    # (after an error the transaction's rollback undoes the SET LOCAL)
    driver.execute("RESET enable_nestloop")
    return rows


def _pg_binary(connection: Connection, sql: str, params: dict[str, Any]) -> list[Any]:
    """Run one statement on the transaction's own psycopg connection with parameters in
    binary format: big arrays dump about 7 times faster than as text."""
    driver = connection.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall()) if cursor.description else []


# Postgres: a batch of rows as one statement over arrays (unnest), one array per column: a
# constant statement text and C-speed parameter encoding, instead of one statement per row
# in a pipeline (executemany), which was a fifth of the relay's CPU. The arrays go in binary
# format (_pg_binary): as text, psycopg quotes every string element with a regular
# expression in Python, which cost the settler a tenth of its time.
_ATTEMPT_ARRAYS = (
    ("job_id", "text"),
    ("scheduled_at", "timestamptz"),
    ("attempt", "integer"),
    ("status", "text"),
    ("started_at", "timestamptz"),
    ("finished_at", "timestamptz"),
    ("exit_code", "integer"),
    ("error", "text"),
    ("output_tail", "text"),
    ("worker", "text"),
)
_INSERT_ATTEMPTS = (
    "INSERT INTO run_attempts ("
    + ", ".join(name for name, _ in _ATTEMPT_ARRAYS)
    + ") SELECT * FROM unnest("
    + ", ".join(f"CAST(%({name})b AS {kind}[])" for name, kind in _ATTEMPT_ARRAYS)
    + ")"
)
# The span of the runs' instants, besides each run's own key: a statement planned at its
# execution then touches the day partitions holding them only, not every partition of the
# run history (an Append over all of them, planned and opened for a handful of rows)
_RUNS_SPAN = (
    " AND runs.scheduled_at BETWEEN CAST(%(first_at)b AS timestamptz)"
    " AND CAST(%(last_at)b AS timestamptz)"
)


def _span(instants: Sequence[datetime]) -> dict[str, datetime | None]:
    """_RUNS_SPAN's parameters for these instants."""
    return {
        "first_at": min(instants, default=None),
        "last_at": max(instants, default=None),
    }


_RUN_ARRAYS = (
    ("job_id", "text"),
    ("scheduled_at", "timestamptz"),
    ("status", "text"),
    ("attempt", "integer"),
    ("started_at", "timestamptz"),
    ("finished_at", "timestamptz"),
    ("exit_code", "integer"),
    ("error", "text"),
    ("output_tail", "text"),
)
_UPDATE_RUNS = (
    "UPDATE runs SET "
    + ", ".join(f"{name} = v.{name}" for name, _ in _RUN_ARRAYS[2:])
    + " FROM unnest("
    + ", ".join(f"CAST(%({name})b AS {kind}[])" for name, kind in _RUN_ARRAYS)
    + ") AS v("
    + ", ".join(name for name, _ in _RUN_ARRAYS)
    + ") WHERE runs.job_id = v.job_id AND runs.scheduled_at = v.scheduled_at"
    + " AND runs.job_id = ANY(CAST(%(job_id)b AS text[]))"
    + _RUNS_SPAN
)

# A worker's lease and settle (queue.py), on the driver's cursor: constant texts, arrays in
# binary, planned at each execution (see lease_candidates), and the clock read inside the
# statement that needs it (an initplan: one clock_timestamp() per statement), not in a
# round trip of its own. A message's job is a LATERAL primary-key lookup (LIMIT 1: never
# flattened into a join): planning a join of the queue with jobs costed a merge join by
# reading the ends of jobs_pkey, and where the newest jobs were deleted or updated those
# ends are dead entries, walked at every planning (0.5-2.7 ms a plan, 0.1 now). Updates
# by key also name the keys with `= ANY` on the table's index: planned with the batch's
# real size (128 rows) and stale statistics, a join alone became a hash join over a seq
# scan of the queue and of today's runs (78-160 ms a statement, 350 starts/s).
_LEASE_CANDIDATES = """
SELECT m.id, m.job_id, m.scheduled_at, m.attempt, j.max_attempts, j.retry_base_seconds,
       j.retry_max_seconds, j.max_concurrency, j.timeout_seconds,
       coalesce(m.payload, j.payload), j.status, j.overlap, j.memory_max, j.cpu_weight,
       j.tasks_max, (SELECT clock_timestamp())
  FROM queue_messages AS m
  JOIN LATERAL (SELECT max_attempts, retry_base_seconds, retry_max_seconds, max_concurrency,
                       timeout_seconds, payload, status, overlap, memory_max, cpu_weight,
                       tasks_max
                  FROM jobs WHERE jobs.job_id = m.job_id LIMIT 1) AS j ON true
 WHERE m.tenant_id = %(tenant_id)s AND m.queue = %(queue)s
   AND m.available_at <= (SELECT clock_timestamp())
   AND m.leased_until IS NULL
   AND (j.max_concurrency <= 0
        OR j.overlap = 'allow' OR (j.overlap <> 'queue' AND m.attempt = 1)
        OR (SELECT count(*) FROM queue_messages AS held
             WHERE held.job_id = m.job_id AND held.leased_until IS NOT NULL)
           < j.max_concurrency)
 ORDER BY m.available_at
 LIMIT %(fetch)s
 FOR UPDATE OF m SKIP LOCKED
"""
_LEASED_COUNTS = """
SELECT job_id, count(*) FROM queue_messages
 WHERE job_id = ANY(CAST(%(job_ids)b AS text[])) AND leased_until IS NOT NULL
 GROUP BY job_id
"""
_MARK_LEASED = (
    """
WITH v AS (
    SELECT * FROM unnest(CAST(%(ids)b AS bigint[]), CAST(%(job_ids)b AS text[]),
                         CAST(%(scheduled_ats)b AS timestamptz[]),
                         CAST(%(attempts)b AS integer[]), CAST(%(owners)b AS text[]))
        AS v(id, job_id, scheduled_at, attempt, owner)
), leased AS (
    UPDATE queue_messages
       SET leased_until = CAST(%(leased_until)b AS timestamptz), lease_owner = v.owner
      FROM v WHERE queue_messages.id = v.id
       AND queue_messages.id = ANY(CAST(%(ids)b AS bigint[]))
)
UPDATE runs SET status = 'running', attempt = v.attempt,
                started_at = CAST(%(now)b AS timestamptz), finished_at = NULL,
                exit_code = NULL, error = NULL, output_tail = NULL
  FROM v WHERE runs.job_id = v.job_id AND runs.scheduled_at = v.scheduled_at
   AND runs.job_id = ANY(CAST(%(job_ids)b AS text[]))
"""
    + _RUNS_SPAN
)
_HELD_MESSAGES = """
SELECT m.id, m.queue, m.job_id, m.scheduled_at, m.tenant_id, m.attempt, j.max_attempts,
       j.retry_base_seconds, j.retry_max_seconds, m.lease_owner, (SELECT clock_timestamp())
  FROM queue_messages AS m
  LEFT JOIN LATERAL (SELECT max_attempts, retry_base_seconds, retry_max_seconds
                       FROM jobs WHERE jobs.job_id = m.job_id LIMIT 1) AS j ON true
 WHERE m.id = ANY(CAST(%(ids)b AS bigint[])) AND m.leased_until IS NOT NULL
 ORDER BY m.id
 FOR UPDATE OF m
"""

# The relay's claim (lease_outbox_rows) in one round trip instead of six (clock, lane read,
# jobs, tenants, lease): the clock is read once, before any row is locked, as the separate
# read was; the lane read is due_outbox_rows'; every row it locks is leased (rows of a
# stopped job or an expired lease are settled in the same transaction right after, which
# overwrites or deletes the lease) by primary key, `= ANY(ARRAY(...))` (an UPDATE ... FROM
# the CTE was planned as a hash join over a seq scan of the whole outbox: 24 ms a claim at
# 100,000 rows); the job and the tenant are one primary-key lookup per row (a LATERAL with
# LIMIT 1 is never flattened into a join, which the planner once made a hash join over the
# whole jobs table).
_LEASE_OUTBOX = """
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now),
picked AS MATERIALIZED (
    SELECT o.id, o.job_id, o.scheduled_at, o.tenant_id, o.target_type, o.target,
           o.attempt, o.lease_owner, o.payload
      FROM unnest(CAST(%(tenants)b AS text[]), CAST(%(kinds)b AS text[]),
                  CAST(%(caps)b AS integer[])) AS l(tenant_id, kind, cap)
     CROSS JOIN LATERAL (
            SELECT id, job_id, scheduled_at, tenant_id, target_type, target,
                   attempt, lease_owner, payload
              FROM outbox
             WHERE outbox.tenant_id = l.tenant_id
               AND outbox.target_type = l.kind
               AND outbox.available_at <= (SELECT now FROM clock)
             ORDER BY outbox.available_at
             LIMIT l.cap
               FOR UPDATE SKIP LOCKED) AS o
),
leased AS (
    UPDATE outbox
       SET available_at = (SELECT now FROM clock)
               + CAST(%(lease_seconds)b AS float8) * interval '1 second',
           lease_owner = CAST(%(token)b AS text)
     WHERE outbox.id = ANY(ARRAY(SELECT id FROM picked))
)
SELECT p.id, p.job_id, p.scheduled_at, p.tenant_id, p.target_type, p.target, p.attempt,
       p.lease_owner, p.payload, j.status,
       CASE WHEN row_number() OVER (PARTITION BY p.job_id ORDER BY p.id) = 1
            THEN j.payload END,
       j.max_attempts, j.retry_base_seconds, j.retry_max_seconds,
       t.tenant_id IS NOT NULL, t.signing_secret, t.allow_list, t.broker_url,
       (SELECT now FROM clock)
  FROM picked AS p
  LEFT JOIN LATERAL (
        SELECT status, payload, max_attempts, retry_base_seconds, retry_max_seconds
          FROM jobs WHERE jobs.job_id = p.job_id LIMIT 1) AS j ON true
  LEFT JOIN LATERAL (
        SELECT tenant_id, signing_secret, allow_list, broker_url
          FROM tenants WHERE tenants.tenant_id = p.tenant_id LIMIT 1) AS t ON true
"""

# Settling's row locks and the database's now in one round trip (the clock was a statement
# of its own): the initplan reads the clock once, when the first row comes out -- before
# any lock is waited for, as the separate read was
_LOCK_OUTBOX_LEASES = """
SELECT id, lease_owner, attempt, (SELECT clock_timestamp())
  FROM outbox
 WHERE id = ANY(CAST(%(ids)b AS bigint[]))
 ORDER BY id
 FOR UPDATE
"""


def _record_outcomes(table_name: str, *, aligned: bool = False) -> str:
    """The statement of record_outcomes deleting from `table_name` (outbox, queue_messages);
    `aligned`: the runs' columns come from the attempts' arrays, all but their status."""
    assert table_name in (schema.outbox.name, schema.queue_messages.name)
    update_runs = _UPDATE_RUNS.replace("%(", "%(r_")
    if aligned:
        for name, _ in _RUN_ARRAYS:
            if name != "status":
                update_runs = update_runs.replace(f"%(r_{name})b", f"%(a_{name})b")
    return (
        "WITH attempts AS ("
        + _INSERT_ATTEMPTS.replace("%(", "%(a_")
        + f"), gone AS (DELETE FROM {table_name} WHERE id = ANY(CAST(%(gone)b AS bigint[])))"
        + ", runs_set AS ("
        + update_runs
        + ") SELECT job_id, upstream_job_id FROM job_dependencies"
        " WHERE upstream_job_id = ANY(CAST(%(upstreams)b AS text[]))"
    )


_RECORD_OUTCOMES: dict[tuple[str, bool], str] = {}
_ALIGNED_RUN_ARRAYS = tuple((name, kind) for name, kind in _RUN_ARRAYS if name == "status")


# The scale benchmark's one-time job rows, as storage/bulk_future.py's _rows makes them in
# Python, made by the server; the times are whole seconds, so that run_at is what
# format_instant writes for them (no fraction).
_GENERATE_ONCE_JOBS = """
INSERT INTO jobs ({columns})
SELECT g.job_id, :tenant_id, :name || '-' || g.job_id,
       '{{"kind": "once", "run_at": "' || to_char(g.at AT TIME ZONE 'UTC',
           'YYYY-MM-DD"T"HH24:MI:SS') || 'Z"}}',
       'queue', :queue, '{{}}', 3, 1.0, 60.0, 'run_once', 3600, 0, 1, 0, NULL, NULL,
       'active', g.at, g.at,
       (('x' || substr(encode(sha256(convert_to(g.job_id, 'UTF8')), 'hex'), 1, 8))::bit(32)
           ::bigint % :partitions)::int,
       1, NULL, :name, now(), now()
FROM (
    SELECT lpad(to_hex(:millis), 12, '0')
               || substr(replace(gen_random_uuid()::text, '-', ''), 1, 20) AS job_id,
           date_trunc('second', CAST(:first_at AS timestamptz) + i * CAST(:spacing AS interval))
               AS at
    FROM generate_series(0, :size - 1) AS i
) AS g
"""


# Job creation: a batch's jobs and its audit entries as one INSERT over arrays each (see
# _ATTEMPT_ARRAYS), instead of an executemany of a statement per row.
_JOB_ARRAYS = (
    ("job_id", "text"),
    ("tenant_id", "text"),
    ("name", "text"),
    ("schedule", "text"),
    ("target_type", "text"),
    ("target", "text"),
    ("payload", "text"),
    ("max_attempts", "integer"),
    ("retry_base_seconds", "float8"),
    ("retry_max_seconds", "float8"),
    ("misfire_policy", "text"),
    ("grace_seconds", "integer"),
    ("window_seconds", "integer"),
    ("max_concurrency", "integer"),
    ("timeout_seconds", "integer"),
    ("overlap", "text"),
    ("memory_max", "bigint"),
    ("cpu_weight", "integer"),
    ("tasks_max", "integer"),
    ("start_at", "timestamptz"),
    ("end_at", "timestamptz"),
    ("status", "text"),
    ("next_run_at", "timestamptz"),
    ("next_fire_at", "timestamptz"),
    ("partition", "integer"),
    ("version", "bigint"),
    ("idempotency_key", "text"),
    ("request_hash", "text"),
    ("created_at", "timestamptz"),
    ("updated_at", "timestamptz"),
    ("metrics", "boolean"),
)
_AUDIT_ARRAYS = (
    ("at", "timestamptz"),
    ("tenant_id", "text"),
    ("actor", "text"),
    ("action", "text"),
    ("job_id", "text"),
    ("detail", "text"),
)


def _insert_over_arrays(table: str, arrays: tuple[tuple[str, str], ...]) -> str:
    return (
        f"INSERT INTO {table} ("
        + ", ".join(f'"{name}"' for name, _ in arrays)
        + ") SELECT * FROM unnest("
        + ", ".join(f"CAST(%({name})b AS {kind}[])" for name, kind in arrays)
        + ")"
    )


_INSERT_JOBS = _insert_over_arrays("jobs", _JOB_ARRAYS)
_INSERT_AUDIT = _insert_over_arrays("audit_log", _AUDIT_ARRAYS)


def _insert_from_json(table: str, columns: tuple[tuple[str, str], ...], param: str) -> str:
    """INSERT of the rows of a JSON array of objects (`param`), each column converted by
    json_populate_recordset to the table's own type."""
    names = ", ".join(f'"{name}"' for name, _ in columns)
    return (
        f"INSERT INTO {table} ({names}) SELECT {names} "
        f"FROM json_populate_recordset(NULL::{table}, CAST(%({param})s AS json))"
    )


# the jobs, their audit entries and their notifications in one statement (data-modifying
# CTEs run whether or not the query reads them; notifications go out at commit). A job
# whose name a create committed since this one read the names is left out, with its
# audit entry and notification; the statement answers how many jobs it wrote (and reads
# `notified`, a plain CTE, so that it runs).
_INSERT_CREATED = (
    f"WITH created AS ({_insert_from_json('jobs', _JOB_ARRAYS, 'jobs')}"
    f" ON CONFLICT (tenant_id, name) WHERE status <> '{JobStatus.deleted.value}' DO NOTHING"
    " RETURNING job_id), "
    f"audited AS ({_insert_from_json('audit_log', _AUDIT_ARRAYS, 'audit')}"
    " WHERE job_id IN (SELECT job_id FROM created)), "
    "notified AS (SELECT pg_notify(%(channel)s, p) FROM unnest(CAST(%(payloads)b AS text[])) AS p"
    " WHERE split_part(p, ':', 2) IN (SELECT job_id FROM created)) "
    "SELECT (SELECT count(*) FROM created), (SELECT count(*) FROM notified)"
)


_JOBS_WRITTEN = "SELECT job_id FROM jobs WHERE job_id = ANY(CAST(%(ids)b AS text[]))"


def _json_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows (dicts) as a JSON array for _insert_from_json, as they are (a key that is
    no listed column is ignored, one missing is NULL): instants in RFC 3339 with their
    offset (a naive one is UTC, as everywhere in storage)."""
    import orjson

    return orjson.dumps(list(rows), option=orjson.OPT_NAIVE_UTC).decode()


def _arrays(
    rows: Sequence[Mapping[str, Any]], arrays: tuple[tuple[str, str], ...]
) -> dict[str, list[Any]]:
    return {name: [row.get(name) for row in rows] for name, _ in arrays}
