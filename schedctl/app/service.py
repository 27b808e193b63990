"""Owns the library API (`Scheduler`): tenants, tokens and quotas, jobs, run history and the
audit log over one Store.

The CLI and the REST API both call this, so validation, tenant resolution and quota checks
(max active jobs and creates per minute, atomic with the insert) happen once. Tenant
arguments accept a name, an id or the Tenant itself; passing a tenant scopes the call to that
tenant's jobs (another tenant's job is NotFound, never Forbidden: ids are no oracle).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from schedctl.app import why
from schedctl.app.create_combiner import CreateCombiner
from schedctl.core import errors
from schedctl.core.closing import Closing
from schedctl.core.limits import DEFAULT_MAX_PAYLOAD_BYTES
from schedctl.domain.alerts.model import AlertConfig, parse_alerts
from schedctl.domain.alerts.policy import AlertPolicy
from schedctl.domain.host_scope import HostScope
from schedctl.domain.jobpatch import JobPatch, parse_job_patch
from schedctl.domain.jobspec import parse_job_request, parse_schedule
from schedctl.domain.models import CreateOutcome, Job, JobStatus, Page, Run, Tenant
from schedctl.scheduling.schedules import AfterSchedule, BootSchedule
from schedctl.storage.db.cursors import check_page_limit, decode_cursor
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.job_create import MAX_BATCH, NewJob
from schedctl.storage.jobs.job_lookup import JobLookup
from schedctl.storage.jobs.job_updates import delete_job, update_job
from schedctl.storage.jobs.jobs import JobRepo
from schedctl.storage.jobs.quotas import MAX_JOBS_RETRY_AFTER_SECONDS, QuotaUse, quota_admission
from schedctl.storage.pipeline import dependencies
from schedctl.storage.pipeline.workers import WorkerRepo
from schedctl.storage.records import alerts as alert_store
from schedctl.storage.records.audit import AuditRepo
from schedctl.storage.tenants.tenants import TenantRepo, TokenInfo, token_id_of

# A tenant argument: a name or an id, or the Tenant itself (the API has it from the token
# and saves a lookup per request).
TenantRef = str | Tenant

RATE_WINDOW = timedelta(minutes=1)
# Job ids start with their creator's clock in milliseconds: the rate count reads only ids
# from the last window, widened by this much for API servers whose clocks run behind.
CLOCK_SKEW = timedelta(minutes=5)
# Idempotency keys live on their job's row (unique per tenant), and job rows are never
# deleted, so a key is kept for as long as its job exists: "at least 24 hours" holds.
# Anything that ever purges old jobs must keep rows younger than this.
IDEMPOTENCY_KEY_RETENTION = timedelta(hours=24)
# how long a measured offset between this machine's clock and the database's is trusted
# for validating bodies (clocks drift by milliseconds a day)
CLOCK_OFFSET_TTL = 30.0
_JOB_ID = re.compile(r"[0-9a-f]{1,40}")


class OverQuota(errors.QuotaExceeded):
    """A quota or rate limit was exceeded; retry_after says when trying again makes sense."""

    def __init__(self, message: str, *, field: str | None, retry_after: int) -> None:
        super().__init__(message, field=field)
        self.retry_after = max(1, retry_after)


class Scheduler(Closing):
    def __init__(
        self,
        store: Store,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        alert_policy: AlertPolicy | None = None,
        metrics_max_jobs: int | None = None,
    ) -> None:
        self.store = store
        self.max_payload_bytes = max_payload_bytes
        # the operator's metrics_max_jobs_per_tenant: jobs with metrics = true per tenant
        self.metrics_max_jobs = metrics_max_jobs
        # the operator's [alerts] policy, checked when alerts are set (Config.alert_policy)
        self.alert_policy = alert_policy or AlertPolicy()
        self.jobs = JobRepo(store)
        self.audit_log = AuditRepo(store)
        self.tenants = TenantRepo(store)
        self.lookup = JobLookup(store)
        self._clock_offset: tuple[float, float] | None = None  # (measured at, seconds)
        self._combiner = CreateCombiner()

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

    # -- tenants -----------------------------------------------------------------------

    def create_tenant(self, name: str, actor: str) -> tuple[Tenant, str]:
        """The tenant and its API token; the token is shown this once and never stored."""
        return self.tenants.create(name, actor=actor)

    def get_tenant(self, tenant: str) -> Tenant:
        return self.tenants.get(tenant)

    def list_tenants(self) -> list[Tenant]:
        return self.tenants.list()

    def set_quotas(
        self,
        tenant: str,
        *,
        max_jobs: int | None = None,
        create_rate_per_minute: int | None = None,
        actor: str,
    ) -> Tenant:
        return self.tenants.set_quotas(
            tenant, max_jobs=max_jobs, create_rate_per_minute=create_rate_per_minute, actor=actor
        )

    def new_token(
        self,
        tenant: str,
        *,
        actor: str,
        host: str | None = None,
        groups: Sequence[str] = (),
    ) -> str:
        """Another API token for the tenant (shown this once); the old ones stay valid. With
        `host`: a host token, limited to that host's queues and jobs (and its `groups`')."""
        if host is None and groups:
            raise errors.ValidationError("--group goes with --host", field="group")
        scope = HostScope.make(host, groups) if host is not None else None
        return self.tenants.new_token(tenant, actor=actor, host=scope)

    def list_tokens(self, tenant: str) -> list[TokenInfo]:
        return self.tenants.list_tokens(tenant)

    def revoke_token(self, token_or_id: str, *, actor: str) -> str:
        """Revoke a token (by its id or the whole token); the API refuses it from the next
        request on. Returns the token id."""
        token_id = token_id_of(token_or_id)
        self.tenants.revoke_token(token_id, actor=actor)
        return token_id

    def _tenant(self, tenant: TenantRef) -> Tenant:
        return tenant if isinstance(tenant, Tenant) else self.tenants.get(tenant)

    def _tenant_id(self, tenant: TenantRef | None) -> str | None:
        return None if tenant is None else self._tenant(tenant).tenant_id

    # -- jobs --------------------------------------------------------------------------

    def create_job(
        self, tenant: TenantRef, body: Mapping[str, Any], *, actor: str
    ) -> tuple[Job, bool]:
        """Create a job from a REST-shaped body; (job, created). Replaying an idempotency
        key with the same body returns the first job with created=False (also when the
        tenant is over its quotas: a replay is not a new job); another body is Conflict.

        The quota checks and the insert are one transaction holding the tenant's row lock
        (Postgres; SQLite transactions are serialized anyway), so concurrent creates can
        neither both take the last slot nor both pass the rate limit."""
        found = self._tenant(tenant)
        item = self._new_job(found, body, self._validation_now(), actor=actor)
        admit = quota_admission(found.tenant_id, self._quotas(found))

        def create_many(items: Sequence[NewJob]) -> list[CreateOutcome]:
            return self.jobs.create_many(
                found.tenant_id,
                items,
                actor=actor,
                admit=admit,
                metrics_max_jobs=self.metrics_max_jobs,
            )

        # concurrent creates of one tenant (API threads) share one transaction
        outcome = self._combiner.create(found.tenant_id, item, create_many)
        if outcome.error is not None:
            raise outcome.error
        assert outcome.job is not None
        job, created = outcome.job, outcome.created
        if created and item.spec.alerts is not None:
            alert_store.set_settings(self.store, found.tenant_id, job.job_id, item.spec.alerts)
        return job, created

    def create_many(
        self, tenant: TenantRef, bodies: Sequence[Any], *, actor: str
    ) -> list[CreateOutcome]:
        """Create up to MAX_BATCH jobs from REST-shaped bodies in one transaction; one
        CreateOutcome per body, in order: the job and whether it is new (else an idempotent
        replay), or the SchedError that refused it, naming the field. A refused body writes
        nothing; the others are created as by create_job, quotas included: once the
        tenant's create rate or max_jobs is reached, the remaining bodies are refused (429)
        and nothing over a quota is written."""
        if len(bodies) > MAX_BATCH:
            raise errors.ValidationError(
                f"at most {MAX_BATCH} jobs per batch, got {len(bodies)}", field="jobs"
            )
        found = self._tenant(tenant)
        now = self._validation_now()
        results: list[CreateOutcome | None] = [None] * len(bodies)
        valid: list[int] = []
        items: list[NewJob] = []
        for index, body in enumerate(bodies):
            try:
                items.append(self._new_job(found, body, now))
            except errors.SchedError as exc:
                results[index] = CreateOutcome(error=exc)
                continue
            valid.append(index)
        outcomes = self.jobs.create_many(
            found.tenant_id,
            items,
            actor=actor,
            admit=quota_admission(found.tenant_id, self._quotas(found)),
            metrics_max_jobs=self.metrics_max_jobs,
        )
        for index, item, outcome in zip(valid, items, outcomes, strict=True):
            results[index] = outcome
            if outcome.created and outcome.job is not None and item.spec.alerts is not None:
                alert_store.set_settings(
                    self.store, found.tenant_id, outcome.job.job_id, item.spec.alerts
                )
        return [r if r is not None else CreateOutcome(error=errors.SchedError()) for r in results]

    def _new_job(
        self, tenant: Tenant, body: Any, now: datetime, *, actor: str | None = None
    ) -> NewJob:
        """A body validated (at the database's `now`) into a NewJob; an HTTP target passes
        the SSRF guard. Raises the SchedError naming the field."""
        spec = parse_job_request(body, now=now, max_payload_bytes=self.max_payload_bytes)
        if spec.target.url is not None:
            # the SSRF guard at creation; every delivery checks again
            # the SSRF guard loads asyncio: only a command that creates an HTTP job needs it
            from schedctl.core.ssrf import check_at_creation

            check_at_creation(spec.target.url, tenant.allow_list)
        self._check_alerts(tenant, spec.alerts)
        return NewJob(
            spec, auto_name=body.get("name") is None, actor=actor
        )  # parse checked it is a Mapping

    def _validation_now(self) -> datetime:
        """The database's clock for validating a body (is run_at past, when is "in 10m"):
        this machine's clock plus its offset to the database's, measured again every
        CLOCK_OFFSET_TTL, not a round trip per create. The insert reads the database's
        clock itself for everything it stores."""
        checked = time.monotonic()
        if self._clock_offset is None or checked - self._clock_offset[0] > CLOCK_OFFSET_TTL:
            self._clock_offset = (checked, self.store.clock_offset(samples=1))
        return datetime.now(UTC) + timedelta(seconds=self._clock_offset[1])

    @staticmethod
    def _quotas(tenant: Tenant) -> Callable[[QuotaUse], Callable[[int], errors.SchedError | None]]:
        """The quota checks: read the tenant's use once, then answer for the n-th job to
        create in this transaction (from 0): the create rate first, then max_jobs."""

        def check(use: QuotaUse) -> Callable[[int], errors.SchedError | None]:
            count, oldest, active = use.counts(RATE_WINDOW, CLOCK_SKEW)

            def refuse(n: int) -> errors.SchedError | None:
                if count + n >= use.create_rate_per_minute:
                    return Scheduler._rate_error(use, tenant, count + n, oldest)
                if active + n >= use.max_jobs:
                    return Scheduler._max_jobs_error(use, tenant)
                return None

            return refuse

        return check

    @staticmethod
    def _rate_error(
        use: QuotaUse, tenant: Tenant, count: int, oldest: datetime | None
    ) -> OverQuota:
        rate = use.create_rate_per_minute
        retry = (
            math.ceil((oldest + RATE_WINDOW - use.now).total_seconds())
            if oldest is not None
            else math.ceil(RATE_WINDOW.total_seconds())
        )
        return OverQuota(
            f"tenant {tenant.name!r} may create {rate} jobs per minute and has created "
            f"{count} in the last minute",
            field="create_rate_per_minute",
            retry_after=retry,
        )

    @staticmethod
    def _max_jobs_error(use: QuotaUse, tenant: Tenant) -> OverQuota:
        return OverQuota(
            f"tenant {tenant.name!r} has reached its limit of {use.max_jobs} active jobs "
            "(cancel some, or ask an operator to raise max_jobs)",
            field="max_jobs",
            retry_after=MAX_JOBS_RETRY_AFTER_SECONDS,
        )

    def get_job(self, job_id: str, tenant: TenantRef | None = None) -> Job:
        job_id, tenant_id = self._job_ref(job_id, tenant)
        job = self.jobs.get(job_id, tenant_id)
        if job.status is JobStatus.deleted:
            # a deleted job is gone for every lookup; only its run history stays readable
            raise errors.NotFound(f"no job {job_id!r}", field="job_id")
        return job

    def list_jobs(
        self,
        tenant: TenantRef | None = None,
        status: str | JobStatus | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Jobs in creation order; pass `next_cursor` back to get the following page. Ids
        are time-ordered and the cursor is the last id seen, so jobs created meanwhile
        appear at the end and never shift or repeat a page."""
        if cursor:
            (after,) = decode_cursor(cursor, 1)
            if not _JOB_ID.fullmatch(after):
                raise errors.ValidationError("not a cursor this server issued", field="cursor")
        return self.jobs.list(
            tenant_id=self._tenant_id(tenant),
            status=_status(status),
            limit=limit,
            cursor=cursor,
        )

    def cancel_job(self, job_id: str, tenant: TenantRef | None = None, *, actor: str) -> Job:
        return self.jobs.cancel(*self._job_ref(job_id, tenant), actor=actor)

    def pause_job(self, job_id: str, tenant: TenantRef | None = None, *, actor: str) -> Job:
        return self.jobs.pause(*self._job_ref(job_id, tenant), actor=actor)

    def resume_job(self, job_id: str, tenant: TenantRef | None = None, *, actor: str) -> Job:
        return self.jobs.resume(*self._job_ref(job_id, tenant), actor=actor)

    def trigger_job(self, job_id: str, tenant: TenantRef | None = None, *, actor: str) -> Run:
        return self.jobs.trigger(*self._job_ref(job_id, tenant), actor=actor)

    def reschedule_job(
        self,
        job_id: str,
        schedule_body: Mapping[str, Any],
        tenant: TenantRef | None = None,
        *,
        actor: str,
    ) -> Job:
        """Replace the schedule (same shape as a job body's "schedule") and recompute the
        next run, atomically with the version bump."""
        # an unknown job is NotFound before a bad schedule is reported: the id comes first
        job_id, tenant_id = self._job_ref(job_id, tenant)
        job = self.jobs.get(job_id, tenant_id)
        if isinstance(job.schedule, AfterSchedule):
            # its runs come from its upstream jobs; a time of its own would run it twice
            raise errors.ValidationError(
                f"job {job_id} runs after its upstream jobs and has no schedule of its own",
                field="schedule",
            )
        schedule = parse_schedule(schedule_body, self.store.now())
        if isinstance(schedule, BootSchedule):
            raise errors.ValidationError(
                "a job becomes an @reboot job only when created so (schedctl apply)",
                field="boot",
            )
        return self.jobs.reschedule(job_id, schedule, tenant_id, actor=actor)

    def runs(
        self,
        job_id: str,
        tenant: TenantRef | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Run history, newest first."""
        if cursor:
            (before,) = decode_cursor(cursor, 1)
            try:
                aware = datetime.fromisoformat(before).tzinfo is not None
            except ValueError:
                aware = False
            if not aware:
                raise errors.ValidationError("not a cursor this server issued", field="cursor")
        return self.jobs.runs(*self._job_ref(job_id, tenant), limit=limit, cursor=cursor)

    # -- audit -------------------------------------------------------------------------

    def audit(
        self,
        tenant: TenantRef | None = None,
        job_id: str | None = None,
        action: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Audit log entries, newest first: who created, changed, cancelled, paused,
        resumed or triggered what, and when."""
        check_page_limit(limit)
        if job_id is not None:
            job_id = self._job_ref(job_id, tenant, strict=False)[0]
        return self.audit_log.list(
            tenant_id=self._tenant_id(tenant),
            job_id=job_id,
            action=action,
            limit=limit,
            cursor=cursor,
        )

    # -- alerts ------------------------------------------------------------------------

    def set_alerts(
        self, tenant: TenantRef, body: Mapping[str, Any] | None, job_id: str | None = None
    ) -> AlertConfig | None:
        """Set (None: clear) the alerts of a job of the tenant, or the tenant's default
        (job_id None). Checked first: bad settings change nothing."""
        found = self._tenant(tenant)
        config = parse_alerts(body) if body is not None else None
        self._check_alerts(found, config)
        target = "" if job_id is None else self._job_ref(job_id, found.tenant_id)[0]
        alert_store.set_settings(self.store, found.tenant_id, target, config)
        return config

    def _check_alerts(self, tenant: Tenant, config: AlertConfig | None) -> None:
        """What parsing cannot know: the operator's recipient domains, and the SSRF guard
        (with the tenant's allow-list) for a webhook, as for an HTTP target. A
        ValidationError naming the field; every send checks again."""
        if config is None:
            return
        self.alert_policy.check(config.email, "alerts.email")
        if config.webhook:
            from schedctl.core.ssrf import check_at_creation

            check_at_creation(config.webhook, tenant.allow_list, field="alerts.webhook")

    def get_alerts(self, tenant: TenantRef, job_id: str | None = None) -> AlertConfig | None:
        """A job's own alerts (None: it uses the tenant default), or the tenant default."""
        found = self._tenant(tenant)
        target = "" if job_id is None else self._job_ref(job_id, found.tenant_id)[0]
        return alert_store.get_settings(self.store, found.tenant_id, target)

    # -- job names and id prefixes (schedctl/storage/jobs/job_lookup.py) --------------------

    def resolve_job(self, tenant: TenantRef | None, ref: str) -> str:
        """The id of the job `ref` names: an exact id, else the exact name of a job not
        deleted, else an unambiguous id prefix (at least 6 characters). NotFound when none
        matches (another tenant's job too); an ambiguous name or prefix is a ValidationError
        naming `job` that lists candidates."""
        return self.lookup.resolve(self._tenant_id(tenant), ref)

    def get_job_by_name(self, name: str, tenant: TenantRef) -> Job:
        """The tenant's job (not deleted) called `name`; NotFound otherwise."""
        tenant_id = self._tenant(tenant).tenant_id
        job_id = self.lookup.name_taken_by(tenant_id, name)
        if job_id is None:
            raise errors.NotFound(f"no job named {name!r}", field="name")
        return self.jobs.get(job_id, tenant_id)

    def check_job_name_free(
        self, tenant: TenantRef, name: str, *, except_job_id: str | None = None
    ) -> None:
        """Conflict naming `name` when another job of the tenant (not deleted) has it (for a
        rename; the database's unique index is the final word)."""
        self.lookup.check_name_free(
            self._tenant(tenant).tenant_id, name, except_job_id=except_job_id
        )

    def short_job_ids(self, tenant: TenantRef | None, job_ids: list[str]) -> dict[str, str]:
        """Each id's shortest unique prefix (at least 8 characters) among the tenant's jobs
        (all jobs with no tenant): what tables show, and what commands accept back."""
        return self.lookup.shortest_prefixes(self._tenant_id(tenant), job_ids)

    def _job_ref(
        self, ref: str, tenant: TenantRef | None, *, strict: bool = True
    ) -> tuple[str, str | None]:
        """(job id, tenant id) for a job reference; not strict: an unknown reference is
        passed on as it is (a filter that then matches nothing)."""
        tenant_id = self._tenant_id(tenant)
        try:
            return self.lookup.resolve(tenant_id, ref), tenant_id
        except errors.NotFound:
            if strict:
                raise
            return ref, tenant_id

    def job_dependencies(self, job_id: str, tenant: TenantRef | None = None) -> dict[str, Any]:
        """The job's upstream and downstream jobs (`after`), as trees:
        {"upstream": [{"job_id", "name", "status", "children"}...], "downstream": [...]}."""
        job = self.get_job(job_id, tenant)  # another tenant's job is NotFound
        return dependencies.graph(self.store, job.job_id)

    def job_why(self, job_id: str, tenant: TenantRef | None = None) -> dict[str, Any]:
        """`schedctl job why`: the schedule and next fires, the last runs with their
        reasons, the current lateness, the live workers of its queue, and its pause and
        alert state (schedctl/app/why.py)."""

        job = self.get_job(job_id, tenant)  # another tenant's job is NotFound
        runs = list(self.jobs.runs(job.job_id, job.tenant_id, limit=why.LAST_RUNS).items)
        workers = (
            WorkerRepo(self.store).live_of(job.tenant_id, job.target.address)
            if why.has_queue(job)
            else None
        )
        alerts = alert_store.get_settings(self.store, job.tenant_id, job.job_id)
        alerts_from = "job"
        if alerts is None:
            alerts = alert_store.get_settings(self.store, job.tenant_id, "")
            alerts_from = "tenant" if alerts is not None else "none"
        return why.report(
            job,
            runs=runs,
            workers=workers,
            alerts=alerts,
            alerts_from=alerts_from,
            now=self.store.now(),
        )

    # -- update and delete (issue 10) --------------------------------------------------

    def update_job(
        self,
        job_id: str,
        body: Mapping[str, Any],
        tenant: TenantRef | None = None,
        *,
        if_version: int | None = None,
        actor: str,
    ) -> Job:
        """Change the fields a partial REST-shaped body names (validated as on create; a
        new URL passes the SSRF guard) in one transaction with the version bump; with
        `if_version`, a job at another version is Conflict and nothing is written."""
        found = self._tenant(tenant) if tenant is not None else None
        # an unknown job is NotFound before a bad body is reported: the id comes first
        job_id, tenant_id = self._job_ref(job_id, found)
        job = self.get_job(job_id, found)
        patch = parse_job_patch(
            body, job, now=self.store.now(), max_payload_bytes=self.max_payload_bytes
        )
        if patch.after is not None:
            # checked before the transaction for a clear error (tenant, existence, cycle,
            # naming `after`); replace() checks again under the update's lock
            dependencies.check_after(self.store, job.job_id, job.tenant_id, patch.after)
        if patch.target is not None and patch.target.url is not None:
            # the SSRF guard resolves names: before the transaction, never holding the lock
            owner = found if found is not None else self.tenants.get(job.tenant_id)
            # the SSRF guard loads asyncio: only an update to an HTTP target needs it
            from schedctl.core.ssrf import check_at_creation

            check_at_creation(patch.target.url, owner.allow_list)

        def parse(current: Job, now: datetime) -> JobPatch:
            # again on the locked row: merged values (retry policy, the cron expression
            # kept under a new zone) come from the version being replaced
            return parse_job_patch(body, current, now=now, max_payload_bytes=self.max_payload_bytes)

        return update_job(
            self.store,
            job_id,
            parse,
            tenant_id,
            if_version=if_version,
            actor=actor,
            metrics_max_jobs=self.metrics_max_jobs,
        )

    def delete_job(
        self,
        job_id: str,
        tenant: TenantRef | None = None,
        *,
        if_version: int | None = None,
        actor: str,
    ) -> Job:
        """Delete: the job stops as on cancel, leaves the lists and lookups (NotFound), its
        run history stays readable through runs() and its idempotency key stays taken
        (a create with it is Conflict) until retention removes them."""
        job_id, tenant_id = self._job_ref(job_id, tenant)
        return delete_job(self.store, job_id, tenant_id, if_version=if_version, actor=actor)


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
