"""Owns where Postgres and SQLite differ: the Dialect interface the storage modules call, and
the choice of one implementation per engine (storage/backend/dialect_postgres.py and
storage/backend/dialect_sqlite.py). A change of locking, or a third backend, is one file.

The differences: the database clock; row locks (FOR UPDATE / SKIP LOCKED / FOR SHARE on
Postgres; SQLite's BEGIN IMMEDIATE transactions are serialized already); upserts and
insert-or-ignore; how a lost lock race and a lost connection look; the per-job advisory
locks of the worker lease; job-change notification (LISTEN/NOTIFY, or a counter the
dispatcher polls); word to idle workers and relays that work is ready (LISTEN/NOTIFY, or
none: embedded, the claim wakes them in process); the batched claim and lane reads (arrays
bound in one statement, or row by row); and the day partitions of run history.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Protocol

from sqlalchemy import Select, Table
from sqlalchemy.engine import Connection, Engine, RowMapping

from schedctl.leasing import ReadyFeed
from schedctl.models import Lane

# The words that new work is ready (Dialect.ready_feed): a built-in queue's new ready
# messages, and new outbox rows for the relays.
OUTBOX_WORD = "outbox"


def queue_word(tenant_id: str, queue: str) -> str:
    """The word for a tenant's queue (insert_runs writes it in SQL the same way)."""
    return f"{tenant_id}:{queue}"


# The row of Dialect.lease_candidates: a ready message and its job's policy and status (the
# message's payload snapshot, else the job's).
LEASE_COLUMNS = (
    "id",
    "job_id",
    "scheduled_at",
    "attempt",
    "max_attempts",
    "retry_base_seconds",
    "retry_max_seconds",
    "max_concurrency",
    "timeout_seconds",
    "payload",
    "status",
    # the run policy (runpolicy.py): overlap is admitted in queue.py, the limits go to the run
    "overlap",
    "memory_max",
    "cpu_weight",
    "tasks_max",
)
# The row of Dialect.held_messages: a held message, its job's retry policy and its owner.
HELD_COLUMNS = (
    "id",
    "queue",
    "job_id",
    "scheduled_at",
    "tenant_id",
    "attempt",
    "max_attempts",
    "retry_base_seconds",
    "retry_max_seconds",
    "lease_owner",
)


class Lock(enum.Enum):
    """How a locking read locks its rows (where the backend has row locks)."""

    update = "update"  # FOR UPDATE: the row will be changed or deleted
    no_key_update = "no_key_update"  # FOR NO KEY UPDATE: changed, but not its key
    share = "share"  # FOR SHARE: read, and must not change until commit


@dataclass(frozen=True)
class RoleGrants:
    """Dialect.runtime_grants: the statements, and what the role could still do beyond
    them (notes for the operator: a superuser, a schema anyone may create in)."""

    statements: tuple[str, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class RunPartitions:
    """The day partitions of runs (Dialect.run_partitions): the days that have one, and
    whether the session's role owns runs (may create and drop them: the owner role does,
    the daemons' runtime role does not)."""

    days: frozenset[date]
    owned: bool


@dataclass(frozen=True)
class Changes:
    """What changed since the last look: some jobs, or possibly anything (reload)."""

    job_ids: tuple[str, ...] = ()
    reload: bool = False


class ChangeFeed(Protocol):
    def wait(self, timeout: float) -> Changes:
        """Block up to `timeout` seconds for changes; return early when there are some."""
        ...

    def close(self) -> None: ...


# The row of Dialect.lease_outbox_rows: a due outbox row the statement leased (its lease
# owner as it was before), its job (NULLs when the job is gone; the job's payload only on
# the first row of each job, so a big payload crosses the wire once per claim) and its
# tenant (`tenant_found` false when the tenant is gone).
OUTBOX_LEASE_COLUMNS = (
    "id",
    "job_id",
    "scheduled_at",
    "tenant_id",
    "target_type",
    "target",
    "attempt",
    "lease_owner",
    "payload",
    "job_status",
    "job_payload",
    "max_attempts",
    "retry_base_seconds",
    "retry_max_seconds",
    "tenant_found",
    "signing_secret",
    "allow_list",
    "broker_url",
    "now",
)


# A message a lease takes: (message id, job_id, scheduled_at, attempt).
LeasedRow = tuple[int, str, datetime, int]


@dataclass(frozen=True)
class LeaseMark:
    """What a lease writes on its messages and runs: the holder, until when it holds them,
    and the runs' start (the database's now). `owner` is one holder for every message, or
    each message's own (in the order of the leased rows): an API lease's owner holds a
    digest of that lease's own secret."""

    owner: str | Sequence[str]
    leased_until: datetime
    now: datetime


@dataclass(frozen=True)
class OutcomeWrites:
    """The settle path's writes for a batch: attempt rows, run updates, the delivery rows
    (table, ids) whose runs ended, and the jobs whose dependents may now run."""

    attempts: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    gone: tuple[Table, Sequence[int]] | None
    upstreams: Sequence[str]


@dataclass(frozen=True)
class ServerSessions:
    """A database server's view of its client sessions: the process serving this
    connection, the address the server answered on (None: a Unix socket), and each client
    session's server process id with its application_name."""

    own_pid: int
    server_address: str | None
    sessions: dict[int, str]


class Dialect(Protocol):
    """What storage asks of a backend. Every method runs inside the caller's transaction
    unless it says otherwise."""

    name: str  # SQLAlchemy's dialect name
    driver: str  # the DB-API module, whose own OperationalError means "connection lost"
    naive_instants: bool  # instants are bound as naive UTC (compared as stored text)
    embedded: bool  # a file of this machine (the embedded default), not a shared server
    generates_rows: bool  # generate_once_jobs works: the server makes benchmark rows itself
    # one writer at a time (a database-wide write lock): a dispatcher's claim threads
    # would only queue for it, so it runs one; a poller first reads, in a transaction
    # that takes no write lock, whether it has anything to write
    single_writer: bool

    def now(self, connection: Connection) -> datetime:
        """The database's clock, aware UTC: every process agrees on "now"."""
        ...

    def locked_clock(self) -> Any | None:
        """`now` as an SQL expression to read in a statement that does other work (one
        round trip less), read after the statement locked its rows (in the RETURNING of
        an UPDATE: a wait for the lock comes before it); None where `now` costs no
        statement (the clock is this process's)."""
        ...

    def clock(self, begin: Callable[[], AbstractContextManager[Connection]]) -> datetime:
        """`now` outside a transaction: `begin` opens one only if the clock needs it."""
        ...

    def insert(self, table: Table) -> Any:
        """An INSERT that takes on_conflict_do_nothing / on_conflict_do_update."""
        ...

    def lock(
        self, query: Any, mode: Lock = Lock.update, *, skip_locked: bool = False, of: Any = None
    ) -> Any:
        """The SELECT, locking the rows it reads; with skip_locked, rows another transaction
        holds are left out instead of waited for."""
        ...

    def lock_rows(self, connection: Connection, query: Any, mode: Lock = Lock.update) -> None:
        """Lock the rows `query` selects until commit (nothing to do where transactions
        are serialized)."""
        ...

    def is_lock_race(self, exc: BaseException) -> bool:
        """This one exception (not its causes) says the transaction lost a lock race
        (deadlock, serialization failure): nothing committed, it may be tried again."""
        ...

    def lock_job_slots(self, connection: Connection, job_ids: Sequence[str]) -> None:
        """Serialize the worker leases of these jobs until commit, without locking job rows."""
        ...

    def lease_candidates(
        self, connection: Connection, tenant_id: str, queue: str, fetch: int
    ) -> tuple[datetime, Sequence[Sequence[Any]]]:
        """The database's now and up to `fetch` ready messages of the tenant's queue that
        their job's max_concurrency may admit, oldest first, locked (others' skipped):
        rows of LEASE_COLUMNS (the clock read in the same statement where it can be)."""
        ...

    def leased_counts(self, connection: Connection, job_ids: Sequence[str]) -> dict[str, int]:
        """Messages of each job held (leased_until set, expired or not); jobs without any
        are absent. Read after lock_job_slots, so a concurrent lease's commit is seen."""
        ...

    def mark_leased(
        self, connection: Connection, leases: Sequence[LeasedRow], mark: LeaseMark
    ) -> None:
        """Lease the messages (id, job_id, scheduled_at, attempt) to `owner` and mark their
        runs running (attempt, started_at now, the previous outcome cleared)."""
        ...

    def held_messages(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime, Sequence[Sequence[Any]]]:
        """The database's now and the held (leased) messages among `ids` with their job's
        retry policy (null without a job row) and lease owner: rows of HELD_COLUMNS, in id
        order, locked (waiting for another holder)."""
        ...

    def notify_job_change(self, connection: Connection, job_id: str, partition: int) -> None:
        """Tell the dispatchers (at commit) that this job's next run may have moved."""
        ...

    def notify_job_changes(
        self, connection: Connection, changed: Sequence[tuple[str, int]]
    ) -> None:
        """notify_job_change for many (job_id, partition) pairs, in one statement."""
        ...

    def change_feed(self, engine: Engine, poll_seconds: float) -> ChangeFeed:
        """A feed of job changes for one dispatcher (its own connection)."""
        ...

    def notify_ready(self, connection: Connection, words: Collection[str]) -> None:
        """Tell the workers and relays waiting for these words (queue_word, OUTBOX_WORD)
        that work is ready, at commit. (insert_runs tells them itself.)"""
        ...

    def ready_feed(self, engine: Engine, word: str) -> ReadyFeed | None:
        """A feed of one word (queue_word for a worker's queue, OUTBOX_WORD for a relay), on
        its own connection; None where workers and relays poll."""
        ...

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
        dispatched one inserted, its delivery: a ready queue message when it targets a
        built-in queue, else an outbox row; returns the runs inserted.

        A built-in queue lives in this database, so the claim's own transaction delivers to
        it: the run reaches its target at the instant it is claimed, with no relay stage
        between (it was a second of a 100,000-run burst, and relay CPU beside the claim).
        The outbox keeps what needs a relay's decision at delivery time: HTTP, tenants
        whose queues are a RabbitMQ broker, and every-host queues (skipped on a host with
        no live worker at that moment). A cancel that commits after the claim is honoured
        where the outbox honoured it, at the lease: a stopped job's message is skipped."""
        ...

    def id_in(self, column: Any, ids: Sequence[int]) -> Any:
        """`column IN ids` for a batch of row ids, in the form this backend parses fastest."""
        ...

    def insert_attempts(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Insert run_attempts rows (the settle path's batch)."""
        ...

    def update_runs(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Set each run's outcome (status, attempt, started_at, finished_at, exit_code,
        error, output_tail) by (job_id, scheduled_at); one row per run."""
        ...

    def record_outcomes(
        self, connection: Connection, writes: OutcomeWrites
    ) -> list[tuple[str, str]] | None:
        """insert_attempts(writes.attempts), update_runs(writes.runs) and the deletion of
        the rows writes.gone (table, ids) whose runs ended: the settle path's writes, in one
        statement where the backend can, which then also returns the dependency edges
        (job_id, upstream_job_id) of writes.upstreams (None: not read,
        dependencies.on_settled reads them)."""
        ...

    def due_outbox_rows(
        self, connection: Connection, wanted: Mapping[Lane, int], now: datetime
    ) -> list[RowMapping]:
        """Up to wanted[lane] due outbox rows of each lane, oldest first, locked; rows
        another relay holds are skipped."""
        ...

    def lease_outbox_rows(
        self,
        connection: Connection,
        wanted: Mapping[Lane, int],
        token: str,
        lease_seconds: float,
    ) -> list[tuple[Any, ...]] | None:
        """due_outbox_rows, the lease of every row it finds (lease_owner `token`,
        available_at the database's now plus `lease_seconds`) and the reads of their jobs
        and tenants, as one statement (one round trip) where the backend can: rows of
        OUTBOX_LEASE_COLUMNS, the database's now read in the statement. None: the backend
        has no such statement; the caller reads and leases step by step."""
        ...

    def lock_outbox_leases(
        self, connection: Connection, ids: Sequence[int]
    ) -> tuple[datetime | None, dict[int, tuple[str | None, int]]] | None:
        """Lock the outbox rows `ids` (in id order, waiting for them) and read the
        database's now in the same statement (None when no row is left): (now, {id:
        (lease_owner, attempt)}), for settling. None: the backend has no such statement;
        the caller reads the clock and locks step by step."""
        ...

    def runtime_grants(self, connection: Connection, role: str) -> RoleGrants | None:
        """The statements that give `role` (which must exist) the daemons' rights on this
        database's scheduler tables and nothing more, as this session's role (the owner)
        would run them (None: the backend has no roles)."""
        ...

    def run_partitions(self, connection: Connection) -> RunPartitions | None:
        """The day partitions of runs that exist, and whether this session's role may make
        and drop them (None: runs is not partitioned here)."""
        ...

    def create_run_partition(
        self, connection: Connection, name: str, start: datetime, end: datetime
    ) -> bool:
        """Create the partition of runs from `start` to `end`; False if it exists."""
        ...

    def drop_run_partitions(self, connection: Connection, cutoff: datetime) -> int:
        """Drop the day partitions of runs wholly before `cutoff`; returns how many."""
        ...

    def due_lag(
        self, connection: Connection, now: datetime, partition_count: int
    ) -> tuple[datetime | None, int]:
        """The oldest due fire time of active jobs and how many are due, for `status`."""
        ...

    def describe(self, connection: Connection) -> str:
        """The backend and its durability settings, for benchmark reports."""
        ...

    def table_bytes(self, connection: Connection, table: str) -> int | None:
        """Bytes of `table` with its indexes (and partitions), for benchmark reports; None
        where the backend cannot tell."""
        ...

    def server_sessions(self, connection: Connection) -> ServerSessions | None:
        """The database server's client sessions, for benchmark reports of its CPU; None
        where there is no server process (SQLite)."""
        ...

    def generate_once_jobs(
        self, connection: Connection, columns: Sequence[str], params: dict[str, Any]
    ) -> None:
        """Insert `params["size"]` one-time job rows made by the server (storage/bulk_future.py
        describes them); only where `generates_rows`."""
        ...

    def set_jobs_due(self, connection: Connection, due: Sequence[tuple[str, datetime]]) -> None:
        """Benchmarks: each job (id) due and firing at its own instant."""
        ...

    def vacuum(self, engine: Engine, table: str, *, full: bool) -> None:
        """Outside any transaction: clear the dead rows of `table` and refresh its planner
        statistics; with `full`, also give the space of deleted rows back (benchmarks)."""
        ...

    def checkpoint(self, engine: Engine) -> bool:
        """At a clean stop: fold whatever a write-ahead log beside the database file holds
        into the file itself, so that the file alone (a copy, a backup) holds every
        committed row. False when another process kept it from finishing (it checkpoints
        at its own stop); True when done or nothing to do (a server database)."""
        ...

    # -- text keys in one parameter (job creation, the built-in queue's move) ------------

    def text_in(self, column: Any, name: str) -> Any:
        """`column IN :name` for a batch of strings (idempotency keys, names, job ids) bound
        as a list under `name` at execution, in the form this backend parses fastest (one
        statement text whatever the batch size)."""
        ...

    def select_each(self, query: Select[Any], column: Any, name: str) -> Select[Any]:
        """The row of `query` whose `column` equals each of the strings bound as a list under
        `name` (`column` is unique among query's rows: an idempotency key, a job's name),
        answered by one index probe per string whatever the table's size or statistics."""
        ...

    def mappings_planned_now(
        self, connection: Connection, statement: Any, params: Mapping[str, Any]
    ) -> list[RowMapping]:
        """`statement`'s rows as mappings, the statement planned for the table as it is now:
        never prepared, so never answered by a plan kept from when the table was empty."""
        ...

    def insert_jobs(self, connection: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert job rows (every column of `jobs` in each) in one statement."""
        ...

    def insert_audit_entries(
        self, connection: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> None:
        """Insert audit_log rows (at, tenant_id, actor, action, job_id, detail)."""
        ...

    def insert_created_jobs(
        self,
        connection: Connection,
        rows: Sequence[Mapping[str, Any]],
        audit_rows: Sequence[Mapping[str, Any]],
        changed: Sequence[tuple[str, int]],
    ) -> set[str]:
        """insert_jobs, insert_audit_entries and notify_job_changes (any may be empty) in
        as few statements as the backend can. Answers the ids of the jobs left out, with
        their audit entries and notifications, because a job of the tenant (not deleted)
        holds their name: a create that committed after this one read the names. Where
        writers are serialized (SQLite) none is; a name taken raises IntegrityError."""
        ...


_DIALECTS: dict[str, Dialect] = {}


def known_dialects() -> dict[str, Dialect]:
    """Every backend this version supports, by SQLAlchemy dialect name."""
    if not _DIALECTS:
        # imported here: the implementations import the schema, which imports this module
        from schedctl.storage.backend.dialect_postgres import PostgresDialect
        from schedctl.storage.backend.dialect_sqlite import SqliteDialect

        # typed: mypy proves each implementation has every method of the interface
        implementations: tuple[Dialect, ...] = (PostgresDialect(), SqliteDialect())
        for dialect in implementations:
            _DIALECTS[dialect.name] = dialect
    return _DIALECTS


def dialect_named(name: str) -> Dialect:
    try:
        return known_dialects()[name]
    except KeyError:
        raise ValueError(f"unsupported database {name!r}") from None


def dialect_of(connection: Connection) -> Dialect:
    """The Dialect of a connection (for functions handed only a connection)."""
    return dialect_named(connection.dialect.name)
