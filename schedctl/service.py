"""Owns the library API (`Scheduler`): tenants, jobs and run history over one Store.

The CLI and the REST API both call this, so validation, tenant resolution and quota checks
happen once. Tenant arguments accept a name or an id; passing a tenant scopes the call to
that tenant's jobs (another tenant's job is NotFound, never Forbidden: ids are no oracle).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

from schedctl import errors
from schedctl.jobspec import DEFAULT_MAX_PAYLOAD_BYTES, parse_job_request, parse_schedule
from schedctl.models import Job, JobSpec, JobStatus, Page, Run, Tenant
from schedctl.storage.jobs import JobRepo
from schedctl.storage.store import Store
from schedctl.storage.tenants import TenantRepo


class Scheduler:
    def __init__(self, store: Store, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self.store = store
        self.max_payload_bytes = max_payload_bytes
        self.jobs = JobRepo(store)
        self.tenants = TenantRepo(store)

    @classmethod
    def open(
        cls,
        url: str,
        *,
        upgrade: bool = False,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> Scheduler:
        return cls(Store.open(url, upgrade=upgrade), max_payload_bytes=max_payload_bytes)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- tenants -----------------------------------------------------------------------

    def create_tenant(self, name: str, actor: str) -> tuple[Tenant, str]:
        """The tenant and its API token; the token is shown this once and never stored."""
        return self.tenants.create(name, actor=actor)

    def get_tenant(self, tenant: str) -> Tenant:
        return self.tenants.get(tenant)

    def list_tenants(self) -> list[Tenant]:
        return self.tenants.list()

    def _tenant_id(self, tenant: str | None) -> str | None:
        return None if tenant is None else self.tenants.get(tenant).tenant_id

    # -- jobs --------------------------------------------------------------------------

    def create_job(self, tenant: str, body: Mapping[str, Any], *, actor: str) -> tuple[Job, bool]:
        """Create a job from a REST-shaped body; (job, created). Replaying an idempotency
        key with the same body returns the first job with created=False."""
        found = self.tenants.get(tenant)
        # validated against the database's clock, the one every dispatcher uses
        spec = parse_job_request(
            body, now=self.store.now(), max_payload_bytes=self.max_payload_bytes
        )
        if self.jobs.count_active(found.tenant_id) >= found.max_jobs:
            # a replay of an accepted request is not a new job and must still succeed
            replay = self._replay(found.tenant_id, spec)
            if replay is not None:
                return replay, False
            raise errors.QuotaExceeded(
                f"tenant {found.name!r} has reached its limit of {found.max_jobs} active jobs",
                field="max_jobs",
            )
        # JobRepo.create reads store.partition_count inside its write transaction; on SQLite
        # a first (uncached) read there opens a second connection that waits for the first
        # one's write lock until the busy timeout. Reading it here first caches it.
        _ = self.store.partition_count
        return self.jobs.create(found.tenant_id, spec, actor=actor)

    def _replay(self, tenant_id: str, spec: JobSpec) -> Job | None:
        """The job an earlier request with this idempotency key created (Conflict if that
        request differed); JobRepo.create does the same check inside its transaction."""
        with self.store.read() as connection:
            return self.jobs._by_idempotency_key(connection, tenant_id, spec)

    def get_job(self, job_id: str, tenant: str | None = None) -> Job:
        return self.jobs.get(job_id, self._tenant_id(tenant))

    def list_jobs(
        self,
        tenant: str | None = None,
        status: str | JobStatus | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Jobs in creation order; pass `next_cursor` back to get the following page."""
        return self.jobs.list(
            tenant_id=self._tenant_id(tenant),
            status=_status(status),
            limit=limit,
            cursor=cursor,
        )

    def cancel_job(self, job_id: str, tenant: str | None = None, *, actor: str) -> Job:
        return self.jobs.cancel(job_id, self._tenant_id(tenant), actor=actor)

    def pause_job(self, job_id: str, tenant: str | None = None, *, actor: str) -> Job:
        return self.jobs.pause(job_id, self._tenant_id(tenant), actor=actor)

    def resume_job(self, job_id: str, tenant: str | None = None, *, actor: str) -> Job:
        return self.jobs.resume(job_id, self._tenant_id(tenant), actor=actor)

    def trigger_job(self, job_id: str, tenant: str | None = None, *, actor: str) -> Run:
        return self.jobs.trigger(job_id, self._tenant_id(tenant), actor=actor)

    def reschedule_job(
        self,
        job_id: str,
        schedule_body: Mapping[str, Any],
        tenant: str | None = None,
        *,
        actor: str,
    ) -> Job:
        """Replace the schedule (same shape as a job body's "schedule") and recompute the
        next run, atomically with the version bump."""
        tenant_id = self._tenant_id(tenant)
        # an unknown job is NotFound before a bad schedule is reported: the id comes first
        self.jobs.get(job_id, tenant_id)
        schedule = parse_schedule(schedule_body, self.store.now())
        return self.jobs.reschedule(job_id, schedule, tenant_id, actor=actor)

    def runs(
        self,
        job_id: str,
        tenant: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Run history, newest first."""
        return self.jobs.runs(job_id, self._tenant_id(tenant), limit=limit, cursor=cursor)


def _status(status: str | JobStatus | None) -> JobStatus | None:
    if status is None or isinstance(status, JobStatus):
        return status
    try:
        return JobStatus(status)
    except ValueError:
        allowed = ", ".join(s.value for s in JobStatus)
        raise errors.ValidationError(
            f"must be one of {allowed}, got {status!r}", field="status"
        ) from None
