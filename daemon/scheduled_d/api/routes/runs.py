"""Owns the run routes: a job's run history (/v1/jobs/{job_id}/runs, newest first) and the
boot runs a host's worker records (POST /v1/boot-runs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from schedctl.app.views import run_to_dict
from schedctl.core import errors
from schedctl.storage.jobs import boot_runs
from scheduled_d.api.auth import BodyDep, CallerDep, SchedulerDep
from scheduled_d.api.routes.params import CursorQuery, JobIdPath, LimitQuery, checked_job_id
from scheduled_d.api.schemas import RunOut, RunPage, error_responses, json_request_body

router = APIRouter(prefix="/v1")


@router.get(
    "/jobs/{job_id}/runs",
    response_model=RunPage,
    summary="Run history of a job",
    responses=error_responses(404, 422),
)
def job_runs(
    job_id: JobIdPath,
    scheduler: SchedulerDep,
    caller: CallerDep,
    cursor: CursorQuery = None,
    limit: LimitQuery = 50,
) -> dict[str, Any]:
    """Newest first."""
    page = scheduler.runs(checked_job_id(job_id), caller.tenant, limit=limit, cursor=cursor)
    return {"items": [run_to_dict(r) for r in page.items], "next_cursor": page.next_cursor}


BOOT_RUN_KEYS = frozenset({"job", "seconds", "exit_code", "error", "output"})


@router.post(
    "/boot-runs",
    response_model=RunOut,
    status_code=201,
    summary="Record the ended run of an @reboot job (its host's worker)",
    responses=error_responses(400, 403, 404, 413, 415, 422),
    openapi_extra=json_request_body(
        {
            "type": "object",
            "required": ["job"],
            "additionalProperties": False,
            "properties": {
                "job": {"type": "string", "description": "The central job's name."},
                "seconds": {"type": "number", "minimum": 0},
                "exit_code": {"type": ["integer", "null"]},
                "error": {"type": ["string", "null"]},
                "output": {"type": ["string", "null"]},
            },
        }
    ),
)
async def record_boot_run(scheduler: SchedulerDep, caller: CallerDep, body: BodyDep) -> Any:
    """{"job": NAME, "seconds", "exit_code", "error", "output"}: the run of the @reboot
    job NAME (a job with a `boot` schedule) that ended now after `seconds`; a host token
    only for its own jobs (another's is 404)."""
    if not isinstance(body, Mapping):
        raise errors.ValidationError("must be an object", field="body")
    extra = sorted(str(k) for k in body if k not in BOOT_RUN_KEYS)
    if extra:
        raise errors.ValidationError("unknown field", field=extra[0])
    name = body.get("job")
    if not isinstance(name, str) or not name:
        raise errors.ValidationError("is required: the job's name", field="job")
    host = caller.host
    tenant_id = caller.tenant.tenant_id

    def record() -> Any:
        run = boot_runs.record(
            scheduler.store,
            tenant_id,
            name,
            seconds=body.get("seconds", 0),
            exit_code=body.get("exit_code"),
            error=body.get("error"),
            output=body.get("output"),
            worker=f"host:{host.host}" if host is not None else caller.actor,
            actor=caller.actor,
            allowed=host.owns_job if host is not None else None,
        )
        return run_to_dict(run)

    return await run_in_threadpool(record)
