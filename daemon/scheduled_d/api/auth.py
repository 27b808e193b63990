"""Owns the API's request dependencies: the bearer-token caller (its tenant, token id and,
for a host token, its host), the Scheduler of the app, and the JSON body (parsed by
schedctl.core.limits, so that malformed JSON is a 400 naming the body and jobspec stays the one
validator).

A host token (schedctl.domain.host_scope) is refused here, before any route runs, on every route
but HOST_TOKEN_ROUTES: a route added later is closed to host tokens until it is listed.
Each listed route narrows what the host may touch itself (its queues, its own jobs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from schedctl.app.service import Scheduler
from schedctl.core import errors, limits
from schedctl.core.errors import MalformedRequest, UnsupportedMediaType
from schedctl.domain.host_scope import HostScope
from schedctl.domain.models import Tenant

# (method, route path) a host token may call; every other route answers 403 to it (its
# presence rides on its leases and heartbeats, as a tenant worker's does). The
# routes themselves keep it to its queues (leases), its leases (looked up by token) and
# the jobs its files define (jobs, alerts: another's is 404).
HOST_TOKEN_ROUTES = frozenset(
    {
        ("GET", "/v1/tenant"),
        ("POST", "/v1/queues/{name:path}/leases"),
        ("POST", "/v1/leases/{lease_id}/heartbeat"),
        ("POST", "/v1/leases/{lease_id}/ack"),
        ("POST", "/v1/leases/{lease_id}/fail"),
        ("POST", "/v1/queues/{name:path}/alert-leases"),
        ("POST", "/v1/alert-leases/{lease_id}/finish"),
        ("GET", "/v1/jobs"),
        ("POST", "/v1/boot-runs"),
        ("POST", "/v1/host-drift"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/{job_id}"),
        ("GET", "/v1/jobs/{job_id}/dependencies"),
        ("PATCH", "/v1/jobs/{job_id}"),
        ("DELETE", "/v1/jobs/{job_id}"),
        ("POST", "/v1/jobs/{job_id}/pause"),
        ("POST", "/v1/jobs/{job_id}/resume"),
        ("GET", "/v1/jobs/{job_id}/alerts"),
        ("PUT", "/v1/jobs/{job_id}/alerts"),
    }
)


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    token_id: str
    host: HostScope | None = None  # a host token's host and groups

    @property
    def actor(self) -> str:
        """What the audit log records: the token, never the token's secret."""
        if self.host is not None:
            return f"token:{self.token_id}@{self.host.host}"
        return f"token:{self.token_id}"


_bearer = HTTPBearer(auto_error=False, description="The tenant's API token: `st_...`.")


# async, like get_caller: FastAPI runs a sync dependency in its thread pool, a hand-off
# per dependency per request
async def get_scheduler(request: Request) -> Scheduler:
    return _scheduler(request)


def request_scheduler(request: Request) -> Scheduler:
    return _scheduler(request)


def _scheduler(request: Request) -> Scheduler:
    scheduler = request.app.state.scheduler
    assert isinstance(scheduler, Scheduler)
    return scheduler


async def get_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    """The token's tenant: from the process's cache of verified tokens on the event loop
    (no database, no thread), else looked up in the thread pool (the store is blocking)."""
    if credentials is None:
        raise errors.Unauthorized(
            "send the tenant's API token as 'Authorization: Bearer st_...'", field="token"
        )
    tenants = _scheduler(request).tenants
    token = credentials.credentials
    found = tenants.cached_tenant(token)
    if found is None:
        found = await run_in_threadpool(tenants.authenticate_tenant, token)
    tenant, token_id, scope = found
    caller = Caller(tenant, token_id, scope)
    request.state.caller = caller  # for the error handlers' metrics
    if scope is not None:
        _check_host_route(request, scope)
    return caller


def _check_host_route(request: Request, scope: HostScope) -> None:
    """Forbidden unless the matched route is one a host token may call."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    if (request.method, path) not in HOST_TOKEN_ROUTES:
        raise errors.Forbidden(
            f"a host token (host {scope.host}) may only lease and settle its host's runs, "
            "report its presence and apply its own job files",
            field="token",
        )


async def request_caller(request: Request) -> Caller:
    """get_caller without FastAPI's dependency solving, for the hot create routes: the
    same bearer parsing (HTTPBearer's own, without auto_error: a missing or non-bearer
    Authorization is None, hence 401) and the same lookup."""
    return await get_caller(request, await _bearer(request))


async def json_body(request: Request) -> Any:
    """The request's JSON body. Parsed here rather than by FastAPI so that
    schedctl.domain.jobspec is the one validator (the CLI's), and malformed JSON is a 400, not
    a 422."""
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(
            f"send the body as Content-Type: application/json, not {media!r}",
            field="content-type",
        )
    raw = await request.body()
    if not raw.strip():
        raise MalformedRequest("the request has no body: send a JSON object", field="body")
    # integers too long for int() and nesting deep enough for a RecursionError are refused
    # naming their field (schedctl.core.limits), never a 500; malformed JSON is a 400
    return limits.parse_json(raw, "body", malformed=MalformedRequest)


SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
CallerDep = Annotated[Caller, Depends(get_caller)]
BodyDep = Annotated[Any, Depends(json_body)]
