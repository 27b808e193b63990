"""Owns the /v1/jobs/{job_id}/runs route: a job's run history, newest first."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from schedctl.views import run_to_dict
from scheduled_d.api.auth import CallerDep, SchedulerDep
from scheduled_d.api.routes.params import CursorQuery, JobIdPath, LimitQuery, checked_job_id
from scheduled_d.api.schemas import RunPage, error_responses

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
