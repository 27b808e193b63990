"""Owns `create_app`, the tenant REST API (`scheduled-d api`) assembled from its parts: the
routers of routes/ (jobs, runs, tenant and /healthz, the workers' leases), the error handlers
(errors.py), the size-limit and metrics layer (middleware.py), the web console under /ui
(ui/); schemas.py holds the documented
shapes, auth.py the caller and body dependencies, server.py the uvicorn server
(scheduled_d.runtime.run_api serves it as the `api` mode).

Every route is scoped to the tenant of the caller's token: another tenant's job is 404, the
same answer as a job that does not exist. Every error, FastAPI's and Starlette's own
included, is `{"error": {"code", "message", "field"}}`. Payloads are never logged: only the
request line reaches the access log, and internal errors are logged without their SQL
parameters. Endpoints are plain `def`s: FastAPI runs them in its thread pool, which suits the
synchronous store.

Idempotency keys (the Idempotency-Key header, or `idempotency_key` in the body) are stored on
their job's row, unique per tenant, and job rows are never deleted: a key is honoured for as
long as its job exists, which is at least the 24 hours promised (a replay of a cancelled
job's key returns that cancelled job). See schedctl.app.service.IDEMPOTENCY_KEY_RETENTION.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from schedctl.app.service import Scheduler
from scheduled_d.api.errors import install_handlers
from scheduled_d.api.middleware import Guard
from scheduled_d.api.routes import alerts, hosts, jobs, leases, runs, tenant
from scheduled_d.api.schemas import ErrorBody, Health
from scheduled_d.api.ui import install_console

API_VERSION = "1"
MIN_REQUEST_BYTES = 1024 * 1024
# JSON escapes can make a payload's request body up to 6x its compact size ("\u0001");
# the request limit leaves room for that, so any payload under its own limit fits
REQUEST_TO_PAYLOAD_RATIO = 8


def create_app(scheduler: Scheduler, *, max_request_bytes: int | None = None) -> FastAPI:
    """The /v1 API over `scheduler`. max_request_bytes defaults to room for any payload under
    the scheduler's payload limit (at least 1 MiB)."""
    limit = max_request_bytes or max(
        MIN_REQUEST_BYTES, REQUEST_TO_PAYLOAD_RATIO * scheduler.max_payload_bytes
    )
    # SQLAlchemy logs statements with their parameters (payloads) at INFO: a daemon run at
    # SCHEDULED_LOG_LEVEL=DEBUG must still not write payloads to its logs
    logging.getLogger("sqlalchemy.engine").setLevel(logging.WARNING)
    app = FastAPI(
        title="scheduled-d tenant API",
        version=API_VERSION,
        description=(
            "Create and manage scheduled jobs of one tenant. Authenticate with the tenant's "
            "token: `Authorization: Bearer st_...`. Errors are "
            '`{"error": {"code", "message", "field"}}`.'
        ),
        docs_url=None,  # the docs pages load scripts from a CDN; /openapi.json is the doc
        redoc_url=None,
        openapi_url="/openapi.json",
        # FastAPI's own OpenTelemetry off: the daemon exports its metrics itself (Prometheus,
        # middleware.py), its "logs" would record exception messages (SQL parameters hold
        # payloads), and asking whether a provider is configured read the environment on
        # every request
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    app.state.scheduler = scheduler
    # in this order: the OpenAPI document lists the paths as they are included
    routers = (jobs.router, runs.router, tenant.router, leases.router, alerts.router, hosts.router)
    for router in routers:
        app.include_router(router)
    app.add_api_route(
        "/healthz",
        tenant.healthz,
        methods=["GET"],
        response_model=Health,
        summary="Health",
        responses={503: {"model": ErrorBody, "description": "The database is unavailable"}},
    )
    # the web console under /ui (scheduled_d/api/ui): pages for the same tenant's data
    install_console(app)
    install_handlers(app)
    app.add_middleware(Guard, max_request_bytes=limit)
    return app
