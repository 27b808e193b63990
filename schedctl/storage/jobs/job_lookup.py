"""Owns finding a job by what a user typed (exact id, then exact name, then an unambiguous id
prefix), the name-uniqueness check, and the shortest unique id prefixes tables show.

Names are unique per tenant among jobs not deleted (the partial unique index
uq_jobs_tenant_name enforces it for every write path; `check_name_free` gives a clear
error before the insert or rename). Prefixes are resolved, and shortest prefixes computed,
among all the tenant's jobs (deleted ones too: their history stays readable by id), so a
prefix a table shows always resolves to its job.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from schedctl.core import errors
from schedctl.domain.job_refs import MIN_SHOWN, common_prefix
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store

# a prefix shorter than this is refused: ids start with 12 hex digits of milliseconds, so
# 6 digits name a ~4.6-hour window and fewer would match nearly everything
MIN_PREFIX = 6
# candidates an ambiguity error lists
MAX_CANDIDATES = 5
MAX_NAME = 200  # the jobs.name column's length
NAME_INDEX = "uq_jobs_tenant_name"
DELETED = "deleted"  # JobStatus.deleted's value: names of deleted jobs are free again
_HEX = frozenset("0123456789abcdef")


def name_taken_by(
    connection: Connection, tenant_id: str, name: str, *, except_job_id: str | None = None
) -> str | None:
    """The id of the tenant's job (not deleted) called `name`, other than `except_job_id`."""
    query = select(schema.jobs.c.job_id).where(
        schema.jobs.c.tenant_id == tenant_id,
        schema.jobs.c.status != DELETED,
        schema.jobs.c.name == name,
    )
    if except_job_id is not None:
        query = query.where(schema.jobs.c.job_id != except_job_id)
    return connection.execute(query.limit(1)).scalar_one_or_none()


def check_name_free(
    connection: Connection, tenant_id: str, name: str, *, except_job_id: str | None = None
) -> None:
    """Conflict naming `name` if another job of the tenant (not deleted) has it; call it in
    the transaction that writes the name (create, rename): the unique index catches a
    concurrent writer, and `is_name_conflict` turns its IntegrityError into the same error."""
    other = name_taken_by(connection, tenant_id, name, except_job_id=except_job_id)
    if other is not None:
        raise name_conflict(name, other)


def name_conflict(name: str, job_id: str | None = None) -> errors.Conflict:
    held = f" (job {job_id})" if job_id else ""
    return errors.Conflict(
        f"the tenant already has a job named {name!r}{held}; names are unique per tenant",
        field="name",
    )


def is_name_conflict(exc: IntegrityError) -> bool:
    """Whether the IntegrityError is the name index's (Postgres names the index; SQLite names
    the columns)."""
    text = str(exc.orig)
    return NAME_INDEX in text or "jobs.tenant_id, jobs.name" in text


def resolve(connection: Connection, tenant_id: str | None, ref: str) -> str:
    """The job id `ref` means: an exact id, else the exact name of a job not deleted, else an
    unambiguous id prefix of at least MIN_PREFIX characters. NotFound when nothing matches
    (also another tenant's job); ValidationError naming `job` listing a few candidates when
    a name or prefix matches several jobs (a name can only with no tenant given)."""
    jobs = schema.jobs
    scope = [] if tenant_id is None else [jobs.c.tenant_id == tenant_id]
    found = connection.execute(
        select(jobs.c.job_id).where(*scope, jobs.c.job_id == ref)
    ).scalar_one_or_none()
    if found is not None:
        return str(found)
    ways: list[tuple[str, list[ColumnElement[bool]]]] = [
        ("name", [*scope, jobs.c.name == ref, jobs.c.status != DELETED])
    ]
    if len(ref) >= MIN_PREFIX and set(ref) <= _HEX:
        # a range read on the id index: ids are lowercase hex, so "g" bounds the prefix
        ways.append(("id prefix", [*scope, jobs.c.job_id >= ref, jobs.c.job_id < ref + "g"]))
    for how, conditions in ways:
        matches = list(
            connection.execute(
                select(jobs.c.job_id)
                .where(*conditions)
                .order_by(jobs.c.job_id)
                .limit(MAX_CANDIDATES + 1)
            ).scalars()
        )
        if len(matches) == 1:
            return str(matches[0])
        if matches:
            raise _ambiguous(ref, how, matches)
    raise errors.NotFound(f"no job {ref!r} (by id, name or id prefix)", field="job_id")


def _ambiguous(ref: str, kind: str, ids: list[str]) -> errors.ValidationError:
    shown = ", ".join(ids[:MAX_CANDIDATES]) + (", ..." if len(ids) > MAX_CANDIDATES else "")
    return errors.ValidationError(
        f"{kind} {ref!r} matches several jobs: {shown}; give more of the id", field="job"
    )


def shortest_prefixes(
    connection: Connection, tenant_id: str | None, job_ids: Iterable[str]
) -> dict[str, str]:
    """For each id, its shortest prefix (at least MIN_SHOWN characters) that no other job of
    the tenant shares (all tenants' jobs when tenant_id is None): the longest prefix it
    shares with its neighbours in id order, plus one. Two indexed reads per id."""
    jobs = schema.jobs
    out: dict[str, str] = {}
    for job_id in job_ids:
        scope = [] if tenant_id is None else [jobs.c.tenant_id == tenant_id]
        before = select(func.max(jobs.c.job_id)).where(*scope, jobs.c.job_id < job_id)
        after = select(func.min(jobs.c.job_id)).where(*scope, jobs.c.job_id > job_id)
        shared = 0
        for neighbour in (
            connection.execute(before).scalar_one_or_none(),
            connection.execute(after).scalar_one_or_none(),
        ):
            if neighbour is not None:
                shared = max(shared, common_prefix(job_id, str(neighbour)))
        out[job_id] = job_id[: max(MIN_SHOWN, shared + 1)]
    return out


class JobLookup:
    """The lookups above, each in its own read transaction (the service's entry points)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def resolve(self, tenant_id: str | None, ref: str) -> str:
        with self.store.read() as connection:
            return resolve(connection, tenant_id, ref)

    def name_taken_by(
        self, tenant_id: str, name: str, *, except_job_id: str | None = None
    ) -> str | None:
        with self.store.read() as connection:
            return name_taken_by(connection, tenant_id, name, except_job_id=except_job_id)

    def check_name_free(
        self, tenant_id: str, name: str, *, except_job_id: str | None = None
    ) -> None:
        with self.store.read() as connection:
            check_name_free(connection, tenant_id, name, except_job_id=except_job_id)

    def shortest_prefixes(self, tenant_id: str | None, job_ids: Iterable[str]) -> dict[str, str]:
        with self.store.read() as connection:
            return shortest_prefixes(connection, tenant_id, list(job_ids))
