"""Owns POST /v1/host-drift: a cron host's worker reports, with its host token, what it
found different between its job files and the central jobs (`schedctl status` shows it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from schedctl.core import errors
from schedctl.storage.jobs import host_drift
from scheduled_d.api.auth import BodyDep, CallerDep, SchedulerDep
from scheduled_d.api.schemas import error_responses, json_request_body

router = APIRouter(prefix="/v1")


@router.post(
    "/host-drift",
    status_code=204,
    summary="A host's job-file drift (its host token's host)",
    responses=error_responses(400, 403, 413, 415, 422),
    openapi_extra=json_request_body(
        {
            "type": "object",
            "required": ["drift"],
            "additionalProperties": False,
            "properties": {"drift": {"type": "array", "items": {"type": "string"}}},
        }
    ),
)
async def report_host_drift(scheduler: SchedulerDep, caller: CallerDep, body: BodyDep) -> None:
    """{"drift": ["changed NAME", ...]}: what `schedctl apply --check` would report on
    the token's host; [] when in step. Only a host token reports, for its own host."""
    if caller.host is None:
        raise errors.Forbidden("only a host token reports its host's drift", field="token")
    if not isinstance(body, Mapping) or set(body) != {"drift"}:
        raise errors.ValidationError('must be {"drift": [...]}', field="drift")
    drift: Any = body["drift"]
    if not isinstance(drift, list) or not all(isinstance(d, str) for d in drift):
        raise errors.ValidationError("must be a list of strings", field="drift")
    if len(drift) > 10 * host_drift.MAX_ENTRIES:
        raise errors.ValidationError(
            f"at most {10 * host_drift.MAX_ENTRIES} entries", field="drift"
        )
    host = caller.host.host
    await run_in_threadpool(
        host_drift.report, scheduler.store, caller.tenant.tenant_id, host, drift
    )
