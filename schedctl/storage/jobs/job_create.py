"""Owns creating jobs in the database, one or a batch (up to 1,000) in one transaction: each
item's idempotency replay, quota admission, name check and first run, then one executemany
INSERT for the jobs, one for their audit entries and one change notification for the
batch. A single create is a batch of one, so both take the same path.

Each item gets its own outcome in the order given: created, replayed (its idempotency key
names an earlier job with the same body, in the database or earlier in the batch) or an
error naming the field; a refused item writes nothing. A dependent item (`after`) is written
in a savepoint of its own, so an unknown upstream refuses that item only.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    CompoundSelect,
    String,
    bindparam,
    func,
    literal_column,
    select,
    union_all,
)
from sqlalchemy.engine import Connection, RowMapping
from sqlalchemy.exc import IntegrityError

from schedctl.core import errors, limits
from schedctl.domain.models import CreateOutcome, Job, JobSpec, JobStatus
from schedctl.scheduling.schedules import AfterSchedule, first_occurrence, schedule_to_dict
from schedctl.scheduling.windows import fire_time
from schedctl.storage.backend.dialect import Dialect, dialect_of
from schedctl.storage.db import schema
from schedctl.storage.db.clock import db_now
from schedctl.storage.db.rows import JOB_AS_STORED, as_stored, job_from_row
from schedctl.storage.db.store import Store
from schedctl.storage.jobs import job_lookup
from schedctl.storage.jobs.create_statements import create_statements
from schedctl.storage.jobs.payloads import encode_payload
from schedctl.storage.pipeline import dependencies

MAX_BATCH = limits.MAX_BATCH_JOBS
# a concurrent create that took a key or a name between our read and our insert fails the
# whole transaction once; the next pass sees its row and answers per item
RACE_ATTEMPTS = 3
# names and keys are looked up with IN lists of at most this many (SQLite's bound on
# parameters is far above; Postgres plans short lists better)
IN_CHUNK = 500


@dataclass(frozen=True)
class NewJob:
    """One item to create: its validated spec; auto_name when no name was given (the default
    name then gets a suffix from the new id, so it never collides)."""

    spec: JobSpec
    auto_name: bool = False
    actor: str | None = None  # who the audit log names, when not the batch's actor


@dataclass(frozen=True)
class Admission:
    """A tenant's quota state read under its row lock: `now` (the database's clock),
    `refuse(n)`, the error for the item that would be the n-th (from 0) created in this
    transaction, or None when the quotas allow it, and `record(created)`, told how many
    it created, before commit."""

    now: datetime
    refuse: Callable[[int], errors.SchedError | None]
    record: Callable[[int], None]


# the transaction's connection, and the most jobs it may create
Admit = Callable[[Connection, int], Admission]


def new_job_id() -> str:
    """Time-ordered (48-bit milliseconds) then random: ids sort by creation, for paging."""
    return new_job_ids(1)[0]


def new_job_ids(count: int) -> list[str]:
    """`count` ids as new_job_id makes them, from one clock read and one read of random
    bytes (a read per id was a visible share of a batch's CPU)."""
    millis = f"{int(time.time() * 1000):012x}"
    random = os.urandom(10 * count).hex()
    return [millis + random[20 * n : 20 * n + 20] for n in range(count)]


def partition_of(job_id: str, partition_count: int) -> int:
    # a stable hash: Python's hash() differs between processes
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:4], "big") % partition_count


def create_jobs(
    store: Store,
    tenant_id: str,
    items: Sequence[NewJob],
    *,
    actor: str,
    admit: Admit | None = None,
    metrics_max_jobs: int | None = None,
) -> list[CreateOutcome]:
    """Create `items` for the tenant in one transaction; one CreateOutcome per item, in order.
    `admit` (the quota checks) runs first in the same transaction, so what it allows is
    atomic with the insert. With `metrics_max_jobs`, an item with `metrics = true` that
    would give the tenant more such jobs is refused, naming `metrics`."""
    if len(items) > MAX_BATCH:
        raise errors.ValidationError(
            f"at most {MAX_BATCH} jobs per batch, got {len(items)}", field="jobs"
        )
    # read before the write transaction: on SQLite a second connection would wait for
    # this one's lock
    partition_count = store.partition_count
    for attempt in range(RACE_ATTEMPTS):
        try:
            with store.tx() as connection:
                batch = _Batch(connection, tenant_id, items, actor, partition_count)
                batch.metrics_max_jobs = metrics_max_jobs
                batch.run(admit)
            return batch.outcomes()
        except IntegrityError as exc:
            if attempt + 1 < RACE_ATTEMPTS:
                continue
            if job_lookup.is_name_conflict(exc):
                raise errors.Conflict(
                    "another create took one of these names at the same time; try again",
                    field="name",
                ) from None
            raise
    raise AssertionError("unreachable")  # pragma: no cover


class _Batch:
    """One pass over the items inside the transaction."""

    def __init__(
        self,
        connection: Connection,
        tenant_id: str,
        items: Sequence[NewJob],
        actor: str,
        partition_count: int,
    ) -> None:
        self.connection = connection
        self.dialect = dialect_of(connection)
        self.tenant_id = tenant_id
        self.items = items
        self.actor = actor
        self.partition_count = partition_count
        self.results: list[CreateOutcome | None] = [None] * len(items)
        self.replays: dict[int, int] = {}  # item -> the earlier item its key replays
        self.batch_keys: dict[str, int] = {}  # key -> the item creating it here
        self.batch_names: dict[str, str] = {}  # name -> job id created here
        self.pending: list[tuple[int, dict[str, Any]]] = []  # rows not yet inserted
        self.created: dict[int, dict[str, Any]] = {}  # item -> its row, inserted
        self.metrics_max_jobs: int | None = None  # None: no bound

    def run(self, admit: Admit | None) -> None:
        """Write the batch; outcomes() answers once the transaction has committed."""
        # read before the tenant's lock, which serializes its creates: a name taken
        # meanwhile leaves its row out of the insert (_insert), a key fails it on its
        # unique index, and the next pass sees that key
        ids = new_job_ids(len(self.items))
        existing, taken = self._existing_keys_and_taken_names(ids)
        # The rows are built before the tenant's lock, which serializes the tenant's
        # creates, from the database's clock read now: the first run, the payload, the
        # partition. Under the lock remain the quota, the name and the insert. Built
        # there, a batch of 1,000 held the lock (the bound on one tenant's creates per
        # second) about a fifth longer, and the machine sat a third idle.
        clock = db_now(self.connection)
        built = self._build(ids, existing, clock)
        if admit is not None:
            # an item whose key is stored already replays: it creates nothing
            new = sum(1 for i in self.items if i.spec.idempotency_key not in existing)
            admission = admit(self.connection, new)
            now, refuse, record = admission.now, admission.refuse, admission.record
        else:
            self._require_tenant()
            now, refuse, record = clock, _admit_all, _record_nothing
        admitted = 0
        # under the tenant's lock (taken by the admission): counted and taken atomically
        metrics_jobs = (
            count_metrics_jobs(self.connection, self.tenant_id)
            if self.metrics_max_jobs is not None and any(i.spec.metrics for i in self.items)
            else 0
        )
        for index, item in enumerate(self.items):
            spec = item.spec
            key = spec.idempotency_key
            if key is not None and (key in existing or key in self.batch_keys):
                self.results[index] = self._replay(index, spec, existing.get(key))
                continue
            # the order of a single create's checks: quota, then schedule, then name
            refused = refuse(admitted)
            if refused is None and spec.metrics and self.metrics_max_jobs is not None:
                refused = metrics_bound_error(metrics_jobs, self.metrics_max_jobs)
            row = built[index]
            if refused is None:
                if isinstance(row, errors.SchedError):
                    refused = row
                else:
                    assert row is not None
                    try:
                        row["name"] = self._name(item, row["job_id"], taken)
                    except errors.SchedError as exc:
                        refused = exc
            if refused is not None or not isinstance(row, dict):
                self.results[index] = CreateOutcome(error=refused)
                continue
            row["created_at"] = row["updated_at"] = now
            admitted += 1
            metrics_jobs += 1 if spec.metrics else 0
            if spec.after:
                self._flush(now)
                self._insert_dependent(index, row, now)
            else:
                self._claim(index, row)
                self.pending.append((index, row))
        self._flush(now)
        record(admitted)

    def outcomes(self) -> list[CreateOutcome]:
        """One per item, in order. The created jobs are built here, after the commit: out
        of the tenant's lock."""
        for index, row in self.created.items():
            job = _job_of(self.items[index].spec, row)
            self.results[index] = CreateOutcome(job=job, created=True)
        for index, earlier in self.replays.items():
            first = self.results[earlier]
            assert first is not None and first.job is not None
            self.results[index] = CreateOutcome(job=first.job, created=False)
        done = [o for o in self.results if o is not None]
        assert len(done) == len(self.results)
        return done

    # -- lookups, one query each for the whole batch -----------------------------------

    def _existing_keys_and_taken_names(
        self, ids: Sequence[str]
    ) -> tuple[dict[str, RowMapping], dict[str, str]]:
        """In one statement (per IN_CHUNK of each list): the tenant's jobs by the items'
        idempotency keys (key -> row), and name -> job id of its jobs (not deleted)
        holding any name this batch may use: the given names and the auto names' first
        choices."""
        keys = sorted({i.spec.idempotency_key for i in self.items if i.spec.idempotency_key})
        names = sorted(
            {
                _auto_name(i.spec.name, ids[n]) if i.auto_name else i.spec.name
                for n, i in enumerate(self.items)
            }
        )
        wanted_keys, wanted_names = set(keys), set(names)
        existing: dict[str, RowMapping] = {}
        taken: dict[str, str] = {}
        lookup = _lookup(self.dialect)
        for start in range(0, max(len(keys), len(names)), IN_CHUNK):
            rows = self.dialect.mappings_planned_now(
                self.connection,
                lookup,
                {
                    "tenant_id": self.tenant_id,
                    "keys": keys[start : start + IN_CHUNK],
                    "names": names[start : start + IN_CHUNK],
                },
            )
            for row in rows:  # a row answering both comes twice
                if row["idempotency_key"] in wanted_keys:
                    existing[row["idempotency_key"]] = row
                if row["name"] in wanted_names and row["status"] != JobStatus.deleted.value:
                    taken[row["name"]] = row["job_id"]
        return existing, taken

    def _require_tenant(self) -> None:
        tenants = schema.tenants
        found = self.connection.execute(
            select(tenants.c.tenant_id).where(tenants.c.tenant_id == self.tenant_id)
        ).scalar_one_or_none()
        if found is None:
            raise errors.NotFound(f"no tenant {self.tenant_id!r}", field="tenant")

    # -- one item ----------------------------------------------------------------------

    def _replay(self, index: int, spec: JobSpec, row: RowMapping | None) -> CreateOutcome | None:
        key = spec.idempotency_key
        if row is not None:
            if row["status"] == JobStatus.deleted.value:
                # the key keeps its meaning while the deleted job's row is kept: no new job
                return CreateOutcome(
                    error=errors.Conflict(
                        f"idempotency key {key!r} belongs to job {row['job_id']}, "
                        "which was deleted",
                        field="idempotency_key",
                    )
                )
            if row["request_hash"] != spec.request_hash:
                return CreateOutcome(error=_other_body(key, f"job {row['job_id']}"))
            return CreateOutcome(job=job_from_row(row), created=False)
        assert key is not None
        earlier = self.batch_keys[key]
        if self.items[earlier].spec.request_hash != spec.request_hash:
            return CreateOutcome(error=_other_body(key, f"item {earlier} of this batch"))
        self.replays[index] = earlier
        return None

    def _build(
        self, ids: Sequence[str], existing: Mapping[str, RowMapping], now: datetime
    ) -> list[dict[str, Any] | errors.SchedError | None]:
        """Each item's row but its name and creation time, or the error its schedule is
        (None for an item whose key is stored: it replays)."""
        built: list[dict[str, Any] | errors.SchedError | None] = []
        for job_id, item in zip(ids, self.items, strict=True):
            if item.spec.idempotency_key in existing:
                built.append(None)
                continue
            try:
                built.append(self._row(job_id, item.spec, now))
            except errors.SchedError as exc:
                built.append(exc)
        return built

    def _row(self, job_id: str, spec: JobSpec, now: datetime) -> dict[str, Any]:
        next_run_at = _first_run(spec, now)
        return {
            "job_id": job_id,
            "tenant_id": self.tenant_id,
            "schedule": json.dumps(schedule_to_dict(spec.schedule)),
            "target_type": spec.target.type.value,
            "target": spec.target.address,
            "payload": encode_payload(spec.payload),
            "max_attempts": spec.retry.max_attempts,
            "retry_base_seconds": spec.retry.base_delay_seconds,
            "retry_max_seconds": spec.retry.max_delay_seconds,
            "misfire_policy": spec.misfire_policy.value,
            "grace_seconds": spec.grace_seconds,
            "window_seconds": spec.window_seconds,
            "max_concurrency": spec.max_concurrency,
            "timeout_seconds": spec.timeout_seconds,
            **spec.run.columns(),
            "start_at": spec.start_at,
            "end_at": spec.end_at,
            "status": JobStatus.active.value,
            "next_run_at": next_run_at,
            # a dependent job: never due, its runs come from upstream
            "next_fire_at": (
                fire_time(job_id, next_run_at, spec.window_seconds)
                if next_run_at is not None
                else None
            ),
            "partition": partition_of(job_id, self.partition_count),
            "version": 1,
            "idempotency_key": spec.idempotency_key,
            "request_hash": spec.request_hash,
            "metrics": spec.metrics,
        }

    def _name(self, item: NewJob, job_id: str, taken: Mapping[str, str]) -> str:
        """The item's name; Conflict naming `name` when a job of the tenant (not deleted)
        or an earlier item of the batch has it."""
        spec = item.spec
        if item.auto_name:
            name = _auto_name(spec.name, job_id)
            if name in taken or name in self.batch_names:
                # 1 in 16 million per pair: the whole id is the name's suffix then
                name = _long_name(spec.name, job_id)
            return name
        holder = taken.get(spec.name) or self.batch_names.get(spec.name)
        if holder is not None:
            raise job_lookup.name_conflict(spec.name, holder)
        return spec.name

    def _claim(self, index: int, row: dict[str, Any]) -> None:
        """Later items see this one's key and name as taken."""
        key = self.items[index].spec.idempotency_key
        if key is not None:
            self.batch_keys[key] = index
        self.batch_names[row["name"]] = row["job_id"]

    # -- writes ------------------------------------------------------------------------

    def _flush(self, now: datetime) -> None:
        """Insert the pending rows with their audit entries and notifications."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        self.created.update(self._insert(pending, now))

    def _insert(
        self, pending: list[tuple[int, dict[str, Any]]], now: datetime
    ) -> list[tuple[int, dict[str, Any]]]:
        """Write the rows; the rows written. One whose name a create committed after this
        batch read the names is written again under its long default name if it was named
        by default, else refused (Conflict naming `name`). Before, such a race failed the
        whole transaction and it ran again: with default names (6 hex digits of the id)
        that was 15 of 100 batches of 1,000 sent four at a time for one tenant."""
        left_out = self._write(pending, now)
        if not left_out:
            return pending
        written: list[tuple[int, dict[str, Any]]] = []
        renamed: list[tuple[int, dict[str, Any]]] = []
        for index, row in pending:
            item = self.items[index]
            if row["job_id"] not in left_out:
                written.append((index, row))
            elif item.auto_name:
                row["name"] = _long_name(item.spec.name, row["job_id"])
                renamed.append((index, row))
            else:
                self.results[index] = CreateOutcome(error=job_lookup.name_conflict(row["name"]))
        left_out = self._write(renamed, now) if renamed else set()
        for index, row in renamed:
            if row["job_id"] in left_out:  # somebody gave a job that very name
                self.results[index] = CreateOutcome(error=job_lookup.name_conflict(row["name"]))
            else:
                self.batch_names[row["name"]] = row["job_id"]
                written.append((index, row))
        return written

    def _write(self, pending: list[tuple[int, dict[str, Any]]], now: datetime) -> set[str]:
        # one statement without RETURNING (on Postgres an INSERT over one array per column:
        # a multi-row INSERT ... RETURNING of a thousand rows, 26,000 parameters, and an
        # executemany were both slower); the jobs are
        # built from the rows written, after the commit (outcomes)
        # jobs, audit entries and notifications in one statement where the backend can
        rows = [row for _, row in pending]
        return create_statements(self.dialect).insert_created_jobs(
            self.connection,
            rows,
            [
                {
                    "at": now,
                    "tenant_id": self.tenant_id,
                    "actor": self.items[index].actor or self.actor,
                    "action": "create",
                    "job_id": row["job_id"],
                    "detail": None,
                }
                for index, row in pending
            ],
            [(row["job_id"], row["partition"]) for row in rows if row["next_fire_at"] is not None],
        )

    def _insert_dependent(self, index: int, row: dict[str, Any], now: datetime) -> None:
        """A job with `after`: in a savepoint, so an unknown upstream or a cycle refuses
        this item only."""
        spec = self.items[index].spec
        try:
            with self.connection.begin_nested():
                if not self._insert([(index, row)], now):
                    return  # its name was taken meanwhile: refused
                dependencies.add(self.connection, row["job_id"], self.tenant_id, spec.after)
        except errors.SchedError as exc:
            self.results[index] = CreateOutcome(error=exc)
            return
        self._claim(index, row)
        self.created[index] = row


_LOOKUPS: dict[type, CompoundSelect[Any]] = {}


def _lookup(dialect: Dialect) -> CompoundSelect[Any]:
    """The tenant's jobs by idempotency key ("keys") and by name ("names", not deleted),
    for lists bound as parameters: built once per backend, so that a create does not
    build and hash it. One statement, not one each: a round trip less per create.

    A UNION ALL, each half answered by its unique index: one WHERE with an OR, or with
    the status bound as a parameter, had Postgres's generic plan (a prepared statement
    after five runs) read every job of the tenant. The status is written into the
    statement so that the partial index on names (status <> 'deleted') applies.

    The tenant is a scalar subquery, not a value the planner sees: Postgres's statistics
    lag behind a new tenant (an import's, until the table's next analyze), and planned
    for the value they take it for a tenant of about one job and look in every job of
    the tenant for each key (ix_jobs_tenant_status, then a filter), the import slowing
    as it went. Not knowing the value, it takes the
    unique index, one probe a key. And it is run unprepared (mappings_planned_now): a
    generic plan kept from when the table was empty scanned it for each key."""
    built = _LOOKUPS.get(type(dialect))
    if built is not None:
        return built
    jobs = schema.jobs
    tenant = jobs.c.tenant_id == select(bindparam("tenant_id", type_=String)).scalar_subquery()
    not_deleted = jobs.c.status != literal_column(f"'{JobStatus.deleted.value}'")
    built = _LOOKUPS[type(dialect)] = union_all(
        dialect.select_each(select(jobs).where(tenant), jobs.c.idempotency_key, "keys"),
        dialect.select_each(select(jobs).where(tenant, not_deleted), jobs.c.name, "names"),
    )
    return built


def _job_of(spec: JobSpec, row: dict[str, Any]) -> Job:
    """The Job a row just written holds: its spec's values as parsed, not read back (the
    schedule's JSON and the payload's encoding, decrypted, cost more than the insert)."""
    return Job(
        schedule=spec.schedule,
        target=spec.target,
        payload=spec.payload,
        retry=spec.retry,
        misfire_policy=spec.misfire_policy,
        status=JobStatus.active,
        metrics=spec.metrics,
        run=spec.run,
        **as_stored(row, JOB_AS_STORED),
    )


def count_metrics_jobs(connection: Connection, tenant_id: str) -> int:
    """The tenant's jobs with `metrics = true` that can still run (not deleted, cancelled
    or completed): what metrics_max_jobs_per_tenant bounds."""
    j = schema.jobs
    return int(
        connection.execute(
            select(func.count()).where(
                j.c.tenant_id == tenant_id,
                j.c.metrics.is_(True),
                j.c.status.in_([JobStatus.active.value, JobStatus.paused.value]),
            )
        ).scalar_one()
    )


def metrics_bound_error(used: int, bound: int) -> errors.SchedError | None:
    """The refusal of one more job with `metrics = true` when `used` of `bound` are taken."""
    if used < bound:
        return None
    return errors.ValidationError(
        f"the tenant already has {used} job(s) with metrics = true, the most this "
        f"installation allows (metrics_max_jobs_per_tenant = {bound}); set metrics = false "
        "here or on another job",
        field="metrics",
    )


def _admit_all(_: int) -> errors.SchedError | None:
    return None


def _record_nothing(_: int) -> None:
    return None


def _auto_name(base: str, job_id: str) -> str:
    """The name of a job created without one: the readable default (where it goes and how
    often) plus the new id's last 6 random hex digits."""
    return f"{base[: job_lookup.MAX_NAME - 7]}-{job_id[-6:]}"


def _long_name(base: str, job_id: str) -> str:
    """The default name when its short form is taken: the whole new id as the suffix."""
    return f"{base[: job_lookup.MAX_NAME - len(job_id) - 1]}-{job_id}"


def _first_run(spec: JobSpec, now: datetime) -> datetime | None:
    if isinstance(spec.schedule, AfterSchedule):
        return None
    first = first_occurrence(spec.schedule, now, start=spec.start_at, end=spec.end_at)
    if first is None:
        raise errors.ValidationError(
            "the schedule has no run between its start and end", field="schedule"
        )
    return first


def _other_body(key: str | None, holder: str) -> errors.Conflict:
    return errors.Conflict(
        f"idempotency key {key!r} was already used for a different job definition ({holder})",
        field="idempotency_key",
    )
