"""Owns the /v1/tenant route (the caller's tenant and quotas) and /healthz (no token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from schedctl.app.views import tenant_to_dict
from schedctl.storage.records.status import check_reachable
from scheduled_d.api.auth import CallerDep, SchedulerDep
from scheduled_d.api.schemas import TenantOut, error_responses

router = APIRouter(prefix="/v1")


@router.get(
    "/tenant", response_model=TenantOut, summary="The caller's tenant", responses=error_responses()
)
def whoami(caller: CallerDep) -> dict[str, Any]:
    """The tenant the token belongs to, with its quotas; for a host token, its host and
    groups (null and [] for a tenant token)."""
    host = caller.host
    return {
        **tenant_to_dict(caller.tenant),
        "token_id": caller.token_id,
        "host": host.host if host is not None else None,
        "groups": list(host.groups) if host is not None else [],
    }


def healthz(scheduler: SchedulerDep) -> dict[str, str]:
    """Liveness and database reachability; no token needed. A database that cannot be
    reached is a 503 saying "database unavailable": where it is, and what the driver said,
    go to the log only."""
    check_reachable(scheduler.store)
    return {"status": "ok"}
