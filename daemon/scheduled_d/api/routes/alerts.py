"""Owns the /v1/jobs/{job_id}/alerts routes: read and replace (or clear) a job's own
alerts; a job without them uses its tenant's default (set by an operator)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from scheduled_d.api.auth import BodyDep, CallerDep, SchedulerDep
from scheduled_d.api.routes.jobs import caller_job_id
from scheduled_d.api.routes.params import JobIdPath
from scheduled_d.api.schemas import (
    JOB_REQUEST_SCHEMA,
    error_responses,
    json_request_body,
)

router = APIRouter(prefix="/v1")

# the job's own alerts, or null: it uses its tenant's default
ALERTS_PUT_SCHEMA: dict[str, Any] = {
    "anyOf": [JOB_REQUEST_SCHEMA["properties"]["alerts"], {"type": "null"}]
}


@router.get(
    "/jobs/{job_id}/alerts",
    summary="A job's own alerts",
    responses=error_responses(404),
)
def get_alerts(job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep) -> dict[str, Any]:
    """`{"alerts": {...}}`, or `{"alerts": null}` when the job uses its tenant's default."""
    config = scheduler.get_alerts(caller.tenant, caller_job_id(scheduler, caller, job_id))
    return {"alerts": config.to_dict() if config is not None else None}


@router.put(
    "/jobs/{job_id}/alerts",
    summary="Replace a job's own alerts",
    responses=error_responses(400, 404, 413, 415, 422),
    openapi_extra=json_request_body(ALERTS_PUT_SCHEMA),
)
def put_alerts(
    job_id: JobIdPath, scheduler: SchedulerDep, caller: CallerDep, body: BodyDep
) -> dict[str, Any]:
    """The body is the alerts object (as in a job's "alerts"), or null to clear them."""
    config = scheduler.set_alerts(caller.tenant, body, caller_job_id(scheduler, caller, job_id))
    return {"alerts": config.to_dict() if config is not None else None}
