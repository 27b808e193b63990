"""Owns the /v1/jobs routes: create (with idempotency keys; one, or up to 1,000 in a batch),
list, read (by id, name or id prefix), update (PATCH, with If-Match), delete, cancel, pause,
resume and trigger a job of the caller's tenant, and its dependencies (after).

A job's version is its entity tag: a read or update answers `ETag: "VERSION"` (strong), and
PATCH and DELETE take `If-Match` with that tag, the bare version, or `*` (any version of
a job that exists)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from schedctl.app.service import Scheduler
from schedctl.app.views import job_to_dict, run_to_dict
from schedctl.core import errors, limits
from schedctl.domain.models import CreateOutcome, Job
from scheduled_d.api.auth import (
    BodyDep,
    Caller,
    CallerDep,
    SchedulerDep,
    json_body,
    request_caller,
    request_scheduler,
)
from scheduled_d.api.routes.params import (
    IDEMPOTENCY_PARAMETER,
    CursorQuery,
    IfMatchHeader,
    JobIdPath,
    LimitQuery,
    PreferHeader,
    StatusQuery,
    checked_job_id,
    prefers_minimal,
)
from scheduled_d.api.schemas import (
    BATCH_REQUEST_EXAMPLES,
    BATCH_REQUEST_SCHEMA,
    JOB_REQUEST_EXAMPLES,
    JOB_REQUEST_SCHEMA,
    JOB_UPDATE_EXAMPLES,
    JOB_UPDATE_SCHEMA,
    BatchOut,
    DependenciesOut,
    JobOut,
    JobPage,
    RunOut,
    error_responses,
    json_request_body,
)

router = APIRouter(prefix="/v1")

# the 200 of a route answering one job, with the job's version as its entity tag
_WITH_ETAG: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Successful Response",
        "headers": {
            "ETag": {
                "description": 'The job\'s version, quoted ("3"): send it back as If-Match.',
                "schema": {"type": "string"},
                "required": True,
            }
        },
    }
}


def _tagged(job: Job, response: Response) -> dict[str, Any]:
    """The job as the API shows it, its version as the response's ETag."""
    response.headers["ETag"] = f'"{job.version}"'
    return job_to_dict(job)


@router.post(
    "/jobs",
    status_code=201,
    response_model=JobOut,
    summary="Create a job",
    responses={
        201: {
            "description": "Created",
            "headers": {"Location": {"schema": {"type": "string"}, "required": True}},
        },
        200: {"model": JobOut, "description": "The job an earlier request with this key made"},
        **error_responses(400, 404, 409, 413, 415, 422, 429),  # 404: an `after` job
    },
    # what FastAPI would document for the bearer dependency and the header parameter,
    # which the route reads itself (below)
    openapi_extra={
        **json_request_body(JOB_REQUEST_SCHEMA, JOB_REQUEST_EXAMPLES),
        "security": [{"HTTPBearer": []}],
        "parameters": [IDEMPOTENCY_PARAMETER],
    },
)
async def create_job(request: Request) -> Response:
    # the caller, the body and the header read here, not as FastAPI dependencies:
    # solving them cost more than the create's own work. The same functions and
    # order as the dependencies (the token first: no token is 401 whatever the body)
    caller = await request_caller(request)
    body = await json_body(request)
    idempotency_key = request.headers.get("idempotency-key")
    # the create blocks on the database: in the thread pool, as a plain def route runs
    return await run_in_threadpool(
        _create_job, request_scheduler(request), caller, body, idempotency_key
    )


def _create_job(
    scheduler: Scheduler, caller: Caller, body: Any, idempotency_key: str | None
) -> Response:
    if isinstance(body, dict) and idempotency_key is not None:
        in_body = body.get("idempotency_key")
        if in_body is not None and in_body != idempotency_key:
            raise errors.ValidationError(
                "the Idempotency-Key header and the body's idempotency_key differ",
                field="idempotency_key",
            )
        body = {**body, "idempotency_key": idempotency_key}
    if caller.host is not None:
        caller.host.check_body(body)
        _check_host_after(scheduler, caller, body)
    job, created = scheduler.create_job(caller.tenant, body, actor=caller.actor)
    if created:
        status, headers = 201, {"Location": f"/v1/jobs/{job.job_id}"}
    else:
        status, headers = 200, {"Idempotent-Replayed": "true"}
    # serialized here, not through the response model (which stays the documented shape):
    # job_to_dict is that shape already, and validating it again was the request's
    # biggest cost
    return _json_response(job_to_dict(job), status, headers)


@router.post(
    "/jobs:batch",
    response_model=None,
    summary="Create up to 1,000 jobs",
    responses={
        200: {
            "model": BatchOut,
            "description": "One result per job, in the order sent",
            "headers": {
                "Preference-Applied": {
                    "schema": {"type": "string"},
                    "description": "return=minimal, when the request preferred it",
                }
            },
        },
        **error_responses(400, 413, 415, 422),
    },
    openapi_extra=json_request_body(BATCH_REQUEST_SCHEMA, BATCH_REQUEST_EXAMPLES),
)
def create_jobs_batch(
    scheduler: SchedulerDep, caller: CallerDep, body: BodyDep, prefer: PreferHeader = None
) -> Response:
    """Each job as POST /v1/jobs would create it (its own idempotency_key, the same
    validation and quotas), all in one transaction: each result says the status a single
    create would have answered: 201 created, 200 replayed, or 4xx with the error naming the
    field; a refused job writes nothing and does not stop the others. Once a quota is
    reached the remaining jobs are 429. The whole request is 422 only when the envelope is
    bad (not {"jobs": [...]}, or more than 1,000 jobs).

    With `Prefer: return=minimal` a created or replayed job's result holds its `job_id`
    and `name` instead of the whole `job` (for imports, which need no more: the whole jobs
    were a sixth of the server's work and most of the client's)."""
    bodies = _batch_bodies(body)
    outcomes = scheduler.create_many(caller.tenant, bodies, actor=caller.actor)
    minimal = prefers_minimal(prefer)
    results = [_batch_result(index, outcome, minimal) for index, outcome in enumerate(outcomes)]
    # serialized here, not through the response model: a thousand jobs validated again
    # would cost more than creating them
    headers = {"Preference-Applied": "return=minimal"} if minimal else None
    return _json_response({"results": results}, headers=headers)


def _json_response(
    data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """Compact JSON of data that is already in its documented shape."""
    try:
        # orjson: json.dumps of a big batch's results was a large share of its CPU
        text: bytes | str = orjson.dumps(data)
    except orjson.JSONEncodeError:  # an integer past 64 bits in a payload: json has no limit
        text = json.dumps(data, separators=(",", ":"))
    return Response(
        text,
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def _batch_bodies(body: Any) -> list[Any]:
    if not isinstance(body, Mapping):
        raise errors.ValidationError('must be an object: {"jobs": [...]}', field="body")
    unknown = sorted(str(key) for key in body if key != "jobs")
    if unknown:
        raise errors.ValidationError(
            f'unknown field {unknown[0]!r}: the batch is {{"jobs": [...]}}', field=unknown[0]
        )
    jobs = body.get("jobs")
    if not isinstance(jobs, list):
        raise errors.ValidationError("is required: a list of job bodies", field="jobs")
    if not 1 <= len(jobs) <= limits.MAX_BATCH_JOBS:
        raise errors.ValidationError(
            f"must hold 1 to {limits.MAX_BATCH_JOBS} jobs, got {len(jobs)}", field="jobs"
        )
    return jobs


def _batch_result(index: int, outcome: CreateOutcome, minimal: bool) -> dict[str, Any]:
    if outcome.error is not None:
        exc = outcome.error
        result: dict[str, Any] = {
            "index": index,
            "status": exc.http_status,
            "error": {"code": exc.code, "message": exc.public_message, "field": exc.field},
        }
        if isinstance(exc, errors.QuotaExceeded):
            result["retry_after"] = exc.retry_after
        return result
    job = outcome.job
    assert job is not None
    status = 201 if outcome.created else 200
    if minimal:
        return {"index": index, "status": status, "job_id": job.job_id, "name": job.name}
    return {"index": index, "status": status, "job": job_to_dict(job)}


@router.get("/jobs", response_model=JobPage, summary="List jobs", responses=error_responses(422))
def list_jobs(
    scheduler: SchedulerDep,
    caller: CallerDep,
    cursor: CursorQuery = None,
    limit: LimitQuery = 50,
    status: StatusQuery = None,
) -> dict[str, Any]:
    """Jobs in creation order. A cursor stays valid while jobs are added: new jobs come
    after every job already listed, so no page shifts or repeats."""
    page = scheduler.list_jobs(caller.tenant, status, limit=limit, cursor=cursor)
    items = list(page.items)
    if caller.host is not None:  # a host sees only its own jobs (a page may come out short)
        items = [j for j in items if caller.host.owns_job(j)]
    return {"items": [job_to_dict(j) for j in items], "next_cursor": page.next_cursor}


@router.get(
    "/jobs/{job_id}",
    response_model=JobOut,
    summary="One job",
    responses={**_WITH_ETAG, **error_responses(404, 422)},
)
def get_job(
    job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep, response: Response
) -> dict[str, Any]:
    return _tagged(_get_job(scheduler, caller, checked_job_id(job_id)), response)


_HEX_ID = re.compile(r"[0-9a-f]{1,40}")  # what a job id looks like (else only a name)


def _check_host_after(scheduler: Scheduler, caller: Caller, body: Any) -> None:
    """A host token's `after` names only jobs of its own host (by id or name)."""
    assert caller.host is not None
    after = body.get("after") if isinstance(body, Mapping) else None
    if not isinstance(after, list):
        return  # none, or the service refuses its shape naming `after`

    def lookup(ref: str) -> list[Job]:
        found: list[Job] = []
        if _HEX_ID.fullmatch(ref):
            try:
                found.append(scheduler.get_job(ref, caller.tenant))
            except errors.NotFound:
                pass
        try:
            found.append(scheduler.get_job_by_name(ref, caller.tenant))
        except errors.NotFound:
            pass
        return found

    caller.host.check_after(after, lookup)


def _get_job(scheduler: Scheduler, caller: Caller, job_id: str) -> Job:
    """The caller's job; for a host token only a job its host's files define (another is
    404, as one that does not exist)."""
    job = scheduler.get_job(job_id, caller.tenant)
    if caller.host is not None and not caller.host.owns_job(job):
        raise errors.NotFound(f"no job {job_id!r}", field="job_id")
    return job


def caller_job_id(scheduler: Scheduler, caller: Caller, job_id: str) -> str:
    """`job_id` (checked) of a job the caller may act on: for a tenant token any of its
    tenant's (the service says 404 for another's), for a host token only its own."""
    job_id = checked_job_id(job_id)
    if caller.host is None:
        return job_id
    return _get_job(scheduler, caller, job_id).job_id


@router.patch(
    "/jobs/{job_id}",
    response_model=JobOut,
    summary="Update a job",
    responses={**_WITH_ETAG, **error_responses(400, 404, 409, 413, 415, 422)},
    openapi_extra=json_request_body(JOB_UPDATE_SCHEMA, JOB_UPDATE_EXAMPLES),
)
def update_job(
    job_id: JobIdPath,
    scheduler: SchedulerDep,
    caller: CallerDep,
    body: BodyDep,
    response: Response,
    if_match: IfMatchHeader = None,
) -> dict[str, Any]:
    """Change the fields the body names (the others keep their values), validated as on
    create, in one transaction with the version bump. A new schedule recomputes the next
    run; a new target or payload applies to runs not yet claimed. With If-Match, a job at
    another version is 409 and nothing changes; `If-Match: *` matches any version."""
    job_id = checked_job_id(job_id)
    if not isinstance(body, Mapping):
        raise errors.ValidationError("must be an object of the fields to change", field="body")
    if caller.host is not None:
        current = _get_job(scheduler, caller, job_id)
        caller.host.check_body(body, current)
        _check_host_after(scheduler, caller, body)
        job_id = current.job_id
    job = scheduler.update_job(
        job_id, body, caller.tenant, if_version=_version(if_match), actor=caller.actor
    )
    return _tagged(job, response)


@router.delete(
    "/jobs/{job_id}",
    status_code=204,
    response_class=Response,
    summary="Delete a job",
    responses={204: {"description": "Deleted"}, **error_responses(400, 404, 409, 422)},
)
def delete_job(
    job_id: JobIdPath,
    scheduler: SchedulerDep,
    caller: CallerDep,
    if_match: IfMatchHeader = None,
) -> Response:
    """Stop the job as a cancel does and remove it: from then on it is 404 here and absent
    from lists (status=deleted still lists it), while its run history stays readable at
    /v1/jobs/{id}/runs and its idempotency key stays taken (409) until retention. Deleting
    it again is 404."""
    scheduler.delete_job(
        caller_job_id(scheduler, caller, job_id),
        caller.tenant,
        if_version=_version(if_match),
        actor=caller.actor,
    )
    return Response(status_code=204)


def _lifecycle_route(
    change: str, summary: str, statuses: tuple[int, ...], description: str | None = None
) -> None:
    """Register POST /jobs/{job_id}/CHANGE (cancel, pause, resume): a change of state
    answered with the changed job, as `Scheduler.CHANGE_job` makes it."""

    def route(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> dict[str, Any]:
        change_job = getattr(scheduler, f"{change}_job")
        job_id = caller_job_id(scheduler, caller, job_id)
        return job_to_dict(change_job(job_id, caller.tenant, actor=caller.actor))

    # the name is the OpenAPI operationId's stem, as for a route written out by hand
    route.__name__ = route.__qualname__ = f"{change}_job"
    router.post(
        f"/jobs/{{job_id}}/{change}",
        response_model=JobOut,
        summary=summary,
        description=description,
        responses=error_responses(*statuses),
    )(route)


_lifecycle_route(
    "cancel",
    "Cancel a job",
    (404, 409),
    "Cancel all future runs; a run already dispatched still completes. The job stays\n"
    "listed (status cancelled).",
)
_lifecycle_route("pause", "Pause a job", (404, 409, 422))
_lifecycle_route(
    "resume",
    "Resume a paused job",
    (404, 409, 422),
    "Continue from the next scheduled time after now.",
)


@router.post(
    "/jobs/{job_id}/trigger",
    status_code=202,
    response_model=RunOut,
    summary="Run a job now",
    responses=error_responses(404, 409, 422),
)
def trigger_job(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> dict[str, Any]:
    """One manual run now, in addition to the schedule; delivered like any other run."""
    run = scheduler.trigger_job(checked_job_id(job_id), caller.tenant, actor=caller.actor)
    return run_to_dict(run)


@router.get(
    "/jobs/by-name/{name:path}",
    response_model=JobOut,
    summary="One job, by its name",
    responses={**_WITH_ETAG, **error_responses(404)},
)
def get_job_by_name(
    name: str, scheduler: SchedulerDep, caller: CallerDep, response: Response
) -> dict[str, Any]:
    """The caller's job (not deleted) with this name; names are unique per tenant. Another
    tenant's name is 404, like an unknown one."""
    return _tagged(scheduler.get_job_by_name(checked_job_id(name), caller.tenant), response)


@router.get(
    "/jobs/{job_id}/dependencies",
    response_model=DependenciesOut,
    summary="A job's upstream and downstream jobs (after), as trees",
    responses=error_responses(404),
)
def get_job_dependencies(
    job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep
) -> dict[str, Any]:
    job_id = caller_job_id(scheduler, caller, job_id)
    graph = scheduler.job_dependencies(job_id, caller.tenant)
    if caller.host is None:
        return graph
    # a host token sees only its own jobs in the trees (a tenant's job that runs after
    # one of the host's is not the host's to know)
    return {side: _own_nodes(scheduler, caller, nodes) for side, nodes in graph.items()}


def _own_nodes(scheduler: Scheduler, caller: Caller, nodes: list[Any]) -> list[Any]:
    assert caller.host is not None
    kept = []
    for node in nodes:
        try:
            job = scheduler.get_job(node["job_id"], caller.tenant)
        except errors.NotFound:
            continue
        if caller.host.owns_job(job):
            kept.append({**node, "children": _own_nodes(scheduler, caller, node["children"])})
    return kept


@router.get(
    "/jobs/{job_id}/why",
    summary="Why a job did (not) run: schedule, next fires, last runs and their reasons",
    responses=error_responses(404),
)
def get_job_why(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> dict[str, Any]:
    """The caller's job's schedule and next fire times, its last runs with the reason each
    was skipped or failed, its lateness, the live workers of its queue, and its pause and
    alert state; another tenant's job is 404, like an unknown one."""
    return scheduler.job_why(checked_job_id(job_id), caller.tenant)


def _version(if_match: str | None) -> int | None:
    """The version If-Match requires; None for none, or for `*`: any version of a job that
    exists (a job that does not is 404 either way)."""
    if if_match is None or if_match.strip() == "*":
        return None
    text = if_match.strip().removeprefix("W/").strip('"')
    if not (text.isascii() and text.isdigit() and len(text) < 19):
        raise errors.ValidationError(
            f"must be the job's version (an integer), got {if_match[:40]!r}", field="If-Match"
        )
    return int(text)
