"""Owns the chaos invariant checker: over the run history, the outbox and the queue, it proves
(or refutes, with the offending rows) the three invariants of DESIGN.md, and counts what it
checked.

1. Nothing claimed twice. The runs primary key makes a second row for a (job_id,
   scheduled_at) impossible, so the checker also looks where a double claim would show:
   - deliveries: every dispatched run is in the outbox or the queue exactly once, or (its
     message acknowledged by a worker) it reached a worker: its status is one only a
     worker's lease sets; a run skipped because its job was cancelled before delivery is
     in none of them, and nothing is delivered without a run;
   - versions: every claim advances its job's version, so two dispatched runs of one job
     claimed at the same job version mean a claim made from a stale read;
   - fencing: per partition, in claim-transaction order, the recorded epoch never goes
     backwards: no claim committed under an epoch older than one already used. The order
     is the claiming transaction's id (Postgres `xmin`): a claim that committed before a new
     owner's epoch write got its id before that write committed, and the new owner's claims
     start after it, so correctly fenced claims are in epoch order. Rows a worker rewrote
     since (leased, acked) carry the worker's transaction id instead and are left out; the
     chaos test leaves one queue unconsumed so that this check keeps its coverage;
   - executions: no run has two succeeded attempts (an ack is fenced by its lease, whether a
     direct worker or a tenant worker over the API made it). Succeeded attempts are counted
     by the kind of worker: an API worker's lease owner, kept in the attempt, is
     `api:TOKEN_ID:DIGEST`; a direct worker's is its node name.
2. Nothing lost: every one-time job due by the cutoff has its run, and every recurring job
   has a run at every occurrence from its first up to the cutoff (contiguous; the workload's
   misfire policy, run_all, never skips one); a cancelled job's runs form a gap-free prefix.
3. Nothing claimed after a cancel committed: a cancel reads version v and writes v + 1, and
   nothing changes a cancelled job afterwards, so its final version is the cancel's; a claim
   that read version w writes w + 1, so every run claimed before the cancel has
   job_version + 1 < the cancel's version.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import literal_column, select

from schedctl.scheduling.schedules import (
    IntervalSchedule,
    OnceSchedule,
    first_occurrence,
    schedule_from_dict,
)
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.queue import CANCELLED_ERROR

Key = tuple[str, datetime]  # run identity: (job_id, scheduled_at)
# The most offending rows a report keeps per kind (counts are always complete).
EXAMPLES = 10


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    partition: int
    first_at: datetime  # a one-time job's run_at, a recurring job's first occurrence
    every_seconds: int | None  # None: a one-time job
    status: str
    version: int  # the final version (for a cancelled job: the version its cancel wrote)

    @property
    def cancelled(self) -> bool:
        return self.status == "cancelled"


@dataclass(frozen=True)
class RunRecord:
    job_id: str
    scheduled_at: datetime
    partition: int
    status: str
    error: str | None
    epoch: int | None
    job_version: int | None
    # the claiming transaction's position in commit order of fenced claims (xmin)
    claim_order: int
    fire_at: datetime | None = None
    dispatched_at: datetime | None = None

    @property
    def key(self) -> Key:
        return (self.job_id, self.scheduled_at)

    @property
    def cancel_skipped(self) -> bool:
        """Claimed, then skipped by the relay because the job was cancelled meanwhile (the
        relay's update gives the row a new xmin, so it has no claim order any more)."""
        return self.status == "skipped" and self.error == CANCELLED_ERROR

    @property
    def misfire_skipped(self) -> bool:
        return self.status == "skipped" and self.error != CANCELLED_ERROR


@dataclass
class History:
    jobs: dict[str, JobRecord]
    runs: list[RunRecord]
    deliveries: list[Key]  # one entry per outbox row and per queue message
    cutoff: datetime  # every run due at or before it must exist
    faults: list[str] = field(default_factory=list)
    # one entry per succeeded attempt: the run and the worker (lease owner) that ran it
    executions: list[tuple[Key, str | None]] = field(default_factory=list)


@dataclass
class Report:
    runs_checked: int = 0
    jobs_checked: int = 0
    cancelled_jobs: int = 0
    runs_before_cancel: int = 0  # runs of cancelled jobs, all claimed before the cancel
    undelivered_after_cancel: int = 0  # of those, skipped by the relay: cancelled meanwhile
    occurrences_expected: int = 0
    deliveries_checked: int = 0
    partitions_checked: int = 0
    executed_direct: int = 0  # runs whose succeeded attempt a direct worker made
    executed_api: int = 0  # ... a tenant worker over the REST API made
    faults: list[str] = field(default_factory=list)
    duplicate_runs: list[Key] = field(default_factory=list)
    duplicate_deliveries: list[Key] = field(default_factory=list)
    version_reuse: list[tuple[str, int]] = field(default_factory=list)
    epoch_regressions: list[str] = field(default_factory=list)
    undelivered: list[Key] = field(default_factory=list)
    orphan_deliveries: list[Key] = field(default_factory=list)
    missing: list[Key] = field(default_factory=list)
    unexpected: list[Key] = field(default_factory=list)
    after_cancel: list[Key] = field(default_factory=list)
    executed_twice: list[Key] = field(default_factory=list)

    @property
    def duplicates(self) -> int:
        """Every sign of a double claim, a double delivery or a double execution."""
        return (
            len(self.duplicate_runs)
            + len(self.duplicate_deliveries)
            + len(self.version_reuse)
            + len(self.epoch_regressions)
            + len(self.executed_twice)
        )

    @property
    def ok(self) -> bool:
        return not (
            self.duplicates
            or self.undelivered
            or self.orphan_deliveries
            or self.missing
            or self.unexpected
            or self.after_cancel
        )

    def summary(self) -> str:
        lines = [
            f"runs checked: {self.runs_checked} (jobs {self.jobs_checked}, of them cancelled "
            f"{self.cancelled_jobs}; occurrences due by the cutoff {self.occurrences_expected}; "
            f"deliveries {self.deliveries_checked}; partitions {self.partitions_checked})",
            f"faults injected: {len(self.faults)} ({', '.join(self.faults) or 'none'})",
            f"executed by workers: {self.executed_direct + self.executed_api} runs (direct "
            f"workers {self.executed_direct}, API workers {self.executed_api})",
            f"duplicates: {self.duplicates} (run rows {len(self.duplicate_runs)}, deliveries "
            f"{len(self.duplicate_deliveries)}, job versions claimed twice "
            f"{len(self.version_reuse)}, epochs going backwards {len(self.epoch_regressions)}, "
            f"runs executed twice {len(self.executed_twice)})",
            f"missing: {len(self.missing)} (undelivered runs {len(self.undelivered)}, "
            f"runs at no occurrence {len(self.unexpected)}, deliveries without a run "
            f"{len(self.orphan_deliveries)})",
            f"claimed after cancel: {len(self.after_cancel)} (runs of cancelled jobs claimed "
            f"before the cancel: {self.runs_before_cancel}, of them not delivered because the "
            f"cancel came first: {self.undelivered_after_cancel})",
        ]
        for name in (
            "duplicate_runs",
            "duplicate_deliveries",
            "version_reuse",
            "epoch_regressions",
            "undelivered",
            "orphan_deliveries",
            "missing",
            "unexpected",
            "after_cancel",
            "executed_twice",
        ):
            found = getattr(self, name)
            if found:
                lines.append(f"  {name} (first {EXAMPLES}): {_show(found[:EXAMPLES])}")
        return "\n".join(lines)


def _show(items: Iterable[object]) -> str:
    shown = []
    for item in items:
        if isinstance(item, tuple):
            shown.append(
                "("
                + ", ".join(v.isoformat() if isinstance(v, datetime) else str(v) for v in item)
                + ")"
            )
        else:
            shown.append(str(item))
    return "; ".join(shown)


# -- the checks ------------------------------------------------------------------------------


def check(history: History) -> Report:
    report = Report(
        runs_checked=len(history.runs),
        jobs_checked=len(history.jobs),
        cancelled_jobs=sum(1 for j in history.jobs.values() if j.cancelled),
        deliveries_checked=len(history.deliveries),
        faults=list(history.faults),
    )
    _check_deliveries(history, report)
    _check_executions(history, report)
    _check_versions(history, report)
    _check_fencing(history, report)
    _check_complete(history, report)
    _check_cancels(history, report)
    return report


def _check_deliveries(history: History, report: Report) -> None:
    rows = Counter(r.key for r in history.runs)
    report.duplicate_runs = sorted(k for k, n in rows.items() if n > 1)
    delivered = Counter(history.deliveries)
    for run in history.runs:
        count = delivered.get(run.key, 0)
        if run.status == "skipped":
            if count:  # skipped runs must never reach a target
                report.orphan_deliveries.append(run.key)
        elif count == 0:
            report.undelivered.append(run.key)
        elif count > 1:
            report.duplicate_deliveries.append(run.key)
    report.orphan_deliveries += sorted(k for k in delivered if k not in rows)


def _check_executions(history: History, report: Report) -> None:
    succeeded = Counter(key for key, _ in history.executions)
    report.executed_twice = sorted(k for k, n in succeeded.items() if n > 1)
    for _, worker in history.executions:
        if is_api_worker(worker):
            report.executed_api += 1
        else:
            report.executed_direct += 1


def is_api_worker(worker: str | None) -> bool:
    """Whether a lease owner is a tenant worker's over the API (`api:TOKEN_ID:DIGEST`)."""
    return worker is not None and worker.startswith("api:")


def _check_versions(history: History, report: Report) -> None:
    claims: Counter[tuple[str, int]] = Counter()
    for run in history.runs:
        if run.misfire_skipped or run.job_version is None:
            continue  # skipped rows share their claim's version (not in this workload)
        claims[(run.job_id, run.job_version)] += 1
    report.version_reuse = sorted(k for k, n in claims.items() if n > 1)


def _check_fencing(history: History, report: Report) -> None:
    by_partition: dict[int, list[RunRecord]] = defaultdict(list)
    for run in history.runs:
        if run.epoch is None:
            report.epoch_regressions.append(
                f"{run.job_id}@{run.scheduled_at.isoformat()}: claimed without an epoch"
            )
        elif not run.cancel_skipped and run.status not in WORKER_STATUSES:
            # a row a worker's lease or ack rewrote carries the worker's xmin, not the claim's
            by_partition[run.partition].append(run)
    report.partitions_checked = len(by_partition)
    for partition, runs in sorted(by_partition.items()):
        highest: RunRecord | None = None
        for run in sorted(runs, key=lambda r: r.claim_order):
            assert run.epoch is not None
            if highest is not None and highest.epoch is not None and run.epoch < highest.epoch:
                report.epoch_regressions.append(
                    f"partition {partition}: {run.job_id}@{run.scheduled_at.isoformat()} "
                    f"claimed under epoch {run.epoch} (tx {run.claim_order}) after "
                    f"{highest.job_id}@{highest.scheduled_at.isoformat()} under epoch "
                    f"{highest.epoch} (tx {highest.claim_order})"
                )
            elif highest is None or highest.epoch is None or run.epoch > highest.epoch:
                highest = run


def occurrences(job: JobRecord, until: datetime) -> list[datetime]:
    """The job's nominal times from its first up to `until` (inclusive)."""
    if job.every_seconds is None:
        return [job.first_at] if job.first_at <= until else []
    step = timedelta(seconds=job.every_seconds)
    count = int((until - job.first_at) / step) + 1 if until >= job.first_at else 0
    return [job.first_at + i * step for i in range(count)]


def _occurrence_index(job: JobRecord, at: datetime) -> int | None:
    if job.every_seconds is None:
        return 0 if at == job.first_at else None
    step = timedelta(seconds=job.every_seconds)
    index, rest = divmod(at - job.first_at, step)
    return int(index) if rest == timedelta(0) and index >= 0 else None


def _check_complete(history: History, report: Report) -> None:
    runs_of: dict[str, list[RunRecord]] = defaultdict(list)
    for run in history.runs:
        runs_of[run.job_id].append(run)
    for job_id in sorted(runs_of):
        if job_id not in history.jobs:
            report.unexpected += [r.key for r in runs_of[job_id]]
    for job in sorted(history.jobs.values(), key=lambda j: j.job_id):
        # a misfire-skipped run was not run: it does not count as done
        done: set[int] = set()
        for run in runs_of.get(job.job_id, []):
            index = _occurrence_index(job, run.scheduled_at)
            if index is None:
                report.unexpected.append(run.key)
            elif not run.misfire_skipped:
                done.add(index)
        due = occurrences(job, history.cutoff)
        if job.cancelled:
            # whatever was claimed before the cancel must be a prefix without holes
            top = max(done, default=-1)
            expected = range(top + 1)
        else:
            expected = range(len(due))
            report.occurrences_expected += len(due)
        step = timedelta(seconds=job.every_seconds or 0)
        for index in expected:
            if index not in done:
                report.missing.append((job.job_id, job.first_at + index * step))


def _check_cancels(history: History, report: Report) -> None:
    for run in history.runs:
        job = history.jobs.get(run.job_id)
        if job is None or not job.cancelled:
            continue
        if run.job_version is None or run.job_version + 1 >= job.version:
            report.after_cancel.append(run.key)
        else:
            report.runs_before_cancel += 1
            report.undelivered_after_cancel += run.cancel_skipped


# -- reading the history from the database -------------------------------------------------


# statuses only a worker's lease (or its settling) gives a run
WORKER_STATUSES = frozenset({"running", "succeeded", "failed", "lost", "dead"})


def load_history(store: Store, cutoff: datetime, faults: Sequence[str] = ()) -> History:
    """Every job, run, outbox row and queue message of the database (Postgres: the claim
    order is the claiming transaction's id, `xmin`)."""
    if not store.is_postgres:
        raise ValueError("the chaos checker reads transaction ids: Postgres only")
    j, r, o, m = schema.jobs, schema.runs, schema.outbox, schema.queue_messages
    a = schema.run_attempts
    xmin: Any = literal_column("runs.xmin::text::bigint").label("claim_order")
    with store.read() as connection:
        job_rows = connection.execute(
            select(
                j.c.job_id,
                j.c.partition,
                j.c.schedule,
                j.c.status,
                j.c.version,
                j.c.created_at,
                j.c.start_at,
            )
        ).all()
        run_rows = connection.execute(
            select(
                r.c.job_id,
                r.c.scheduled_at,
                r.c.partition,
                r.c.status,
                r.c.error,
                r.c.epoch,
                r.c.job_version,
                xmin,
                r.c.fire_at,
                r.c.dispatched_at,
            )
        ).all()
        deliveries = [
            (row[0], row[1])
            for table in (o, m)
            for row in connection.execute(select(table.c.job_id, table.c.scheduled_at)).all()
        ]
        executions: list[tuple[Key, str | None]] = [
            ((row[0], row[1]), row[2])
            for row in connection.execute(
                select(a.c.job_id, a.c.scheduled_at, a.c.worker).where(a.c.status == "succeeded")
            ).all()
        ]
    # workers run during the faults: a run whose message was leased and acknowledged (or
    # is being retried) left the queue; its status says it reached a worker
    queued = set(deliveries)
    deliveries += [
        (row[0], row[1])
        for row in run_rows
        if row[3] in WORKER_STATUSES and (row[0], row[1]) not in queued
    ]
    jobs = {}
    for job_id, partition, schedule, status, version, created_at, start_at in job_rows:
        parsed = schedule_from_dict(json.loads(schedule))
        if isinstance(parsed, OnceSchedule):
            first, every = parsed.run_at, None
        elif isinstance(parsed, IntervalSchedule):
            # what JobRepo.create computed: the first occurrence after the creation
            found = first_occurrence(parsed, created_at, start=start_at)
            assert found is not None
            first, every = found, parsed.every_seconds
        else:
            raise ValueError(f"job {job_id}: the checker knows once and interval schedules")
        jobs[job_id] = JobRecord(job_id, int(partition), first, every, status, int(version))
    runs = [
        RunRecord(
            job_id=row[0],
            scheduled_at=row[1],
            partition=int(row[2]),
            status=row[3],
            error=row[4],
            epoch=None if row[5] is None else int(row[5]),
            job_version=None if row[6] is None else int(row[6]),
            claim_order=int(row[7]),
            fire_at=row[8],
            dispatched_at=row[9],
        )
        for row in run_rows
    ]
    return History(
        jobs=jobs,
        runs=runs,
        deliveries=deliveries,
        cutoff=cutoff,
        faults=list(faults),
        executions=executions,
    )
